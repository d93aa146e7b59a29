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
Its parameters live in parameter groups (:mod:`mpirt.parallel.groups`): a store
(:class:`~mpirt.parallel.flat.FlatParams`; ZeRO-3: :class:`~mpirt.parallel.zero3.ShardedParams`,
sharded per unit group, with tp and pp), the communicator its gradients are averaged over and its
sync, chosen once from the ZeRO stage (:class:`~mpirt.parallel.groups.DataParallelSync`,
:class:`~mpirt.parallel.zero.Zero12Optimizer`, :class:`~mpirt.parallel.zero3.Zero3Optimizer`).
The engine loops over ``[dense over dp x cp, experts over edp]``: under context parallelism
(:mod:`mpirt.parallel.context`) each rank takes its chunks of the replica's sequences, and the
gradient sync, ZeRO's shards and the loss's mean span dp x cp (``grid.comm["dp_cp"]``: the ranks
that hold the same parameters); under expert parallelism (:mod:`mpirt.parallel.experts`, ``--ep``)
each rank holds ``1 / ep`` of the experts, whose group syncs over the edp ranks
(``grid.comm["edp"]``) and adds its squares to the norm over ep. The engine alone zeroes the
gradients, once a step. Sequence parallelism's partial gradients are summed over tp once, and one
global-norm clip counts every element once over dp (ZeRO shards), tp and pp
(:func:`~mpirt.parallel.flat.clip_flat`); :attr:`Engine.optimizer` steps every group's optimizer
(one group: its own; more: a :class:`~mpirt.parallel.groups.ChainedOptimizer`).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from mpirt.core import recompute
from mpirt.core.modeling import attention_core
from mpirt.parallel import tensor as TP
from mpirt.parallel.tensor import program
from mpirt.parallel.context import ContextShard, parallelize_context
from mpirt.parallel.flat import clip_flat, count_once
from mpirt.parallel.groups import ChainedOptimizer, finish_backward, parameter_groups
from mpirt.parallel.layout import Layout
from mpirt.parallel.pipeline.stage import PipelineStage
from mpirt.parallel.shards import load_shards, save_shards
from mpirt.parallel.whole import WholeModel, parameter_axes


@dataclass(frozen=True)
class Hyper:
    """What the engine takes from the run beyond its layout: the dtype of weights and
    activations, the seed of the initial weights, and AdamW's settings."""

    dtype: str = "float32"
    seed: int = 0
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    weight_decay: float = 0.0

    @classmethod
    def of(cls, cfg) -> "Hyper":
        """A :class:`mpirt.run.config.TrainConfig`'s."""
        return cls(dtype=cfg.dtype, seed=cfg.seed, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                   weight_decay=cfg.weight_decay)


