"""Layout-independent model and optimizer state for any parallel layout.

Sharded checkpoints (:func:`save_shards` / :func:`load_shards`): each rank describes what it holds
as boxes of the global tensors, from each parameter's ShardSpec and its tp and ep coordinates (a blocked
dimension, e.g. the fused qkv, gives one box per block) and, under ZeRO, from its flat segments
(a segment of a flattened tp slice is a few boxes); loading asks the reader for exactly those
boxes, each read straight into its place, so any layout loads what any other wrote, and no rank
holds more than its own state (plus one box on a GPU, staged through the host). The same path
initialises from a Hugging Face directory (``mpirt.models.hf.HFReader``).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

import mpirt.core.backend as B
from mpirt.checkpoint.store import CheckpointError
from mpirt.parallel import tensor as TP
from mpirt.parallel.zero_shard import ZeroOptimizer


# --- sharded checkpoints: each rank writes and reads only its own boxes ------------------------
def _runs(p, sizes: dict, ranks: dict) -> list[list[tuple]]:
    """Per dimension, the ``(local offset, global offset, length)`` runs in which this rank's
    slice of ``p`` (its places ``ranks`` on the axes of ``sizes``) sits in the global tensor (a
    blocked dimension has one run per block), cut to the unpadded tensor (vocabulary padding is
    never saved)."""
    logical = getattr(p, "logical_shape", p.global_shape)
    out = []
    for d, n in enumerate(p.global_shape):
        idx = p.spec.dim_index(d, n, sizes, ranks)
        if isinstance(idx, slice):
            runs = [(0, idx.start or 0, (n if idx.stop is None else idx.stop) - (idx.start or 0))]
        else:
            cuts = [0, *(np.flatnonzero(np.diff(idx) != 1) + 1).tolist(), len(idx)]
            runs = [(a, int(idx[a]), b - a) for a, b in zip(cuts, cuts[1:])]
        out.append([(lo, g, min(m, logical[d] - g)) for lo, g, m in runs if g < logical[d]])
    return out


def _flat_boxes(shape, lo: int, hi: int) -> list[tuple]:
    """Boxes ``(start, shape)`` that cover the elements ``[lo, hi)`` of a C-ordered array of
    ``shape``, in order; each is one contiguous run of the flat array."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    row = math.prod(shape[1:])
    (i, j), (k, m) = divmod(lo, row), divmod(hi, row)
    if i == k:
        return [((i, *s), (1, *n)) for s, n in _flat_boxes(shape[1:], j, m)]
    out = []
    if j:
        out += [((i, *s), (1, *n)) for s, n in _flat_boxes(shape[1:], j, row)]
        i += 1
    if k > i:
        out.append(((i,) + (0,) * (len(shape) - 1), (k - i, *shape[1:])))
    if m:
        out += [((k, *s), (1, *n)) for s, n in _flat_boxes(shape[1:], 0, m)]
    return out


def _boxes(p, axes: tuple, array, lo: int | None = None):
    """``(global start, shape, view)`` for every box of the global tensor held by ``array``: this
    rank's slice of ``p`` (``axes``: the axis sizes and this rank's places, tp and ep) (``lo``
    None), or elements ``[lo, lo + array.size)`` of that slice, flattened (a ZeRO segment). Each
    view is a writable view into ``array``."""
    runs = _runs(p, *axes)
    local = p.spec.local_shape(p.global_shape, axes[0])
    if lo is None:
        parts = [((0,) * len(local), local, array)]
    else:
        parts = []
        for start, shape in _flat_boxes(local, lo, lo + array.size):
            off = int(np.ravel_multi_index(start, local)) - lo
            parts.append((start, shape, array[off:off + math.prod(shape)].reshape(shape)))
    for start, shape, view in parts:
        per_dim = [[(g + a - lo_, b - a, a - s) for lo_, g, m in dim_runs
                    for a, b in [(max(s, lo_), min(s + n, lo_ + m))] if a < b]
                   for s, n, dim_runs in zip(start, shape, runs)]
        for combo in itertools.product(*per_dim):
            yield (tuple(c[0] for c in combo), tuple(c[1] for c in combo),
                   view[tuple(slice(c[2], c[2] + c[1]) for c in combo)])


