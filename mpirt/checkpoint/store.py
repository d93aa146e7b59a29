"""Checkpoints: safetensors + JSON (never pickle), checksummed, committed atomically.

Layout of a checkpoint root ``directory``::

    directory/
      latest                  one line: the name of the current version ("step-00000300")
      step-00000300/          one complete checkpoint (a "version")
        meta.json             format, version, step, config, extra, optimizer scalars, tensors, files
        meta.sha256           "<sha256 of meta.json>  meta.json" (``sha256sum -c`` reads it)
        model.safetensors     parameter name -> array
        optimizer.safetensors "<param name>.<state>" -> array (e.g. "h.0.attn.w.exp_avg")
      .tmp-step-00000400/     a save in progress (or one that crashed): never read, removed later

Commit protocol: everything is written into ``.tmp-<name>/`` and fsynced; the directory is renamed
to ``<name>`` (atomic) and the root fsynced; then ``latest`` is replaced atomically (``os.replace``
of a fsynced temporary file) and the root fsynced again; finally older versions beyond ``keep`` and
stale temporaries are removed. A crash at any point leaves ``latest`` naming a complete, checked
version, or (killed between a first save's rename and its pointer) no ``latest`` and a complete
version, which loading then takes (the newest that verifies); a version exists under a ``step-*``
name only once all of its files are on disk.

Integrity: meta.json records the sha256 and size of every tensor file, and ``meta.sha256`` records
the sha256 of meta.json itself, so an edited meta.json (its step, a shape) or a flipped or
truncated byte in any file is refused naming the file. :func:`verify_checkpoint` checks all of it
without reading a tensor into memory; every loader calls it first.

Every tensor in ``meta.json`` records its global shape, dtype, ShardSpec dims and a list of shards
``{"file", "key", "start", "shape"}``: a box of the global tensor (where it starts, its shape)
stored under ``key`` in ``file``. A single-process save (:func:`save_state`) writes one shard per
tensor into model/optimizer files; a sharded save (:mod:`mpirt.checkpoint.sharded`, format
version 3) has each rank write its own boxes into ``rank-NNNNN.safetensors``.
:class:`CheckpointReader` returns any box of any tensor, reading only the overlapping parts of the
shards that hold it, so every version (1-3) loads into any layout.

``python -m mpirt.checkpoint info DIR`` describes a checkpoint and ``python -m mpirt.checkpoint
export DIR OUT`` writes a Hugging Face directory (:mod:`mpirt.checkpoint.__main__`).

Over 400 lines: the on-disk format, its atomic commit and its verification are one contract, read side by side.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save_file

import mpirt.core.backend as B
from mpirt.checkpoint.tensorfile import SafetensorsFile, TensorFileError
from mpirt.version import __version__

FORMAT, VERSION = "mpirt-checkpoint", 3  # 2: meta.sha256 covers meta.json; 3: sharded saves
META, MODEL, OPTIM, LATEST = "meta.json", "model.safetensors", "optimizer.safetensors", "latest"
META_SUM = "meta.sha256"
_VERSION_RE = re.compile(r"step-(\d+)(?:-(\d+))?")


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupted or does not fit the model/optimizer."""


# --- writing -------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path, fsync: bool = False) -> str:
    h, buf = hashlib.sha256(), bytearray(1 << 16)  # one small buffer: hashing a shard holds no tensor
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(path: Path, arrays: dict) -> dict:
    """Write ``arrays`` as safetensors, fsync, and return the file's entry for ``meta["files"]``.
    A failed write (disk full, quota) raises OSError naming the file."""
    try:
        save_file({k: np.ascontiguousarray(B.to_host(v)) for k, v in arrays.items()}, str(path),
                  metadata={"format": FORMAT})
    except SafetensorError as err:  # safetensors reports I/O failures as its own error type
        raise OSError(f"{path}: {err}") from None
    return {"sha256": _sha256(path, fsync=True), "bytes": path.stat().st_size}


