"""The registry of communication calls: :class:`CommStats` and the process-wide :data:`stats`.

Pure Python (no mpi4py), so the monitor and tests can read it without MPI.
"""
from __future__ import annotations

import threading
import time
from typing import NamedTuple


class CommRecord(NamedTuple):
    op: str
    axis: str
    nbytes: int
    seconds: float
    engine: str
    end: float       # perf_counter at completion (the monitor's trace places the call by it)
    blocked: float   # seconds the calling thread waited in it: all of a blocking call's, a
                     # non-blocking call's time in ``wait()``, 0 when ``test()`` found it done
    dtype: object = None  # the array's dtype (None for objects and barriers)


class CommStats:
    """Every communication call: op, axis, bytes, seconds, engine, dtype.

    ``records`` is a list of :class:`CommRecord`, newest last, bounded to ``max_records`` (when
    full, the oldest records go, down to half); ``summary()`` totals are never dropped. Set
    ``enabled = False`` to record nothing. Bytes follow
    nccl-tests: the array size for allreduce/broadcast/send/recv, the full input for
    reduce_scatter, the full output for allgather. Seconds are wall time inside the call; for
    non-blocking calls, from the post to the completion seen by ``test()``/``wait()``; for NCCL,
    the launch only (the stream is not synchronized). ``cursor()`` and ``since(cursor)`` give the
    records added after a point (the monitor's per-step window), trimming included.
    """

    def __init__(self, max_records: int = 20_000):
        self.max_records = max_records
        self.enabled = True
        self.records: list[CommRecord] = []
        self._totals: dict[tuple[str, str], list] = {}
        self._folded = 0  # records[:_folded] are already counted in _totals
        self._dropped = 0  # records trimmed so far: a cursor is an index into all records ever added
        self._lock = threading.Lock()

    def add(self, op: str, axis: str, nbytes: int, seconds: float, engine: str = "host",
            blocked: float | None = None, dtype=None) -> None:
        """Record one call that just completed (lock-free: a list append is atomic; totals are
        folded in on read). ``blocked`` defaults to ``seconds`` (a blocking call)."""
        if self.enabled:
            self.records.append(_new_tuple(CommRecord, (op, axis, nbytes, seconds, engine, _clock(),
                                                         seconds if blocked is None else blocked, dtype)))
            if len(self.records) > self.max_records:
                self._trim()

    def _fold(self) -> None:
        end = len(self.records)
        for op, axis, nbytes, seconds, *_ in self.records[self._folded:end]:
            t = self._totals.get((op, axis))
            if t is None:
                self._totals[(op, axis)] = [1, nbytes, seconds]
            else:
                t[0] += 1
                t[1] += nbytes
                t[2] += seconds
        self._folded = end

    def _trim(self) -> None:
        with self._lock:
            self._fold()
            k = min(len(self.records) - self.max_records // 2, self._folded)
            if k > 0:
                del self.records[:k]
                self._folded -= k
                self._dropped += k

    def cursor(self) -> int:
        """A position after every record so far (for :meth:`since`)."""
        return self._dropped + len(self.records)

    def since(self, cursor: int) -> list[CommRecord]:
        """The records added after :meth:`cursor` returned ``cursor`` (those trimmed meanwhile
        are gone: keep windows shorter than ``max_records / 2`` calls)."""
        return self.records[max(0, cursor - self._dropped):]

    def summary(self) -> dict[tuple[str, str], dict]:
        """``{(op, axis): {"calls": int, "bytes": int, "seconds": float}}`` since the last reset."""
        with self._lock:
            self._fold()
            return {k: {"calls": c, "bytes": b, "seconds": s} for k, (c, b, s) in self._totals.items()}

    def calls(self, op: str | None = None, axis: str | None = None) -> int:
        """Number of calls, optionally only of one op and/or one axis."""
        return sum(v["calls"] for (o, a), v in self.summary().items()
                   if (op is None or o == op) and (axis is None or a == axis))

    def reset(self) -> None:
        with self._lock:
            self._dropped += len(self.records)
            self.records.clear()
            self._totals.clear()
            self._folded = 0


_new_tuple = tuple.__new__  # builds a CommRecord 3x faster than its constructor
_clock = time.perf_counter
stats = CommStats()
