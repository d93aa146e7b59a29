"""Which checkpoint versions are good: saved before the training loss left its recent range.

A run that diverges can keep saving finite versions (a loss of 1e18 is finite) before its loss
becomes NaN; "the last checkpoint" is then a diverged one that every resume replays. The training
loop feeds each step's loss to a :class:`LossRange`; each version's metadata keeps its loss,
gradient norm and whether that loss was in range (``extra.good``), and the largest master weight
(:func:`mpirt.checkpoint.sharded.save_sharded`; under float16 a master beyond the format's range
would be infinite in the model, so such a version is never good). A version saved at step ``s``
is good when its own record says so and, where this run saw it, the loss of step ``s + 1`` (the
first computed from its weights) was in range too.
"""
from __future__ import annotations

import math
from collections import deque
from pathlib import Path

import numpy as np

from mpirt.checkpoint.store import CheckpointError, read_checkpoint_meta, version_dirs

WINDOW = 20       # in-range losses the range is taken over
MIN_SEEN = 5      # losses needed before a finite loss can be out of range


class LossRange:
    """The recent range of the training loss: the last :data:`WINDOW` in-range losses. A loss is
    out of range when not finite, or (once :data:`MIN_SEEN` were seen) above the highest of them
    by more than their spread (at least a tenth of the highest): noise stays in, a divergence
    (a loss that jumps from 5 to 1e18, or climbs steadily) leaves. Out-of-range losses do not
    widen the range, so it stays the one from before the divergence."""

    def __init__(self):
        self.recent: deque = deque(maxlen=WINDOW)
        self.out: list[list[int]] = []      # out-of-range steps as [first, last] runs

    @classmethod
    def seeded(cls, records) -> "LossRange":
        """A range that has seen ``records`` (metrics records with ``step`` and ``loss``): a
        resumed run judges its first steps against the losses before the resume."""
        seen = cls()
        for r in records:
            loss = r.get("loss")
            seen.observe(int(r["step"]), float("nan") if loss is None else float(loss))
        return seen

    def bounds(self) -> tuple[float, float] | None:
        """``(lowest, highest)`` of the recent in-range losses, None before any."""
        return (min(self.recent), max(self.recent)) if self.recent else None

    def in_range(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return False
        if len(self.recent) < MIN_SEEN:
            return True
        lo, hi = self.bounds()
        return loss <= hi + max(hi - lo, 0.1 * abs(hi))

    def observe(self, step: int, loss: float) -> bool:
        """Record step ``step``'s loss; returns whether it was in range."""
        ok = self.in_range(loss)
        if ok:
            self.recent.append(loss)
        elif self.out and self.out[-1][1] == step - 1:
            self.out[-1][1] = step
        else:
            self.out.append([step, step])
        return ok

    def left_at(self, step: int) -> bool:
        """Whether the loss of ``step`` was out of range (as far as this run saw)."""
        return any(first <= step <= last for first, last in self.out)

    def describe(self) -> str:
        """Where the loss left its range, in words (empty when it never did)."""
        if not self.out:
            return ""
        lo, hi = self.bounds() or (math.nan, math.nan)
        return f"the loss left its recent range {lo:.4g}..{hi:.4g} at step {self.out[0][0]}"


def version_good(meta: dict, seen: LossRange | None = None, dtype: str | None = None) -> bool:
    """Whether a version (its meta.json) is good: its own record (``extra.good``; older versions
    without one count as good), its largest master weight within ``dtype``'s range, and, when
    ``seen`` saw the next step, that step's loss in range."""
    extra = meta.get("extra") or {}
    if extra.get("good") is False:
        return False
    largest = extra.get("params_max_abs")
    if dtype is not None and largest is not None and np.dtype(dtype).kind == "f" and \
            largest > float(np.finfo(np.dtype(dtype)).max):
        return False
    return seen is None or not seen.left_at(int(meta["step"]) + 1)


def last_good_version(ckpt, seen: LossRange | None = None, dtype: str | None = None) -> Path | None:
    """The newest good version under ``ckpt`` (a checkpoint root), or None."""
    root = Path(ckpt)
    for path in reversed(version_dirs(root) if root.is_dir() else []):
        try:
            meta = read_checkpoint_meta(path)
        except (CheckpointError, OSError):
            continue
        if version_good(meta, seen, dtype):
            return path
    return None


def resume_advice(ckpt, seen: LossRange | None = None, dtype: str | None = None) -> str:
    """What the stop message says of the good checkpoint: its step and the exact flag that
    resumes from it."""
    good = last_good_version(ckpt, seen, dtype)
    if good is None:
        return "no good checkpoint was written" if Path(ckpt, "latest").exists() else "no checkpoint was written"
    step = read_checkpoint_meta(good)["step"]
    return f"the last good checkpoint is step {step}: resume from it with --init-from {good}"
