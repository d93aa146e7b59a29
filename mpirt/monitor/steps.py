"""Where a training step's time goes, on every rank, and which rank holds the others up.

:class:`StepMonitor` brackets one step (``begin``, ``mark`` after each part the training loop
runs, ``end`` with the engine's own timers) and returns flat per-step figures for the metrics:

- parts, seconds, that add up to the step: ``data_s``, ``forward_s``, ``backward_s``,
  ``weight_grad_s`` (zero-bubble pipelines), ``bubble_s`` (a pipeline rank idle inside its
  schedule: waiting for a neighbour), ``grad_sync_s`` (after backward: the dp gradient wait, the
  tied-weight and sequence-parallel sums, the loss), ``optimizer_s`` (clip and update),
  ``injected_s`` (a test's slowdown, :mod:`mpirt.run.faults`) and ``other_s`` (the rest: unmeasured);
- communication from the registry (:data:`mpirt.comm.stats`, the calls completed inside the
  step), per axis: ``comm_<axis>_bytes``, ``comm_<axis>_s`` (in flight: a non-blocking call
  from its post to its completion) and ``comm_<axis>_wait_s`` (this rank blocked in it);
  ``dp_exposed_s`` / ``dp_hidden_s``: the gradient sync's blocked time and its in-flight time that
  overlapped compute (dp, or dp x cp, and the experts' over edp);
- ``mpi_wait_s`` (all blocked time), ``compute_s`` = step - ``mpi_wait_s`` (what the rank did
  itself: a slow rank has more of it, the ranks waiting for it more ``mpi_wait_s``), ``comm_s``
  (blocked time but the pipeline's p2p waits inside its schedule, which are the bubble): a step
  is ``comm_s + bubble_s`` and the rest, the live view's shares;
- memory: ``memory_bytes`` (host memory the rank owns, :func:`owned_bytes`), ``gpu_pool_bytes``
  (CuPy's pool, on GPUs).

:func:`aggregate` (collective, every logging interval) gives rank 0 min/median/max of each
figure over the ranks and names the slowest rank by compute time.

Cost: a few ``perf_counter`` calls per part, one pass over the step's comm records and a read of
``/proc/self/status`` per step; ``bench/monitor.py`` measures it against a run without it.
"""
from __future__ import annotations

import resource
import statistics
import time

import numpy as np

import mpirt.core.backend as B
from mpirt.comm import stats as comm_stats
from mpirt.parallel.pipeline.schedules import BACKWARD, FORWARD, WEIGHT

PARTS = ("data", "forward", "backward", "weight_grad", "bubble", "grad_sync", "optimizer", "injected", "other")
# the per-rank figures rank 0 gathers every interval (means over the interval's steps)
FIGURES = ("step_time_s", "compute_s", "mpi_wait_s", "comm_s", "bubble_s", "forward_s", "backward_s",
           "weight_grad_s", "grad_sync_s", "optimizer_s", "memory_bytes")


