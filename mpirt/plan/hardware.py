"""The machine the performance model runs on: :class:`Cluster` and its presets.

A cluster is nodes of devices; each device has a peak rate per dtype, a memory, a memory
bandwidth and the fraction of the peak its GEMMs reach (``gemm_efficiency``, at large shapes:
the rate of a product of smallest dimension ``d`` is ``peak x efficiency x d / (d + gemm_half_dim)``,
or, calibrated, ``gemm_rates`` interpolated in log d).
Links are alpha-beta: a message of ``n`` bytes takes ``latency + n / bandwidth``, intra-node
(NVLink, shared memory) and inter-node (InfiniBand, per device). ``op_overhead_s`` is what one
autograd Function costs on top of its arithmetic (Python, kernel launch), forward or backward.

CPU clusters add what oversubscription needs: ``cores`` per node (ranks beyond them share cores,
and a rank waiting in MPI spins, so every rank gets ``cores / ranks`` of a core), and, from
``--calibrate``, ``collectives``: per world size and group size, the measured (alpha, beta) of
allreduce, allgather and point-to-point at that rank count (see :mod:`mpirt.plan.calibrate`).

Presets (``PRESETS``) come from vendor data sheets; the efficiencies are assumptions, marked as
such in the planner's output. ``load(name)`` also reads calibrated presets saved as JSON under
``$MPIRT_CACHE/plan/<name>.json`` (default ``~/.cache/mpirt/plan``; ``$MPIRT_PLAN_CACHE``, the
older name, still wins when set) or a path.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path



def plan_cache() -> Path:
    """Where calibrated presets are saved: ``$MPIRT_PLAN_CACHE`` (kept as an alias) when set, else
    ``plan/`` in mpirt's cache (``$MPIRT_CACHE``, default ``~/.cache/mpirt``), beside the rest of what
    mpirt measures of this machine."""
    from mpirt.cpu.sysinfo import cache_dir
    return Path(os.environ.get("MPIRT_PLAN_CACHE") or cache_dir() / "plan")


@dataclass
class Cluster:
    """A homogeneous cluster (see the module docstring). Rates in FLOP/s, bandwidths in bytes/s."""

    name: str
    devices_per_node: int
    nodes: int
    peak_flops: dict                    # dtype -> dense peak FLOP/s of one device
    memory_bytes: float                 # per device
    memory_bandwidth: float             # per device (elementwise passes)
    gemm_efficiency: float              # share of the peak large GEMMs reach
    gemm_half_dim: float = 0.0          # the smallest GEMM dimension at which the rate is half of it
    intra_latency: float = 5e-6
    intra_bandwidth: float = 100e9      # per device, one direction
    inter_latency: float = 10e-6
    inter_bandwidth: float = 25e9       # per device, one direction
    op_overhead_s: float = 20e-6        # per autograd Function call, forward or backward
    ew_passes: float = 6.0              # elementwise bytes moved per kept activation byte, F + B
    overlap: bool = True                # dp buckets overlap the backward (NCCL/progress thread)
    cores: int = 0                      # CPU: cores per node (0: a device per rank, no sharing)
    threads_per_core: float = 1.0       # CPU: speed-up of a second GEMM thread (measured)
    collectives: dict = field(default_factory=dict)   # CPU: {world: {group: {op: [alpha, beta]}}}
    gemm_rates: dict = field(default_factory=dict)    # calibrated: {smallest dim: FLOP/s of one core}
    # calibrated: per rank count N on a node, {"slowdown": a block's forward + backward on each of N
    # concurrent ranks over one rank's alone, "block_fb_s"} (replaces the cores / N scaling at that N)
    compute_by_ranks: dict = field(default_factory=dict)
    opt_tensor_s: float = 0.0           # calibrated AdamW step: per parameter tensor
    opt_byte_s: float = 0.0             # and per parameter byte (0: ~12 passes at the bandwidth)
    checkpoint_gather: bool = False     # memory: the end of a run gathers the full state (older checkpoints)
    process_bytes: float = 0.0          # a rank's process baseline (0: mpirt.plan.memory.PROCESS_BYTES); calibrated
    source: str = "data sheet"
    notes: str = ""
    runtime: str = ""                   # calibrated: the mpirt it measured (runtime_fingerprint)

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of one device for ``dtype`` (bfloat16 for float16; float32 for float64 if missing)."""
        key = "bfloat16" if dtype == "float16" else dtype
        return self.peak_flops.get(key) or self.peak_flops.get("float32")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Cluster":
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["gemm_rates"] = {float(k): v for k, v in d.get("gemm_rates", {}).items()}
        d["compute_by_ranks"] = {int(n): c for n, c in d.get("compute_by_ranks", {}).items()}
        d["collectives"] = {int(w): {int(g): ops for g, ops in by.items()} for w, by in d.get("collectives", {}).items()}
        return cls(**d)

    def with_shape(self, nodes: int, devices_per_node: int) -> "Cluster":
        return dataclasses.replace(self, nodes=nodes, devices_per_node=devices_per_node)


