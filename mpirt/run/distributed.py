"""Start-up shared by every entry point: ``ctx = init_distributed(seed)``.

It installs the abort-on-error hook, learns the world (rank, size, rank and ranks on this node),
optionally checks that every rank holds the same config, selects the array backend and binds a
GPU by local rank, limits BLAS threads per rank, and derives per-rank seeds from one seed.

Same config means same inputs too: a path is only a name, and on a cluster each node may read its
own copy. :func:`input_fingerprint` condenses what the named files hold (the model TOML, the
``init_from`` directory, the dataset's meta.json and the sizes of its token files) into a few
strings that ride along with the config through :func:`check_same_config`.

BLAS threads. NumPy's OpenBLAS starts one thread per core in *every* rank, so k ranks on a node
oversubscribe its cores k times. The thread variables cannot be set before NumPy loads here (it is
already imported), so :func:`mpirt.cpu.threads.set_num_threads`, the one owner of the thread counts,
gives mpirt's pool the count and sets the OpenBLAS mapped into the process to one thread (the
pool splits the GEMMs itself; without OpenBLAS the GEMM library keeps its own count);
``Context`` holds both counts read back. The count is ``threads`` when given; otherwise left
alone when the user set OMP_NUM_THREADS, OPENBLAS_NUM_THREADS or MKL_NUM_THREADS; otherwise the
CPUs this process may use (its affinity mask) divided by the ranks on the node, at least 1. An
OpenBLAS not found is recorded in ``Context.blas_note`` and start-up carries on.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import mpirt.core.backend as B
from mpirt import comm as C
from mpirt.cpu import threads as T
from mpirt.run.config import ConfigError, config_hash, diff_configs

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass
class Context:
    """What :func:`init_distributed` set up for this process."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    seed: int
    backend: str
    device: int | None
    threads: int                      # mpirt's thread pool (GEMMs split over it, elementwise passes)
    blas_threads: int | None          # OpenBLAS's own thread count read back (None: OpenBLAS not found)
    blas_note: str                    # where the count came from, or why it could not be set
    comm: C.Comm = field(repr=False)  # the world

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rank_seed(self, purpose: str, rank: int | None = None) -> int:
        """A 63-bit seed for (seed, rank, purpose): distinct per rank and purpose, reproducible."""
        return derive_seed(self.seed, self.rank if rank is None else rank, purpose)

    def rng(self, purpose: str) -> np.random.Generator:
        """A NumPy generator seeded with :meth:`rank_seed` ``(purpose)``."""
        return np.random.default_rng(self.rank_seed(purpose))


def derive_seed(seed: int, rank: int, purpose: str) -> int:
    """SeedSequence over (seed, rank, sha256(purpose)) -> one 63-bit integer."""
    tag = int.from_bytes(hashlib.sha256(purpose.encode()).digest()[:8], "little")
    state = np.random.SeedSequence([int(seed), int(rank), tag]).generate_state(2, np.uint64)
    return int(state[0]) >> 1


def init_distributed(seed: int, backend: str = "auto", threads: int | None = None,
                     config=None) -> Context:
    """Set up this rank (see the module docstring) and return its :class:`Context`.

    ``backend``: "auto" (MPIRT_BACKEND if set, else CuPy when usable), "numpy" or "cupy".
    ``config``: a dict (or object with ``to_dict()``) checked with :func:`check_same_config`
    before any other collective.
    """
    C.install_abort_on_error()
    world = C.world_comm()
    if config is not None:
        check_same_config(world, config)
    info = C.world()
    name = B.select(None if backend == "auto" else backend)
    device = B.bind_device(info.local_rank)
    count, note = plan_blas_threads(threads, info.local_size)
    if count is not None:
        T.set_num_threads(count)  # mpirt's pool; OpenBLAS one thread where it is found
    if T.blas_threads() is None and count is not None:
        note += "; OpenBLAS not found: the GEMM library keeps its own thread count"
    if name == "numpy":
        agree_on_kernels(world)
    return Context(info.rank, info.size, info.local_rank, info.local_size, int(seed), name, device,
                   T.num_threads(), T.blas_threads(), note, world)


def agree_on_kernels(comm: C.Comm) -> None:
    """Every rank runs the same op forms: the C kernels (:mod:`mpirt.cpu.kernels`) only if every rank
    has them. Replicated parameters (layer norms under tp without sequence parallelism) get their
    gradients on each rank independently; one computed by C and another by NumPy would differ in
    the last bits and drift apart."""
    from mpirt.cpu import kernels
    have = comm.allgather_object(kernels.library() is not None)
    if not all(have) and kernels.library() is not None:
        kernels.disable(f"rank {have.index(False)} cannot run the C kernels: every rank runs the NumPy forms")


