"""The two sides of a verification: a layout built on a group of ranks, stepped like training, its
weights snapshotted after every step as a parameters-only sharded checkpoint.

A side is a :class:`~mpirt.run.config.TrainConfig` whose layout keys (dp, tp, pp, cp, ep, ZeRO,
sequence parallelism, schedule, micro-batches, chunks) name the layout, resolved with the model
(:class:`~mpirt.parallel.layout.Layout`) and run by :class:`~mpirt.parallel.engine.Engine` on the
first ``layout.world_size`` ranks of the launch: the training script's own parts, so what is
verified is what trains.
"""
from __future__ import annotations

import dataclasses
import math
import shlex
from pathlib import Path

import numpy as np

from mpirt.checkpoint.sharded import save_sharded
from mpirt.comm import stats
from mpirt.core.optim import cosine_lr
from mpirt.core.settings import ConfigError, convert_value, field_types
from mpirt.data.tokens import get_batch
from mpirt.monitor.live import expert_figures
from mpirt.parallel.engine import Engine, Hyper
from mpirt.parallel.grid import Grid
from mpirt.parallel.layout import Layout, LayoutError, pipeline_microbatches
from mpirt.plan.budget import check_budget
from mpirt.plan.memory import recompute_where_it_pays
from mpirt.run.config import TrainConfig
from mpirt.run.distributed import derive_seed
from mpirt.verify.traffic import differences

# the keys a layout string (--reference, --against) may name; what it leaves out is 1, 0 or off
LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero", "sequence_parallel", "schedule", "microbatches", "chunks")
SINGLE_RANK = dict(dp=1, tp=1, pp=1, cp=1, ep=1, zero=0, sequence_parallel=False, microbatches=0)
_TYPES = field_types(TrainConfig)


def layout_config(cfg: TrainConfig, text: str, flag: str) -> TrainConfig:
    """``cfg`` on the layout ``text`` names (``"dp=1 tp=2"``, commas or spaces between the keys of
    :data:`LAYOUT_KEYS`), every axis it does not name 1 and ZeRO off; ConfigError naming ``flag``."""
    values = dict(SINGLE_RANK)
    for word in shlex.split(text.replace(",", " ")):
        key, eq, value = word.partition("=")
        key = key.strip("-").replace("-", "_")
        if key not in LAYOUT_KEYS or not eq:
            raise ConfigError(f"{flag}: {word!r} is not KEY=VALUE with KEY one of {', '.join(LAYOUT_KEYS)}")
        values[key] = convert_value(f"{flag} {key}", value, _TYPES[key], text=True)
    out = dataclasses.replace(cfg, **values)
    try:
        out.validate()
    except ConfigError as err:
        raise ConfigError(f"{flag}: {err}") from None
    return out


def check_axes(cfg: TrainConfig, world_size: int, what: str) -> None:
    """Refuse axes that cannot make a layout of ``world_size`` ranks before any size is derived
    from them (ConfigError starting with ``what``); the batch rules wait for :func:`resolve`."""
    try:
        Layout.resolve(cfg, world_size, batch_rules=False)
    except LayoutError as err:
        raise ConfigError(f"{what}: {err}") from None


def resolve(cfg: TrainConfig, model_cfg, world_size: int, what: str) -> Layout:
    """The layout of ``cfg`` on ``world_size`` ranks, resolved with the model and checked as the
    training script checks it (the budget too, when ``--memory-budget`` is given); ConfigError
    starting with ``what`` (e.g. "reference tp=2")."""
    try:
        layout = recompute_where_it_pays(cfg, model_cfg, Layout.resolve(cfg, world_size, model_cfg))
        check_budget(cfg, model_cfg, layout, world_size)
    except (LayoutError, ValueError) as err:
        raise ConfigError(f"{what}: {err}") from None
    return layout


def microbatches(cfg: TrainConfig) -> int:
    """Micro-batches per step and dp replica: the pipeline's, else ``grad_accum``."""
    return pipeline_microbatches(cfg.microbatches, cfg.pp) if cfg.pp > 1 else cfg.grad_accum


def dp_size(cfg: TrainConfig, world_size: int) -> int:
    return cfg.dp or world_size // (cfg.pp * cfg.cp * cfg.tp)


