"""The run's layout as data: :class:`Layout`, resolved once from the training config and the
dp/pp/tp sizes, with every value derived from them (pure: no communication, nothing built).

What used to be derived again wherever it was needed (the engine, the pipeline stage, the memory
predictor, the planner's estimate, the monitor, the start-up banner) reads it from here:
effective sequence parallelism, the micro-batches per step and their rows, the interleaved
schedule's chunks, the pipeline's stages, whether the backward is split, each rank's grid
coordinates. A ``Layout`` is also a read-only mapping of the axis sizes (``layout["pp"]``), the
form the predictor and the summaries took before it existed.

The layout's refusals still live beside the code they protect (``train.plan_layout``,
``config``, ``grid``, ``parallel.tensor.layout``, ``schedules``, ``partition``,
``engine.zero_refusal``); gathering them here is the next step.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

AXES = ("dp", "pp", "tp")


@functools.lru_cache(maxsize=64)
def _schedule(name: str, pp: int, microbatches: int, chunks: int):
    from mpirt.parallel.schedules import build
    return build(name, pp, microbatches, chunks)


@dataclass(frozen=True)
class Layout(Mapping):
    """dp x pp x tp and what follows from them and the config (see the module docstring).

    ``microbatches``: per step and dp replica, the pipeline schedule's under pp, else
    ``grad_accum``; ``rows``: batch rows per micro-batch; ``chunks``: model chunks per pipeline
    rank (the interleaved schedule's virtual stages; 1 otherwise)."""

    dp: int
    pp: int
    tp: int
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 1
    chunks: int = 1
    rows: int = 1

    @classmethod
    def of(cls, cfg, sizes) -> "Layout":
        """The layout of training config ``cfg`` on ``sizes`` (a mapping with dp, pp and tp)."""
        if isinstance(sizes, Layout):
            return sizes
        dp, pp, tp = (int(sizes[k]) for k in AXES)
        m = (cfg.microbatches or pp) if pp > 1 else cfg.grad_accum
        return cls(dp=dp, pp=pp, tp=tp, zero=cfg.zero, sequence_parallel=bool(cfg.sequence_parallel and tp > 1),
                   schedule=cfg.schedule, microbatches=m,
                   chunks=cfg.chunks if pp > 1 and cfg.schedule == "interleaved" else 1,
                   rows=cfg.batch_size // dp // m)

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
        return self.dp * self.pp * self.tp

    @property
    def stages(self) -> int:
        """Pipeline stages: pp x chunks (1 without a pipeline)."""
        return self.pp * self.chunks

    @property
    def pipeline_schedule(self):
        """The built pipeline schedule (:mod:`mpirt.parallel.schedules`), None without pp."""
        return _schedule(self.schedule, self.pp, self.microbatches, self.chunks) if self.pp > 1 else None

    @property
    def split_backward(self) -> bool:
        """Whether weight gradients wait for their own W pass (zero-bubble schedules)."""
        return self.pp > 1 and self.pipeline_schedule.split_backward

    def position(self, rank: int) -> dict:
        """``{"dp", "pp", "tp"}`` coordinates of world rank ``rank`` (tp innermost, as
        :class:`mpirt.grid.Grid`)."""
        return {"dp": rank // (self.pp * self.tp), "pp": rank // self.tp % self.pp, "tp": rank % self.tp}

    def stage_rank(self, rank: int) -> int:
        """The world rank at dp 0, tp 0 of ``rank``'s pipeline stage."""
        return self.position(rank)["pp"] * self.tp

    def describe(self) -> str:
        """``dp 2 x pp 2 x tp 2`` plus the ZeRO stage, the schedule, micro-batches and sequence
        parallelism."""
        out = f"dp {self.dp} x pp {self.pp} x tp {self.tp}"
        if self.zero:
            out += f", ZeRO-{self.zero}"
        if self.pp > 1:
            out += f", {self.schedule} schedule, {self.microbatches} micro-batches"
        if self.sequence_parallel:
            out += ", sequence parallel"
        return out
