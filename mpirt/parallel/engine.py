"""The training engine: one optimizer step of a model laid out on any dp x pp x tp grid.

The training script talks to one interface whatever the layout:

    engine.train_step(x, y, loss_scale=1.0, step=None) -> float   # forward/backward of this dp
                                         # replica's rows, grads synced (loss_scale times the loss's)
    engine.clip(max_norm)   -> float     # global gradient norm (before clipping), over all shards
    engine.optimizer.step()
    engine.evaluate(x, y)   -> float     # mean loss of the global batch, no gradients
    engine.save_sharded(writer) / engine.load_sharded(reader)     # checkpoints: this rank's boxes

:class:`Engine` is a *local part* and a *sync*. The local part is this rank's piece of the model:
a :class:`~mpirt.parallel.pipeline.PipelineStage` when pp > 1 (its schedule runs the micro-batches),
else the model made tensor parallel by its ``tp_plan`` (a loop over ``grad_accum`` micro-batches).
Its parameters live in one :class:`~mpirt.parallel.flat.FlatParams` store, and the sync over dp
is :class:`~mpirt.parallel.data.DataParallel` or :class:`~mpirt.parallel.zero.ZeroOptimizer` over
that store (ZeRO-3 shards per unit instead, with tp but not with pp). Sequence parallelism's
partial gradients are summed over tp once, and one global-norm clip counts every element once
over dp (ZeRO shards), tp and pp (:func:`~mpirt.parallel.flat.clip_flat`).
"""
from __future__ import annotations

import contextlib
import time

import mpirt.backend as B
from mpirt import memory, recompute
from mpirt.data import split_microbatches
from mpirt.modeling import attention_core, build_model
from mpirt.nn import dropout_modules, place_dropouts
from mpirt.optim import AdamW
from mpirt.parallel import tensor as TP
from mpirt.parallel.data import DataParallel
from mpirt.parallel.flat import FlatParams, count_once
from mpirt.parallel.layout import Layout, zero_refusal
from mpirt.parallel.pipeline import PipelineStage
from mpirt.parallel.state import load_shards, save_shards
from mpirt.parallel.zero import ZeroOptimizer
from mpirt.tensor import no_grad


def seeded_init(seed: int, axis_sizes: dict, axis_ranks: dict):
    """``init(p, out=None)``: parameter ``p``'s slice of its seeded initial tensor
    (:meth:`mpirt.nn.Parameter.init_slice`), written into ``out`` when given (a device array
    through one host slice)."""
    def init(p, out=None):
        if out is not None and B.is_device_array(out):
            out[...] = B.asarray(p.init_slice(seed, axis_sizes, axis_ranks))
            return out
        return p.init_slice(seed, axis_sizes, axis_ranks, out=out)
    return init


