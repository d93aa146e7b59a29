"""What every ZeRO stage shares: :class:`ZeroOptimizer`, AdamW over this rank's shard (its
hyperparameters and moments, the update, the gradient norm, the checkpoint format). The stages and
their classes are described in :mod:`mpirt.parallel.zero`, which makes them
(``ZeroOptimizer(model, comm, stage=s)``): :class:`~mpirt.parallel.zero.Zero12Optimizer` over the
flat store, :class:`~mpirt.parallel.zero3.Zero3Optimizer` over the sharded one."""
from __future__ import annotations

import contextlib

import mpirt.core.backend as B
from mpirt.core.optim import AdamW, Scalars, adamw_update, check_state_keys
from mpirt.core.precision import compute_dtype, is_half
from mpirt.parallel.flat import allreduce_runs, clip_flat, is_partial, place_shards, runs_calls, sum_squares


PIECE_BYTES = 16 << 20  # the update and stage 1's allreduce run over pieces of the shard this large
WRONG_STORE = ("ZeroOptimizer: stage 3 needs the model or its ShardedParams (its units gather parameters); "
               "stages 1-2 take the model, parameters or a FlatParams")


def check_hyper(lr: float, betas, eps: float, weight_decay: float) -> None:
    """Refuse (ValueError) betas outside [0, 1) and a negative lr, eps or weight_decay."""
    beta1, beta2 = betas
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"ZeroOptimizer: betas must be in [0, 1), got {tuple(betas)}")
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"ZeroOptimizer: lr ({lr}), eps ({eps}) and weight_decay ({weight_decay}) must be >= 0")


def decayed_ids(params, shapes: dict, decay) -> dict:
    """{id(p): whether p is decayed}: ``decay(p)``, default ``ndim >= 2`` of its shape in ``shapes``."""
    decay = decay or (lambda p: len(shapes[id(p)]) >= 2)
    return {id(p): bool(decay(p)) for p in params}


