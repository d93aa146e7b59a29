"""The run's layout as data: :class:`Layout`, resolved once from the training config and the
dp/pp/tp sizes, with every value derived from them (pure: no communication, nothing built).

What used to be derived again wherever it was needed (the engine, the pipeline stage, the memory
predictor, the planner's estimate, the monitor, the start-up banner) reads it from here:
effective sequence parallelism, the micro-batches per step and their rows, the interleaved
schedule's chunks, the pipeline's stages, whether the backward is split, each rank's grid
coordinates. A ``Layout`` is also a read-only mapping of the axis sizes (``layout["pp"]``), the
form the predictor and the summaries took before it existed.

:meth:`Layout.resolve` holds the rules of a layout, in one table of checks, each refusal a
:class:`LayoutError` whose message starts with the key to change (``train.plan_layout`` reports
it as a ConfigError, ``mpirt.slurm`` as the flag to change); :meth:`Layout.check_model` the rules
that need the model (positions, stages to fill, tensor-parallel sizes, recomputation). The
checks of one value on its own stay with the value: a config field's range in ``config``, the
grid's arithmetic (``grid.check_layout``), a schedule's shape (``schedules.check_shape``) and a
user split (``partition``); the rules here call them and name the key.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

AXES = ("dp", "pp", "cp", "tp", "ep")  # the grid's axes, and ep: the expert-parallel groups carved out of dp


class LayoutError(ValueError):
    """A layout that cannot run: ``key`` is the config key to change (``dp/pp/tp`` for the axis
    sizes), ``reason`` why; the message is ``"key: reason"``."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


def sequence_parallel_in_effect(asked: bool, tp: int) -> bool:
    """Sequence parallelism runs only with tp > 1 (it splits the sequence over the tp ranks)."""
    return bool(asked and tp > 1)


def pipeline_microbatches(asked: int | None, pp: int) -> int:
    """A pipeline's micro-batches per step: as asked, else pp (the fewest that fill it)."""
    return asked or pp


_BOUNDS: dict = {}


def _stage_bounds(model_cfg, seq_len: int, stages: int) -> tuple:
    """The FLOP-balanced block ranges of ``stages`` virtual stages
    (:func:`mpirt.parallel.pipeline.partition.partition`), remembered per model config and sequence
    length: the planner resolves thousands of layouts of one model."""
    from mpirt.core.modeling import config_key, layer_costs
    from mpirt.parallel.pipeline.partition import partition

    key = (config_key(model_cfg), seq_len, stages)
    if key not in _BOUNDS:
        if len(_BOUNDS) >= 1024:
            _BOUNDS.clear()
        _BOUNDS[key] = tuple(partition(layer_costs(model_cfg, seq_len), stages))
    return _BOUNDS[key]


@functools.lru_cache(maxsize=256)  # a planner's search meets ~80 shapes at 512 GPUs; a rebuilt one is proved again
def _schedule(name: str, pp: int, microbatches: int, chunks: int):
    from mpirt.parallel.pipeline.schedules import build
    return build(name, pp, microbatches, chunks)


