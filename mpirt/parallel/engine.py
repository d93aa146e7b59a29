"""The training engine: one optimizer step of a model laid out on any dp x pp x cp x tp grid.

The training script talks to one interface whatever the layout:

    engine.train_step(x, y, loss_scale=1.0, step=None) -> float   # forward/backward of this dp
                                         # replica's rows, grads synced (loss_scale times the loss's)
    engine.clip(max_norm)   -> float     # global gradient norm (before clipping), over all shards
    engine.optimizer.step()
    engine.evaluate(x, y)   -> float     # mean loss of the global batch, no gradients
    engine.save_sharded(writer) / engine.load_sharded(reader)     # checkpoints: this rank's boxes

:class:`Engine` is a *local part* and a *sync*. The local part is this rank's piece of the model:
a :class:`~mpirt.parallel.pipeline.stage.PipelineStage` when pp > 1 (its schedule runs the micro-batches),
else a :class:`~mpirt.parallel.whole.WholeModel` (the model made tensor parallel by its ``tp_plan``,
a loop over ``grad_accum`` micro-batches); both present one interface (listed in
:mod:`mpirt.parallel.whole`), so the engine never asks which it holds.
Its parameters live in one store, :class:`~mpirt.parallel.flat.FlatParams` (ZeRO-3:
:class:`~mpirt.parallel.zero3.ShardedParams`, sharded per unit group, with tp and pp),
and the sync over dp is :class:`~mpirt.parallel.ddp.DataParallel` or
:class:`~mpirt.parallel.zero.ZeroOptimizer` over that store. Under context parallelism
(:mod:`mpirt.parallel.context`) each rank takes its chunks of the replica's sequences, and the
gradient sync, ZeRO's shards and the loss's mean span dp x cp (``grid.comm["dp_cp"]``: the
ranks that hold the same parameters). Sequence parallelism's
partial gradients are summed over tp once, and one global-norm clip counts every element once
over dp (ZeRO shards), tp and pp (:func:`~mpirt.parallel.flat.clip_flat`).

Under expert parallelism (:mod:`mpirt.parallel.experts`, ``--ep``) each rank holds ``1 / ep`` of
the experts: their weights live in a second store whose sync (DataParallel or ZeRO-1/2) runs over
the edp group (``grid.comm["edp"]``) while the dense store's runs over dp; one
:class:`~mpirt.parallel.experts.OptimizerPair` steps both under ZeRO (one AdamW holds both
without), and the norm adds the experts' squares over ep.
"""
from __future__ import annotations

import contextlib
import time

from mpirt.core import recompute
from mpirt.core.modeling import attention_core
from mpirt.core.optim import AdamW
from mpirt.parallel import tensor as TP
from mpirt.parallel.tensor import program
from mpirt.parallel.ddp import DataParallel
from mpirt.parallel.context import ContextShard, parallelize_context
from mpirt.parallel.experts import OptimizerPair, is_expert
from mpirt.parallel.flat import FlatParams, clip_flat, count_once
from mpirt.parallel.layout import Layout
from mpirt.parallel.pipeline.stage import PipelineStage
from mpirt.parallel.shards import load_shards, save_shards
from mpirt.parallel.whole import WholeModel, parameter_axes
from mpirt.parallel.zero import ZeroOptimizer
from mpirt.parallel.zero3 import ShardedParams