GiB = 2**30
# Data-sheet figures (SXM boards; dense bf16 peaks as in mpirt.monitor.flops.GPU_PEAKS). The links: NVLink per
# GPU one direction (A100 300 GB/s, H100/H200 450 GB/s), one InfiniBand NIC per GPU (A100: HDR 200 Gb/s,
# H100/H200: NDR 400 Gb/s). Efficiencies are assumptions: large bf16 GEMMs reach ~75% of the A100's
# peak and ~65% of the H100's (cuBLAS, published measurements), NCCL rings ~80% of link bandwidth.
PRESETS: dict[str, Cluster] = {
    "a100": Cluster("a100", 8, 1, {"bfloat16": 312e12, "float32": 19.5e12, "float64": 19.5e12}, 80 * GiB,
                    2.0e12, 0.75, 64, 5e-6, 0.8 * 300e9, 10e-6, 0.8 * 25e9, 20e-6),
    "h100": Cluster("h100", 8, 1, {"bfloat16": 989e12, "float32": 67e12, "float64": 67e12}, 80 * GiB,
                    3.35e12, 0.65, 128, 5e-6, 0.8 * 450e9, 10e-6, 0.8 * 50e9, 20e-6),
    "h200": Cluster("h200", 8, 1, {"bfloat16": 989e12, "float32": 67e12, "float64": 67e12}, 141e9,
                    4.8e12, 0.65, 128, 5e-6, 0.8 * 450e9, 10e-6, 0.8 * 50e9, 20e-6),
    # an uncalibrated CPU node: 50 GFLOP/s per core (AVX2 float32 GEMM), 10 GB/s per core, MPI over shared
    # memory; the ranks' waits spin (MPICH), no progress thread: dp sync does not overlap the backward
    "cpu": Cluster("cpu", 1, 1, {"float32": 50e9, "float64": 25e9, "bfloat16": 50e9}, 16 * GiB, 10e9, 1.0, 32,
                   2e-6, 5e9, 20e-6, 1e9, 15e-6, overlap=False, cores=os.cpu_count() or 1,
                   source="assumed", notes="uncalibrated: run python -m mpirt.plan --calibrate"),
}


def runtime_fingerprint() -> str:
    """A digest of this mpirt's code (its Python and C sources): a calibration measured the speed
    of one version, and a faster or slower mpirt makes it stale."""
    import hashlib
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def describe_source(cluster: Cluster) -> str:
    """How the cluster's figures were obtained, for the end-of-run line: a calibration taken with
    another mpirt says so (its op costs no longer describe this one)."""
    if cluster.source == "calibrated" and cluster.runtime != runtime_fingerprint():
        return "calibrated with another mpirt version: rerun python -m mpirt.plan --calibrate"
    return cluster.source


def load(name: str) -> Cluster:
    """A preset by name, a calibrated preset saved under :func:`plan_cache`, or a JSON file path. A
    calibrated file of the same name wins over the built-in (``cpu`` after ``--calibrate``)."""
    path = Path(name)
    if path.suffix == ".json" and path.exists():
        return Cluster.from_dict(json.loads(path.read_text()))
    saved = plan_cache() / f"{name}.json"
    if saved.exists():
        return Cluster.from_dict(json.loads(saved.read_text()))
    if name.lower() in PRESETS:
        return dataclasses.replace(PRESETS[name.lower()])
    raise ValueError(f"unknown hardware {name!r}: one of {', '.join(PRESETS)}, a calibrated preset in {plan_cache()} "
                     f"(`python -m mpirt.plan --calibrate --save-as {name}` makes one of this machine) or a JSON file")


def save(cluster: Cluster, path: Path | None = None) -> Path:
    """Write ``cluster`` as JSON (default ``plan_cache()/<name>.json``); returns the path."""
    path = Path(path) if path else plan_cache() / f"{cluster.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cluster.to_dict(), indent=1) + "\n")
    return path