def owned_bytes(peak: bool = False) -> int:
    """The memory this process owns: its resident set less its file-backed pages (the code of
    Python, NumPy, MPI and the kernels, shared with every process that maps those files and
    reclaimable by the kernel), i.e. heap, arrays, stacks and MPI's shared segments. ``peak``:
    the high-water mark (VmHWM less RssFile now: the file pages are mapped at start-up and stay,
    so the difference is the peak of the rest; file pages mapped only around the peak, such as a
    checkpoint being read, or reclaimed since, make it read high, code mapped after it low).
    Where /proc/self/status is missing: the peak resident set (``ru_maxrss``) with ``peak``, else 0."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssFile"):
                    fields[key] = int(value.split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    if len(fields) < 3:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if peak else 0
    return fields["VmHWM" if peak else "VmRSS"] - fields["RssFile"]


class StepMonitor:
    """Per-step breakdown of one rank (see the module docstring). ``trace``: a
    :class:`mpirt.monitor.trace.TraceRecorder` that gets this step's spans while it is recording."""

    def __init__(self, trace=None):
        self.trace = trace
        self.marks: list = []
        self.cursor = 0
        self.peak_stash_bytes = 0  # the largest activation stash a pipeline step held

    def begin(self, step: int) -> None:
        """Start step ``step`` (counted from 1)."""
        self.step = step
        if self.trace is not None:
            self.trace.select(step)
        self.cursor = comm_stats.cursor()
        self.marks = [("begin", time.perf_counter())]

    def mark(self, part: str) -> None:
        """The time since the previous mark was spent in ``part``."""
        self.marks.append((part, time.perf_counter()))

    def end(self, engine_stats: dict) -> dict:
        """The step's figures; ``engine_stats``: the engine's ``stats`` after its ``train_step`` (the
        local part's timers, :mod:`mpirt.parallel.whole`). The last mark ends the step."""
        marks, t_end = self.marks, self.marks[-1][1]
        step_s = t_end - marks[0][1]
        out = dict.fromkeys((p + "_s" for p in PARTS), 0.0)
        spans = []  # (name, t0, t1) on the compute row of the trace
        window = None  # the local part's (start, end): a pipeline's waits inside it are its bubble
        for (_, t0), (part, t1) in zip(marks, marks[1:]):
            if part == "train_step":
                inner, window = self._engine_parts(engine_stats, t0, t1, spans)
                for k, v in inner.items():
                    out[k + "_s"] += v
                out["other_s"] += max(0.0, (t1 - t0) - sum(inner.values()))
            else:
                out[part + "_s"] += t1 - t0
                spans.append((part, t0, t1))
        axes: dict = {}
        wait = outside = 0.0
        records = comm_stats.since(self.cursor)
        for r in records:
            a = axes.get(r.axis)
            if a is None:
                a = axes[r.axis] = [0, 0.0, 0.0]
            a[0] += r.nbytes
            a[1] += r.seconds
            a[2] += r.blocked
            wait += r.blocked
            if not (window and r.axis == "pp" and window[0] <= r.end <= window[1]):
                outside += r.blocked  # the pipeline's own waits inside its schedule are the bubble
        for axis, (nbytes, seconds, blocked) in axes.items():
            out[f"comm_{axis}_bytes"], out[f"comm_{axis}_s"], out[f"comm_{axis}_wait_s"] = nbytes, seconds, blocked
        # the gradient sync: over dp (dp x cp under cp), and the experts' over edp under ep
        sync = [a for a in (axes.get("dp") or axes.get("dp_cp"), axes.get("edp")) if a]
        out["dp_exposed_s"] = sum(a[2] for a in sync)
        out["dp_hidden_s"] = sum(max(0.0, a[1] - a[2]) for a in sync)
        out.update(mpi_wait_s=wait, compute_s=max(0.0, step_s - wait), comm_s=outside, memory_bytes=owned_bytes())
        if B.name == "cupy":
            out["gpu_pool_bytes"] = B.pool_bytes()[0]
        if self.trace is not None and self.trace.recording:
            self.trace.add_step(self.step, spans, records)
        return out

    def _engine_parts(self, st: dict, t0: float, t1: float, spans: list) -> tuple[dict, tuple | None]:
        """(seconds per part inside ``train_step``, the local part's (start, end)); ``st``: the
        engine's stats (one format for a pipeline stage and the whole model, :mod:`mpirt.parallel.whole`)."""
        op, start = st["op_s"], st["t0"]
        self.peak_stash_bytes = max(self.peak_stash_bytes, st.get("peak_stash_bytes", 0))
        parts = {"forward": op.get(FORWARD, 0.0), "backward": op.get(BACKWARD, 0.0),
                 "weight_grad": op.get(WEIGHT, 0.0),
                 "bubble": st["idle_s"], "grad_sync": st.get("sync_s", 0.0)}
        names = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight_grad", "wait": "bubble"}
        for a, b, kind, mb, chunk in st.get("trace", ()):
            label = names.get(kind, kind) + (f" mb{mb}" if mb is not None else "") + (f" c{chunk}" if chunk else "")
            spans.append((label, start + a, start + b))
        if "sync_t0" in st:
            spans.append(("grad_sync", st["sync_t0"], st["sync_t0"] + st["sync_s"]))
        return parts, (start, start + st["step_s"])


class Interval:
    """Per-rank means of :data:`FIGURES` over the steps since the last :func:`aggregate`."""

    def __init__(self):
        self.sums = np.zeros(len(FIGURES))
        self.steps = 0

    def add(self, record: dict) -> None:
        self.sums += [record.get(k, 0.0) for k in FIGURES]
        self.steps += 1

    def take(self) -> np.ndarray:
        means = self.sums / max(self.steps, 1)
        self.sums[:] = 0.0
        self.steps = 0
        return means


def aggregate(interval: Interval, world_comm, per_rank_limit: int = 64) -> dict | None:
    """Collective over the world: every rank's :class:`Interval` means go to every rank (one
    small allgather); returns on rank 0 ``{"ranks": {figure: {min, median, max}}, "slowest_rank",
    "per_rank": {figure: [...]} (up to ``per_rank_limit`` ranks)}``, None elsewhere."""
    mine = interval.take()
    every = world_comm.allgather(mine, counts=[len(FIGURES)] * world_comm.size).reshape(world_comm.size, -1)
    if world_comm.rank != 0:
        return None
    table = {name: every[:, i] for i, name in enumerate(FIGURES)}
    ranks = {name: {"min": float(v.min()), "median": float(statistics.median(v)), "max": float(v.max())}
             for name, v in table.items()}
    compute = table["compute_s"]
    slowest = int(np.argmax(compute))
    out = {"ranks": ranks, "slowest_rank": slowest,
           "slowest_compute_over_median": float(compute[slowest] / max(statistics.median(compute), 1e-12))}
    if world_comm.size <= per_rank_limit:
        out["per_rank"] = {name: [float(x) for x in v] for name, v in table.items()}
    return out