@dataclass(frozen=True)
class Layout(Mapping):
    """dp x pp x cp x tp and what follows from them and the config (see the module docstring);
    ``ep``: the dp ranks over which a mixture of experts' experts are split (divides dp).

    ``microbatches``: per step and dp replica, the pipeline schedule's under pp, else
    ``grad_accum``; ``rows``: batch rows per micro-batch; ``chunks``: model chunks per pipeline
    rank (the interleaved schedule's virtual stages; 1 otherwise); ``seq_len``: the global
    sequence length (:attr:`tokens` of each sequence a rank holds); ``recompute``: the rerun mode
    (none, selective, full). Resolved with a model (``Layout.resolve(cfg, world, model_cfg)``):
    ``bounds``, the block range ``[lo, hi)`` of each of the ``stages`` (balanced by FLOPs,
    :func:`mpirt.parallel.pipeline.partition.partition`; virtual stage ``s`` runs on pp rank
    ``s % pp`` as chunk ``s // pp``), and ``recomputed``, the global block indices that
    ``recompute``/``recompute_layers`` pick (every block under ZeRO-3, whose units always rerun);
    both empty without a model. The training start-up leaves out of ``recomputed`` the blocks of
    the stages where a rerun would not lower the peak and lists them in ``recompute_unpaid``
    (:func:`mpirt.plan.memory.recompute_where_it_pays`): the object the runtime is built from."""

    dp: int
    pp: int
    tp: int
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 1
    chunks: int = 1
    rows: int = 1
    seq_len: int = 0
    recompute: str = "none"
    bounds: tuple = ()
    recomputed: tuple = ()
    recompute_unpaid: tuple = ()

    @classmethod
    def of(cls, cfg, sizes, model_cfg=None) -> "Layout":
        """The layout of training config ``cfg`` on ``sizes`` (a mapping with dp, pp, tp and
        optionally cp and ep, a ``Layout`` too: derived again from ``cfg``, which may differ from
        the one it came from),
        with the stage bounds and recomputed blocks of ``model_cfg`` when given (ValueError when
        its blocks cannot fill the stages: :meth:`check_model` says so in its own words first)."""
        from mpirt.core import recompute

        dp, pp, tp = (int(sizes[k]) for k in ("dp", "pp", "tp"))
        cp, ep = int(sizes.get("cp", 1)), int(sizes.get("ep", 1))
        m = pipeline_microbatches(cfg.microbatches, pp) if pp > 1 else cfg.grad_accum
        chunks = cfg.chunks if pp > 1 and cfg.schedule == "interleaved" else 1
        bounds = recomputed = ()
        if model_cfg is not None:
            n = model_cfg.n_layer
            bounds = _stage_bounds(model_cfg, cfg.seq_len, pp * chunks) if pp > 1 else ((0, n),)
            recomputed = tuple(range(n)) if cfg.zero == 3 else \
                tuple(recompute.chosen(n, cfg.recompute, cfg.recompute_layers))
        return cls(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep, zero=cfg.zero,
                   sequence_parallel=sequence_parallel_in_effect(cfg.sequence_parallel, tp),
                   schedule=cfg.schedule, microbatches=m, chunks=chunks, rows=cfg.batch_size // dp // m,
                   seq_len=cfg.seq_len, recompute=cfg.recompute, bounds=bounds, recomputed=recomputed)

    @classmethod
    def micro_batch(cls, rows: int, seq_len: int, *, tp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                    ep: int = 1) -> "Layout":
        """One rank's share of a micro-batch of ``rows`` sequences of ``seq_len`` tokens under ``tp``,
        ``cp``, sequence parallelism and ``ep``, the rest single: the shape a model's
        ``activation_bytes_of`` reads, for a planner's estimate of a layout no run holds."""
        return cls(dp=ep, pp=1, tp=tp, cp=cp, ep=ep, rows=rows, seq_len=seq_len,
                   sequence_parallel=sequence_parallel_in_effect(sequence_parallel, tp))

    @staticmethod
    def axes(world_size: int, dp: int, pp: int, tp: int, cp: int = 1) -> tuple[int, int, int]:
        """``(dp, pp, tp)`` on ``world_size`` ranks, dp derived when 0 (LayoutError ``dp/pp/tp``
        when the sizes, cp included, are not positive integers whose product is the world size)."""
        from mpirt.parallel.grid import check_layout, resolve_dp

        try:
            dp = resolve_dp(world_size, dp=dp, pp=pp, cp=cp, tp=tp)
            check_layout(dp=dp, pp=pp, cp=cp, tp=tp, world_size=world_size)
        except ValueError as err:
            raise LayoutError("dp/pp/tp", str(err)) from None
        return dp, pp, tp

    @classmethod
    def resolve(cls, cfg, world_size: int, model_cfg=None, batch_rules: bool = True) -> "Layout":
        """The layout of ``cfg`` on ``world_size`` ranks (dp derived when not given), refusing
        (:class:`LayoutError`) what cannot run. Pure: no communication. With ``model_cfg``, also
        what the model refuses (:meth:`check_model`), and the stage bounds and recomputed blocks
        filled in. ``batch_rules=False`` leaves out the rules that the batch settings (batch_size,
        grad_accum, microbatches and the schedule's shape they make) take part in: a job script
        checks the rest before they are final."""
        from mpirt.parallel.pipeline.schedules import check_shape

        from mpirt.parallel.grid import check_expert_layout

        dp = cls.axes(world_size, cfg.dp, cfg.pp, cfg.tp, cfg.cp)[0]
        try:
            check_expert_layout(dp, cfg.ep)
        except ValueError as err:
            raise LayoutError("ep", str(err).removeprefix("ep: ")) from None
        if cfg.ep > 1 and cfg.zero == 3:
            raise LayoutError("zero", f"ZeRO-3 shards the parameters over dp, the experts under ep={cfg.ep} are "
                              "already split over it: use --zero 1 or 2 with --ep")
        layout = cls.of(cfg, {"dp": dp, "pp": cfg.pp, "tp": cfg.tp, "cp": cfg.cp, "ep": cfg.ep})
        if cfg.sequence_parallel and cfg.tp == 1:
            raise LayoutError("sequence_parallel", "needs tp > 1")
        if cfg.cp > 1 and cfg.seq_len % (2 * cfg.cp):
            raise LayoutError("cp", f"seq_len {cfg.seq_len} does not cut into 2 x cp = {2 * cfg.cp} equal chunks "
                              "(each context-parallel rank holds one from each end of the sequence)")
        if not batch_rules:
            return layout.with_model(cfg, model_cfg) if model_cfg is not None else layout
        if cfg.pp > 1:
            if cfg.grad_accum > 1:
                raise LayoutError("grad_accum", f"with pp={cfg.pp} the pipeline's micro-batches replace gradient "
                                  f"accumulation; use --microbatches instead of --grad-accum={cfg.grad_accum}")
            m = layout.microbatches
            if (cfg.batch_size // dp) % m:
                raise LayoutError("microbatches", f"the {cfg.batch_size // dp} rows per data-parallel replica "
                                  f"(batch_size {cfg.batch_size} / dp {dp}) do not split into {m} micro-batches")
            try:
                check_shape(cfg.schedule, cfg.pp, m, layout.chunks)
            except ValueError as err:
                raise LayoutError("schedule", str(err)) from None
        if cfg.batch_size % (dp * cfg.grad_accum):
            raise LayoutError("batch_size", f"the global batch {cfg.batch_size} does not divide into dp={dp} x "
                              f"grad_accum={cfg.grad_accum} = {dp * cfg.grad_accum} equal micro-batches")
        return layout.with_model(cfg, model_cfg) if model_cfg is not None else layout

    def with_model(self, cfg, model_cfg) -> "Layout":
        """This layout with ``model_cfg``'s stage bounds and recomputed blocks, refusing
        (:class:`LayoutError`) a model it cannot hold (:meth:`check_model`)."""
        self.check_model(cfg, model_cfg)
        return self.of(cfg, self, model_cfg)

    def check_model(self, cfg, model_cfg) -> None:
        """Refuse (:class:`LayoutError`) a model this layout cannot hold: a sequence longer than
        its positions, fewer blocks than pipeline stages, sizes tp does not divide
        (:func:`mpirt.parallel.tensor.check_model_tp`), recomputation it cannot do."""
        from mpirt.core.modeling import attention_core, model_class
        from mpirt.core.recompute import parse_layers
        from mpirt.parallel.tensor.axis import check_model_tp

        if cfg.seq_len > model_cfg.n_positions:
            raise LayoutError("seq_len", f"{cfg.seq_len} exceeds the model's n_positions {model_cfg.n_positions}")
        if self.pp > 1 and model_cfg.n_layer < self.stages:
            raise LayoutError("pp", f"n_layer={model_cfg.n_layer} cannot fill pp x chunks = {self.stages} pipeline "
                              "stages")
        if self.cp > 1 and not attention_core(model_cfg):
            raise LayoutError("cp", f"model_type {model_cfg.model_type!r} has no attention to split a sequence over")
        experts = getattr(model_cfg, "n_expert", 0)
        if self.ep > 1 and not experts:
            raise LayoutError("ep", f"model_type {model_cfg.model_type!r} has no experts to split")
        if self.ep > 1 and experts % self.ep:
            raise LayoutError("ep", f"{self.ep} does not divide the model's n_expert={experts} (each expert-parallel "
                              "rank holds n_expert / ep whole experts)")
        if model_class(model_cfg).routes_per_sequence and (self.cp > 1 or self.sequence_parallel):
            raise LayoutError("cp" if self.cp > 1 else "sequence_parallel",
                              f"model_type {model_cfg.model_type!r} routes each sequence's tokens together (expert "
                              "capacity, load-balancing loss): the layout may not split a sequence")
        try:
            check_model_tp(model_cfg, self.tp, seq_len=cfg.seq_len // self.cp,
                           sequence_parallel=cfg.sequence_parallel)
        except ValueError as err:
            held = f" (seq_len {cfg.seq_len} / cp {self.cp}: the tokens a context-parallel rank holds)" \
                if self.cp > 1 else ""
            raise LayoutError("tp", f"{err}{held}") from None
        if cfg.recompute == "selective" and not attention_core(model_cfg):
            raise LayoutError("recompute", f"model_type {model_cfg.model_type!r} names no attention core for "
                              "selective recomputation; use full")
        beyond = sorted(i for i in parse_layers(cfg.recompute_layers) or () if i >= model_cfg.n_layer)
        if beyond:
            raise LayoutError("recompute_layers", f"block {beyond[0]} does not exist (n_layer={model_cfg.n_layer})")

    # --- the axis sizes, as a mapping ---------------------------------------------------------
    def __getitem__(self, axis: str) -> int:
        if axis not in AXES:
            raise KeyError(axis)
        return getattr(self, axis)

    def __iter__(self):
        return iter(AXES)

    def __len__(self) -> int:
        return len(AXES)

    # --- derived --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """The ranks that hold the same dense parameters, dp x cp: data parallelism's gradient
        sync and ZeRO's shards span them (the grid's ``dp_cp`` communicator)."""
        return self.dp * self.cp

    @property
    def tokens(self) -> int:
        """The tokens of each sequence a rank holds: its ``2 x cp`` chunks' share of ``seq_len``."""
        return self.seq_len // self.cp

    @property
    def probe_tokens(self) -> int:
        """The fewest tokens a probe of the model (a lazy build looking which parameters a part
        uses) may run through a rank: one per tp rank under sequence parallelism, and a cp rank's
        two chunks."""
        return (self.tp if self.sequence_parallel else 1) * (2 if self.cp > 1 else 1)

    @property
    def stages(self) -> int:
        """Pipeline stages: pp x chunks (1 without a pipeline)."""
        return self.pp * self.chunks

    @property
    def pipeline_schedule(self):
        """The built pipeline schedule (:mod:`mpirt.parallel.pipeline.schedules`), None without pp."""
        return _schedule(self.schedule, self.pp, self.microbatches, self.chunks) if self.pp > 1 else None

    @property
    def split_backward(self) -> bool:
        """Whether weight gradients wait for their own W pass (zero-bubble schedules)."""
        return self.pp > 1 and self.pipeline_schedule.split_backward

    def position(self, rank: int) -> dict:
        """``{"dp", "pp", "cp", "tp", "ep"}`` coordinates of world rank ``rank`` (tp innermost, then cp,
        as :class:`mpirt.parallel.grid.Grid`; ep: the place in its ep group, dp rank % ep)."""
        from mpirt.parallel.grid import grid_coords
        coords = dict(zip(AXES, grid_coords(rank, dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp)))
        return {**coords, "ep": coords["dp"] % self.ep}

    def pipeline_rank(self, block: int) -> int:
        """The pp rank that holds global block ``block`` (resolved with a model: :attr:`bounds`)."""
        stage = next(s for s, (lo, hi) in enumerate(self.bounds) if lo <= block < hi)
        return stage % self.pp

    def stage_rank(self, rank: int) -> int:
        """The world rank at dp 0, cp 0, tp 0 of ``rank``'s pipeline stage."""
        return self.position(rank)["pp"] * self.cp * self.tp

    def describe(self) -> str:
        """``dp 2 x pp 2 x tp 2`` plus the ZeRO stage, the schedule, micro-batches and sequence
        parallelism."""
        out = f"dp {self.dp} x pp {self.pp} x " + (f"cp {self.cp} x " if self.cp > 1 else "") + f"tp {self.tp}"
        if self.ep > 1:
            out += f", experts over ep {self.ep}"
        if self.zero:
            out += f", ZeRO-{self.zero}"
        if self.pp > 1:
            out += f", {self.schedule} schedule, {self.microbatches} micro-batches"
        if self.sequence_parallel:
            out += ", sequence parallel"
        return out