def short_shape(sides: list[tuple[TrainConfig, int]], seq_len: int | None, batch_size: int | None,
                n_positions: int) -> tuple[int, int]:
    """``(seq_len, batch_size)`` every side (``(cfg, world size)``) can run: the given ones, else the
    shortest sequence of at least 16 tokens that cp's 2 x cp chunks (and sequence parallelism's tp
    pieces of them) cut evenly, and the smallest batch of at least 4 rows that every side's dp x
    micro-batches divide."""
    if seq_len is None:
        unit = math.lcm(*(2 * c.cp * (c.tp if c.sequence_parallel else 1) if c.cp > 1 else
                          (c.tp if c.sequence_parallel else 1) for c, _ in sides))
        seq_len = min(unit * -(-16 // unit), max(unit, n_positions // unit * unit))
    if batch_size is None:
        unit = math.lcm(*(dp_size(c, n) * microbatches(c) for c, n in sides))
        batch_size = unit * -(-4 // unit)
    return seq_len, batch_size


class ParamsOnly:
    """A :class:`~mpirt.checkpoint.sharded.ShardWriter` seen through: only the weights' boxes go in
    (a snapshot to compare needs no optimizer state)."""

    def __init__(self, writer):
        self.writer = writer

    def add(self, kind, *args) -> None:
        if kind == "params":
            self.writer.add(kind, *args)


def routing(engine, grid) -> list[int] | None:
    """Tokens routed to each expert in the step, summed over the model's MoE layers and over the
    ranks that hold different tokens or layers (tp ranks repeat the router: counted once); None
    without experts. Collective over the side's ranks."""
    routers = [m for _, m in engine.model.named_modules() if "tokens_per_expert" in getattr(m, "stats_keys", ())]
    counts = expert_figures(routers).get("moe_tokens_per_expert")
    if counts is None:
        return None
    mine = np.array(counts, np.int64) * (grid.coords["tp"] == 0)
    return [int(v) for v in grid.comm["world"].allreduce(mine)]


def run_side(cfg: TrainConfig, model_cfg, layout: Layout, comm, tokens, snapshots: Path, *, first_step: int,
             steps: int, lr=None, reader=None, loss_scale: float = 1.0) -> list[dict]:
    """Train ``steps`` steps of ``cfg`` on ``layout`` over ``comm`` (its ranks), from the seeded
    initial weights, or from checkpoint ``reader`` (weights and optimizer state), starting at the
    0-based ``first_step``: each step's batch comes from ``tokens`` as training draws it
    (:func:`mpirt.data.tokens.get_batch`), its dropout masks are training's, its learning rate is
    ``lr`` (None: the run's cosine schedule). After each step the weights go to ``snapshots``
    (one checkpoint version per step). Returns per step ``{"step", "loss", "grad_norm",
    "tokens_per_expert" (routed, when the layout runs one micro-batch per step; else None),
    "communication" (the first step: what its calls differ in from what its layout predicts,
    :func:`mpirt.verify.traffic.differences`, every rank's, "rank R: ..."; else None),
    "snapshot"}`` on every rank of ``comm``."""
    grid = Grid(**layout, comm=comm)
    engine = Engine(layout, model_cfg, grid, Hyper.of(cfg), dropout_seed=derive_seed(cfg.seed, 0, "dropout"))
    if reader is not None:
        engine.load_sharded(reader, with_optimizer=True)
    records = []
    try:
        for step in range(first_step, first_step + steps):
            engine.optimizer.lr = lr if lr is not None else cosine_lr(
                step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=min(cfg.warmup_steps, cfg.steps), total_steps=cfg.steps)
            x, y = get_batch(tokens, step, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                             dp_rank=grid.coords["dp"], dp_size=grid.sizes["dp"])
            cursor = stats.cursor()
            loss = engine.train_step(x, y, loss_scale=loss_scale, step=step + 1)
            norm = engine.clip((cfg.grad_clip if cfg.grad_clip > 0 else math.inf) * loss_scale) / loss_scale
            engine.optimizer.grad_scale = 1.0 / loss_scale
            engine.optimizer.step()
            traffic = None
            if step == first_step:   # the whole step's calls against the program its layout predicts
                mine = differences(layout, model_cfg, cfg.dtype, comm.rank, cursor, engine)
                traffic = [f"rank {r}: {d}" for r, found in enumerate(comm.allgather_object(mine)) for d in found]
            routed = routing(engine, grid) if layout.microbatches == 1 else None
            path = save_sharded(snapshots, comm, lambda w: engine.save_sharded(ParamsOnly(w)), step=step + 1,
                                config=cfg.to_dict(), extra={"layout": dict(grid.sizes)}, optimizer=None,
                                keep=steps + 1)
            records.append({"step": step + 1, "loss": loss, "grad_norm": norm, "tokens_per_expert": routed,
                            "communication": traffic, "snapshot": None if path is None else str(path)})
    finally:
        engine.close()
        grid.free()
    return records
