"""Pipeline parallelism: stage partitioning and the one executor that runs any schedule.

    stage = PipelineStage(layout, model_cfg, grid, dtype="float32", seed=0)   # layout: Layout.resolve(...)
    loss = stage.train_step(x, y)   # every pp rank passes its dp share of the batch (same x, y)

The stage is the pipeline's *local part*: it runs the schedule's forward and backward and sums
the tied embedding's gradients. :class:`mpirt.parallel.engine.Engine` adds what every layout shares:
the parameter store, the dp average (DataParallel or ZeRO), the sequence-parallel gradient sum,
the one global-norm clip and the optimizer.

The model's layers ``[embed, h.0, ..., h.{L-1}, head]`` are cut into ``S = pp * chunks`` contiguous
virtual stages (:mod:`mpirt.parallel.pipeline.partition`: balanced by a per-layer cost estimate, or a user
``split``); chunk ``c`` of pp rank ``r`` is virtual stage ``c * pp + r``. Each rank builds only its
own layers, with the parameter names of the full model, and initialises them from the same
name-derived seeds, so any layout starts from the weights of the single-rank model. The tied
embedding/head ``wte`` lives on the first and the last rank; after every backward the two copies'
gradients are summed between those two ranks (one send/recv pair), so the copies stay identical.

With ``grid.tp > 1`` each stage's modules are made tensor parallel by the model's ``tp_plan``
(:func:`mpirt.parallel.tensor.parallelize`); pipeline messages then go between the ranks of equal
tp coordinate (``grid.comm["pp"]``), and with ``sequence_parallel`` carry ``T / tp`` positions.

The schedule (:mod:`mpirt.parallel.pipeline.schedules`) is checked before anything runs
(:func:`mpirt.parallel.pipeline.check.check`); then every rank walks its action list
(:mod:`mpirt.parallel.pipeline.executor`): receives are posted ahead (one per neighbour and kind) into
preallocated buffers and waited on where the list says ``recv``; sends are non-blocking.
Activations are ``(micro-batch rows, T, n_embd)`` in the model dtype on every link: the shape is
agreed once per batch shape by all pp ranks (one allgather of a small tuple), and every receive
checks that the message fills its buffer exactly. Per-rank timers, the peak number of stashed
activations and their estimated bytes are in :attr:`PipelineStage.stats` after each step.
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

import mpirt.core.backend as B
from mpirt.core.injected import injected
from mpirt.core.modeling import block_class, build_model, check_config, lm_loss, model_class, seed_dropouts
from mpirt.core.nn import Module, dropout_modules, graph_parameters, place_dropouts, seed_losses, stand_ins
from mpirt.parallel.experts import parallelize_experts
from mpirt.parallel.pipeline.partition import layer_costs, partition
from mpirt.parallel.pipeline.executor import PipelineExecutor
from mpirt.parallel.pipeline.check import check
from mpirt.parallel.layout import Layout, pipeline_microbatches, sequence_parallel_in_effect
from mpirt.parallel.pipeline.schedules import ScheduleError, build, canonical_name
from mpirt.parallel.whole import parameter_axes
from mpirt.core.tensor import Tensor, no_grad

# ---------------------------------------------------------------------------------------------
# this rank's part of the model

class _Blocks(Module):
    """Blocks registered under their global index, so names read ``h.5.attn...``."""


def message_bytes(layout, model_cfg, dtype: str) -> int:
    """One pipeline message's bytes: a micro-batch's activations (or their gradient) between two
    stages, under sequence parallelism the tp rank's piece of the sequence."""
    tokens = layout.tokens // (layout.tp if layout.sequence_parallel else 1)
    return layout.rows * tokens * model_cfg.n_embd * np.dtype(dtype).itemsize


