"""What this process is communicating, for the watchdog: channels, in-flight calls and the ring.

Pure Python (no mpi4py), so the bookkeeping and its text can be tested without MPI.

A :class:`Channel` belongs to one :class:`~mpirt.comm.Comm`: its axis, the world ranks of its
members, a key that names it the same way on every member, the number of collectives started on
it, the call in flight on it and the label that calls started on it get. Each thread uses its own
communicators, so one slot per channel is enough, and a thread writes it without a lock.

A *call* is a plain list (built per MPI call, so it must be cheap) with the fields ``T0`` (start),
``CHAN``, ``OP``, ``NBYTES``, ``PEER`` (the other rank of a point-to-point call in the channel's
numbering, -1 for a collective), ``COUNT`` (the channel's collective count after this call),
``LABEL`` (any object, formatted only when a report is written), ``DONE`` (end time or None),
``SINCE`` (when the caller started waiting on it) and ``POLLED`` (the latest unsuccessful test
of a polled wait, None for a blocking wait) and ``DTYPE`` (the array's dtype, None for objects
and barriers: the registry records it, so a step's calls can be held to the dtypes its layout
names). Every call also goes into :data:`ring`, the last
:data:`RING_SIZE` calls of this process, which :func:`dump` writes out.
"""
from __future__ import annotations

import collections
import itertools
import time
import weakref

T0, CHAN, OP, NBYTES, PEER, COUNT, LABEL, DONE, SINCE, POLLED, DTYPE = range(11)
RING_SIZE = 64
FRESH_S = 1.0  # a polled wait counts as waited on while its latest test is this recent
SENDS = ("send", "isend")

ring: collections.deque = collections.deque(maxlen=RING_SIZE)
_live: dict = {}                                # serial -> weak reference to a live Channel
_serial = itertools.count()
_made: collections.Counter = collections.Counter()  # channels made per (axis, members)


class Channel:
    """The watchdog's view of one communicator (see the module docstring). Its ``key`` numbers
    the channels made with the same axis and members, so communicators made in the same order on
    every member (as collective creation demands) get the same key on each of them."""

    __slots__ = ("axis", "world", "key", "calls", "cur", "label", "__weakref__")

    def __init__(self, axis: str, world: tuple[int, ...]):
        self.axis = axis
        self.world = world      # world rank of each member, indexed by its rank here
        self.key = (axis, world, _made[(axis, world)])
        _made[(axis, world)] += 1
        self.calls = 0          # collectives started (the same sequence on every member)
        self.cur = None         # the call this process is waiting in, or None
        self.label = None       # captured by the calls started on this channel
        serial = next(_serial)
        _live[serial] = weakref.ref(self, lambda _, serial=serial: _live.pop(serial, None))

    def __repr__(self) -> str:
        return f"Channel(axis={self.axis!r}, world={self.world}, calls={self.calls})"


def channels() -> list[Channel]:
    """The live channels (a snapshot, safe to take from another thread)."""
    return [ch for ch in (ref() for ref in list(_live.values())) if ch is not None]


def new_call(ch: Channel, op: str, nbytes: int, peer: int, t0: float, dtype=None) -> list:
    """Start a call on ``ch``: count it when it is a collective, put it in the ring and the slot."""
    if peer < 0:
        ch.calls += 1
    call = [t0, ch, op, nbytes, peer, ch.calls, ch.label, None, t0, None, dtype]
    ring.append(call)
    ch.cur = call
    return call


class labelled:
    """``with labelled(channel, label):`` calls started on ``channel`` inside the block carry
    ``label`` (any object; ``str(label)`` is called only when a report is written)."""

    __slots__ = ("_ch", "_label", "_prev")

    def __init__(self, ch: Channel, label):
        self._ch, self._label = ch, label

    def __enter__(self):
        self._prev = self._ch.label
        self._ch.label = self._label
        return self

    def __exit__(self, *exc) -> None:
        self._ch.label = self._prev


def waiting(call: list, now: float, timeout: float = 0.0) -> float | None:
    """Seconds ``call`` has been waited on when that exceeds ``timeout``, else None. A polled
    wait counts only while it is being polled (its latest test within :data:`FRESH_S`): a handle
    tested once in passing and then left alone while the rank computes is not a hang."""
    if call[DONE] is not None:
        return None
    polled = call[POLLED]
    if polled is not None and now - polled > FRESH_S:
        return None
    waited = now - call[SINCE]
    return waited if waited > timeout else None


def describe(call: list) -> str:
    """One call in the runtime's terms: its label if any, then op, axis, bytes, peer or count."""
    ch = call[CHAN]
    what = f"{call[OP]} on axis {ch.axis}, {call[NBYTES]} bytes"
    peer = call[PEER]
    if peer >= 0:
        world = f" = world rank {ch.world[peer]}" if ch.axis != "world" and peer < len(ch.world) else ""
        what += f", {'to' if call[OP] in SENDS else 'from'} {ch.axis} rank {peer}{world}"
    else:
        what += f", collective #{call[COUNT]} on this communicator"
    label = call[LABEL]
    return what if label is None else f"{label} ({what})"


def state(now: float | None = None) -> str:
    """What this process is doing in communication right now, in one line."""
    now = time.perf_counter() if now is None else now
    busy = [c for c in (ch.cur for ch in channels()) if c is not None and waiting(c, now) is not None]
    if busy:
        return "; ".join(f"waiting {now - c[SINCE]:.1f} s in {describe(c)}" for c in busy)
    last = ring[-1] if ring else None
    if last is None:
        return "not in a communication call (none made yet)"
    done = last[DONE]
    ended = f"ended {now - done:.1f} s ago" if done is not None else "did not complete"
    return f"not in a communication call; the last one, {describe(last)}, {ended}"


def dump(rank: int, now: float | None = None) -> str:
    """The ring as text, oldest first, one call per line with its start relative to ``now``."""
    now = time.perf_counter() if now is None else now
    calls = list(ring)
    lines = [f"rank {rank}: last {len(calls)} communication calls (oldest first):"]
    for c in calls:
        done = c[DONE]
        took = f"took {(done - c[T0]) * 1e3:.3f} ms" if done is not None else "NOT COMPLETED"
        lines.append(f"  rank {rank}: t-{now - c[T0]:.3f} s  {describe(c)}  {took}")
    return "\n".join(lines)
