"""ZeRO stage 3: its parameter store, its units and its optimizer (:class:`Zero3Optimizer`).

A *unit* is a method of the model (``embed``, each block's ``forward``, ``head``) whose call
gathers the parameters it uses. :func:`plan_units` finds, by running the units once on one short row,
which parameters each unit uses, and groups the parameters by the set of units that use them
(GPT's tied ``wte``, used by ``embed`` and ``head``, is its own group). :class:`ShardedParams` is
the store: each group a :class:`~mpirt.parallel.flat.ShardedLayout` over the dp ranks, this
rank's chunks of every group in one parameter and one gradient vector. :class:`ShardedUnit`
replaces each unit's method by activation recomputation's :class:`~mpirt.core.recompute.Rerun`
with the weights sharded: its forward all-gathers the unit's groups, runs the unit without a
graph and frees them; its backward all-gathers them again, recomputes the unit with a graph
(dropout replays the forward's masks), back-propagates, reduce-scatters (averages) the full
gradients and returns the owned chunks as the gradients of the shard tensors. Each gather
starts the next unit's (forward: the one after, backward: the one before) without waiting for
it, so that it travels while this unit computes; the next unit takes it. :class:`Zero3Optimizer`
is AdamW over the store's shards (:class:`~mpirt.parallel.zero_shard.ZeroOptimizer`'s state and
update): the units fill its gradient shard, and they gather what it updates.
"""
from __future__ import annotations

import contextlib

import numpy as np

import mpirt.core.backend as B
from mpirt.core.nn import Module, dropout_modules, dropout_states, graph_parameters, restore_dropout_states, stand_ins
from mpirt.core.recompute import Rerun
from mpirt.core.tensor import Tensor, enable_grad
from mpirt.parallel.ddp import broadcast_parameters
from mpirt.parallel.flat import ShardedLayout, place_shards, trainable
from mpirt.parallel.step_simulation import Op
from mpirt.parallel.zero_shard import WRONG_STORE, ZeroOptimizer, check_hyper, decayed_ids


