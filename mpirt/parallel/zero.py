"""ZeRO: AdamW with its state, gradients and parameters sharded over the data-parallel ranks.

The parameters are laid out as flat vectors ("groups", :class:`mpirt.parallel.flat.FlatLayout`);
each group is cut into ``dp`` contiguous chunks and dp rank ``r`` owns chunk ``r`` of every group. The
owned chunks, concatenated, form this rank's *shard*: its AdamW state (``exp_avg``,
``exp_avg_sq``) and, from stage 2, its gradients, and at stage 3 its parameters, are flat arrays
over the shard, and the update is one :func:`mpirt.core.optim.adamw_update` call over it (the same
math as :class:`mpirt.core.optim.AdamW`; weight decay is applied first, element-wise, on the runs of
the shard that belong to decayed parameters, exactly as AdamW applies it per parameter).

* Stage 1: one group, all parameters, kept in the parameter store
  (:class:`mpirt.parallel.flat.FlatParams`): each ``p.data`` and ``p.grad`` is a view into a full
  flat vector. ``step`` allreduces (averages) the full gradient, updates the owned chunk, allgathers
  the parameters. Per rank: params 4N + grads 4N + state 8N/dp bytes (fp32).
* Stage 2: as stage 1, but the gradient is reduce-scattered, so only the owned chunk is kept.
  With ``stream_grads`` the full gradient never exists: backward fills each parameter's own
  ``p.grad``, and as soon as a bucket (a range of at most ``bucket_bytes`` of the parameter
  store, cut in the order backward finishes the gradients, across parameter boundaries) has all
  its gradients final it is packed into one staging buffer, reduced straight into the owners'
  chunks (an uneven reduce-scatter: each rank gets the part of the range it owns, maybe none)
  and added to the gradient shard; a ``p.grad`` is freed once every bucket took its part. Every
  micro-batch's backward does so (gradient accumulation, a pipeline's micro-batches: the shard
  sums them, at the price of one reduction per micro-batch); a pipeline's tied copies are
  ``held`` for the step (summed over the pipeline ends first). Peak gradient memory: the
  gradients being filled (at most one parameter's beyond those of the bucket in flight), the
  staging buffer, the held gradients and the shard. Without it the full gradient lives between
  :meth:`zero_grad` and :meth:`step`. Persistent: 4N + (4 + 8)N/dp.
* Stage 3: the parameters themselves are sharded. Groups follow the model's *units*: for a model
  with the ``embed`` / ``h`` / ``head`` interface of :mod:`mpirt.core.modeling` the units are ``embed``, each
  block and ``head``, and a group is the set of parameters used by the same units (so GPT's tied
  ``wte`` is its own group, gathered by both ``embed`` and ``head``). The store is
  :class:`mpirt.parallel.zero3.ShardedParams`: this rank's chunks of the groups, parameters and
  gradients. Each unit's call gathers its groups, runs and frees them; its backward gathers them
  again, recomputes the unit (stage 3 implies activation recomputation per unit) and
  reduce-scatters the gradients into the shard (:mod:`mpirt.parallel.zero3`).
  Outside a unit ``p.data`` is an empty placeholder. Persistent: 16N/dp.

Mixed precision (:mod:`mpirt.core.precision`): with half parameters the shard also holds a float32
master (``master_shard``) and the moments are float32, so the optimizer state is 12 bytes per
parameter over dp (bf16 ZeRO-1: 2 + 2 + 12/dp per parameter). The update runs on the master with
the gradient shard converted to float32 (times ``grad_scale``), then the half shard is rounded
from it and all-gathered. :meth:`full_parameters` shows the model the full float32 masters.

Checkpoints are layout-independent: :meth:`state_dict` gathers the shards into AdamW's format
(full arrays per parameter), :meth:`load_state_dict` keeps this rank's shard of such a state, and
``with opt.full_parameters():`` shows the model its full weights for ``model.state_dict()`` /
``load_state_dict`` (stage 3). A checkpoint moves between AdamW and ZeRO at any stage and dp size.

Over 400 lines: ZeRO 1-2's sharded optimizer and its gradient stream share the shard arithmetic (split pending issue 33 item 2, parameter groups).
"""
from __future__ import annotations

import contextlib

