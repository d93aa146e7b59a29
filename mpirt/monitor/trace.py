"""A Chrome / Perfetto trace of a few training steps: every rank's compute and communication on
one timeline (open ``OUT_DIR/trace.json`` in https://ui.perfetto.dev or chrome://tracing).

One process row per rank (named with its dp/pp/tp coordinates), with threads:

- ``compute``: the step's parts (data, forward, backward, weight_grad, grad_sync, optimizer; a
  pipeline rank's F/B/W per micro-batch and its ``bubble`` waits);
- ``MPI blocked``: every call this rank waited in (op, axis, bytes, and the wait);
- ``in flight <axis>``: non-blocking calls from post to completion (dp buckets overlapping the
  backward, pipeline sends and receives), on as many lanes as overlap;
- ``GPU``: NVML samples as counters (utilisation, memory-controller utilisation), on GPUs.

Times are microseconds from a common origin: each rank's ``perf_counter`` when it left the
barrier before the first step, so ranks line up to the barrier's skew. Each rank writes its part
(:meth:`TraceRecorder.write`), and world rank 0 joins them (:func:`merge`).
"""
from __future__ import annotations

import json
from pathlib import Path


class TraceRecorder:
    """Spans of the steps ``first .. first + steps - 1`` (counted from 1) of one rank."""

    def __init__(self, rank: int, label: str, origin: float, first: int, steps: int):
        self.rank, self.label, self.origin = rank, label, origin
        self.first, self.last = first, first + steps - 1
        self.recording = False
        self.events: list[dict] = []
        self.tids = {"compute": 0, "MPI blocked": 1}  # thread name -> the integer id traces need

    def select(self, step: int) -> None:
        """Record step ``step`` if it is in the window."""
        self.recording = self.first <= step <= self.last

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def _span(self, name: str, tid: str, t0: float, t1: float, args: dict | None = None) -> None:
        tid = self.tids.setdefault(tid, len(self.tids))
        ev = {"name": name, "ph": "X", "pid": self.rank, "tid": tid, "ts": self._us(t0),
              "dur": round(max(t1 - t0, 0.0) * 1e6, 3)}
        if args:
            ev["args"] = args
        self.events.append(ev)

    def add_step(self, step: int, spans, records) -> None:
        """The compute ``spans`` ((name, start, end), perf_counter) and comm ``records``
        (:class:`mpirt.comm.CommRecord`) of step ``step``."""
        for name, t0, t1 in spans:
            self._span(name, "compute", t0, t1, {"step": step})
        lanes: dict = {}
        for r in sorted(records, key=lambda r: r.end - r.seconds):
            t0 = r.end - r.seconds
            args = {"axis": r.axis, "bytes": r.nbytes, "blocked_us": round(r.blocked * 1e6, 1), "step": step}
            if r.blocked > 0:
                self._span(f"{r.op} {r.axis}", "MPI blocked", r.end - r.blocked, r.end, args)
            if r.seconds > r.blocked:  # a non-blocking call: its life from post to completion
                ends = lanes.setdefault(r.axis, [])
                lane = next((i for i, e in enumerate(ends) if e <= t0), len(ends))
                if lane == len(ends):
                    ends.append(0.0)
                ends[lane] = r.end
                tid = f"in flight {r.axis}" + (f" {lane + 1}" if lane else "")
                self._span(f"{r.op} {r.axis}", tid, t0, r.end, args)

    def add_counter(self, t: float, name: str, values: dict) -> None:
        """A counter sample (e.g. GPU utilisation) at perf_counter time ``t``."""
        self.events.append({"name": name, "ph": "C", "pid": self.rank, "ts": self._us(t), "args": values})

    def write(self, path: Path) -> None:
        """This rank's events, with the names of its process row and threads."""
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": self.label}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}}]
        for name, tid in self.tids.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid,
                         "args": {"sort_index": tid}})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta + self.events))


def merge(parts: list[Path], out: Path, metadata: dict | None = None) -> int:
    """Join the ranks' ``parts`` into one trace file ``out`` (``{"traceEvents": [...]}``); the
    parts are removed. Returns the number of events."""
    events = []
    for p in parts:
        events += json.loads(p.read_text())
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}}))
    tmp.replace(out)
    for p in parts:
        p.unlink()
    return len(events)