class ShardedParams:
    """ZeRO-3's parameter store: the trainable parameters of ``model`` grouped by the units that
    use them (:func:`plan_units`; ``units``, ``probe_len`` as there), each group chunked over the
    ranks of ``comm`` (dp), and this rank's chunks of all groups back to back in :attr:`data`
    (parameters) and :attr:`grad` (gradients, which the units' reduce-scatters fill). Outside a
    unit every ``p.data`` is an empty placeholder and ``p.grad`` None (:meth:`release`).

    Parameters that hold values are broadcast from dp rank 0 first; lazy ones are made one at a
    time by ``init(p)`` (the same values on every rank), of which the rank keeps its chunk, so
    the model is never held whole. ``counted`` as for :class:`~mpirt.parallel.flat.FlatParams`;
    ``shapes``: each parameter's shape, by id.

    A pipeline stage passes its own ``units`` (its embed, blocks, head) and their ``runs`` (the
    model chunk of each: the interleaved schedule's chunks run apart, so a unit's gather prefetches
    only a neighbour in its chunk), ``probe`` (what its first unit takes when that is not the
    embedding: a one-token hidden state, two tokens under context parallelism), ``dropout_roots`` (the
    modules whose dropouts the discovery run must leave as it found them) and ``alone`` (its copy
    of the tied embedding: a group of its own, laid out alike on both pipeline ends, so
    :meth:`alone_grads` can be summed over them)."""

    def __init__(self, model, comm, counted=None, init=None, units=None, probe_len: int = 1, probe=None,
                 dropout_roots=None, alone=(), runs=None):
        self.model, self.comm = model, comm
        self.counted = counted or (lambda p: True)
        self.params = trainable(model.parameters(), "ShardedParams", allow_empty=False)
        self.dtype = self.params[0].dtype
        self.shapes = {id(p): tuple(p.shape) for p in self.params}
        self.alone = sorted(alone, key=lambda p: p.name or "")
        self.dropout_roots = tuple(dropout_roots or (model,))  # every unit's rerun replays their masks
        self.runs = runs  # the model chunk of each unit: a unit prefetches only its neighbours in it
        if all(p.materialized for p in self.params):
            broadcast_parameters(self.params, comm)
        with stand_ins(self.params):  # the one-row discovery run needs no real values
            self.units, groups = plan_units(self, units, probe_len, probe)
        self.groups = [ShardedLayout(g, self.shapes, comm.rank, comm.size) for g in groups]
        self.numel = sum(g.numel for g in self.groups)
        self.shard_numel = place_shards(self.groups)
        xp = B.xp
        self.data = xp.empty(self.shard_numel, dtype=self.dtype)
        self.grad = xp.zeros(self.shard_numel, dtype=self.dtype)
        self._placeholder = xp.empty(0, dtype=self.dtype)
        self._prefetch = None  # (group ids, handles): the next unit's all-gather in flight
        for g in self.groups:  # one parameter at a time: this rank keeps its chunk of each
            for p, lo, hi, pos in g.segments(g.lo, g.hi):
                value = p.data if p.materialized else init(p)
                start = g.shard_offset + pos
                self.data[start:start + hi - lo] = B.asarray(value.reshape(-1)[lo:hi])
            g.shard = Tensor(self.data[g.in_shard], requires_grad=True)
            g.shard.grad = self.grad[g.in_shard]
        self.release()
        for unit in self.units:
            unit.install()

    def alone_grads(self) -> list:
        """The gradient shards of the ``alone`` parameters' groups, in the order of their names."""
        out = []
        for p in self.alone:
            g = next(g for g in self.groups if g.params == [p])
            out.append(self.grad[g.in_shard])
        return out

    def release(self) -> None:
        """Every parameter back to its placeholder (no array of its own), ``p.grad`` None."""
        for p in self.params:
            p.data, p.grad = self._placeholder, None

    @contextlib.contextmanager
    def gathered(self, group_ids, prefetch=None):
        """Inside, the given groups' full parameters are temporary arrays behind ``p.data``: the
        prefetched gather when it was of these groups, else gathered now. ``prefetch``: the
        groups of the unit expected next, whose all-gather starts once these are in place and
        runs while this unit computes (:meth:`take_prefetched`)."""
        try:
            fulls = self.take_prefetched(group_ids)
            if fulls is None:
                fulls = [self.groups[i].gather(self.comm, self.data) for i in group_ids]
            for i, full in zip(group_ids, fulls):
                g = self.groups[i]
                for p, v in zip(g.params, g.views(full)):
                    p.data = v
            if prefetch is not None:
                B.synchronize()
                self._prefetch = (tuple(prefetch), [self.comm.iallgather_flat(self.data[self.groups[i].in_shard],
                                                                              self.groups[i].numel)
                                                    for i in prefetch])
            yield
        finally:
            for i in group_ids:
                for p in self.groups[i].params:
                    p.data, p.grad = self._placeholder, None

    def take_prefetched(self, group_ids):
        """The full flat arrays of ``group_ids`` when the gather in flight is theirs (waited for),
        else None; a gather in flight of other groups (the schedule turned from forward to
        backward) is completed and dropped. Every dp rank runs the same units in the same order,
        so they start and complete the same gathers."""
        pending, self._prefetch = self._prefetch, None
        if pending is None:
            return None
        fulls = [h.wait() for h in pending[1]]
        return fulls if pending[0] == tuple(group_ids) else None


class GatherProgram:
    """ZeRO-3's gathers and reduce-scatters as the pre-flight proof's operations (appended to
    ``ops``), in the order :class:`ShardedParams` issues them: a unit takes the gather in flight
    when it is its own (waits for it), else completes and drops it and gathers; then starts its
    neighbour's (``prefetch``). A unit is ``(name, bytes of its tp slice, blocks)``."""

    def __init__(self, ops: list, dtype: str):
        self.ops, self.dtype, self.count, self.pending = ops, dtype, 0, None

    def _start(self, what: str, nbytes: int, label: str) -> int:
        self.ops.append(Op(what, "dp_cp", nbytes, label=label, dtype=self.dtype))
        self.count += 1
        return self.count - 1

    def gather(self, unit: tuple, prefetch: tuple | None, label: str) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            self.ops.append(Op("wait", "dp_cp", label=label, index=pending[1]))
        if pending is None or pending[0] != unit:
            self._start("allgather", unit[1], label)
        if prefetch is not None:
            self.pending = (prefetch, self._start("iallgather", prefetch[1], f"{label}, prefetching {prefetch[0]}"))

    def reduce_scatter(self, unit: tuple, label: str) -> None:
        self._start("reduce_scatter", unit[1], label)