class ZeroOptimizer(Scalars):
    """AdamW sharded over the ranks of ``comm`` (a dp :class:`mpirt.comm.Comm`), ZeRO stage 1-3:
    ``ZeroOptimizer(model_or_params, comm, stage=s, ...)`` makes a
    :class:`~mpirt.parallel.zero.Zero12Optimizer` (stages 1-2) or a
    :class:`~mpirt.parallel.zero3.Zero3Optimizer` (stage 3; import :mod:`mpirt.parallel.zero`,
    where both are registered), whose docstrings list what else each takes.

    ``model_or_params``: the parameter store, :class:`~mpirt.parallel.flat.FlatParams` (stages
    1-2) or :class:`~mpirt.parallel.zero3.ShardedParams` (stage 3), or a Module (required for
    stage 3 without a store: the store is made here) or a list of Parameters.
    ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``decay`` (predicate: which parameters are
    decayed; default ``ndim >= 2``; a prebuilt ShardedParams has emptied ``p.data``: read names or
    ``global_shape`` there) as :class:`mpirt.core.optim.AdamW`.
    Under tensor and pipeline parallelism (the distributed optimizer): ``counted(p)`` says whether
    ``p``'s gradient counts in the norm on this rank (:func:`mpirt.parallel.flat.count_once`) and
    ``norm_comms`` are the other axes over which ranks hold different parameters (tp, pp); the
    dp group is then the ranks of one (pp, tp) coordinate. Parameters are broadcast from dp rank
    0 at construction, except lazy ones (no array yet): ``init(p, out=None)`` gives their value
    on every rank alike (e.g. :meth:`mpirt.core.nn.Parameter.init_slice`).

    Loop: ``zero_grad()``; forward/backward per micro-batch (scale the loss by 1/K); optionally
    ``clip_grad_norm(max_norm)``; ``step()``. All parameters must share one dtype. As a parameter
    group's sync (:mod:`mpirt.parallel.groups`) it is also its own optimizer: ``no_sync``,
    ``finish`` and ``close`` have nothing to do, the gradients are reduced where first needed
    (:meth:`sync_partial_grads`, :meth:`norm_parts`, :meth:`step`).

    A stage's class provides ``zero_grad``, ``calls``, ``gather_parameters``,
    ``full_parameters`` and three steps of the ones here: ``_held()`` (the parameter and gradient
    arrays kept between steps), ``_reduce()`` (the gradients averaged over dp into the shard) and
    ``_publish()`` (the updated shard made the parameters the model uses).
    """

    stage: int
    reruns_units = False  # ZeRO-3's units rerun their forward in backward
    _by_stage: dict = {}  # stage -> the class that runs it (each registers: class C(ZeroOptimizer, stages=...))
    STATE_NAMES = AdamW.state_names
    hyper_names = AdamW.hyper_names

    def __init_subclass__(cls, stages=(), **kwargs):
        super().__init_subclass__(**kwargs)
        ZeroOptimizer._by_stage.update(dict.fromkeys(stages, cls))

    def __new__(cls, model_or_params, comm, stage: int = 1, *args, **kwargs):
        if cls is ZeroOptimizer:
            if stage not in (1, 2, 3):
                raise ValueError(f"ZeroOptimizer: stage must be 1, 2 or 3, got {stage}")
            cls = ZeroOptimizer._by_stage[stage]
        return super().__new__(cls)

    def _init_shard(self, params, comm, groups, shapes: dict, decayed: dict, counted, *, lr, betas, eps,
                    weight_decay, norm_comms) -> None:
        """The state every stage keeps: hyperparameters, the shard's layout (``groups``, each a
        :class:`~mpirt.parallel.flat.ShardedLayout`) and the AdamW moments over it."""
        self.params, self.comm = params, comm
        self.rank, self.size = comm.rank, comm.size
        self.dtype = params[0].dtype
        self.lr, self.beta1, self.beta2 = float(lr), float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.step_count = 0
        self.grad_scale = 1.0  # multiplies the gradient as the update reads it (1/loss scale)
        self.norm_comms = tuple(norm_comms)
        self._shapes, self.groups = shapes, groups
        self.numel = sum(g.numel for g in groups)
        self.shard_numel = place_shards(groups)
        self.state_dtype = compute_dtype(self.dtype)
        self.exp_avg = B.xp.zeros(self.shard_numel, dtype=self.state_dtype)
        self.exp_avg_sq = B.xp.zeros(self.shard_numel, dtype=self.state_dtype)
        self._decay_runs = [r for g in groups for r in g.shard_runs(lambda p: decayed[id(p)])]
        self._counted_runs = [r for g in groups for r in g.shard_runs(counted)]
        self._partial_runs = [r for g in groups for r in g.shard_runs(is_partial)]
        self._reduced = False

    def _init_master(self) -> None:
        """Half parameters: the float32 master of the parameter shard."""
        self.master_shard = self.param_shard.astype(self.state_dtype) if is_half(self.dtype) else None

    def owned_segments(self) -> list[tuple]:
        """Which elements this rank owns: ``(param, start, stop, shard_start)`` means elements
        ``[start, stop)`` of ``param`` (flattened) are ``[shard_start, shard_start + stop - start)``
        of the rank's shard arrays (``param_shard``, ``grad_shard``, ``exp_avg``, ``exp_avg_sq``)."""
        return [(p, a, b, g.shard_offset + pos) for g in self.groups for p, a, b, pos in g.segments(g.lo, g.hi)]

    # --- the training step (a parameter group's sync) -------------------------------------------
    def no_sync(self):
        """Context for the non-final micro-batches: nothing to hold back (the shard sums every one)."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """The backward is over: nothing to wait for (the gradients are reduced where first needed)."""

    def close(self) -> None:
        """Nothing to release (no communication thread)."""

    def sync_partial_grads(self, tp_comm) -> None:
        """Sum over tp the partial gradients of sequence parallelism's replicated parameters, in
        the reduced shard (summing over tp commutes with averaging over dp). Collective over tp."""
        self.reduce_gradients()
        allreduce_runs(tp_comm, self.grad_shard, self._partial_runs)

    def partial_sum_calls(self, tp_comm) -> list[tuple]:
        """The calls of :meth:`sync_partial_grads` (:func:`~mpirt.parallel.flat.runs_calls`)."""
        return runs_calls(tp_comm, self.grad_shard, self._partial_runs)

    def reduce_gradients(self) -> None:
        """Average the gradients over the dp ranks into this rank's gradient shard (the stage's
        :meth:`_reduce`). Idempotent until the next step."""
        if self._reduced:
            return
        self._reduced = True
        B.synchronize()
        self._reduce()

    def clip_grad_norm(self, max_norm: float | None) -> float:
        """Clip the (dp-averaged) gradient by its global L2 norm, as :func:`mpirt.core.optim.clip_grad_norm`:
        scale by ``max_norm / (norm + 1e-6)`` when the norm exceeds ``max_norm`` (None: only the
        norm). The norm sums this rank's counted elements of its shard over dp and ``norm_comms``.
        Returns the norm before clipping."""
        return clip_flat(*self.norm_parts(), self.norm_comms, max_norm)

    def norm_parts(self) -> tuple:
        """``(the counted sum of squares of the reduced gradient, summed over dp; the arrays a clip
        scales)``: this optimizer's part of a global norm. Collective over dp."""
        self.reduce_gradients()
        sq = sum_squares(self.grad_shard, self._counted_runs)
        return (self.comm.allreduce_scalar(sq) if self.size > 1 else sq), [self._held()[1]]

    def step(self) -> None:
        """One AdamW update of this rank's shard, then the stage's :meth:`_publish` (stages 1-2
        all-gather the parameters). The update runs piece by piece (:data:`PIECE_BYTES`): its
        temporaries stay that small."""
        self.reduce_gradients()
        self.step_count += 1
        scale, xp = float(self.grad_scale), B.xp
        if self.weight_decay:
            keep = 1.0 - self.lr * self.weight_decay
            param = self.param_shard if self.master_shard is None else self.master_shard
            for a, b in self._decay_runs:
                param[a:b] *= keep
        n = self.shard_numel
        piece = max(1, PIECE_BYTES // self.exp_avg.itemsize)
        scratch = xp.empty(min(n, piece), dtype=self.state_dtype)
        for a in range(0, n, piece):
            b = min(a + piece, n)
            param, grad = self.param_shard[a:b], self.grad_shard[a:b]
            if self.master_shard is not None:  # half: update the float32 master, unscaled in float32
                param, grad = self.master_shard[a:b], xp.multiply(grad, scale, dtype=self.state_dtype)
            elif scale != 1.0:
                grad *= scale
            adamw_update(param, grad, self.exp_avg[a:b], self.exp_avg_sq[a:b], step=self.step_count, lr=self.lr,
                         beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=0.0, scratch=scratch[:b - a])
        self.refresh_parameters()
        self._reduced = False

    def refresh_parameters(self) -> None:
        """After the shards were written (an update, a sharded checkpoint load): round the half
        parameters from the masters, then the stage's :meth:`_publish`. Collective over dp at stages 1-2."""
        if self.master_shard is not None:
            self.param_shard[...] = self.master_shard  # rounded to nearest even
        self._publish()

    # --- accounting and checkpoints -------------------------------------------------------------
    def memory_bytes(self) -> dict:
        """Bytes this rank holds persistently (between steps): parameters, gradients, AdamW state
        (with the float32 master shard under mixed precision)."""
        params, grads = self._held()
        master = 0 if self.master_shard is None else self.master_shard.nbytes
        return {"params": int(params.nbytes), "grads": int(grads.nbytes),
                "optimizer": int(self.exp_avg.nbytes + self.exp_avg_sq.nbytes + master)}

    def state_dict(self) -> dict:
        """The state in :meth:`mpirt.core.optim.AdamW.state_dict`'s format, whatever the stage and dp size:
        ``{"type": "AdamW", "step", "lr", "beta1", "beta2", "eps", "weight_decay",
        "<param name>.exp_avg", "<param name>.exp_avg_sq"}`` with full host arrays of each parameter's
        global shape, gathered from the shards. Collective over the dp comm: every rank must call
        it, and every rank gets the whole dict. It loads into AdamW or into ZeRO at any stage and dp
        size. The model's weights are not in it (see :meth:`full_parameters`)."""
        d = {"type": "AdamW", **self.scalars()}
        full = {}
        for state in self.STATE_NAMES:
            arr = getattr(self, state)
            for g in self.groups:
                flat = B.to_host(g.gather(self.comm, arr))
                for p, v in zip(g.params, g.views(flat)):
                    full[f"{p.name}.{state}"] = v
        d.update((f"{p.name}.{state}", full[f"{p.name}.{state}"]) for p in self.params for state in self.STATE_NAMES)
        return d

    def load_state_dict(self, d: dict) -> None:
        """Restore a state in :meth:`state_dict`'s (AdamW's) format, saved at any stage and dp size:
        this rank keeps its shard of each array. Names, shapes and scalars are all checked first;
        errors name the key. Local (no communication); every rank must load the same dict."""
        if d.get("type", "AdamW") != "AdamW":
            raise ValueError(f"load_state_dict: state of a {d['type']} optimizer, ZeroOptimizer loads AdamW state")
        want = {f"{p.name}.{k}": p for p in self.params for k in self.STATE_NAMES}
        check_state_keys(d, want, self.hyper_names)
        for k, p in want.items():
            if tuple(d[k].shape) != self._shapes[id(p)]:
                raise ValueError(f"load_state_dict: {k} has shape {tuple(d[k].shape)}, expected {self._shapes[id(p)]}")
        for p, a, b, start in self.owned_segments():
            for k in self.STATE_NAMES:
                getattr(self, k)[start:start + b - a] = B.asarray(d[f"{p.name}.{k}"].reshape(-1)[a:b],
                                                                  dtype=self.state_dtype)
        self.load_scalars(d)

    @contextlib.contextmanager
    def _gathered(self):
        """Inside, every ``p.data`` is its full value gathered from the shards (the float32
        masters under mixed precision); yields the full flat vector of each group. On a normal
        exit the values in ``p.data`` (written in place, or rebound) go back into this rank's
        shard (and the half shard is rounded from the masters). Collective over dp."""
        source = self.param_shard if self.master_shard is None else self.master_shard
        gathered = []
        for g in self.groups:
            full = g.gather(self.comm, source)
            gathered.append((g, full, g.views(full)))
            for p, v in zip(g.params, gathered[-1][2]):
                p.data = v
        yield [full for _, full, _ in gathered]
        for g, full, views in gathered:
            for p, v in zip(g.params, views):
                if p.data is not v:
                    v[...] = p.data
            source[g.in_shard] = full[g.lo:g.hi]
        if source is not self.param_shard:
            self.param_shard[...] = source  # rounded to nearest even