class Engine:
    """This rank's part of the model on ``grid``, its parameter groups (:attr:`groups`: each a
    store, its sync and optimizer) and the optimizer that steps them all (:attr:`optimizer`).

    ``layout``: the run's :class:`~mpirt.parallel.layout.Layout`, resolved with the model
    (``Layout.resolve(cfg, world, model_cfg)``; the training script's also leaves out the blocks
    whose recomputation would not lower the peak, :func:`mpirt.run.prepare.plan_layout`): every
    choice of the layout (stages and schedule, micro-batches, ZeRO stage, sequence parallelism,
    the blocks that recompute and how) is read from it, never derived again. ``model_cfg``: any
    registered model's config; ``hyper``: dtype, seed and optimizer settings (:class:`Hyper`);
    ``dropout_seed``: the mask seed. ``local``: a prebuilt :class:`PipelineStage` to use instead
    of building one (tests that pass their own partition or wait mode)."""

    def __init__(self, layout: Layout, model_cfg, grid, hyper: Hyper, dropout_seed: int, local=None):
        if not layout.bounds:
            raise ValueError("Engine: the layout was resolved without the model (no stage bounds): "
                             "Layout.resolve(cfg, world, model_cfg)")
        self.grid, self.layout, self.hyper, self._width = grid, layout, hyper, model_cfg.n_embd
        self.tp_comm, self.pp_comm = grid.comm["tp"], grid.comm["pp"]
        self.dp_comm = grid.comm["dp_cp"]  # the ranks holding the same parameters: dp, and cp when > 1
        tp, sp = layout.tp, layout.sequence_parallel
        if layout.pp > 1 or local is not None:
            self.local = local or PipelineStage(layout, model_cfg, grid, dtype=hyper.dtype, seed=hyper.seed)
        else:
            self.local = WholeModel(layout, model_cfg, grid, dtype=hyper.dtype, seed=hyper.seed)
        self.model = self.local.model
        self.context = ContextShard(grid.comm["cp"]) if layout.cp > 1 else None
        if self.context is not None:
            for part in self.local.dropout_roots:
                parallelize_context(part, self.context)
        if local is None:
            for part in self.local.dropout_roots:
                TP.reseed_dropouts(part, dropout_seed, grid.coords["tp"], tp, sp)
        counted = count_once(grid.coords["tp"] if tp > 1 else 0, self.local.tied_copy)
        self._norm_comms = (self.tp_comm, self.pp_comm)  # ranks along them hold different parameters
        optimizer = dict(lr=hyper.lr, betas=hyper.betas, weight_decay=hyper.weight_decay)
        self.groups = parameter_groups(self.local, grid, layout.zero, counted, self._norm_comms, optimizer,
                                       probe_len=layout.probe_tokens)
        self._units_rerun = self.groups[0].sync.reruns_units
        if not self._units_rerun:  # ZeRO-3's units rerun in backward already (they keep only their inputs)
            picked = {i: b for i, b in self.local.blocks.items() if i in layout.recomputed}
            recompute.apply(picked, layout.recompute, "", attention_core(model_cfg))  # "": each block given
        optimizers = [g.optimizer for g in self.groups]
        self.optimizer = optimizers[0] if len(optimizers) == 1 else ChainedOptimizer(optimizers)

    # --- the step -------------------------------------------------------------------------------
    def _no_sync(self):
        stack = contextlib.ExitStack()
        for g in self.groups:
            stack.enter_context(g.sync.no_sync())
        return stack

    def train_step(self, x, y, loss_scale: float = 1.0, step: int | None = None) -> float:
        """Forward and backward of this dp replica's rows (x, y), backward seeded with
        ``loss_scale`` (:class:`mpirt.core.precision.LossScaler`), the gradients zeroed before;
        then the gradients are summed over the tied copies, over tp for sequence-parallel
        partial sums and averaged over each group's ranks (dp x cp, the experts' edp). Returns
        the (unscaled) mean loss of the global batch. ``step``: the optimizer step, which with the
        rows' place in the global batch (this replica holds rows ``[dp rank x len(x), ...)``)
        makes the dropout masks those of one rank running the whole batch (None: each module's
        call count stands in)."""
        for g in self.groups:
            g.sync.zero_grad()
        row0 = self.grid.coords["dp"] * len(x)
        x, y = self._held(x, y)
        loss = self.local.train_step(x, y, loss_scale, place=None if step is None else (step, row0),
                                     no_sync=self._no_sync)
        t0 = time.perf_counter()
        finish_backward(self.groups, self.tp_comm)
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
        ``max_norm`` (None: only the norm); returns the norm before clipping. Each group's squares
        are summed over its sync's ranks and its norm span (the experts' over ep), the whole over
        tp and pp."""
        parts = [g.norm_parts() for g in self.groups]
        sq = sum((part_sq for part_sq, _ in parts[1:]), parts[0][0])
        return clip_flat(sq, [a for _, arrays in parts for a in arrays], self._norm_comms, max_norm)

    def step_calls(self) -> list[tuple[str, str, int, str]]:
        """``(axis, kind, bytes, dtype)`` of the calls a step on its layout makes that the engine's
        parts list themselves: tp's inside the modules (:func:`mpirt.parallel.tensor.program.step_calls`,
        a block recomputed whole or every unit under ZeRO-3 running its forward twice) and the sum
        of sequence parallelism's partial gradients; each group's sync's calls of a fixed number
        and size (DataParallel's buckets; ZeRO's, as :meth:`~mpirt.parallel.zero.Zero12Optimizer.calls`
        lists them); the pipeline's tied-embedding gradient sum (a send and a receive of each tied
        copy's gradient, under ZeRO-3 its shard, between the two pipeline ends)."""
        layout = self.layout
        if self._units_rerun:   # every unit reruns its forward in backward
            rerun = [self.model]
        else:
            rerun = [b for i, b in self.local.blocks.items() if i in layout.recomputed and layout.recompute == "full"]
        reruns = {id(m) for part in rerun for m in [m for _, m in part.named_modules()] + list(vars(part).values())}
        out = program.step_calls(self.model, self.tp_comm, layout.rows * layout.tokens, layout.microbatches, reruns,
                                 self._width, self.hyper.dtype, lookups=self.local.has_embed)
        out += [c for g in self.groups for c in g.sync.partial_sum_calls(self.tp_comm)]
        out += [c for g in self.groups for c in g.sync.calls()]
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
        :class:`mpirt.checkpoint.sharded.ShardWriter` (without ZeRO the first rank of each group's
        sync: of dp x cp, for the experts under ep of edp; the tied embedding from the first stage
        only). Local (see :func:`mpirt.parallel.shards.save_shards`)."""
        writes = {id(p) for g in self.groups if g.comm.rank == 0 for p in g.store.params}
        save_shards(writer, self.model, [g.optimizer for g in self.groups], parameter_axes(self.grid),
                    replica=lambda p: id(p) in writes, skip=set(self.local.tied_copy))

    def load_sharded(self, reader, with_optimizer: bool = True) -> None:
        """Read this rank's boxes from a :class:`mpirt.checkpoint.store.CheckpointReader` (both pipeline
        ends read the tied embedding). Collective over dp under ZeRO."""
        load_shards(reader, self.model, [g.optimizer for g in self.groups], parameter_axes(self.grid),
                    with_optimizer=with_optimizer)

    def close(self) -> None:
        """Stop the syncs' communication threads, if any."""
        for g in self.groups:
            g.sync.close()
