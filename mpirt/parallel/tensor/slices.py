"""Tensor-parallel state: sharding parameters and state dicts, and gathering a parameter back.
(The gradient sum of sequence-parallel replicated parameters, global norms and clipping over tp
are the parameter store's: :mod:`mpirt.parallel.flat`.)"""
from __future__ import annotations

import numpy as np

import mpirt.core.backend as B
from mpirt.core.nn import Module, Parameter

from .axis import AXIS, PaddedParameter, pad_rows


# =============================================================================================
# parameters and state dicts
# =============================================================================================
def shard_param(p: Parameter, full, tp: int, rank: int):
    """This tp rank's slice of ``full``, a full (unpadded or padded) array shaped like ``p``."""
    a = np.asarray(B.to_host(full))
    if isinstance(p, PaddedParameter) and tuple(a.shape) == p.logical_shape:
        a = pad_rows(a, p.global_shape[0])
    if tuple(a.shape) != tuple(p.global_shape):
        raise ValueError(f"{p.name}: has shape {tuple(a.shape)}, expected {p.global_shape}")
    return np.ascontiguousarray(p.spec.shard(a, {AXIS: tp}, {AXIS: rank}))


def gather_param(p: Parameter, local, comm):
    """The full, unpadded array (NumPy) of which ``local`` is this rank's shard over the tp
    ``comm``, placed by ``p``'s ShardSpec: the inverse of :func:`shard_param`. Collective."""
    t = comm.size
    if AXIS not in p.spec.dims or t == 1:
        full = np.array(B.to_host(local))
    else:
        parts = B.to_host(comm.allgather(B.xp.ascontiguousarray(local)[None], counts=[1] * t))
        full = np.empty(p.global_shape, dtype=parts.dtype)
        for rank in range(t):
            p.spec.place(full, parts[rank], {AXIS: t}, {AXIS: rank})
    return full[:p.logical_shape[0]] if isinstance(p, PaddedParameter) else full


def shard_state_dict(model: Module, full_state: dict, axis_sizes: dict, axis_ranks: dict) -> dict:
    """This rank's slices of a full (unsharded, unpadded) state dict, e.g. a Hugging Face GPT-2
    file: ``model.load_state_dict(shard_state_dict(model, hf, {"tp": t}, {"tp": r}))``. Padded
    tables are padded with zero rows first; shapes are checked against each global shape."""
    out = {}
    for name, p in model.named_parameters():
        if name not in full_state:
            raise KeyError(f"shard_state_dict: {name} missing from the full state dict")
        out[name] = shard_param(p, full_state[name], axis_sizes.get(AXIS, 1), axis_ranks.get(AXIS, 0))
    return out