class Engine:
    """This rank's part of the model on ``grid``, its parameter store, dp sync and optimizer.

    ``cfg``: a :class:`mpirt.config.TrainConfig` (layout, schedule, ZeRO stage, recompute, dtype,
    optimizer); ``model_cfg``: any registered model's config; ``dropout_seed``: this dp replica's
    mask seed. ``local``: a prebuilt :class:`PipelineStage` to use instead of building one (tests
    that pass their own partition or wait mode)."""

    def __init__(self, cfg, model_cfg, grid, dropout_seed: int, local=None):
        self.grid, self.cfg = grid, cfg
        self.tp_comm, self.pp_comm, self.dp_comm = grid.comm["tp"], grid.comm["pp"], grid.comm["dp"]
        tp, pp = grid.sizes["tp"], grid.sizes["pp"]
        why = zero_refusal(cfg.zero, tp, pp)
        if why:
            raise ValueError(why)
        layout = Layout.of(cfg, grid.sizes)
        sp = layout.sequence_parallel
        if pp > 1 or local is not None:
            self.stage = local or PipelineStage(
                model_cfg, grid, schedule=cfg.schedule, microbatches=layout.microbatches,
                chunks=layout.chunks, dtype=cfg.dtype, seed=cfg.seed,
                seq_len=cfg.seq_len, sequence_parallel=cfg.sequence_parallel)
            self.model, blocks, tied_copy = self.stage.model, self.stage.blocks, self.stage.tied_copy
            # the tied embedding's copies, summed over the pipeline ends after the schedule
            held = [p for name, p in self.model.named_parameters() if name in self.stage.tied_names] \
                if self.stage.has_embed or self.stage.has_head else []
            roots = (self.model, self.stage.shell)  # the embedding dropout stays in the ends' shell
            init = None  # the stage initialises its own layers
        else:
            self.stage = None
            # built lazily (no arrays); every layout starts from the single-rank weights: each
            # parameter's slice of its seeded tensor is generated straight into the store (ZeRO-3:
            # one parameter at a time, of which the rank keeps its shard)
            self.model = build_model(model_cfg, dtype=cfg.dtype)
            if tp > 1:
                TP.parallelize(self.model, self.tp_comm, sequence_parallel=cfg.sequence_parallel)
            init = seeded_init(cfg.seed, {"tp": tp}, {"tp": grid.coords["tp"]})
            blocks, tied_copy, roots, held = dict(enumerate(self.model.h)), (), (self.model,), []
        if local is None:
            for part in filter(None, roots):
                TP.reseed_dropouts(part, dropout_seed, grid.coords["tp"], tp, cfg.sequence_parallel)
        self._dropouts = list(dropout_modules(*roots).values())
        # ZeRO-3 already reruns every unit in backward (its units keep only their inputs); elsewhere
        # recompute only where it lowers this stage's predicted peak (memory.recompute_pays)
        if cfg.zero < 3 and (local is not None or memory.recompute_pays(cfg, model_cfg, layout, grid.rank)):
            recompute.apply(blocks, cfg.recompute, cfg.recompute_layers, attention_core(model_cfg))
        counted = count_once(grid.coords["tp"] if tp > 1 else 0, tied_copy)
        norm_comms = (self.tp_comm, self.pp_comm)  # ranks along them hold different parameters
        hyper = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
        self.ddp = self.store = None
        if cfg.zero == 3:
            self.optimizer = ZeroOptimizer(self.model, self.dp_comm, stage=3, counted=counted, norm_comms=norm_comms,
                                           probe_len=tp if sp else 1, init=init, **hyper)
        else:
            params = self.stage.parameters() if self.stage else self.model.parameters()
            self.store = FlatParams(params, counted, init=init, grads=cfg.zero != 2)  # ZeRO-2: a shard only
            if cfg.zero:  # ZeRO-2 reduces buckets during backward; a pipeline's tied copies wait for the step
                self.optimizer = ZeroOptimizer(self.store, self.dp_comm, stage=cfg.zero, norm_comms=norm_comms,
                                               stream_grads=True, held=held, **hyper)
            else:
                if grid.sizes["dp"] > 1:
                    self.ddp = DataParallel(self.store, self.dp_comm)
                self.optimizer = AdamW(self.store.params, **hyper)
        self._norm_comms = norm_comms
        self._stats: dict = {}  # timers of the last train_step

    # --- the step -------------------------------------------------------------------------------
    def _no_sync(self):
        return self.ddp.no_sync() if self.ddp else contextlib.nullcontext()

    def train_step(self, x, y, loss_scale: float = 1.0, step: int | None = None) -> float:
        """Forward and backward of this dp replica's rows (x, y), backward seeded with
        ``loss_scale`` (:class:`mpirt.precision.LossScaler`); then the gradients are summed over
        the tied copies, over tp for sequence-parallel partial sums and averaged over dp. Returns
        the (unscaled) mean loss of the global batch. ``step``: the optimizer step, which with the
        rows' place in the global batch (this replica holds rows ``[dp rank x len(x), ...)``)
        makes the dropout masks those of one rank running the whole batch (None: each module's
        call count stands in)."""
        self.optimizer.zero_grad()
        clock = time.perf_counter
        row0 = self.grid.coords["dp"] * len(x)
        try:
            if self.stage:
                with self._no_sync():
                    loss = self.stage.train_step(x, y, loss_scale, place=None if step is None else (step, row0))
            else:
                loss = self._accumulate(x, y, loss_scale, None if step is None else (step, row0))
        finally:  # a later forward without a step (by hand) counts calls again
            place_dropouts(self._dropouts, None)
        t0 = clock()
        if self.ddp:
            self.ddp.finish()
        (self.optimizer if self.cfg.zero else self.store).sync_partial_grads(self.tp_comm)
        loss = self.dp_comm.allreduce_scalar(loss, "avg")
        if self.stage:
            self.stage.stats["sync_t0"], self.stage.stats["sync_s"] = t0, clock() - t0
        else:
            self._stats["spans"].append(("grad_sync", t0, clock()))
        return loss

    def _accumulate(self, x, y, loss_scale: float, place: tuple | None) -> float:
        """``grad_accum`` micro-batches of the whole (tp-parallel) model; all but the last only
        accumulate locally. ``place``: (step, global row of x's first row) for the dropout masks.
        ``stats["spans"]``: (part, start, end) times for the monitor."""
        k = self.cfg.grad_accum
        loss_sum = 0.0
        spans = self._stats["spans"] = []
        clock = time.perf_counter
        for i, (xm, ym) in enumerate(split_microbatches(x, y, k)):
            if place is not None:
                place_dropouts(self._dropouts, place[0], place[1] + i * len(xm))
            with self._no_sync() if i < k - 1 else contextlib.nullcontext():
                t0 = clock()
                _, loss = self.model(B.asarray(xm), B.asarray(ym))
                B.synchronize()  # the device's forward is timed as forward (no-op on NumPy)
                t1 = clock()
                (loss * (loss_scale / k)).backward()
            loss_sum += loss.item()
            spans += (("forward", t0, t1), ("backward", t1, clock()))
        return loss_sum / k

    @property
    def stats(self) -> dict:
        """Timers of the last step: the pipeline stage's (:attr:`PipelineStage.stats`) or the
        micro-batch loop's spans."""
        return self.stage.stats if self.stage else self._stats

    def clip(self, max_norm: float | None) -> float:
        """Scale every gradient by ``max_norm / (norm + 1e-6)`` when the global norm exceeds
        ``max_norm`` (None: only the norm); returns the norm before clipping."""
        if isinstance(self.optimizer, ZeroOptimizer):
            return self.optimizer.clip_grad_norm(max_norm)
        return self.store.clip(max_norm, self._norm_comms)

    def evaluate(self, x, y) -> float:
        """Mean loss of the global batch (this replica's rows ``x``, ``y``), no gradients."""
        if self.stage:
            loss = self.stage.evaluate(x, y)
        else:
            self.model.eval()
            with no_grad():
                loss = self.model(B.asarray(x), B.asarray(y))[1].item()
            self.model.train()
        return self.dp_comm.allreduce_scalar(loss, "avg")

    # --- state ------------------------------------------------------------------------------------
    def save_sharded(self, writer) -> None:
        """Add this rank's boxes of the weights and optimizer state to a
        :class:`mpirt.checkpoint_sharded.ShardWriter` (dp rank 0 without ZeRO; the tied embedding
        from the first stage only). Local (see :func:`mpirt.parallel.state.save_shards`)."""
        skip = set(self.stage.tied_copy) if self.stage else set()
        save_shards(writer, self.model, self.optimizer, self.tp_comm, replica=self.grid.coords["dp"] == 0, skip=skip)

    def load_sharded(self, reader, with_optimizer: bool = True) -> None:
        """Read this rank's boxes from a :class:`mpirt.checkpoint.CheckpointReader` (both pipeline
        ends read the tied embedding). Collective over dp under ZeRO."""
        load_shards(reader, self.model, self.optimizer, self.tp_comm, with_optimizer=with_optimizer)

    def close(self) -> None:
        """Stop DataParallel's communication thread, if any."""
        if self.ddp:
            self.ddp.close()