def check_same_config(comm: C.Comm, cfg) -> str:
    """Check that every rank of ``comm`` holds the same config; returns its hash.

    All ranks allgather the sha256 of the canonical JSON; only when they differ are the full
    dicts gathered, and every rank raises the same :class:`ConfigError` naming the ranks that
    differ from rank 0 and the differing keys.
    """
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    h = config_hash(d)
    hashes = comm.allgather_object(h)
    if all(x == hashes[0] for x in hashes):
        return h
    dicts = comm.allgather_object(d)
    by_hash: dict[str, list[int]] = {}
    for r, x in enumerate(hashes):
        if x != hashes[0]:
            by_hash.setdefault(x, []).append(r)
    parts = []
    for ranks in by_hash.values():
        r = ranks[0]
        keys = [f"{k} (rank 0: {_shown(dicts[0], k)}, rank {r}: {_shown(dicts[r], k)})"
                for k in diff_configs(dicts[0], dicts[r])]
        who = f"rank {r}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who} differ{'s' if len(ranks) == 1 else ''} from rank 0 in {', '.join(keys)}")
    raise ConfigError("config differs across ranks: " + "; ".join(parts))


def _shown(d: dict, dotted: str, limit: int = 80) -> str:
    """The value at a dotted name of :func:`mpirt.run.config.diff_configs` (a key may itself hold a
    dot, as in "dataset train.bin size"), shortened for a one-line message."""
    while dotted not in d:
        head, _, dotted = dotted.partition(".")
        if not dotted or not isinstance(d.get(head), dict):
            return "(absent)"
        d = d[head]
    text = repr(d[dotted])
    return text if len(text) <= limit else text[:limit - 3] + "..."


def input_fingerprint(cfg, data_dir=None) -> dict:
    """What the files a :class:`mpirt.run.config.TrainConfig` names hold, as short comparable strings:
    the model file (``model`` as a TOML file, or a HF directory's config.json) and the
    ``init_from`` directory when given, by sha256; the dataset (``data_dir``, default
    ``cfg.data``) by its meta.json's sha256 and the byte sizes of train.bin and val.bin. Fold it
    into the config given to :func:`check_same_config` (e.g. under ``"inputs"``) so that ranks
    reading different copies behind one path are refused naming the file.
    """
    out = {}
    model = Path(cfg.model)
    if model.is_file() or (model / "config.json").is_file():
        f = model if model.is_file() else model / "config.json"
        out["model file"] = f"{f} sha256 {_file_sha(f)}"
    if cfg.init_from:
        out["init_from"] = f"{cfg.init_from} {_dir_digest(Path(cfg.init_from))}"
    data = Path(data_dir or cfg.data)
    meta = data / "meta.json"
    out["dataset meta.json"] = f"sha256 {_file_sha(meta)}" if meta.is_file() else "absent"
    for name in ("train.bin", "val.bin"):
        path = data / name
        out[f"dataset {name} size"] = path.stat().st_size if path.is_file() else None
    return out


_SMALL = 1 << 20  # files up to this size are fingerprinted by content, larger ones by size


def _file_sha(path: Path) -> str:
    """The first 16 hex digits of the file's sha256: ample to tell copies apart, short to show."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _dir_digest(directory: Path) -> str:
    """A digest of a checkpoint or model directory: the names and sizes of its files, the contents
    of the small ones (meta.json, meta.sha256, latest, config.json, an index), recursively (a
    checkpoint root holds its versions). Tensor files are covered by size here; their checksums
    are in meta.json, which is covered by content."""
    h = hashlib.sha256()
    files = {p.relative_to(directory): p for p in directory.rglob("*") if p.is_file()}
    for rel in sorted(r for r in files if not any(part.startswith(".") for part in r.parts)):  # no temporaries
        size = files[rel].stat().st_size
        h.update(f"{rel}\0{size}\0".encode())
        if size <= _SMALL:
            h.update(files[rel].read_bytes())
    return "sha256 " + h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# BLAS threads

def plan_blas_threads(threads: int | None, local_size: int, env=None,
                      cpus: int | None = None) -> tuple[int | None, str]:
    """(thread count to set or None to leave alone, a note saying why)."""
    env = os.environ if env is None else env
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads: must be >= 1, got {threads}")
        return threads, f"threads={threads} argument"
    for var in THREAD_VARS:
        if env.get(var):
            return None, f"left to the user's {var}={env[var]}"
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if cpus < (os.cpu_count() or cpus):  # bound by the launcher (srun --cpu-bind): already this rank's share
            return cpus, f"{cpus} cpus bound to this rank"
    n = max(1, cpus // max(1, local_size))
    return n, f"{cpus} cpus // {local_size} ranks on the node"


