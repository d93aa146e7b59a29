"""ZeRO: AdamW with its state, gradients and parameters sharded over the data-parallel ranks.

The parameters are laid out as flat vectors ("groups", :class:`mpirt.parallel.flat.FlatLayout`);
each group is cut into ``dp`` contiguous chunks and dp rank ``r`` owns chunk ``r`` of every group. The
owned chunks, concatenated, form this rank's *shard*: its AdamW state (``exp_avg``,
``exp_avg_sq``) and, from stage 2, its gradients, and at stage 3 its parameters, are flat arrays
over the shard, and the update is one :func:`mpirt.core.optim.adamw_update` call over it (the same
math as :class:`mpirt.core.optim.AdamW`; weight decay is applied first, element-wise, on the runs of
the shard that belong to decayed parameters, exactly as AdamW applies it per parameter).
``ZeroOptimizer(model, comm, stage=s)`` makes the stage's class; what every stage shares (the state
over the shard, the update, the norm, checkpoints) is :class:`ZeroOptimizer`'s.

* Stage 1 (:class:`Zero12Optimizer`): one group, all parameters, kept in the parameter store
  (:class:`mpirt.parallel.flat.FlatParams`): each ``p.data`` and ``p.grad`` is a view into a full
  flat vector. ``step`` allreduces (averages) the full gradient, updates the owned chunk, allgathers
  the parameters. Per rank: params 4N + grads 4N + state 8N/dp bytes (fp32).
* Stage 2 (:class:`Zero12Optimizer`): as stage 1, but the gradient is reduce-scattered, so only the
  owned chunk is kept. With ``stream_grads`` the full gradient never exists: backward fills each parameter's own
  ``p.grad``, and as soon as a bucket (a range of at most ``bucket_bytes`` of the parameter
  store, cut in the order backward finishes the gradients, across parameter boundaries) has all
  its gradients final it is packed into one staging buffer, reduced straight into the owners'
  chunks (an uneven reduce-scatter: each rank gets the part of the range it owns, maybe none)
  and added to the gradient shard; a ``p.grad`` is freed once every bucket took its part. Every
  micro-batch's backward does so (gradient accumulation, a pipeline's micro-batches: the shard
  sums them, at the price of one reduction per micro-batch); a pipeline's tied copies are
  ``held`` for the step (summed over the pipeline ends first). Peak gradient memory: the
  gradients being filled (at most one parameter's beyond those of the bucket in flight), the
  staging buffer, the held gradients and the shard (:class:`mpirt.parallel.zero_stream.GradStream`).
  Without it the full gradient lives between :meth:`~ZeroOptimizer.zero_grad` and
  :meth:`~ZeroOptimizer.step`. Persistent: 4N + (4 + 8)N/dp.
* Stage 3 (:class:`Zero3Optimizer`): the parameters themselves are sharded. Groups follow the model's *units*: for a model
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
from it and all-gathered. :meth:`~ZeroOptimizer.full_parameters` shows the model the full float32 masters.

Checkpoints are layout-independent: :meth:`~ZeroOptimizer.state_dict` gathers the shards into AdamW's format
(full arrays per parameter), :meth:`~ZeroOptimizer.load_state_dict` keeps this rank's shard of such a state, and
``with opt.full_parameters():`` shows the model its full weights for ``model.state_dict()`` /
``load_state_dict`` (stage 3). A checkpoint moves between AdamW and ZeRO at any stage and dp size.

Over 400 lines: ZeRO 1-2's sharded optimizer and its gradient stream share the shard arithmetic (split pending issue 33 item 2, parameter groups).
"""
from __future__ import annotations

import contextlib

import mpirt.core.backend as B
from mpirt.core.injected import injected
from mpirt.core.nn import Module
from mpirt.parallel.ddp import broadcast_parameters
from mpirt.parallel.flat import FlatParams, ShardedLayout, trainable
from mpirt.parallel.zero3 import ShardedParams, Zero3Optimizer
from mpirt.parallel.zero_shard import PIECE_BYTES, WRONG_STORE, ZeroOptimizer, check_hyper, decayed_ids
from mpirt.parallel.zero_stream import GradStream

