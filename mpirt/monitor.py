"""Run monitoring: step timing, throughput, MFU, a progress line on rank 0, per-rank JSONL metrics."""
from __future__ import annotations

import json
import math
import resource
import statistics
import sys
import time
from pathlib import Path

import mpirt.backend as B


def measure_peak_flops(dtype: str = "float32", n: int = 2048, seconds: float = 0.5) -> float:
    """FLOP/s of one large square GEMM on this device: the practical peak MFU is measured against.

    On CPUs the vendor peak is rarely known or reachable, so mpirt reports MFU relative to what the
    BLAS library achieves on an n x n x n product: the fastest of the products run in ``seconds``
    (the best one is the least disturbed by other processes).
    """
    a = B.xp.ones((n, n), dtype=dtype)
    c = a @ a  # warm-up: threads started, pages touched
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < seconds or best == math.inf:
        t0 = time.perf_counter()
        c = a @ a
        B.synchronize()
        best = min(best, time.perf_counter() - t0)
    del c
    return 2.0 * n ** 3 / best


def format_seconds(seconds: float) -> str:
    """``75.2`` -> ``1m15s``; ``4000`` -> ``1h06m``; under a minute with one decimal."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


class Progress:
    """A one-line progress display: redrawn in place on a terminal, a line per update otherwise
    (a log file never gets control characters). Shows the elapsed time of this run and the time
    left at its pace so far to ``total`` (or to ``end`` when this job ends earlier)."""

    def __init__(self, total: int, start: int = 0, stream=sys.stderr, enabled: bool = True, end: int | None = None):
        self.total, self.start, self.done, self.stream, self.enabled = total, start, start, stream, enabled
        self.end = total if end is None else end
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, **fields) -> None:
        """Show ``step`` of ``total`` with ``fields`` (name -> number or text)."""
        if not self.enabled:
            return
        self.done = step
        width = 24
        filled = int(width * step / max(self.total, 1))
        elapsed = time.perf_counter() - self.t0
        left = elapsed / (step - self.start) * (self.end - step) if step > self.start else math.inf
        parts = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} {parts} "
                f"| {format_seconds(elapsed)} elapsed, {format_seconds(left)} left")
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _json_or_none(line: str):
    """A metrics line, or None for one cut short when a job was killed mid-write."""
    try:
        return json.loads(line)
    except ValueError:
        return None


class Metrics:
    """Per-step records: kept in memory for the summary and written to ``path`` as JSON lines.

    A fresh run (``resume_step`` None) starts the file empty. A resumed run keeps the records up to
    ``resume_step`` (the checkpoint's step) and drops the later ones, which the resumed run is
    about to redo: the file then holds each step once, as an uninterrupted run's would."""

    def __init__(self, path: str | Path | None, resume_step: int | None = None):
        self.records: list[dict] = []
        self.file = None
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and path.exists():
                self.records = [r for r in map(_json_or_none, path.read_text().splitlines())
                                if r is not None and r.get("step", 0) <= resume_step]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            tmp.replace(path)
            self.file = open(path, "a", buffering=1)

    def log(self, **record) -> None:
        self.records.append(record)
        if self.file:
            self.file.write(json.dumps(record) + "\n")

    def median(self, key: str, skip_first: int = 1) -> float:
        """Median of ``key`` over the records, skipping warm-up steps when there are enough."""
        values = [r[key] for r in self.records if key in r]
        if len(values) > skip_first:
            values = values[skip_first:]
        return statistics.median(values) if values else math.nan

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