import mpirt.core.backend as B
from mpirt.core.injected import injected
from mpirt.core.nn import Module
from mpirt.core.optim import AdamW, Scalars, adamw_update
from mpirt.core.precision import compute_dtype, is_half
from mpirt.parallel.ddp import broadcast_parameters
from mpirt.comm import chunk_bounds
from mpirt.parallel.flat import (FlatParams, ShardedLayout, allreduce_runs, clip_flat, is_partial, place_shards,
                                 runs_calls, sum_squares, trainable)
from mpirt.parallel.zero3 import ShardedParams


PIECE_BYTES = 16 << 20  # the update and stage 1's allreduce run over pieces of the shard this large
BUCKET_BYTES = 4 << 20  # stage 2 reduces the gradients in buckets of about this many bytes


class ZeroOptimizer(Scalars):
    """AdamW sharded over the ranks of ``comm`` (a dp :class:`mpirt.comm.Comm`), ZeRO stage 1-3.

    ``model_or_params``: the parameter store, :class:`~mpirt.parallel.flat.FlatParams` (stages
    1-2) or :class:`~mpirt.parallel.zero3.ShardedParams` (stage 3), or a Module (required for
    stage 3 without a store: the store is made here) or a list of Parameters.
    ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``decay`` (predicate: which parameters are
    decayed; default ``ndim >= 2``; a prebuilt ShardedParams has emptied ``p.data``: read names or
    ``global_shape`` there) as :class:`mpirt.core.optim.AdamW`. ``units`` (stage 3 only): a
    list of ``(object, method_name)`` whose calls gather parameters; the default is the model's
    ``embed``, each of ``h`` and ``head``; ``probe_len``: the sequence length their one-time
    parameter discovery runs at (sequence parallelism needs a multiple of tp).
    Under tensor and pipeline parallelism (the distributed optimizer): ``counted(p)`` says whether
    ``p``'s gradient counts in the norm on this rank (:func:`mpirt.parallel.flat.count_once`) and
    ``norm_comms`` are the other axes over which ranks hold different parameters (tp, pp); the
    dp group is then the ranks of one (pp, tp) coordinate. Parameters are broadcast from dp rank
    0 at construction, except lazy ones (no array yet): ``init(p, out=None)`` gives their value
    on every rank alike (e.g. :meth:`mpirt.core.nn.Parameter.init_slice`); at stage 3 one parameter is
    generated at a time and the rank keeps its chunk, so the model is never held whole.
    ``stream_grads`` (stage 2): reduce the gradients bucket by bucket (``bucket_bytes``) while
    each micro-batch's backward runs, never holding them whole; ``held``: parameters whose
    gradients wait for the step instead (a pipeline's tied copies, summed over its ends first).

    Loop: ``zero_grad()``; forward/backward per micro-batch (scale the loss by 1/K); optionally
    ``clip_grad_norm(max_norm)``; ``step()``. All parameters must share one dtype.
    """

    def __init__(self, model_or_params, comm, stage: int = 1, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, decay=None, units=None, counted=None,
                 norm_comms=(), probe_len: int = 1, init=None, stream_grads: bool = False, held=(),
                 bucket_bytes: int = BUCKET_BYTES):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroOptimizer: stage must be 1, 2 or 3, got {stage}")
        beta1, beta2 = betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"ZeroOptimizer: betas must be in [0, 1), got {tuple(betas)}")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"ZeroOptimizer: lr ({lr}), eps ({eps}) and weight_decay ({weight_decay}) must be >= 0")
        if isinstance(model_or_params, (FlatParams, ShardedParams)):
            store, params = model_or_params, model_or_params.params
        else:
            store = None
            params = trainable(model_or_params.parameters() if isinstance(model_or_params, Module)
                               else model_or_params, "ZeroOptimizer", allow_empty=False)
        wrong_store = isinstance(store, FlatParams) if stage == 3 else isinstance(store, ShardedParams)
        if wrong_store or stage == 3 and store is None and not isinstance(model_or_params, Module):
            raise ValueError("ZeroOptimizer: stage 3 needs the model or its ShardedParams (its units gather "
                             "parameters); stages 1-2 take the model, parameters or a FlatParams")
        self.params = params
        self.comm, self.stage = comm, stage
        self.rank, self.size = comm.rank, comm.size
        self.dtype = self.params[0].dtype
        self.lr, self.beta1, self.beta2 = float(lr), float(beta1), float(beta2)
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.step_count = 0
        self.grad_scale = 1.0  # multiplies the gradient as the update reads it (1/loss scale)
        self.norm_comms = tuple(norm_comms)
        counted = counted or (store.counted if store is not None else (lambda p: True))
        self._shapes = store.shapes if isinstance(store, ShardedParams) else {id(p): tuple(p.shape) for p in params}
        decay = decay or (lambda p: len(self._shapes[id(p)]) >= 2)
        self._decayed = {id(p): bool(decay(p)) for p in self.params}  # before stage 3 empties p.data
        if stage == 3 and store is None:
            store = ShardedParams(model_or_params, comm, counted, init=init, units=units, probe_len=probe_len)
        self.groups = store.groups if stage == 3 else [ShardedLayout(self.params, self._shapes, self.rank, self.size)]
        self.numel = sum(g.numel for g in self.groups)
        offset = self.shard_numel = place_shards(self.groups)
        xp = B.xp
        self.state_dtype = compute_dtype(self.dtype)
        self.exp_avg = xp.zeros(offset, dtype=self.state_dtype)
        self.exp_avg_sq = xp.zeros(offset, dtype=self.state_dtype)
        self._decay_runs = [r for g in self.groups for r in g.shard_runs(lambda p: self._decayed[id(p)])]
        self._counted_runs = [r for g in self.groups for r in g.shard_runs(counted)]
        self._partial_runs = [r for g in self.groups for r in g.shard_runs(is_partial)]
        self._reduced = False
        if stage == 3:
            self.store, self.units = store, store.units
            self.param_shard, self.grad_shard = store.data, store.grad
        else:
            g = self.groups[0]
            lazy = any(not p.materialized for p in self.params)
            self.store = store or FlatParams(self.params, counted, init=init, grads=stage == 1)
            if not lazy:  # seeded values are the same on every rank already
                broadcast_parameters(self.store, comm)
            self.flat_param = self.store.data
            self.param_shard = self.flat_param[g.lo:g.hi]
            if self.rank == 0 and self.size > 1 and injected("zero-shard-offset"):  # test-only (mpirt.core.injected)
                self.param_shard = self.flat_param[g.lo + 1:g.hi + 1]
            if stage == 1:
                self.grad_shard = self.store.grad[g.lo:g.hi]
            else:
                self.grad_shard = xp.zeros(offset, dtype=self.dtype)
                self.store.release_grads()
        self._stream = _GradStream(self, bucket_bytes, held) if stream_grads and stage == 2 else None
        self.master_shard = self.param_shard.astype(self.state_dtype) if is_half(self.dtype) else None

    @property
    def model(self):
        """Stage 3: the model whose units gather the parameters (None at stages 1-2)."""
        return self.store.model if self.stage == 3 else None

    def owned_segments(self) -> list[tuple]:
        """Which elements this rank owns: ``(param, start, stop, shard_start)`` means elements
        ``[start, stop)`` of ``param`` (flattened) are ``[shard_start, shard_start + stop - start)``
        of the rank's shard arrays (``param_shard``, ``grad_shard``, ``exp_avg``, ``exp_avg_sq``)."""
        return [(p, a, b, g.shard_offset + pos) for g in self.groups for p, a, b, pos in g.segments(g.lo, g.hi)]

    def gather_parameters(self) -> dict:
        """Name -> full parameter as a host array (collective at stage 3)."""
        out = {}
        for g in self.groups:
            if self.stage == 3:
                full = B.to_host(g.gather(self.comm, self.param_shard))
                for p, v in zip(g.params, g.views(full)):
                    out[p.name] = v.copy()
            else:
                for p in g.params:
                    out[p.name] = B.to_host(p.data).copy()
        return out

    # --- the training step --------------------------------------------------------------------
    @property
    def flat_grad(self):
        """Stages 1-2: the full local gradient (the store's), None while released (stage 2)."""
        return self.store.grad if self.stage < 3 else None

    def zero_grad(self) -> None:
        """Zero the gradients (stage 2: the shard; without ``stream_grads`` also allocate the
        transient full gradient for backward)."""
        self._reduced = False
        if self._stream is not None:  # each p.grad is made by backward and freed once reduced
            self.store.release_grads()
            self._stream.reset()
        elif self.stage < 3:
            self.store.zero_grad()
        if self.stage > 1:
            self.grad_shard.fill(0)

    def sync_partial_grads(self, tp_comm) -> None:
        """Sum over tp the partial gradients of sequence parallelism's replicated parameters
        (stages 1-2: in the full gradient before it is reduced; stage 3: in the shard, where the
        units' reduce-scatter already put them). Collective over tp."""
        if self.stage < 3 and self._stream is None:
            self.store.sync_partial_grads(tp_comm)
        else:  # summing over tp commutes with averaging over dp: done on the reduced shard
            self.reduce_gradients()
            allreduce_runs(tp_comm, self.grad_shard, self._partial_runs)

    def partial_sum_calls(self, tp_comm) -> list[tuple]:
        """The calls of :meth:`sync_partial_grads` (:func:`~mpirt.parallel.flat.runs_calls`)."""
        if self.stage < 3 and self._stream is None:
            return self.store.partial_sum_calls(tp_comm)
        return runs_calls(tp_comm, self.grad_shard, self._partial_runs)

    def reduce_gradients(self) -> None:
        """Average the gradients over the dp ranks into this rank's gradient shard (stage 1:
        allreduce of the full gradient; stage 2: reduce-scatter, then the full gradient is
        released; stage 3: already done during backward). Idempotent until the next step."""
        if self._reduced:
            return
        self._reduced = True
        B.synchronize()
        if self.stage == 1:  # in pieces: MPI's temporary buffers stay as small as one
            self.store.check_views("ZeroOptimizer")
            grad, piece = self.store.grad, max(1, PIECE_BYTES // self.store.grad.itemsize)
            for a in range(0, grad.size, piece):
                part = grad[a:a + piece]
                self.comm.allreduce(part, op="avg", out=part)
        elif self._stream is not None:
            self._stream.finish()
        elif self.stage == 2:
            self.store.check_views("ZeroOptimizer")
            self.comm.reduce_scatter(self.store.grad, op="avg", out=self.grad_shard)
            self.store.release_grads()

    def calls(self) -> list[tuple[str, str, int, str]]:
        """``(axis, kind, bytes, dtype)`` of the calls on dp whose number and size a step fixes:
        stage 1's gradient average in pieces and stages 1-2's parameter gather after the update.
        Not listed: the streamed reduce-scatters of stage 2 (per micro-batch and bucket, as
        backward completes them) and stage 3's gathers and reduce-scatters (per unit run)."""
        axis, dtype = self.comm.axis, self.dtype.name
        if self.stage == 3:
            return []
        out = []
        if self.stage == 1:
            size, piece = self.store.grad.size, max(1, PIECE_BYTES // self.store.grad.itemsize)
            out += [(axis, "allreduce", min(piece, size - a) * self.store.grad.itemsize, dtype)
                    for a in range(0, size, piece)]
        return out + [(axis, "allgather", int(self.flat_param.nbytes), dtype)]

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
        return (self.comm.allreduce_scalar(sq) if self.size > 1 else sq), \
            [self.store.grad if self.stage == 1 else self.grad_shard]

    def step(self) -> None:
        """One AdamW update of this rank's shard; stages 1-2 then all-gather the parameters.
        The update runs piece by piece (:data:`PIECE_BYTES`): its temporaries stay that small."""
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
        if self.master_shard is not None:
            self.param_shard[...] = self.master_shard  # rounded to nearest even
        if self.stage < 3:
            B.synchronize()
            self.comm.allgather_flat(self.param_shard, self.groups[0].numel, out=self.flat_param)  # in place
        else:
            self.grad_shard.fill(0)  # consumed: the next backward accumulates from zero
        self._reduced = False

    # --- accounting and checkpoints -------------------------------------------------------------
    def memory_bytes(self) -> dict:
        """Bytes this rank holds persistently (between steps): parameters, gradients, AdamW state
        (with the float32 master shard under mixed precision)."""
        params = self.param_shard.nbytes if self.stage == 3 else self.flat_param.nbytes
        grads = self.flat_grad.nbytes if self.stage == 1 else self.grad_shard.nbytes
        master = 0 if self.master_shard is None else self.master_shard.nbytes
        return {"params": int(params), "grads": int(grads),
                "optimizer": int(self.exp_avg.nbytes + self.exp_avg_sq.nbytes + master)}

    STATE_NAMES = AdamW.state_names
    hyper_names = AdamW.hyper_names

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
        given = {k for k, v in d.items() if hasattr(v, "shape")}
        missing = sorted(set(want) - given) + [k for k in ("step", *self.hyper_names) if k not in d]
        unexpected = sorted(given - set(want))
        if missing or unexpected:
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for k, p in want.items():
            if tuple(d[k].shape) != self._shapes[id(p)]:
                raise ValueError(f"load_state_dict: {k} has shape {tuple(d[k].shape)}, expected {self._shapes[id(p)]}")
        for p, a, b, start in self.owned_segments():
            for k in self.STATE_NAMES:
                getattr(self, k)[start:start + b - a] = B.asarray(d[f"{p.name}.{k}"].reshape(-1)[a:b],
                                                                  dtype=self.state_dtype)
        self.load_scalars(d)

    def refresh_parameters(self) -> None:
        """After the shards were written (a sharded checkpoint load): round the half parameters
        from the masters, and at stages 1-2 all-gather the full parameters. Collective over dp."""
        if self.master_shard is not None:
            self.param_shard[...] = self.master_shard  # rounded to nearest even
        if self.stage < 3:
            B.synchronize()
            self.comm.allgather_flat(self.param_shard, self.groups[0].numel, out=self.flat_param)

    @contextlib.contextmanager
    def full_parameters(self):
        """Context: inside, every ``p.data`` is the full parameter (the full float32 master under
        mixed precision), so ``model.state_dict()``, ``model.load_state_dict()``,
        :func:`mpirt.checkpoint.store.save_checkpoint` and :func:`~mpirt.checkpoint.store.load_checkpoint` work
        as without ZeRO. On exit the values in ``p.data`` (written in place, or rebound to an array
        of the same shape) become the parameters: stage 3 keeps this rank's chunk and releases the
        full arrays, stages 1-2 copy a rebound ``p.data`` back into the flat parameter vector, and
        masters keep their chunk and refresh the half parameters from it. Collective at stage 3
        and with masters (all-gather on entry); every rank must write the same values. Do not run
        the model inside (stage-3 units release the parameters they gather). On an exception
        nothing is written back at stage 3 or to the masters."""
        if self.stage < 3 and self.master_shard is None:
            try:
                yield
            finally:
                self._attach_flat_parameters()
            return
        source = self.param_shard if self.master_shard is None else self.master_shard
        fulls = []
        try:
            for g in self.groups:
                full = g.gather(self.comm, source)
                fulls.append((g, full, g.views(full)))
                for p, v in zip(g.params, fulls[-1][2]):
                    p.data = v
            yield
            for g, full, views in fulls:
                for p, v in zip(g.params, views):
                    if p.data is not v:
                        v[...] = p.data
                source[g.in_shard] = full[g.lo:g.hi]
            if source is not self.param_shard:
                self.param_shard[...] = source  # rounded to nearest even
                if self.stage < 3:
                    self.flat_param[...] = fulls[0][1]
        finally:
            if self.stage < 3:  # the masters' values are in the flat vector already (or dropped)
                self._attach_flat_parameters(copy=False)
            else:
                self.store.release()

    def _attach_flat_parameters(self, copy: bool = True) -> None:
        """Stages 1-2: make every ``p.data`` its view into the flat parameter vector again,
        copying in (``copy``) the values of a ``p.data`` that was rebound."""
        g = self.groups[0]
        for p, v in zip(g.params, g.views(self.flat_param)):
            if p.data.base is not self.flat_param or p.data.shape != v.shape:
                if copy:
                    v[...] = p.data
                p.data = v


class _GradStream:
    """ZeRO-2's gradient reduction while backward runs (see the module docstring): buckets are
    ranges of at most ``bucket_bytes`` of the parameter store, cut from its end (the order backward
    finishes the gradients) at element granularity, so a large parameter spans several buckets
    and no bucket is larger than the staging buffer. They are reduced in index order (every rank
    issues the same collectives in the same order) once every parameter they touch reported its
    gradient final; a parameter's ``p.grad`` is freed once every bucket it touches took its part
    (the parts taken before are zeroed, so a micro-batch that adds to it before then, as an
    interleaved pipeline's order does, is owed to all of them again). A bucket whose parameters
    finish before its predecessors' waits for them, and :meth:`finish` reduces whatever is left (unused parameters never fire their hook: their
    bucket, and those after it, wait until then, also through the next micro-batches). Every
    micro-batch's backward (gradient accumulation, a pipeline's micro-batches) reduces its
    buckets and the shard sums them. The parameters in ``held`` (a pipeline's tied copies, summed
    over the pipeline ends after the schedule) get buckets of their own, which the stream passes
    over and :meth:`finish` reduces."""

    def __init__(self, opt: ZeroOptimizer, bucket_bytes: int, held=()):
        self.opt, store = opt, opt.store
        lo_mine = opt.groups[0].lo
        owners = chunk_bounds(store.numel, opt.size)
        step = max(1, bucket_bytes // store.dtype.itemsize)
        held = {id(p) for p in held}
        # runs of parameters alike (held or not), from the end; each cut into buckets from its end
        runs, bounds = [], []
        for p, (a, b) in zip(store.params, store.offsets):
            if runs and runs[-1][2] == (id(p) in held):
                runs[-1][1] = b
            else:
                runs.append([a, b, id(p) in held])
        for a, b, is_held in reversed(runs):
            bounds += [(max(a, hi - step), hi, is_held) for hi in range(b, a, -step)]
        # (lo, hi, [(param, start, stop, pos)], elements per rank, where this rank's part goes in the shard)
        self.buckets = [(lo, hi, store.segments(lo, hi),
                         [max(0, min(hi, r_hi) - max(lo, r_lo)) for r_lo, r_hi in owners], max(lo, lo_mine) - lo_mine)
                        for lo, hi, _ in bounds]
        self.held = [is_held for *_, is_held in bounds]
        self._buckets_of: dict = {}
        for k, bucket in enumerate(self.buckets):
            for p, *_ in bucket[2]:
                self._buckets_of.setdefault(id(p), []).append(k)
        self._held_ids = held
        self.staging = B.xp.empty(min(step, store.numel), dtype=store.dtype)
        for p in store.params:
            if id(p) not in held:
                p.register_hook(self._ready)
        self.reset()

    def reset(self) -> None:
        self.final = [set() for _ in self.buckets]  # parameters final since the bucket's last reduction
        # per parameter, the buckets its p.grad still owes data: freed when none is left (a
        # gradient made again before all were reduced owes all of them again)
        self.owed = {key: set(ks) for key, ks in self._buckets_of.items() if key in self._held_ids}
        self.next, self.pending = 0, False  # the bucket to reduce next; whether a pass is under way

    def _ready(self, p) -> None:
        self.owed[id(p)] = set(self._buckets_of[id(p)])
        for k in self._buckets_of[id(p)]:
            self.final[k].add(id(p))
        self.pending = True
        while self.pending:
            k = self.next
            if not self.held[k]:
                if len(self.final[k]) < len(self.buckets[k][2]):
                    break
                self._reduce_bucket(k)
            self.next = (k + 1) % len(self.buckets)
            self.pending = self.next != 0  # after the last bucket the next micro-batch starts over

    def _reduce_bucket(self, k: int) -> None:
        """Pack bucket ``k``, reduce-scatter it into the shard. What it took of a gradient is gone
        from ``p.grad`` afterwards (freed once no bucket is owed any of it, zeroed before: a later
        micro-batch adds only its own part)."""
        lo, hi, members, counts, at = self.buckets[k]
        opt = self.opt
        for p, a, b, pos in members:
            part = self.staging[pos:pos + b - a]
            if p.grad is None:
                part.fill(0)
                continue
            if not p.grad.flags.c_contiguous:  # (once: its flat ranges must be views)
                p.grad = B.xp.ascontiguousarray(p.grad)
            flat = p.grad.reshape(-1)
            part[...] = flat[a:b]
            owed = self.owed.get(id(p), set())
            owed.discard(k)
            if owed:
                flat[a:b] = 0
            else:
                p.grad = None
        self.final[k].clear()
        B.synchronize()
        mine = opt.comm.reduce_scatter(self.staging[:hi - lo], op="avg", counts=counts)
        if counts[opt.rank]:
            opt.grad_shard[at:at + counts[opt.rank]] += mine

    def finish(self) -> None:
        """Reduce, in index order, the held buckets and every bucket that got a gradient since
        its last reduction (a waiting bucket of this or an earlier micro-batch: the same ones on
        every rank, whose graphs are alike); then the next backward starts from bucket 0."""
        for k, final in enumerate(self.final):
            if final or self.held[k]:
                self._reduce_bucket(k)
        self.reset()