class Engine:
    """This rank's part of the model on ``grid``, its parameter store, dp sync and optimizer.

    ``cfg``: a :class:`mpirt.run.config.TrainConfig` (layout, schedule, ZeRO stage, recompute, dtype,
    optimizer); ``model_cfg``: any registered model's config; ``dropout_seed``: this dp replica's
    mask seed. ``local``: a prebuilt :class:`PipelineStage` to use instead of building one (tests
    that pass their own partition or wait mode); ``layout``: the run's resolved
    :class:`~mpirt.parallel.layout.Layout` with the model, whose ``recomputed`` blocks this rank
    recomputes (the training script leaves out the stages where it would not lower the peak,
    :func:`mpirt.plan.memory.recompute_where_it_pays`); None, or one resolved without the model:
    resolved here from ``cfg`` with the model, every block the config picks recomputing."""

    def __init__(self, cfg, model_cfg, grid, dropout_seed: int, local=None, layout: Layout | None = None):
        self.grid, self.cfg, self._width = grid, cfg, model_cfg.n_embd
        self.tp_comm, self.pp_comm = grid.comm["tp"], grid.comm["pp"]
        self.dp_comm = grid.comm["dp_cp"]  # the ranks holding the same parameters: dp, and cp when > 1
        self.ep_comm, self.edp_comm = grid.comm["ep"], grid.comm["edp"]  # experts split / replicated
        tp, pp, cp = grid.sizes["tp"], grid.sizes["pp"], grid.sizes["cp"]
        if layout is None or not layout.bounds:
            layout = Layout.of(cfg, grid.sizes, model_cfg)
        sp = layout.sequence_parallel
        if pp > 1 or local is not None:
            self.local = local or PipelineStage(
                model_cfg, grid, schedule=cfg.schedule, microbatches=layout.microbatches,
                chunks=layout.chunks, dtype=cfg.dtype, seed=cfg.seed, split=[hi - lo for lo, hi in layout.bounds],
                seq_len=cfg.seq_len // cp, sequence_parallel=cfg.sequence_parallel)
        else:
            self.local = WholeModel(model_cfg, grid, dtype=cfg.dtype, seed=cfg.seed,
                                    sequence_parallel=cfg.sequence_parallel, grad_accum=cfg.grad_accum)
        self.model = self.local.model
        self.context = ContextShard(grid.comm["cp"]) if cp > 1 else None
        if self.context is not None:
            for part in self.local.dropout_roots:
                parallelize_context(part, self.context)
        if local is None:
            for part in self.local.dropout_roots:
                TP.reseed_dropouts(part, dropout_seed, grid.coords["tp"], tp, cfg.sequence_parallel)
        if cfg.zero < 3:  # ZeRO-3 already reruns every unit in backward (its units keep only their inputs)
            picked = {i: b for i, b in self.local.blocks.items() if i in layout.recomputed}
            recompute.apply(picked, cfg.recompute, "", attention_core(model_cfg))  # "": each block given
        counted = count_once(grid.coords["tp"] if tp > 1 else 0, self.local.tied_copy)
        norm_comms = (self.tp_comm, self.pp_comm)  # ranks along them hold different parameters
        hyper = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
        self.ddp, self.expert_store = [], None
        # the parameter store: ZeRO-3's is sharded per unit group, the others hold this rank's part whole
        if cfg.zero == 3:
            self.store = ShardedParams(self.model, self.dp_comm, counted, init=self.local.init,
                                       units=self.local.units, probe_len=(tp if sp else 1) * (2 if cp > 1 else 1),
                                       probe=self.local.probe,
                                       dropout_roots=self.local.dropout_roots, alone=self.local.held_tied,
                                       runs=self.local.unit_runs)
            if self.local.held_tied:  # a pipeline's tied copies: summed over its ends as gradient shards
                self.local.tied_grads = self.store.alone_grads
        else:  # the experts split over ep (if any) in a store of their own
            params = self.local.parameters()
            experts = [p for p in params if is_expert(p)]
            self.store = FlatParams([p for p in params if not is_expert(p)], counted, init=self.local.init,
                                    grads=cfg.zero != 2)  # ZeRO-2: a shard only
            self.expert_store = FlatParams(experts, counted, init=self.local.init, grads=cfg.zero != 2) \
                if experts else None
        # the dp sync: ZeRO over the store (stage 2 reduces buckets during backward; a pipeline's
        # tied copies wait for the step), else DataParallel's buckets and AdamW; the experts' over edp
        if cfg.zero:
            self.optimizer = ZeroOptimizer(self.store, self.dp_comm, stage=cfg.zero, norm_comms=norm_comms,
                                           stream_grads=True, held=self.local.held_tied, **hyper)
            if self.expert_store is not None:
                self.optimizer = OptimizerPair(self.optimizer, ZeroOptimizer(
                    self.expert_store, self.edp_comm, stage=cfg.zero, norm_comms=norm_comms, stream_grads=True,
                    **hyper))
        else:
            self.ddp = [DataParallel(store, comm) for store, comm in ((self.store, self.dp_comm),
                                                                     (self.expert_store, self.edp_comm))
                        if store is not None and comm.size > 1]
            self.optimizer = AdamW(self.store.params + (self.expert_store.params if self.expert_store else []),
                                   **hyper)
        self._norm_comms = norm_comms

    # --- the step -------------------------------------------------------------------------------
    def _no_sync(self):
        stack = contextlib.ExitStack()
        for ddp in self.ddp:
            stack.enter_context(ddp.no_sync())
        return stack

    def train_step(self, x, y, loss_scale: float = 1.0, step: int | None = None) -> float:
        """Forward and backward of this dp replica's rows (x, y), backward seeded with
        ``loss_scale`` (:class:`mpirt.core.precision.LossScaler`); then the gradients are summed over
        the tied copies, over tp for sequence-parallel partial sums and averaged over dp x cp. Returns
        the (unscaled) mean loss of the global batch. ``step``: the optimizer step, which with the
        rows' place in the global batch (this replica holds rows ``[dp rank x len(x), ...)``)
        makes the dropout masks those of one rank running the whole batch (None: each module's
        call count stands in)."""
        self.optimizer.zero_grad()
        row0 = self.grid.coords["dp"] * len(x)
        x, y = self._held(x, y)
        loss = self.local.train_step(x, y, loss_scale, place=None if step is None else (step, row0),
                                     no_sync=self._no_sync)
        t0 = time.perf_counter()
        for ddp in self.ddp:
            ddp.finish()
        (self.optimizer if self.cfg.zero else self.store).sync_partial_grads(self.tp_comm)
        loss = self.dp_comm.allreduce_scalar(loss, "avg")
        self.local.stats["sync_t0"], self.local.stats["sync_s"] = t0, time.perf_counter() - t0
        return loss

    @property
    def stats(self) -> dict:
        """Timers of the last step: the local part's (:mod:`mpirt.parallel.whole` lists them) and
        the gradient sync's ``sync_t0``, ``sync_s``."""
        return self.local.stats

    def clip(self, max_norm: float | None) -> float:
        """Scale every gradient by ``max_norm / (norm + 1e-6)`` when the global norm exceeds
        ``max_norm`` (None: only the norm); returns the norm before clipping. The experts' squares
        are summed over ep (each rank holds others), the whole over tp and pp."""
        parts = getattr(self.optimizer, "parts", (self.optimizer,)) if self.cfg.zero else \
            [s for s in (self.store, self.expert_store) if s is not None]
        sq, grads = parts[0].norm_parts()
        if len(parts) > 1:
            expert_sq, expert_grads = parts[1].norm_parts()
            sq, grads = sq + self.ep_comm.allreduce_scalar(expert_sq), grads + expert_grads
        return clip_flat(sq, grads, self._norm_comms, max_norm)

    def step_calls(self, layout) -> list[tuple[str, str, int, str]]:
        """``(axis, kind, bytes, dtype)`` of the calls a step on ``layout`` makes that the engine's
        parts list themselves: tp's inside the modules (:func:`mpirt.parallel.tensor.program.step_calls`,
        a block recomputed whole or every unit under ZeRO-3 running its forward twice) and the sum
        of sequence parallelism's partial gradients; the gradient sync's calls of a fixed number
        and size (DataParallel's buckets; ZeRO's, as :meth:`~mpirt.parallel.zero.ZeroOptimizer.calls`
        lists them); the pipeline's tied-embedding gradient sum (a send and a receive of each tied
        copy's gradient, under ZeRO-3 its shard, between the two pipeline ends)."""
        if self.cfg.zero == 3:   # every unit reruns its forward in backward
            rerun = [self.model]
        else:
            rerun = [b for i, b in self.local.blocks.items() if i in layout.recomputed and self.cfg.recompute == "full"]
        reruns = {id(m) for part in rerun for m in [m for _, m in part.named_modules()] + list(vars(part).values())}
        tokens = layout.rows * (self.cfg.seq_len // layout.cp)
        out = program.step_calls(self.model, self.tp_comm, tokens, layout.microbatches, reruns,
                                 self._width, self.cfg.dtype, lookups=self.local.has_embed)
        out += (self.optimizer if self.cfg.zero else self.store).partial_sum_calls(self.tp_comm)
        out += [c for ddp in self.ddp for c in ddp.calls()] + (self.optimizer.calls() if self.cfg.zero else [])
        return out + self.local.tied_calls()

    def evaluate(self, x, y) -> float:
        """Mean loss of the global batch (this replica's rows ``x``, ``y``), no gradients."""
        return self.dp_comm.allreduce_scalar(self.local.evaluate(*self._held(x, y)), "avg")

    def _held(self, x, y):
        """The tokens of rows ``x``, ``y`` this rank computes: its chunks of each sequence under cp."""
        if self.context is None:
            return x, y
        return self.context.shard(x), self.context.shard(y)

    # --- state ------------------------------------------------------------------------------------
    def save_sharded(self, writer) -> None:
        """Add this rank's boxes of the weights and optimizer state to a
        :class:`mpirt.checkpoint.sharded.ShardWriter` (without ZeRO the first rank of dp x cp, for
        the experts under ep the first of edp; the tied embedding from the first stage only).
        Local (see :func:`mpirt.parallel.shards.save_shards`)."""
        writes = {False: self.dp_comm.rank == 0, True: self.edp_comm.rank == 0}  # by is_expert
        save_shards(writer, self.model, self.optimizer, parameter_axes(self.grid),
                    replica=lambda p: writes[is_expert(p)], skip=set(self.local.tied_copy))

    def load_sharded(self, reader, with_optimizer: bool = True) -> None:
        """Read this rank's boxes from a :class:`mpirt.checkpoint.store.CheckpointReader` (both pipeline
        ends read the tied embedding). Collective over dp under ZeRO."""
        load_shards(reader, self.model, self.optimizer, parameter_axes(self.grid), with_optimizer=with_optimizer)

    def close(self) -> None:
        """Stop DataParallel's communication threads, if any."""
        for ddp in self.ddp:
            ddp.close()
