"""Sharded checkpoints (format version 3): every rank writes only what it owns.

Collective save (:func:`save_sharded`, over the world comm): rank 0 creates ``.tmp-step-N/``;
each rank writes its boxes of the weights and of the optimizer state (an engine's
``save_sharded(writer)`` adds them to a :class:`ShardWriter`) into ``rank-NNNNN.safetensors``,
streamed one tensor at a time, hashed while written, fsynced; rank 0 gathers the small shard
descriptions, writes meta.json and meta.sha256 last and commits the version atomically
(:func:`mpirt.checkpoint.store.commit_version`). An error on any rank (disk full) or a non-finite value
reaches every rank, and the previous checkpoint stays intact. Loading is the other way round:
each rank asks a :class:`mpirt.checkpoint.store.CheckpointReader` for the boxes it needs.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np

import mpirt.core.backend as B
from mpirt.checkpoint.store import FORMAT, begin_version, build_meta, commit_version

_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
           "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(path: Path, items: list) -> dict:
    """Write a safetensors file from ``items``, ``(key, shape, dtype, get)`` tuples whose ``get()``
    returns the array, called one at a time while writing: only one tensor is in memory beyond
    the caller's. fsyncs; returns ``{"sha256", "bytes"}`` (hashed as written). OSError on failure."""
    header, offset = {}, 0
    for key, shape, dtype, _ in items:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[key] = {"dtype": _DTYPES[str(np.dtype(dtype))], "shape": [int(d) for d in shape],
                       "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": FORMAT}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            digest.update(chunk)
        for key, shape, dtype, get in items:
            a = np.ascontiguousarray(B.to_host(get()), dtype=dtype)
            if a.shape != tuple(shape):
                raise ValueError(f"write_safetensors: {key} has shape {a.shape}, announced {tuple(shape)}")
            data = a.reshape(-1).view(np.uint8)
            f.write(data)
            digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "bytes": path.stat().st_size}


class ShardWriter:
    """This rank's part of a sharded checkpoint: boxes of global tensors, kept as references (no
    copies) until :meth:`write` streams them into one file."""

    def __init__(self, rank: int):
        self.file = f"rank-{rank:05d}.safetensors"
        self.tensors: dict = {"params": {}, "optimizer_state": {}}
        self._items: list = []

    def add(self, kind: str, name: str, global_shape, spec, start, array) -> None:
        """Record ``array`` as the box of tensor ``name`` (``kind``: params or optimizer_state, of
        ``global_shape``, split as ShardSpec dims ``spec``) that starts at ``start``."""
        key = f"{name}@{','.join(str(int(s)) for s in start)}"
        e = self.tensors[kind].setdefault(name, {"shape": [int(n) for n in global_shape], "dtype": str(array.dtype),
                                                 "spec": list(spec), "shards": []})
        e["shards"].append({"file": self.file, "key": key, "start": [int(s) for s in start],
                            "shape": [int(n) for n in array.shape]})
        self._items.append((key, array))

    @property
    def nbytes(self) -> int:
        """Bytes of the boxes added so far (this rank's shard)."""
        return sum(int(a.nbytes) for _, a in self._items)

    def max_abs(self, kind: str) -> float:
        """The largest magnitude among this rank's boxes of ``kind`` (0.0 for none)."""
        names = {e["key"] for t in self.tensors[kind].values() for e in t["shards"]}
        return max((float(B.xp.abs(a).max()) for k, a in self._items if k in names and a.size), default=0.0)

    def all_finite(self) -> bool:
        return all(bool(B.xp.isfinite(a).all()) for _, a in self._items)

    def write(self, directory: Path) -> dict:
        """Write the file (none when nothing was added); returns ``{file: {"sha256", "bytes"}}``."""
        if not self._items:
            return {}
        items = [(k, a.shape, a.dtype, lambda a=a: a) for k, a in self._items]
        return {self.file: write_safetensors(directory / self.file, items)}


def save_sharded(directory, comm, fill, *, step: int, config, extra: dict | None, optimizer: dict | None,
                 keep: int = 1, params_limit: float | None = None) -> Path | None:
    """Save a new version under ``directory`` with every rank of ``comm`` writing its own part:
    ``fill(writer)`` adds this rank's boxes to a :class:`ShardWriter`. ``optimizer``: ``{"type",
    "scalars"}`` (step, lr, hyperparameters, loss scale) or None. Collective over ``comm``.
    ``extra.params_max_abs`` records the largest weight magnitude; above ``params_limit`` (the
    largest value the model's dtype holds, for float32 masters of a float16 model) the version
    is recorded as not good (``extra.good`` false).

    Returns the version's path on every rank, or None (nothing written) when some rank's state is
    not finite. Raises OSError on every rank when any rank failed to write (the message names the
    rank and file); the previous version stays intact and the temporary directory is removed.
    """
    rank = comm.rank
    setup = None
    if rank == 0:
        try:
            meta = build_meta(step, config, extra, optimizer, {}, {})
            setup = begin_version(directory, step, keep)
        except (OSError, TypeError, ValueError) as err:
            setup = err
    setup = comm.broadcast_object(setup, root=0)
    if isinstance(setup, Exception):
        raise setup
    root, name, tmp = setup
    writer = ShardWriter(rank)
    fill(writer)
    finite, files, error = writer.all_finite(), {}, None
    if finite:
        try:
            files = writer.write(tmp)
        except OSError as err:
            error = f"rank {rank}: {err}"
    parts = comm.allgather_object((error, finite, files, writer.tensors, writer.max_abs("params") if finite else 0.0))
    errors = [e for e, *_ in parts if e]
    result = None
    if rank == 0:
        largest = max(p[4] for p in parts)
        meta["extra"] = {**(meta["extra"] or {}), "params_max_abs": largest}
        if params_limit is not None and largest > params_limit:
            meta["extra"]["good"] = False
        if errors or not all(p[1] for p in parts):
            shutil.rmtree(tmp, ignore_errors=True)
            result = errors[0] if errors else None
        else:
            try:
                result = commit_version(root, name, tmp, _merge(meta, parts), keep)
            except (OSError, ValueError) as err:
                shutil.rmtree(tmp, ignore_errors=True)
                result = f"rank 0: {err}"
    result = comm.broadcast_object(result if rank == 0 else None, root=0)
    if isinstance(result, str):
        raise OSError(result)
    return result


def _merge(meta: dict, parts: list) -> dict:
    """meta.json from every rank's files and tensor descriptions (shard lists concatenated)."""
    for _, _, files, tensors, _ in parts:
        meta["files"].update(files)
        for kind, entries in tensors.items():
            for tname, e in entries.items():
                have = meta[kind].setdefault(tname, dict(e, shards=[]))
                if (have["shape"], have["dtype"]) != (e["shape"], e["dtype"]):
                    raise ValueError(f"save_sharded: ranks disagree on {tname}: {have['shape']} {have['dtype']} "
                                     f"vs {e['shape']} {e['dtype']}")
                have["shards"] += e["shards"]
    return meta
