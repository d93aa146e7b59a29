"""Full, layout-independent model and optimizer state for any parallel layout.

Checkpoints hold full tensors, so a run saved on one layout resumes on any other. Saving gathers:
tensor-parallel shards over tp (each parameter's ShardSpec says where its slice goes), ZeRO's
optimizer and parameter shards over dp (the ZeroOptimizer does that itself). Loading slices the
full tensors back. Both are collective over the ranks that hold the model.
"""
from __future__ import annotations

import contextlib

from mpirt.parallel import tensor as TP


def _slots(state: dict, name: str) -> list[str]:
    """Keys of the optimizer arrays that belong to parameter ``name`` (``name.exp_avg``, ...)."""
    return [k for k, v in state.items() if hasattr(v, "shape") and k.rsplit(".", 1)[0] == name]


def _full_parameters(optimizer):
    """ZeRO-3 keeps only parameter shards; this makes ``p.data`` full for the duration."""
    full = getattr(optimizer, "full_parameters", None)
    return full() if full is not None else contextlib.nullcontext()


def gather_state(model, optimizer, tp_comm=None) -> tuple[dict, dict]:
    """Full weights and full optimizer state (NumPy), on every rank. Collective."""
    with _full_parameters(optimizer):
        if tp_comm is None or tp_comm.size == 1:
            weights = model.state_dict()
        else:
            weights = TP.full_state_dict(model, tp_comm)
    state = optimizer.state_dict()
    if tp_comm is not None and tp_comm.size > 1:
        for name, p in model.named_parameters():
            for key in _slots(state, name):
                state[key] = TP.gather_param(p, state[key], tp_comm)
    return weights, state


def scatter_state(model, optimizer, weights: dict, state: dict | None, tp_comm=None) -> None:
    """Load full ``weights`` and optimizer ``state`` (None: weights only) into this rank's shards."""
    if tp_comm is not None and tp_comm.size > 1:
        t, r = tp_comm.size, tp_comm.rank
        weights = TP.shard_state_dict(model, weights, {"tp": t}, {"tp": r})
        if state is not None:
            state = dict(state)
            for name, p in model.named_parameters():
                for key in _slots(state, name):
                    state[key] = TP.shard_param(p, state[key], t, r)
    with _full_parameters(optimizer):
        model.load_state_dict(weights)
    if state is not None:
        optimizer.load_state_dict(state)