def _arrays(model, optimizer, skip) -> list[tuple]:
    """``(kind, name, param, array, lo)`` for everything this rank holds of the checkpoint through
    ``optimizer`` (one optimizer): the weights (float32 masters under mixed precision) and the
    optimizer state; ``lo`` is the ZeRO segment's offset in the parameter's flattened slice (None:
    the whole slice)."""
    out = []
    if isinstance(optimizer, ZeroOptimizer):
        weights = optimizer.param_shard if optimizer.master_shard is None else optimizer.master_shard
        for p, a, b, s in optimizer.owned_segments():
            if p.name in skip:
                continue
            out.append(("params", p.name, p, weights[s:s + b - a], a))
            out += [("optimizer_state", f"{p.name}.{k}", p, getattr(optimizer, k)[s:s + b - a], a)
                    for k in optimizer.STATE_NAMES]
        return out
    params = {id(p): p for _, p in model.named_parameters()}
    for i, p in enumerate(optimizer.params):
        if p.name in skip or id(p) not in params:
            continue
        master = optimizer.master[i]
        out.append(("params", p.name, p, p.data if master is None else master, None))
        out += [("optimizer_state", f"{p.name}.{k}", p, a, None) for k, a in optimizer.state[i].items()]
    return out


def _each(optimizers) -> list:
    """``optimizers`` as a list: one optimizer, or a list of them (an engine's groups')."""
    return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]


def tp_axes(tp_comm) -> tuple[dict, dict]:
    """The ``axes`` of a rank whose parameters are split over a tp ``comm`` alone (None: not split)."""
    return ({TP.AXIS: tp_comm.size}, {TP.AXIS: tp_comm.rank}) if tp_comm is not None else ({}, {})


def save_shards(writer, model, optimizers, axes=({}, {}), *, replica=lambda p: True, skip=()) -> None:
    """Add this rank's boxes to a :class:`mpirt.checkpoint.sharded.ShardWriter` through
    ``optimizers`` (an optimizer, or one per parameter group): its slices
    (``axes``: the sizes of tp and ep and this rank's places; a parameter replicated over tp from
    tp rank 0 only), its ZeRO segments, and without ZeRO only on the replica that writes
    (``replica(p)``: e.g. dp rank 0, or for an expert the edp rank 0). ``skip``: names another
    rank writes (the tied embedding on the last pipeline stage). Local: no communication."""
    for opt in _each(optimizers):
        sharded = isinstance(opt, ZeroOptimizer)  # each rank writes its segments
        for kind, name, p, array, lo in _arrays(model, opt, skip):
            if axes[1].get(TP.AXIS, 0) and TP.AXIS not in p.spec.dims or not (sharded or replica(p)):
                continue
            shape = getattr(p, "logical_shape", p.global_shape)
            for start, _, view in _boxes(p, axes, array, lo):
                writer.add(kind, name, shape, p.spec.dims, start, view)


def load_shards(reader, model, optimizers, axes=({}, {}), *, with_optimizer: bool = True) -> None:
    """Fill this rank's weights (and optimizer state and scalars, ``with_optimizer``) of
    ``optimizers`` (an optimizer, or one per parameter group) from a
    :class:`mpirt.checkpoint.store.CheckpointReader` (or anything with its ``meta``, ``entry`` and
    ``read(kind, name, start, shape, out=)``, such as ``mpirt.models.hf.HFReader``), reading only
    the boxes this rank holds, whatever layout wrote them, each straight into its place (on NumPy no
    box is held twice). ``axes``: as :func:`save_shards`. Collective over dp under ZeRO (the
    parameters are refreshed from shards)."""
    if with_optimizer and reader.meta["optimizer"] is None:
        raise CheckpointError(f"{reader.path}: the checkpoint holds no optimizer state")
    for opt in _each(optimizers):
        for kind, name, p, array, lo in _arrays(model, opt, ()):
            if kind == "optimizer_state" and not with_optimizer:
                continue
            reader.entry(kind, name, getattr(p, "logical_shape", p.global_shape))
            for start, shape, view in _boxes(p, axes, array, lo):
                if isinstance(view, np.ndarray):  # read straight into the parameter or state
                    reader.read(kind, name, start, shape, out=view)
                else:  # a device array: one box on the host, then copied over
                    view[...] = B.asarray(reader.read(kind, name, start, shape), dtype=view.dtype)
    for opt in _each(optimizers):
        if with_optimizer:
            opt.load_scalars(reader.meta["optimizer"]["scalars"])
        if isinstance(opt, ZeroOptimizer):
            opt.refresh_parameters()
        else:
            for p, master in zip(opt.params, opt.master):
                if master is not None:
                    p.data[...] = master  # rounded to nearest even