def plan_units(store, units, probe_len: int = 1, probe=None):
    """The :class:`ShardedUnit` list of ``store`` (:class:`ShardedParams`) and its parameter groups (lists
    of parameters, one per set of units that use the same parameters, in first-use order; each
    of ``store.alone`` in a group of its own). ``units``: a list of ``(object, method_name)``, or
    None for the model's embed / h / head; ``probe_len``: tokens of the one-row batch the
    discovery runs (a multiple of tp under sequence parallelism); ``probe``: the first unit's
    input when it is not the embedding."""
    model = store.model
    if units is None:
        if not all(hasattr(model, a) for a in ("embed", "h", "head")):
            raise ValueError("ZeRO-3: the model has no embed/h/head interface; "
                             "pass units=[(object, method_name), ...]")
        units = [(model, "embed")] + [(blk, "forward") for blk in model.h] + [(model, "head")]
    used = _discover_unit_params(store, units, probe_len, probe)
    param_ids = {id(p) for p in store.params}
    signature = {}
    for k, ps in enumerate(used):
        for p in ps:
            if id(p) in param_ids:
                signature.setdefault(id(p), []).append(k)
    alone = {id(p) for p in store.alone}
    groups, by_sig = [], {}
    for p in store.params:  # registration order within a group; groups in first-use order
        sig = tuple(signature.get(id(p), ())) + ((p.name,) if id(p) in alone else ())
        if sig not in by_sig:
            by_sig[sig] = []
            groups.append((sig, by_sig[sig]))
        by_sig[sig].append(p)
    groups.sort(key=lambda sg: sg[0][0] if sg[0] and isinstance(sg[0][0], int) else len(units))
    plan = []
    for k, (obj, name) in enumerate(units):
        member = [i for i, (sig, _) in enumerate(groups) if k in sig]
        plan.append(ShardedUnit(store, obj, name, member))
    return plan, [ps for _, ps in groups]


def _discover_unit_params(store, units, probe_len: int, probe) -> list[list]:
    """Run the units once, each on the previous one's output, to see which parameters each uses:
    from a (1, probe_len) token batch when the first is the embedding, else from ``probe``."""
    if len(units) == 1:
        return [store.params]
    if [name for _, name in units][:1] != ["embed"] and probe is None:
        raise ValueError("ZeRO-3: pass units whose first is the model's embed, or the probe input of the "
                         "first (parameter discovery runs the units in turn on one token)")
    saved = dropout_states(dropout_modules(*store.dropout_roots).values())
    used = []
    x = B.xp.zeros((1, probe_len), dtype=np.int64) if [name for _, name in units][:1] == ["embed"] else probe
    with enable_grad():
        for k, (obj, name) in enumerate(units):
            inp = x if k == 0 and units[0][1] == "embed" else Tensor(x, requires_grad=True)
            out = getattr(obj, name)(inp)
            used.append(graph_parameters(out))
            x = out.data
    restore_dropout_states(saved)
    return used


class ShardedUnit(Rerun):
    """One stage-3 unit: ``obj.<name>`` replaced by a :class:`~mpirt.core.recompute.Rerun` whose
    weights are the unit's parameter groups, gathered for the forward and again for the rerun,
    and whose weight inputs are the groups' shards. The rerun's backward sums the full gradients
    into its own dict (a micro-batch's gradients stay apart from another's whose backward is
    open: a zero-bubble schedule runs other micro-batches between one's B and W); each group's
    are packed and reduce-scattered (averaged) into the owned chunks."""

    def __init__(self, store: ShardedParams, obj, name: str, group_ids: list[int]):
        super().__init__(getattr(obj, name), dropouts=dropout_modules(*store.dropout_roots).values())
        self.store, self.obj, self.name, self.group_ids = store, obj, name, group_ids

    def install(self) -> None:
        """Route ``obj.<name>`` through this unit, once the groups' shards exist; the units
        before and after it (in forward order) are the ones its backward and forward prefetch."""
        self.params = tuple(self.store.groups[i].shard for i in self.group_ids)
        units = self.store.units
        runs = self.store.runs or [0] * len(units)
        at = units.index(self)
        self.after = units[at + 1].group_ids if at + 1 < len(units) and runs[at + 1] == runs[at] else None
        self.before = units[at - 1].group_ids if at > 0 and runs[at - 1] == runs[at] else None
        object.__setattr__(self.obj, self.name, self)

    def weights(self):
        return self.store.gathered(self.group_ids, prefetch=self.after)

    @contextlib.contextmanager
    def backward_weights(self):
        with self.store.gathered(self.group_ids, prefetch=self.before):
            yield {}  # this backward's own sink

    def weight_grads(self, sink: dict) -> tuple:
        out = []
        for i in self.group_ids:
            g = self.store.groups[i]
            full = B.xp.zeros(g.numel, dtype=self.store.dtype)
            for p, v in zip(g.params, g.views(full)):
                grad = sink.pop(id(p), None)
                if grad is not None:
                    v[...] = grad
            B.synchronize()
            out.append(self.store.comm.reduce_scatter(full, op="avg"))
        if sink:
            raise RuntimeError(f"ZeRO-3 unit {self.name}: {len(sink)} trainable tensor(s) outside its groups "
                               "got gradients; they would be lost")
        return tuple(out)