class PipelineStage(PipelineExecutor):
    """This rank's stage of a pipeline-parallel model and the executor of its schedule.

    ``layout``: the run's :class:`~mpirt.parallel.layout.Layout` resolved with the model, from
    which the stage reads its schedule (:attr:`Layout.pipeline_schedule`), the block range of
    every virtual stage (:attr:`Layout.bounds`) and sequence parallelism; ``model_cfg``: the
    config of any registered model type (:mod:`mpirt.core.modeling`); ``grid``: a
    :class:`mpirt.parallel.grid.Grid` of the layout's sizes (tp > 1 makes every stage tensor
    parallel through the model's ``tp_plan``, :func:`mpirt.parallel.tensor.parallelize`;
    sequence parallelism then splits the activations between stages along the sequence too);
    ``wait``: ``"block"`` (MPI Wait) or ``"poll"`` (test and sleep ``poll_s``: yields the CPU to
    other ranks when cores are oversubscribed). :meth:`standalone` builds one from pipeline
    settings alone (tests, benchmarks).
    """

    def __init__(self, layout, model_cfg, grid, *, dtype="float32", seed: int = 0, wait: str = "block",
                 poll_s: float = 2e-5):
        if wait not in ("block", "poll"):
            raise ValueError(f"wait: expected block or poll, got {wait!r}")
        if not layout.bounds:
            raise ValueError("PipelineStage: the layout was resolved without the model (no stage bounds): "
                             "Layout.resolve(cfg, world, model_cfg)")
        self.layout, self.cfg, self.grid, self.dtype = layout, model_cfg, grid, np.dtype(dtype)
        self.comm = grid.comm["pp"]
        self.rank, self.pp = self.comm.rank, self.comm.size
        self.tp, self.sequence_parallel = grid.tp, layout.sequence_parallel
        self.wait_mode, self.poll_s = wait, poll_s
        self.loss_scale = 1.0  # the last stage's backward seed (train_step sets it)
        # pp 1 (tests of the executor alone): a layout builds no pipeline schedule of its own
        sched = layout.pipeline_schedule or build(layout.schedule, 1, layout.microbatches, layout.chunks)
        if sched.pp != self.pp:
            raise ScheduleError(f"schedule {sched.name} was made for pp={sched.pp}, the grid has pp={self.pp}")
        check(sched)                     # the pre-flight proof, on every rank, before any communication
        self.schedule, self.eval_schedule = sched, sched.forward_only()
        check(self.eval_schedule)
        self.m, self.v, self.S = sched.microbatches, sched.chunks, sched.num_stages
        self.bounds = list(layout.bounds)
        self.chunk_bounds = [self.bounds[c * self.pp + self.rank] for c in range(self.v)]
        self.has_embed, self.has_head = self.rank == 0, self.rank == self.pp - 1
        self._build(seed)
        self._shape_key = None
        self.trace = False  # True: stats["trace"] lists (start, end, op, mb, chunk) of every compute and wait
        self.stats: dict = {}
        self._stash_bytes: dict = {}

    @classmethod
    def standalone(cls, model_cfg, grid, schedule: str = "1f1b", microbatches: int | None = None, chunks: int = 1,
                   *, split=None, balance: str = "flops", seq_len: int | None = None,
                   sequence_parallel: bool = False, **kwargs) -> "PipelineStage":
        """A stage on ``grid`` from pipeline settings alone, outside a training layout (tests,
        benchmarks): ``schedule`` by name (gpipe, 1f1b, interleaved, zb-h1), ``microbatches`` per
        step (default pp), ``chunks`` per rank (interleaved); the blocks ``split`` as given (blocks
        per virtual stage), else balanced by ``balance`` ("flops" or "params") at ``seq_len``
        (default n_positions). ``kwargs``: the constructor's (dtype, seed, wait, poll_s)."""
        layout = Layout(dp=grid.dp, pp=grid.pp, tp=grid.tp, schedule=canonical_name(schedule),
                        microbatches=pipeline_microbatches(microbatches, grid.pp), chunks=chunks,
                        seq_len=seq_len or model_cfg.n_positions,
                        sequence_parallel=sequence_parallel_in_effect(sequence_parallel, grid.tp))
        costs = layer_costs(model_cfg, seq_len) if split is None else [None] * (model_cfg.n_layer + 2)
        bounds = tuple(partition(costs, layout.stages, split, balance))
        return cls(dataclasses.replace(layout, bounds=bounds), model_cfg, grid, **kwargs)

    # -- construction ----------------------------------------------------------------------
    def _build(self, seed: int) -> None:
        cfg, dtype = self.cfg, str(self.dtype)
        check_config(cfg)  # middle stages build blocks only, never the model that would check it
        self.lm_loss = lm_loss
        model = Module()
        model.config = cfg
        self.shell, self.tied_names, registered = None, [], []
        if self.has_embed or self.has_head:
            # embed/head come from the model class itself, built without blocks
            shell = build_model(dataclasses.replace(cfg, n_layer=0), dtype=dtype)
            # which parameters do embed and head use? run each once on a dummy input and look (the
            # shell is lazy: its parameters lend zero-cost stand-ins for that, nothing is allocated)
            with stand_ins(shell.parameters()):
                e_params = graph_parameters(shell.embed(B.xp.zeros((1, 1), dtype=np.int64)))
                h_params = graph_parameters(shell.head(Tensor(B.xp.zeros((1, 1, cfg.n_embd), dtype))))
            used = {id(p) for p in (e_params if self.has_embed else []) + (h_params if self.has_head else [])}
            for name, child in list(shell._modules.items()):
                if any(id(p) in used for p in child.parameters()):
                    setattr(model, name, child)
                    registered.append(name)
                elif child.parameters():  # e.g. ln_f on a first stage: never runs here, so not kept
                    del shell._modules[name]
                    object.__setattr__(shell, name, None)
            if self.has_head:
                self.lm_loss = getattr(shell, "loss_fn", lm_loss)
                for fn in ("head_fn", "loss_fn"):
                    if hasattr(shell, fn):
                        setattr(model, fn, getattr(shell, fn))
            names = {id(p): n for n, p in shell.named_parameters()}
            self.tied_names = sorted(names[id(p)] for p in e_params if any(p is q for q in h_params))
            self.shell = shell
        blocks, cls = _Blocks(), block_class(cfg)
        self.blocks = {}
        for lo, hi in self.chunk_bounds:
            for i in range(lo, hi):
                self.blocks[i] = cls(cfg, dtype)
                setattr(blocks, str(i), self.blocks[i])
        model.h = blocks
        for name, p in model.named_parameters():
            p.name = name
        seed_dropouts(model, seed)
        if self.shell is not None:
            seed_dropouts(self.shell, seed)
        if self.tp > 1:
            self._parallelize(model, registered)
        parallelize_experts(model, self.grid.comm["ep"])
        model.initialize(seed, *parameter_axes(self.grid))  # this rank's slices of the one-rank model
        self.model = model
        self._params = model.parameters()
        self._dropouts = list(dropout_modules(model, self.shell).values())
        self.place = None
        if any(p.dtype != self.dtype for p in self._params):
            raise TypeError(f"PipelineStage: parameters of mixed dtypes {sorted({str(p.dtype) for p in self._params})}")
        # the norm counts every element once: the tied copy on the first rank only
        self.tied_copy = self.tied_names if self.pp > 1 and self.has_head else []

    def _parallelize(self, model, registered: list) -> None:
        """Tensor parallelism inside the stage: the model class's plan applied to this stage's
        modules (entries for the head and loss only on the last stage), then the swapped modules
        handed back to the shell whose embed/head run them."""
        from mpirt.parallel import tensor as TP

        plan = getattr(model_class(self.cfg), "tp_plan", None)
        if plan is None:
            raise NotImplementedError(f"PipelineStage: model_type {self.cfg.model_type!r} has no tp_plan; "
                                      "tensor parallelism needs one")
        plan = [e for e in plan if e[1] not in ("vocab_head", "vocab_loss") or self.has_head]
        TP.parallelize(model, self.grid.comm["tp"], sequence_parallel=self.sequence_parallel, plan=plan)
        for name in registered:
            setattr(self.shell, name, getattr(model, name))
        if self.has_head:
            for fn in ("head_fn", "loss_fn"):
                if hasattr(model, fn):
                    object.__setattr__(self.shell, fn, getattr(model, fn))
            self.lm_loss = getattr(model, "loss_fn", self.lm_loss)

    # -- the public surface (a local part: mpirt.parallel.whole) ---------------------------------
    init = None  # the stage initialises its own layers

    @property
    def held_tied(self) -> list:
        """This rank's copies of the tied embedding (pipeline ends): their gradients are summed over
        the ends after the schedule, so a ZeRO-2 stream holds them for the step."""
        if not (self.has_embed or self.has_head):
            return []
        return [p for name, p in self.model.named_parameters() if name in self.tied_names]

    @property
    def units(self) -> list:
        """``(object, method)`` of each part that runs alone, in the order a micro-batch meets
        them: the embedding, the blocks of each chunk, the head (ZeRO-3's units)."""
        blocks = [(self.blocks[i], "forward") for lo, hi in self.chunk_bounds for i in range(lo, hi)]
        return [(self.shell, "embed")] * self.has_embed + blocks + [(self.shell, "head")] * self.has_head

    @property
    def unit_runs(self) -> list:
        """The model chunk of each of :attr:`units` (the embedding the first's, the head the last's)."""
        blocks = [c for c, (lo, hi) in enumerate(self.chunk_bounds) for _ in range(lo, hi)]
        return [0] * self.has_embed + blocks + [len(self.chunk_bounds) - 1] * self.has_head

    @property
    def probe(self):
        """What this stage's first unit takes in a one-token run: token ids on the first stage
        (None: the store makes them), else a (1, 1, C) hidden state (one token of the local
        sequence, under sequence parallelism too; two under context parallelism, one per chunk)."""
        held = 2 if self.grid.sizes["cp"] > 1 else 1
        return None if self.has_embed else B.xp.zeros((1, held, self.cfg.n_embd), dtype=self.dtype)

    @property
    def dropout_roots(self) -> tuple:
        """The modules whose dropouts this stage runs (the embedding's stays in the ends' shell)."""
        return tuple(m for m in (self.model, self.shell) if m is not None)

    def parameters(self) -> list:
        """This rank's parameters (each once; with pp > 1 the tied ``wte`` is on two ranks)."""
        return list(self._params)

    def named_parameters(self) -> list:
        return list(self.model.named_parameters())

    def describe_partition(self) -> str:
        """``stage s (rank r, chunk c): h.lo-h.hi [+ embed] [+ head]`` per virtual stage."""
        out = []
        for s, (lo, hi) in enumerate(self.bounds):
            extra = (" + embed" if s == 0 else "") + (" + head" if s == self.S - 1 else "")
            out.append(f"stage {s} (rank {s % self.pp}, chunk {s // self.pp}): h.{lo}..h.{hi - 1}{extra}")
        return "\n".join(out)

    def train_step(self, x, y, loss_scale: float = 1.0, place: tuple | None = None,
                   no_sync=contextlib.nullcontext) -> float:
        """Forward and backward of the batch ``(x, y)`` (this dp replica's rows, split into
        ``microbatches``), then the tied-weight gradient sum over the pipeline ends. The last stage
        seeds backward with ``loss_scale`` (the gradients are then that many times the loss's).
        Returns the mean loss of these rows on every pp rank. The gradients add to what the
        parameters hold: zeroing them, averaging over dp, the sequence-parallel gradient sum and
        clipping are the engine's (:class:`mpirt.parallel.engine.Engine`).
        ``place``: (step, global batch row of x's first row): each micro-batch's dropout masks are
        then the single rank's for its rows (None: the modules' call counts stand in). The
        schedule runs inside ``no_sync()`` (the dp sync waits for the whole step)."""
        self.loss_scale, self.place = float(loss_scale), place
        seed_losses(self.dropout_roots, self.loss_scale / self.m)
        x, y = self._prepare(x, y)
        try:
            with no_sync():
                loss = self._run(self.schedule, x, y, training=True)
                self._sync_tied()
        finally:  # a later forward without a step (by hand) counts calls again
            self.place = None
            place_dropouts(self._dropouts, None)
        return self._share_loss(loss)

    def evaluate(self, x, y) -> float:
        """Mean loss of ``(x, y)`` without gradients (forward-only schedule), dropout off."""
        x, y = self._prepare(x, y)
        parts = [m for m in (self.model, self.shell) if m is not None]
        for m in parts:
            m.eval()
        try:
            with no_grad():
                loss = self._run(self.eval_schedule, x, y, training=False)
        finally:
            for m in parts:
                m.train()
        return self._share_loss(loss)

    # -- the step ----------------------------------------------------------------------------
    def _prepare(self, x, y):
        if x is None or len(x.shape) != 2:
            raise ValueError(f"pipeline batch: expected x of shape (rows, seq_len) on every pp rank, got "
                             f"{None if x is None else tuple(x.shape)}")
        if y is not None and tuple(y.shape) != tuple(x.shape):
            raise ValueError(f"pipeline batch: y shape {tuple(y.shape)} != x shape {tuple(x.shape)}")
        rows, t = int(x.shape[0]), int(x.shape[1])
        if rows % self.m:
            raise ValueError(f"pipeline batch: {rows} rows cannot be split into microbatches={self.m} equal "
                             "micro-batches")
        key = (rows, t)
        if key != self._shape_key:  # agree on shapes and layout once, before any p2p
            mine = (rows, t, str(self.dtype), self.schedule.name, self.m, self.v, tuple(self.bounds),
                    self.cfg.n_embd, self.tp, self.sequence_parallel)
            every = self.comm.allgather_object(mine) if self.pp > 1 else [mine]
            bad = [r for r, s in enumerate(every) if s != mine]
            if bad:
                raise ValueError(f"pipeline ranks disagree on (rows, seq_len, dtype, schedule, m, chunks, split, "
                                 f"n_embd, tp, sequence_parallel): rank {self.rank} has {mine}, rank {bad[0]} has {every[bad[0]]}")
            self._shape_key = key
            if self.sequence_parallel and t % self.tp:
                raise ValueError(f"sequence parallelism: seq_len {t} is not divisible by tp={self.tp}")
            self.act_shape = (rows // self.m, t // self.tp if self.sequence_parallel else t, self.cfg.n_embd)
            self._pool = {"act": [], "grad": []}
            self._stash_bytes = {}
        xs = ys = None
        if self.has_embed:
            xa = B.xp.asarray(x)
            xs = [xa[i * self.act_shape[0]:(i + 1) * self.act_shape[0]] for i in range(self.m)]
        if self.has_head:
            if y is None:
                raise ValueError("pipeline batch: the last stage needs the targets y")
            ya = B.xp.asarray(y)
            ys = [ya[i * self.act_shape[0]:(i + 1) * self.act_shape[0]] for i in range(self.m)]
            if injected("pp-microbatch-order"):  # test-only (mpirt.core.injected)
                ys.reverse()
        return xs, ys

    def _forward(self, chunk, mb, inp, xs, ys):
        """Chunk ``chunk`` on micro-batch ``mb``: the stage output, or the scaled loss (last stage)."""
        s = chunk * self.pp + self.rank
        if self.place is not None:
            step, row0 = self.place
            place_dropouts(self._dropouts, step, row0 + mb * self.act_shape[0])
        h = self.shell.embed(xs[mb]) if s == 0 else inp
        lo, hi = self.chunk_bounds[chunk]
        for i in range(lo, hi):
            h = self.blocks[i](h)
        if s < self.S - 1:
            return h, None
        loss = self.lm_loss(self.shell.head(h), ys[mb])
        return loss * (self.loss_scale / self.m), loss.item()
