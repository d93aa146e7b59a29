"""ZeRO stage 3's unit machinery (used by :class:`mpirt.parallel.zero.ZeroOptimizer`).

A *unit* is a method of the model (``embed``, each block's ``forward``, ``head``) whose call
gathers the parameters it uses. :func:`plan_units` finds, by running the units once on one short row,
which parameters each unit uses, and groups the parameters by the set of units that use them
(GPT's tied ``wte``, used by ``embed`` and ``head``, is its own group). :class:`ShardedUnit`
replaces the method by activation recomputation's :class:`~mpirt.core.recompute.Rerun` with the
weights sharded: its forward all-gathers the unit's groups, runs the unit without a graph and
frees them; its backward all-gathers them again, recomputes the unit with a graph (dropout
replays the forward's masks), back-propagates, reduce-scatters (averages) the full gradients and
returns the owned chunks as the gradients of the shard tensors.
"""
from __future__ import annotations

import contextlib

import numpy as np

import mpirt.core.backend as B
from mpirt.core.nn import dropout_modules, dropout_states, graph_parameters, restore_dropout_states
from mpirt.core.recompute import Rerun
from mpirt.core.tensor import Tensor, enable_grad


def plan_units(opt, units, probe_len: int = 1):
    """The :class:`ShardedUnit` list of ``opt`` (a stage-3 ZeroOptimizer) and its parameter groups (lists
    of parameters, one per set of units that use the same parameters, in first-use order).
    ``units``: a list of ``(object, method_name)``, or None for the model's embed / h / head;
    ``probe_len``: tokens of the one-row batch the discovery runs (a multiple of tp under
    sequence parallelism)."""
    model = opt.model
    if units is None:
        if not all(hasattr(model, a) for a in ("embed", "h", "head")):
            raise ValueError("ZeroOptimizer stage 3: the model has no embed/h/head interface; "
                             "pass units=[(object, method_name), ...]")
        units = [(model, "embed")] + [(blk, "forward") for blk in model.h] + [(model, "head")]
    used = _discover_unit_params(opt, units, probe_len)
    param_ids = {id(p) for p in opt.params}
    signature = {}
    for k, ps in enumerate(used):
        for p in ps:
            if id(p) in param_ids:
                signature.setdefault(id(p), []).append(k)
    groups, by_sig = [], {}
    for p in opt.params:  # registration order within a group; groups in first-use order
        sig = tuple(signature.get(id(p), ()))
        if sig not in by_sig:
            by_sig[sig] = []
            groups.append((sig, by_sig[sig]))
        by_sig[sig].append(p)
    groups.sort(key=lambda sg: sg[0][0] if sg[0] else len(units))
    plan = []
    for k, (obj, name) in enumerate(units):
        member = [i for i, (sig, _) in enumerate(groups) if k in sig]
        plan.append(ShardedUnit(opt, obj, name, member))
    return plan, [ps for _, ps in groups]


def _discover_unit_params(opt, units, probe_len: int) -> list[list]:
    """Run the units once on a (1, probe_len) token batch to see which parameters each one uses."""
    if len(units) == 1:
        return [opt.params]
    if [name for _, name in units][:1] != ["embed"]:
        raise ValueError("ZeroOptimizer stage 3: pass units whose first is the model's embed "
                         "(parameter discovery runs embed -> ... -> head on one token)")
    saved = dropout_states(dropout_modules(opt.model).values())
    used, x = [], B.xp.zeros((1, probe_len), dtype=np.int64)
    with enable_grad():
        for k, (obj, name) in enumerate(units):
            inp = x if k == 0 else Tensor(x, requires_grad=True)
            out = getattr(obj, name)(inp)
            used.append(graph_parameters(out))
            x = out.data
    restore_dropout_states(saved)
    return used


@contextlib.contextmanager
def gathered(opt, group_ids, with_grads: bool = False):
    """Full parameters of ``opt``'s given groups as temporary arrays behind ``p.data`` (and zeroed
    full gradient buffers behind ``p.grad``); yields {group index: full gradient buffer}."""
    grads = {}
    try:
        for i in group_ids:
            g = opt.groups[i]
            B.synchronize()
            full = opt.comm.allgather_flat(g.shard.data, g.numel)
            for p, v in zip(g.params, g.views(full)):
                p.data = v
            if with_grads:
                grads[i] = B.xp.zeros(g.numel, dtype=opt.dtype)
                for p, v in zip(g.params, g.views(grads[i])):
                    p.grad = v
        yield grads
    finally:
        for i in group_ids:
            for p in opt.groups[i].params:
                p.data, p.grad = opt._placeholder, None


class ShardedUnit(Rerun):
    """One stage-3 unit: ``obj.<name>`` replaced by a :class:`~mpirt.core.recompute.Rerun` whose
    weights are the unit's parameter groups, gathered for the forward and again for the rerun,
    and whose weight inputs are the groups' shards: the full gradients the rerun's backward
    leaves in each ``p.grad`` are reduce-scattered (averaged) into the owned chunks."""

    sums_leaf_grads = False  # the full gradients go to p.grad buffers, reduce-scattered per group

    def __init__(self, opt, obj, name: str, group_ids: list[int]):
        super().__init__(getattr(obj, name), dropouts=dropout_modules(obj).values())
        self.opt, self.obj, self.name, self.group_ids = opt, obj, name, group_ids

    def install(self) -> None:
        """Route ``obj.<name>`` through this unit, once the groups' shards exist."""
        self.params = tuple(self.opt.groups[i].shard for i in self.group_ids)
        object.__setattr__(self.obj, self.name, self)

    def weights(self):
        return gathered(self.opt, self.group_ids)

    def backward_weights(self):
        return gathered(self.opt, self.group_ids, with_grads=True)

    def weight_grads(self, full_grads: dict) -> tuple:
        B.synchronize()
        return tuple(self.opt.comm.reduce_scatter(full_grads[i], op="avg") for i in self.group_ids)