class Zero3Optimizer(ZeroOptimizer, stages=(3,)):
    """ZeRO stage 3 over the sharded parameter store (see :class:`ZeroOptimizer` for the
    arguments; ``model_or_params``: a :class:`~mpirt.parallel.zero3.ShardedParams`, or the Module
    to make one of: ``units``, ``probe_len`` and ``init`` as there, one parameter generated at a
    time of which the rank keeps its chunk, so the model is never held whole). Its parameter and
    gradient shards are the store's; the units' reduce-scatters fill the gradient one during
    backward, so there is nothing left to reduce, and after the update nothing to gather (the
    units gather what they run)."""

    stage = 3
    reruns_units = True

    def __init__(self, model_or_params, comm, stage: int = 3, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, decay=None, counted=None, norm_comms=(),
                 init=None, units=None, probe_len: int = 1):
        if stage != 3:
            raise ValueError(f"Zero3Optimizer: stage must be 3, got {stage}")
        check_hyper(lr, betas, eps, weight_decay)
        store = model_or_params if isinstance(model_or_params, ShardedParams) else None
        if store is None and not isinstance(model_or_params, Module):
            raise ValueError(WRONG_STORE)
        params = store.params if store is not None else trainable(model_or_params.parameters(), "ZeroOptimizer",
                                                                   allow_empty=False)
        shapes = store.shapes if store is not None else {id(p): tuple(p.shape) for p in params}
        decayed = decayed_ids(params, shapes, decay)  # before the store empties p.data
        counted = counted or (store.counted if store is not None else (lambda p: True))
        if store is None:
            store = ShardedParams(model_or_params, comm, counted, init=init, units=units, probe_len=probe_len)
        self._init_shard(params, comm, store.groups, shapes, decayed, counted, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, norm_comms=norm_comms)
        self.store, self.units = store, store.units
        self.param_shard, self.grad_shard = store.data, store.grad
        self._init_master()

    def gather_parameters(self) -> dict:
        """Name -> full parameter as a host array. Collective over dp."""
        out = {}
        for g in self.groups:
            full = B.to_host(g.gather(self.comm, self.param_shard))
            for p, v in zip(g.params, g.views(full)):
                out[p.name] = v.copy()
        return out

    def _held(self) -> tuple:
        """The parameter and gradient arrays kept between steps: the shards."""
        return self.param_shard, self.grad_shard

    def zero_grad(self) -> None:
        """Zero the gradient shard (the units' reduce-scatters add into it)."""
        self._reduced = False
        self.grad_shard.fill(0)

    def _reduce(self) -> None:
        """Nothing: the units reduce-scattered the gradients into the shard during backward."""

    def calls(self) -> list[tuple[str, str, int, str]]:
        """None of a fixed number: the units' gathers and reduce-scatters go with their runs."""
        return []

    def _publish(self) -> None:
        """Nothing: the units gather the updated shard when they run."""

    @contextlib.contextmanager
    def full_parameters(self):
        """Context: inside, every ``p.data`` is the full parameter (the full float32 master under
        mixed precision), gathered from the shards, so ``model.state_dict()``,
        ``model.load_state_dict()`` and the checkpoint functions work as without ZeRO. On exit the
        values in ``p.data`` (written in place, or rebound to an array of the same shape) go back
        into this rank's chunk and the full arrays are released. Collective over dp; every rank
        must write the same values. Do not run the model inside (the units release the parameters
        they gather). On an exception nothing is written back."""
        try:
            with self._gathered():
                yield
        finally:
            self.store.release()
