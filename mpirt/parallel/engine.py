"""Training engines: one optimizer step of a model laid out on a dp x pp x tp grid.

The training script talks to one interface whatever the layout:

    engine.train_step(x, y, loss_scale=1.0) -> float   # forward/backward of this dp replica's rows,
                                         # grads synced (and loss_scale times the loss's)
    engine.clip(max_norm)   -> float     # global gradient norm (before clipping), over all shards
    engine.optimizer.step()
    engine.evaluate(x, y)   -> float     # mean loss of the global batch, no gradients
    engine.save_sharded(writer) / engine.load_sharded(reader)     # checkpoints: this rank's boxes
    engine.full_state() / engine.load_full_state(weights, state)   # layout-independent full tensors
    engine.dropout_state() / engine.load_dropout_state(d)          # where each mask stream stands

:class:`ShardedEngine` runs dp x tp (data parallelism or ZeRO 1-3, tensor/sequence parallelism)
on one model object; :class:`PipelineEngine` runs a pipeline stage (with dp and tp inside it).
"""
from __future__ import annotations

import contextlib
import time

import numpy as np

import mpirt.backend as B
from mpirt.data import split_microbatches
from mpirt import recompute
from mpirt.modeling import attention_core, build_model
from mpirt.nn import Dropout
from mpirt.optim import AdamW, clip_grad_norm
from mpirt.parallel import tensor as TP
from mpirt.parallel.data import DataParallel
from mpirt.parallel.pipeline import PipelineStage
from mpirt.parallel.state import gather_state, load_shards, save_shards, scatter_state
from mpirt.parallel.zero import ZeroOptimizer
from mpirt.tensor import no_grad