def _tensor_entry(a, spec_dims, file: str, key: str) -> dict:
    shape = [int(n) for n in a.shape]
    return {"shape": shape, "dtype": str(a.dtype), "spec": list(spec_dims),
            "shards": [{"file": file, "key": key, "start": [0] * len(shape), "shape": shape}]}


def _to_dict(config) -> dict:
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(config)


def _write_pointer(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    _write_bytes(tmp, (name + "\n").encode())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _versions(root: Path) -> list[Path]:
    """Committed version directories under ``root``, oldest step first."""
    found = []
    for p in root.iterdir():
        m = _VERSION_RE.fullmatch(p.name)
        if m and p.is_dir():
            found.append(((int(m[1]), int(m[2] or 0)), p))
    return [p for _, p in sorted(found)]


def version_dirs(root) -> list[Path]:
    """Committed version directories under the checkpoint root ``root``, oldest step first."""
    return _versions(Path(root))


def _good(meta: dict) -> bool:
    """Whether a version's meta.json records it as good (``extra.good``; none recorded: good)."""
    return (meta.get("extra") or {}).get("good") is not False


def save_checkpoint(directory, model, optimizer, *, step: int, config, extra: dict | None = None,
                    keep: int = 1) -> Path:
    """Save an unsharded ``model`` (and ``optimizer``, may be None) as a new version under ``directory``.

    A convenience over :func:`save_state` for single-rank runs; parallel runs gather full arrays
    first (:mod:`mpirt.parallel.shards`) and call :func:`save_state` on one rank.
    """
    params = list(model.named_parameters())
    if any(tuple(p.shape) != tuple(p.global_shape) for _, p in params):
        raise ValueError("save_checkpoint: the model is sharded; gather it with mpirt.parallel.shards first")
    return save_state(directory, model.state_dict(), optimizer.state_dict() if optimizer is not None else None,
                      step=step, config=config, extra=extra, keep=keep,
                      specs={n: p.spec.dims for n, p in params})


def save_state(directory, weights: dict, optimizer_state: dict | None, *, step: int, config,
               extra: dict | None = None, keep: int = 1, specs: dict | None = None) -> Path:
    """Save full (unsharded) ``weights`` (name -> array) and ``optimizer_state`` (an optimizer's
    ``state_dict()``: arrays named ``<param>.<slot>`` plus scalars, or None) as a new version.

    ``config`` (a dict, or an object with ``to_dict()``, or a dataclass) and ``extra`` must be
    JSON-serialisable. ``specs`` (name -> ShardSpec dims) is recorded for information: the arrays
    are always the full tensors, so any layout can load them. After the new version is committed,
    the ``keep - 1`` newest other versions are kept and the rest removed. Returns its path.
    """
    specs = specs or {}
    weights = {n: B.to_host(a) for n, a in weights.items()}
    tensors = {n: _tensor_entry(a, specs.get(n, (None,) * a.ndim), MODEL, n) for n, a in weights.items()}
    opt_meta, opt_arrays, opt_tensors = None, {}, {}
    if optimizer_state is not None:
        opt_arrays = {k: B.to_host(v) for k, v in optimizer_state.items() if hasattr(v, "shape")}
        for k, v in opt_arrays.items():
            owner = k.rsplit(".", 1)[0]
            opt_tensors[k] = _tensor_entry(v, specs.get(owner, (None,) * v.ndim), OPTIM, k)
        opt_meta = {"type": optimizer_state.get("type"),
                    "scalars": {k: v for k, v in optimizer_state.items() if k not in opt_arrays and k != "type"}}
    meta = build_meta(step, config, extra, opt_meta, tensors, opt_tensors)
    root, name, tmp = begin_version(directory, step, keep)
    meta["files"][MODEL] = _write_tensors(tmp / MODEL, weights)
    if optimizer_state is not None:
        meta["files"][OPTIM] = _write_tensors(tmp / OPTIM, opt_arrays)
    return commit_version(root, name, tmp, meta, keep)


def build_meta(step: int, config, extra, optimizer: dict | None, params: dict, optimizer_state: dict) -> dict:
    """meta.json's contents (``files`` still empty); refuses what JSON cannot hold, naming it."""
    meta = {"format": FORMAT, "version": VERSION, "mpirt_version": __version__, "created": time.time(),
            "step": int(step), "config": _to_dict(config), "extra": extra, "optimizer": optimizer,
            "params": params, "optimizer_state": optimizer_state, "files": {}}
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_checkpoint: config/extra/optimizer scalars are not JSON-serialisable: {e}") from None
    return meta


def begin_version(directory, step: int, keep: int) -> tuple[Path, str, Path]:
    """Create the root and an empty ``.tmp-<name>/`` for a new version of ``step`` (a second save
    of one step gets a new name; the old one stays intact). Returns (root, name, tmp)."""
    if int(step) != step or step < 0 or keep < 1:
        raise ValueError(f"save_checkpoint: need an integer step >= 0 and keep >= 1, got step={step}, keep={keep}")
    root = Path(directory)
    if (root / META).exists():
        raise ValueError(f"save_checkpoint: {root} is a checkpoint version; pass the root directory above it")
    root.mkdir(parents=True, exist_ok=True)
    name, n = f"step-{int(step):08d}", 0
    while (root / name).exists():
        n += 1
        name = f"step-{int(step):08d}-{n}"
    tmp = root / f".tmp-{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return root, name, tmp


def commit_version(root: Path, name: str, tmp: Path, meta: dict, keep: int) -> Path:
    """Write meta.json and meta.sha256 last into ``tmp`` (its tensor files fsynced already), rename
    it to ``name``, point ``latest`` at it, and prune to the ``keep`` newest versions; a version
    that is not good (``extra.good`` false: saved after the loss left its range) prunes only
    versions that are not good either, so the good ones survive a diverging stretch."""
    meta_bytes = json.dumps(meta, indent=1, sort_keys=True).encode()
    _write_bytes(tmp / META, meta_bytes)
    _write_bytes(tmp / META_SUM, f"{hashlib.sha256(meta_bytes).hexdigest()}  {META}\n".encode())
    _fsync_dir(tmp)
    os.rename(tmp, root / name)
    _fsync_dir(root)
    _write_pointer(root, name)
    # Clean up: stale temporaries and versions beyond ``keep`` (never the new one).
    for p in root.iterdir():
        if p.name.startswith(".tmp-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    others = [p for p in _versions(root) if p.name != name]
    if not _good(meta):  # a version saved after the run went wrong never rotates out the good ones
        others = [p for p in others if not _stored_good(p)]
    for p in others[:max(0, len(others) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return root / name


def _stored_good(vdir: Path) -> bool:
    """Whether the committed version ``vdir`` records itself as good (unreadable: not good)."""
    try:
        return _good(json.loads((vdir / META).read_text()))
    except (OSError, ValueError):
        return False


# --- reading -------------------------------------------------------------------------------------
def looks_like_checkpoint(path) -> bool:
    """True when ``path`` holds what an mpirt checkpoint is made of (``latest``, ``meta.json``,
    ``step-*`` versions) or is a save in progress, whether or not it is intact: such a path is
    meant as a checkpoint, and loading it reports what is wrong instead of "not a checkpoint"."""
    p = Path(path)
    if not p.is_dir():
        return False
    if p.name.startswith(".tmp-") or (p / META).exists() or (p / LATEST).exists():
        return True
    return any(_VERSION_RE.fullmatch(c.name) for c in p.iterdir())


def _resolve(path) -> Path:
    """The version directory for ``path``: itself if it holds meta.json, else what ``latest`` names."""
    p = Path(path)
    if p.name.startswith(".tmp-"):
        raise CheckpointError(f"{p} is an uncommitted (in-progress or crashed) save")
    if (p / META).is_file():
        return p
    if (p / LATEST).is_file():
        try:
            name = (p / LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{p / LATEST}: unreadable ({e})") from None
        if not _VERSION_RE.fullmatch(name):
            raise CheckpointError(f"{p / LATEST}: does not name a checkpoint version: {name!r}")
        if not (p / name / META).is_file():
            raise CheckpointError(f"{p / LATEST} names {name}, but {p / name / META} is missing")
        return p / name
    if not p.is_dir():
        raise FileNotFoundError(f"no checkpoint at {p}: no such directory")
    if _versions(p):
        return _newest_verified(p)
    raise FileNotFoundError(f"no checkpoint at {p} (neither {p / META} nor {p / LATEST} exists)")


def _newest_verified(root: Path) -> Path:
    """The newest version under ``root`` that verifies end to end, for a root without ``latest``:
    a save killed between its version's rename and the pointer's write (the first save of a run
    leaves no pointer at all) must not make the run unresumable. CheckpointError when none verifies."""
    problems = []
    for version in reversed(_versions(root)):
        try:
            meta = read_checkpoint_meta(version)
            _verify_files(version, meta)
            return version
        except (CheckpointError, OSError) as err:
            problems.append(f"{version.name}: {err}")
    raise CheckpointError(f"{root / LATEST} is missing and no version there verifies ({'; '.join(problems)})")


def intact_version(root) -> Path | None:
    """The newest version under the checkpoint root ``root`` that verifies end to end, or None
    (none does, or ``root`` is not a root): what a run whose newest version is damaged can
    resume from instead."""
    try:
        return _newest_verified(Path(root)) if Path(root).is_dir() and _versions(Path(root)) else None
    except CheckpointError:
        return None


def _format_version(raw: bytes):
    try:
        return json.loads(raw).get("version")
    except (ValueError, AttributeError):
        return None


def _check_meta_sum(vdir: Path, raw: bytes) -> None:
    """Refuse a meta.json whose sha256 is not the one ``meta.sha256`` recorded at save time."""
    sum_path = vdir / META_SUM
    try:
        recorded = sum_path.read_text().split()
    except FileNotFoundError:
        if _format_version(raw) == 1:
            return  # written before meta.sha256 existed: its tensor files are still checksummed
        raise CheckpointError(f"{sum_path} is missing: {vdir / META} cannot be verified") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{sum_path}: unreadable ({e})") from None
    if len(recorded) != 2 or recorded[1] != META or not re.fullmatch(r"[0-9a-f]{64}", recorded[0]):
        raise CheckpointError(f"{sum_path}: corrupted (expected '<sha256>  {META}')")
    digest = hashlib.sha256(raw).hexdigest()
    if digest != recorded[0]:
        raise CheckpointError(f"{vdir / META} was edited or corrupted: its sha256 is {digest}, "
                              f"{sum_path} records {recorded[0]}")


def read_checkpoint_meta(directory) -> dict:
    """The ``meta.json`` of the checkpoint at ``directory`` (a root or a version), plus ``"path"``,
    after checking it against ``meta.sha256``."""
    vdir = _resolve(directory)
    raw = (vdir / META).read_bytes()
    _check_meta_sum(vdir, raw)
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{vdir / META}: not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{vdir / META}: not an mpirt checkpoint (format "
                              f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{vdir / META}: format version {meta['version']} is newer than this mpirt reads ({VERSION})")
    meta["path"] = str(vdir)
    return meta


def is_checkpoint(path) -> bool:
    """True when ``path`` is a checkpoint root or version with a readable mpirt ``meta.json``."""
    try:
        read_checkpoint_meta(path)
        return True
    except (OSError, ValueError):
        return False


def _verify_files(vdir: Path, meta: dict) -> None:
    """Every file meta.json lists is there with its recorded size and sha256, and every shard
    names a listed file."""
    files = meta["files"]
    for entries in (meta["params"], meta["optimizer_state"]):
        for name, e in entries.items():
            unlisted = {sh["file"] for sh in e["shards"]} - set(files)
            if unlisted:
                raise CheckpointError(f"{vdir / META}: {name} is stored in {sorted(unlisted)}, which it does not list")
    for fname, info in files.items():
        _verify_file(vdir / fname, info)


def _verify_file(path: Path, info: dict) -> None:
    """``path`` is there with the size and sha256 that ``info`` (its meta.json entry) records."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if size != info["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is truncated or corrupted: {size} bytes, "
                              f"expected {info['bytes']}")
    digest = _sha256(path)
    if digest != info["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupted: sha256 {digest}, expected {info['sha256']}")


def verify_checkpoint(directory) -> dict:
    """Check the checkpoint at ``directory`` (root or version) end to end without loading a
    tensor: ``latest``, meta.json against ``meta.sha256``, every file's size and sha256. Returns
    its meta; CheckpointError (FileNotFoundError when nothing is there) names the file at fault."""
    meta = read_checkpoint_meta(directory)
    _verify_files(Path(meta["path"]), meta)
    return meta


def _check_shapes(what: str, entries: dict, expected: dict) -> None:
    """``expected``: name -> shape. Errors name missing/unexpected keys or the key and both shapes."""
    missing, unexpected = sorted(set(expected) - set(entries)), sorted(set(entries) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{what}: missing keys {missing}, unexpected keys {unexpected}")
    for name, shape in expected.items():
        _check_shape(what, name, entries[name], shape)


def _check_shape(what: str, name: str, entry: dict, shape) -> None:
    """CheckpointError naming ``name`` and both shapes when ``entry``'s stored shape is not ``shape``."""
    if tuple(entry["shape"]) != tuple(shape):
        raise CheckpointError(f"{what}: {name} has shape {tuple(entry['shape'])} in the checkpoint, "
                              f"{tuple(shape)} in the model")


class BoxReader:
    """What :func:`mpirt.parallel.shards.load_shards` reads from: ``path``, ``meta`` (per kind in
    :attr:`KINDS` a dict name -> ``{"shape", "dtype"}``), :meth:`entry`, and
    ``read(kind, name, start, shape, out=)`` from the subclass."""

    KINDS = ("params", "optimizer_state")
    MISSING_HINT = ""   # appended to the "no tensor" error (e.g. what the source cannot hold)

    def entry(self, kind: str, name: str, shape=None) -> dict:
        """The description of tensor ``name`` (``kind``: one of :attr:`KINDS`), checked against
        ``shape`` (the global shape the caller expects) when given; :class:`CheckpointError`
        naming the source and the tensor otherwise."""
        e = self.meta.get(kind, {}).get(name) if kind in self.KINDS else None
        if e is None:
            raise CheckpointError(f"{self.path}: no tensor {name} under {kind}{self.MISSING_HINT}")
        if shape is not None:
            _check_shape(str(self.path), name, e, shape)
        return e


class CheckpointReader(BoxReader):
    """Reads any box of any tensor of a checkpoint (format 1-3), from the parts of the shards that
    overlap it only (safetensors slices: the rest of a file is never read).

    ``directory``: a root or a version. meta.json is checked against meta.sha256 at once; with
    ``verify`` each file's size and sha256 are checked (streamed) before its first read; pass
    ``verify=False`` after :func:`verify_checkpoint` has checked them all. ``meta`` is meta.json.
    Errors (:class:`CheckpointError`) name the file and the tensor.
    """

    def __init__(self, directory, verify: bool = True):
        self.meta = read_checkpoint_meta(directory)
        self.path = Path(self.meta["path"])
        self.verify = verify
        self._handles: dict = {}

    def _open(self, fname: str):
        handle = self._handles.get(fname)
        if handle is None:
            info = self.meta["files"].get(fname)
            if info is None:
                raise CheckpointError(f"{self.path / META}: a shard is stored in {fname}, which it does not list")
            if self.verify:
                _verify_file(self.path / fname, info)
            try:
                handle = self._handles[fname] = SafetensorsFile(self.path / fname)
            except (TensorFileError, OSError) as e:
                raise CheckpointError(f"checkpoint file {self.path / fname}: unreadable ({e})") from None
        return handle

    def read(self, kind: str, name: str, start=None, shape=None, out=None) -> np.ndarray:
        """The box of tensor ``name`` at ``start`` (default: the origin) of ``shape`` (default:
        the whole tensor): written into ``out`` (a NumPy array of that shape, any dtype, e.g. a
        view into a parameter; converted on the way, no copy of the box in between) and returned,
        or a new array of the tensor's dtype when ``out`` is None."""
        e = self.entry(kind, name)
        full = tuple(e["shape"])
        start = tuple(start) if start is not None else (0,) * len(full)
        shape = tuple(shape) if shape is not None else full
        if len(start) != len(full) or any(s < 0 or s + n > g for s, n, g in zip(start, shape, full)):
            raise CheckpointError(f"{self.path}: the box {start} + {shape} is outside {name} of shape {full}")
        if out is None:
            out = np.empty(shape, dtype=e["dtype"])
        elif tuple(out.shape) != shape:
            raise ValueError(f"CheckpointReader.read: out has shape {tuple(out.shape)}, the box {shape}")
        filled = 0
        for sh in e["shards"]:
            where = f"{self.path / sh['file']}: {name} (key {sh['key']})"
            if "shape" in sh and not _overlap(start, shape, sh["start"], sh["shape"]):
                continue  # format 3 records the box: no need to open the file
            try:
                part = self._open(sh["file"])
                stored = part.shape(sh["key"])
            except TensorFileError as err:
                raise CheckpointError(f"{where}: unreadable ({err})") from None
            if tuple(sh.get("shape", stored)) != stored or len(stored) != len(full) or any(
                    s < 0 or s + n > g for s, n, g in zip(sh["start"], stored, full)):
                raise CheckpointError(f"{where}: has shape {stored}, which does not fit at {sh['start']} "
                                      f"in {name} of shape {full}")
            box = _overlap(start, shape, sh["start"], stored)
            if box is None:
                continue
            lo, hi = box
            part.read(sh["key"], out[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))],
                      tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, sh["start"])))
            filled += int(np.prod([b - a for a, b in zip(lo, hi)]))
        if filled != out.size:
            raise CheckpointError(f"{self.path}: the shards of {name} cover {filled} of the {out.size} elements "
                                  f"of the box {start} + {shape}")
        return out


def _overlap(start_a, shape_a, start_b, shape_b):
    """(lo, hi) corners of the intersection of two boxes, or None when it is empty."""
    lo = [max(a, b) for a, b in zip(start_a, start_b)]
    hi = [min(a + m, b + n) for a, m, b, n in zip(start_a, shape_a, start_b, shape_b)]
    return (lo, hi) if all(a < b for a, b in zip(lo, hi)) else None


def load_state(directory) -> tuple[dict, dict, dict | None]:
    """Read the checkpoint at ``directory`` (root or version directory) after verifying every
    file's checksum: returns ``(meta, weights, optimizer_state or None)`` with full arrays."""
    meta = verify_checkpoint(directory)
    reader = CheckpointReader(meta["path"], verify=False)
    weights = {n: reader.read("params", n) for n in meta["params"]}
    state = None
    if meta["optimizer"] is not None:
        state = dict(meta["optimizer"]["scalars"], type=meta["optimizer"]["type"])
        state.update((k, reader.read("optimizer_state", k)) for k in meta["optimizer_state"])
    return meta, weights, state


def load_checkpoint(directory, model, optimizer=None) -> dict:
    """Load the checkpoint at ``directory`` (root: the ``latest`` version; or a version directory)
    into an unsharded ``model`` and, when given, ``optimizer``; return its meta (``step``, ...).

    Checksums, names and shapes are all verified before anything is modified.
    """
    meta = read_checkpoint_meta(directory)
    vdir = Path(meta["path"])
    _check_shapes(f"{vdir}: model", meta["params"], {n: p.shape for n, p in model.named_parameters()})
    if optimizer is not None and meta["optimizer"] is None:
        raise CheckpointError(f"{vdir}: the checkpoint holds no optimizer state")
    meta, weights, state = load_state(directory)
    if optimizer is not None:
        optimizer.load_state_dict(state)  # validates type, every key and shape before changing anything
    model.load_state_dict(weights)
    return meta
