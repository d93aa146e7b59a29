"""What a pipeline rank holds along its schedule's action list: the stashes its forwards keep
until their backward and, under a split (zero-bubble) schedule, the weight passes' inputs its
backwards keep until their W, as counts per chunk; the peak of any byte sizes per chunk."""
from __future__ import annotations

from mpirt.parallel.pipeline.schedules import BACKWARD, FORWARD, WEIGHT


def peak_in_flight(schedule, rank: int, chunk_bytes: list, weight_bytes: list | None = None,
                   backward_bytes: list | None = None) -> int:
    """Peak bytes of the micro-batches a pipeline rank holds for backward under ``schedule`` (its
    action list: an F stashes ``chunk_bytes[chunk]`` until its B), as
    :class:`mpirt.parallel.pipeline.executor.PipelineExecutor` holds them. When the backward is split,
    a B leaves ``weight_bytes[chunk]`` (the weight passes' inputs and output gradients) until its
    W; without ``weight_bytes`` the stash itself stays until W. ``backward_bytes``: what a B of each
    chunk adds while it runs beside what is held as it starts; the peak then counts every B's too."""
    split = schedule.split_backward
    weight_bytes = weight_bytes if split and weight_bytes is not None else chunk_bytes
    sizes = list(chunk_bytes) + list(weight_bytes)
    after, before_backward = _holdings(schedule, rank)
    peak = max(sum(n * b for n, b in zip(held, sizes)) for held in after)
    if backward_bytes is None:
        return peak
    return max(peak, max((sum(n * b for n, b in zip(held, sizes)) + backward_bytes[c] for held, c in before_backward),
                         default=0))


_HOLDINGS: dict = {}


def _holdings(schedule, rank: int) -> tuple[list, list]:
    """The distinct states of what ``rank`` holds along its action list, as counts ``[stashes of
    chunk 0 .. v-1, weight-pass holds of chunk 0 .. v-1]``: after each action, and ``(state, chunk)``
    as each B starts. The peak of any byte sizes is the largest of their dot products with these
    (the planner asks for the same schedule with thousands of sizes). Keyed by the schedule's
    identity (the built schedules are cached, :func:`mpirt.parallel.layout._schedule`), the
    schedule kept alive with the answer."""
    key = (id(schedule), rank)
    if key in _HOLDINGS and _HOLDINGS[key][0] is schedule:
        return _HOLDINGS[key][1]
    v, split = schedule.chunks, schedule.split_backward
    held, states, starts = [0] * (2 * v), {(0,) * (2 * v)}, set()
    for a in schedule.actions[rank]:
        if a.op == FORWARD:
            held[a.chunk] += 1
        elif a.op == BACKWARD:
            starts.add((tuple(held), a.chunk))
            held[a.chunk] -= 1
            held[v + a.chunk] += split  # without a split, nothing waits for W
        elif a.op == WEIGHT:
            held[v + a.chunk] -= 1
        else:
            continue
        states.add(tuple(held))
    if len(_HOLDINGS) >= 4096:
        _HOLDINGS.clear()
    _HOLDINGS[key] = (schedule, (sorted(states), sorted(starts)))
    return _HOLDINGS[key][1]