class ShardedEngine:
    """One model replica per dp rank (ZeRO shards it over dp), tensor parallel over tp."""

    def __init__(self, cfg, model_cfg, grid, dropout_seed: int):
        self.grid, self.cfg = grid, cfg
        self.tp_comm, self.dp_comm = grid.comm["tp"], grid.comm["dp"]
        tp = grid.sizes["tp"]
        # every layout starts from the same weights: full tensors from the seed, then sliced
        self.model = build_model(model_cfg, dtype=cfg.dtype, seed=cfg.seed if tp == 1 else None)
        if tp > 1:
            TP.parallelize(self.model, self.tp_comm, sequence_parallel=cfg.sequence_parallel, seed=cfg.seed)
        TP.reseed_dropouts(self.model, dropout_seed, grid.coords["tp"], cfg.sequence_parallel)
        if cfg.zero < 3:  # ZeRO-3 already reruns every block in backward (its units keep only their inputs)
            recompute.apply(dict(enumerate(self.model.h)), cfg.recompute, cfg.recompute_layers,
                            attention_core(model_cfg))
        betas = (cfg.beta1, cfg.beta2)
        self.ddp = None
        if cfg.zero:
            self.optimizer = ZeroOptimizer(self.model, self.dp_comm, stage=cfg.zero, lr=cfg.lr, betas=betas,
                                           weight_decay=cfg.weight_decay)
        else:
            if grid.sizes["dp"] > 1:
                self.ddp = DataParallel(self.model, self.dp_comm)
            self.optimizer = AdamW(self.model.parameters(), lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)
        self.stats: dict = {}  # timers of the last train_step

    def train_step(self, x, y, loss_scale: float = 1.0) -> float:
        """Forward and backward over ``grad_accum`` micro-batches of the rows (x, y), backward
        seeded with ``loss_scale`` (:class:`mpirt.precision.LossScaler`); returns the (unscaled)
        mean loss of the global batch. ``stats["spans"]``: its (part, start, end) perf_counter
        times (forward, backward, grad_sync) for the monitor."""
        self.optimizer.zero_grad()
        k = self.cfg.grad_accum
        loss_sum = 0.0
        spans = self.stats["spans"] = []
        clock = time.perf_counter
        for i, (xm, ym) in enumerate(split_microbatches(x, y, k)):
            # all but the last micro-batch only accumulate locally
            with self.ddp.no_sync() if self.ddp and i < k - 1 else contextlib.nullcontext():
                t0 = clock()
                _, loss = self.model(B.asarray(xm), B.asarray(ym))
                B.synchronize()  # the device's forward is timed as forward (no-op on NumPy)
                t1 = clock()
                (loss * (loss_scale / k)).backward()
            loss_sum += loss.item()
            spans += (("forward", t0, t1), ("backward", t1, clock()))
        t0 = clock()
        if self.ddp:
            self.ddp.finish()
        TP.sync_sequence_parallel_grads(self.model, self.tp_comm)
        loss = self.dp_comm.allreduce_scalar(loss_sum / k, "avg")
        spans.append(("grad_sync", t0, clock()))
        return loss

    def clip(self, max_norm: float) -> float:
        if self.cfg.zero:
            return self.optimizer.clip_grad_norm(max_norm)
        if self.tp_comm.size > 1:
            return TP.clip_grad_norm(self.model.parameters(), max_norm, {"tp": self.tp_comm})
        return clip_grad_norm(self.model.parameters(), max_norm)

    def evaluate(self, x, y) -> float:
        self.model.eval()
        with no_grad():
            loss = self.model(B.asarray(x), B.asarray(y))[1].item()
        self.model.train()
        return self.dp_comm.allreduce_scalar(loss, "avg")

    def full_state(self) -> tuple[dict, dict]:
        """Full weights and optimizer state, on every rank (collective)."""
        return gather_state(self.model, self.optimizer, self.tp_comm)

    def load_full_state(self, weights: dict, state: dict | None) -> None:
        scatter_state(self.model, self.optimizer, weights, state, self.tp_comm)

    def save_sharded(self, writer) -> None:
        """Add this rank's boxes of the weights and optimizer state to a
        :class:`mpirt.checkpoint_sharded.ShardWriter` (local; see :func:`mpirt.parallel.state.save_shards`)."""
        save_shards(writer, self.model, self.optimizer, self.tp_comm, replica=self.grid.coords["dp"] == 0)

    def load_sharded(self, reader, with_optimizer: bool = True) -> None:
        """Read this rank's boxes from a :class:`mpirt.checkpoint.CheckpointReader` (collective
        over dp under ZeRO)."""
        load_shards(reader, self.model, self.optimizer, self.tp_comm, with_optimizer=with_optimizer)

    def dropout_state(self) -> dict:
        """``{module name: calls}`` for every Dropout: how far each mask stream has advanced (the
        call count is part of the mask seed), so that a resumed run draws the masks an
        uninterrupted one would. Every rank holds every module here, with the same counts."""
        return {name: m.calls for name, m in _dropouts(self.model).items()}

    def load_dropout_state(self, state: dict) -> None:
        """Restore the counts saved by :meth:`dropout_state`; modules it does not name keep theirs."""
        _load_dropouts(_dropouts(self.model), state)

    def close(self) -> None:
        if self.ddp:
            self.ddp.close()