__all__ = ["BUCKET_BYTES", "ZeroOptimizer", "Zero12Optimizer", "Zero3Optimizer"]  # stage 3's registers on import

BUCKET_BYTES = 4 << 20  # stage 2 reduces the gradients in buckets of about this many bytes


class Zero12Optimizer(ZeroOptimizer, stages=(1, 2)):
    """ZeRO stages 1 and 2 over the flat parameter store (see :class:`ZeroOptimizer` for the
    arguments; ``model_or_params``: a Module, a list of Parameters or a
    :class:`~mpirt.parallel.flat.FlatParams`). ``stream_grads`` (stage 2): reduce the gradients
    bucket by bucket (``bucket_bytes``) while each micro-batch's backward runs, never holding them
    whole (:class:`~mpirt.parallel.zero_stream.GradStream`); ``held``: parameters whose gradients
    wait for the step instead (a pipeline's tied copies, summed over its ends first)."""

    def __init__(self, model_or_params, comm, stage: int = 1, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, decay=None, counted=None, norm_comms=(),
                 init=None, stream_grads: bool = False, held=(), bucket_bytes: int = BUCKET_BYTES):
        if stage not in (1, 2):
            raise ValueError(f"Zero12Optimizer: stage must be 1 or 2, got {stage}")
        check_hyper(lr, betas, eps, weight_decay)
        if isinstance(model_or_params, ShardedParams):
            raise ValueError(WRONG_STORE)
        store = model_or_params if isinstance(model_or_params, FlatParams) else None
        params = store.params if store is not None else trainable(
            model_or_params.parameters() if isinstance(model_or_params, Module) else model_or_params,
            "ZeroOptimizer", allow_empty=False)
        counted = counted or (store.counted if store is not None else (lambda p: True))
        shapes = {id(p): tuple(p.shape) for p in params}
        self.stage = stage
        g = ShardedLayout(params, shapes, comm.rank, comm.size)
        self._init_shard(params, comm, [g], shapes, decayed_ids(params, shapes, decay), counted, lr=lr, betas=betas,
                         eps=eps, weight_decay=weight_decay, norm_comms=norm_comms)
        lazy = any(not p.materialized for p in params)
        self.store = store or FlatParams(params, counted, init=init, grads=stage == 1)
        if not lazy:  # seeded values are the same on every rank already
            broadcast_parameters(self.store, comm)
        self.flat_param = self.store.data
        self.param_shard = self.flat_param[g.lo:g.hi]
        if self.rank == 0 and self.size > 1 and injected("zero-shard-offset"):  # test-only (mpirt.core.injected)
            self.param_shard = self.flat_param[g.lo + 1:g.hi + 1]
        if stage == 1:
            self.grad_shard = self.store.grad[g.lo:g.hi]
        else:
            self.grad_shard = B.xp.zeros(self.shard_numel, dtype=self.dtype)
            self.store.release_grads()
        self._stream = GradStream(self, bucket_bytes, held) if stream_grads and stage == 2 else None
        self._init_master()

    def gather_parameters(self) -> dict:
        """Name -> full parameter as a host array (each ``p.data`` is whole already)."""
        return {p.name: B.to_host(p.data).copy() for p in self.params}

    def _held(self) -> tuple:
        """The parameter and gradient arrays kept between steps (a clip scales the gradient one)."""
        return self.flat_param, (self.store.grad if self.stage == 1 else self.grad_shard)

    def zero_grad(self) -> None:
        """Zero the gradients (stage 2: the shard; without ``stream_grads`` also allocate the
        transient full gradient for backward)."""
        self._reduced = False
        if self._stream is not None:  # each p.grad is made by backward and freed once reduced
            self.store.release_grads()
            self._stream.reset()
        else:
            self.store.zero_grad()
        if self.stage == 2:
            self.grad_shard.fill(0)

    def sync_partial_grads(self, tp_comm) -> None:
        """As :meth:`ZeroOptimizer.sync_partial_grads`; without a stream, in the full gradient
        before it is reduced."""
        if self._stream is None:
            self.store.sync_partial_grads(tp_comm)
        else:
            super().sync_partial_grads(tp_comm)

    def partial_sum_calls(self, tp_comm) -> list[tuple]:
        """The calls of :meth:`sync_partial_grads` (:func:`~mpirt.parallel.flat.runs_calls`)."""
        if self._stream is None:
            return self.store.partial_sum_calls(tp_comm)
        return super().partial_sum_calls(tp_comm)

    def _reduce(self) -> None:
        """Stage 1: allreduce of the full gradient (in pieces: MPI's temporary buffers stay as
        small as one); stage 2: the stream's last buckets, or a reduce-scatter of the full
        gradient, which is then released."""
        if self.stage == 1:
            self.store.check_views("ZeroOptimizer")
            grad, piece = self.store.grad, max(1, PIECE_BYTES // self.store.grad.itemsize)
            for a in range(0, grad.size, piece):
                part = grad[a:a + piece]
                self.comm.allreduce(part, op="avg", out=part)
        elif self._stream is not None:
            self._stream.finish()
        else:
            self.store.check_views("ZeroOptimizer")
            self.comm.reduce_scatter(self.store.grad, op="avg", out=self.grad_shard)
            self.store.release_grads()

    def calls(self) -> list[tuple[str, str, int, str]]:
        """``(axis, kind, bytes, dtype)`` of the calls on dp whose number and size a step fixes:
        stage 1's gradient average in pieces and the parameter gather after the update. Not
        listed: the streamed reduce-scatters of stage 2 (per micro-batch and bucket, as backward
        completes them)."""
        axis, dtype = self.comm.axis, self.dtype.name
        out = []
        if self.stage == 1:
            size, piece = self.store.grad.size, max(1, PIECE_BYTES // self.store.grad.itemsize)
            out += [(axis, "allreduce", min(piece, size - a) * self.store.grad.itemsize, dtype)
                    for a in range(0, size, piece)]
        return out + [(axis, "allgather", int(self.flat_param.nbytes), dtype)]

    def _publish(self) -> None:
        """The updated shard into every rank's full parameter vector (all-gathered in place)."""
        B.synchronize()
        self.comm.allgather_flat(self.param_shard, self.groups[0].numel, out=self.flat_param)

    @contextlib.contextmanager
    def full_parameters(self):
        """Context: inside, every ``p.data`` is the full parameter (the full float32 master under
        mixed precision), so ``model.state_dict()``, ``model.load_state_dict()``,
        :func:`mpirt.checkpoint.store.save_checkpoint` and :func:`~mpirt.checkpoint.store.load_checkpoint` work
        as without ZeRO. On exit the values in ``p.data`` (written in place, or rebound to an array
        of the same shape) become the parameters: a rebound ``p.data`` is copied back into the flat
        vector; masters keep their chunk and refresh the half parameters from it (collective: an
        all-gather on entry; on an exception nothing is written to them). Every rank must write
        the same values."""
        try:
            if self.master_shard is None:  # every p.data is its view of the full vector already
                yield
            else:
                with self._gathered() as fulls:
                    yield
                self.flat_param[...] = fulls[0]  # the masters rounded, as the shard was
        finally:
            self._attach_flat_parameters(copy=self.master_shard is None)

    def _attach_flat_parameters(self, copy: bool) -> None:
        """Make every ``p.data`` its view into the flat parameter vector again, copying in
        (``copy``) the values of a ``p.data`` that was rebound."""
        g = self.groups[0]
        for p, v in zip(g.params, g.views(self.flat_param)):
            if p.data.base is not self.flat_param or p.data.shape != v.shape:
                if copy:
                    v[...] = p.data
                p.data = v