class PipelineEngine:
    """This rank's pipeline stage (a slice of the layers, tp inside it, averaged over dp)."""

    def __init__(self, cfg, model_cfg, grid, dropout_seed: int):
        self.grid, self.cfg = grid, cfg
        self.tp_comm, self.pp_comm = grid.comm["tp"], grid.comm["pp"]
        self.stage = PipelineStage(model_cfg, grid, schedule=cfg.schedule, microbatches=cfg.microbatches or None,
                                   chunks=cfg.chunks if cfg.schedule == "interleaved" else 1, dtype=cfg.dtype,
                                   seed=cfg.seed, seq_len=cfg.seq_len, sequence_parallel=cfg.sequence_parallel)
        self.model = self.stage.model
        # the blocks' dropouts and the embedding's (in the first and last stages' shell): each dp
        # replica draws its own masks
        for part in filter(None, (self.model, self.stage.shell)):
            TP.reseed_dropouts(part, dropout_seed, grid.coords["tp"], cfg.sequence_parallel)
        recompute.apply(self.stage.blocks, cfg.recompute, cfg.recompute_layers, attention_core(model_cfg))
        self.optimizer = AdamW(self.stage.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                               weight_decay=cfg.weight_decay)

    def train_step(self, x, y, loss_scale: float = 1.0) -> float:
        return self.stage.train_step(x, y, loss_scale)

    @property
    def stats(self) -> dict:
        """The stage's timers of the last step (:attr:`PipelineStage.stats`)."""
        return self.stage.stats

    def clip(self, max_norm: float) -> float:
        return self.stage.clip_grad_norm(max_norm)

    def evaluate(self, x, y) -> float:
        return self.stage.evaluate(x, y)

    def full_state(self) -> tuple[dict, dict]:
        """Full weights and optimizer state of the whole model, complete on pipeline rank 0
        (other ranks get their own stage's part). Collective: each stage gathers its tp shards,
        then every array missing on pp rank 0 is sent there point to point, described first by
        (name, shape, dtype) so no array travels through pickle. The tied embedding, held by
        the first and the last stage, is identical in both and taken from the first."""
        weights, state = gather_state(self.model, self.optimizer, self.tp_comm)
        pp = self.pp_comm
        tables = {"w": weights, "s": state}
        local = [(t, k, v.shape, v.dtype.str) for t, d in tables.items() for k, v in d.items() if hasattr(v, "shape")]
        seen = set()
        for owner, described in enumerate(pp.allgather_object(local)):
            for table, key, shape, dtype in described:
                if (table, key) in seen:
                    continue
                seen.add((table, key))
                if owner == 0:
                    continue
                if pp.rank == owner:
                    pp.send(np.ascontiguousarray(tables[table][key]), dest=0)
                elif pp.rank == 0:
                    tables[table][key] = pp.recv(np.empty(shape, dtype=dtype), source=owner)
        return weights, state

    def load_full_state(self, weights: dict, state: dict | None) -> None:
        """Load this stage's part of full tensors (names of the whole model)."""
        names = {n for n, _ in self.model.named_parameters()}
        weights = {n: a for n, a in weights.items() if n in names}
        if state is not None:
            state = {k: v for k, v in state.items() if not hasattr(v, "shape") or k.rsplit(".", 1)[0] in names}
        scatter_state(self.model, self.optimizer, weights, state, self.tp_comm)

    def save_sharded(self, writer) -> None:
        """Add this stage's boxes to ``writer`` (dp rank 0; the tied embedding from the first
        stage only). Local."""
        tied = self.stage.tied_names if self.stage.has_head and self.grid.sizes["pp"] > 1 else ()
        save_shards(writer, self.model, self.optimizer, self.tp_comm, replica=self.grid.coords["dp"] == 0,
                    skip=set(tied))

    def load_sharded(self, reader, with_optimizer: bool = True) -> None:
        """Read this stage's boxes (both ends read the tied embedding) from ``reader``. Local."""
        load_shards(reader, self.model, self.optimizer, self.tp_comm, with_optimizer=with_optimizer)

    def _dropouts(self) -> dict:
        # the embedding dropout has no parameters, so it stays in the first stage's shell
        return _dropouts(self.model, self.stage.shell)

    def dropout_state(self) -> dict:
        """``{module name: calls}`` for every Dropout of the whole model, on every rank (collective
        over pp: each stage holds only its own modules). See :meth:`ShardedEngine.dropout_state`."""
        merged: dict = {}
        for part in self.pp_comm.allgather_object({name: m.calls for name, m in self._dropouts().items()}):
            for name, calls in part.items():  # the first and last stage's shells both hold ``drop``: only one
                merged[name] = max(calls, merged.get(name, 0))  # runs it, the other's count stays 0
        return merged

    def load_dropout_state(self, state: dict) -> None:
        """Restore this stage's counts from a whole-model :meth:`dropout_state`."""
        _load_dropouts(self._dropouts(), state)

    def close(self) -> None:
        """Nothing to release: the stage owns no communicators of its own."""


def _dropouts(*roots) -> dict:
    """Every Dropout module under the ``roots`` (None skipped), by module name."""
    return {name: m for root in roots if root is not None
            for name, m in root.named_modules() if isinstance(m, Dropout)}


def _load_dropouts(modules: dict, state: dict) -> None:
    for name, m in modules.items():
        if name in state:
            m.calls = int(state[name])


def build_engine(cfg, model_cfg, grid, dropout_seed: int):
    """The engine for the grid: a pipeline when pp > 1, else one sharded model."""
    cls = PipelineEngine if grid.sizes["pp"] > 1 else ShardedEngine
    return cls(cfg, model_cfg, grid, dropout_seed)
