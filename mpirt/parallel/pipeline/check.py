"""Pipeline schedules checked before they run: the pre-flight proof, the performance model and
the timeline picture (schedules themselves are made in :mod:`mpirt.parallel.pipeline.schedules`).

:func:`simulate` runs all ranks' lists together: computes take their cost, sends never block,
a receive blocks until the matching send has run, and messages are matched FIFO per
(source, destination, kind), as MPI's non-overtaking rule matches them for one (source, tag). It
proves (or refutes) that every send has its receive, that each receive gets the message it
expects, and that the program cannot deadlock; on failure it names the first blocked action of
every stuck rank. The same run gives the timeline (:func:`format_timeline`), the bubble fraction
and the peak number of stashed activations, i.e. the performance model.

Why the proof covers the executor: compute never blocks, sends are non-blocking (``isend``), each
receive is waited on exactly where its ``recv`` action stands (posting it earlier, as the executor
does, only makes the message available sooner), and MPI matches messages of one (source, tag) in
order, which is the FIFO rule simulated here (one tag per kind).

Pure Python: no MPI, no NumPy. ``python -m mpirt.schedule`` is the command line.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mpirt.parallel.pipeline.schedules import (BACKWARD, COMM, COMPUTE, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, WEIGHT, Schedule,
                                               ScheduleError, canonical_name)


def default_costs(split_backward: bool) -> dict:
    """Unit costs: F = 1, B = 2 (input and weight gradient), or B = W = 1 when split."""
    return {FORWARD: 1, BACKWARD: 1, WEIGHT: 1} if split_backward else {FORWARD: 1, BACKWARD: 2, WEIGHT: 0}


@dataclass
class SimResult:
    """What :func:`simulate` found. ``timeline[r]`` lists (start, end, Action) of rank r's computes."""

    ok: bool
    errors: list
    timeline: list
    makespan: float
    busy: list
    peak_stash: list
    messages: int
    schedule: Schedule = field(repr=False, default=None)

    @property
    def idle(self) -> list:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble(self) -> float:
        """Idle time over total time, all ranks together."""
        n = len(self.busy)
        return sum(self.idle) / (n * self.makespan) if self.makespan else 0.0

    def report(self) -> str:
        if self.ok:
            return (f"OK: {self.messages} messages, every send has its receive, no deadlock "
                    f"(makespan {self.makespan:g}, bubble {100 * self.bubble:.1f}%)")
        return "FAILED:\n  " + "\n  ".join(self.errors)


def _structure_errors(s: Schedule) -> list:
    """Per-rank checks: every (mb, chunk) forwarded and backwarded once, in order, with its
    receives before and sends after, to and from the right neighbours."""
    errs = []
    p, m, v, last = s.pp, s.microbatches, s.chunks, s.num_stages - 1
    if len(s.actions) != p:
        return [f"schedule has {len(s.actions)} action lists for pp={p}"]
    backward = any(a.op == BACKWARD for acts in s.actions for a in acts)
    for r, acts in enumerate(s.actions):
        seen = {}  # (op, mb, chunk) -> position
        for i, a in enumerate(acts):
            if a.op not in COMPUTE + COMM:
                errs.append(f"rank {r}: {a.describe(v)}: unknown op {a.op!r}")
                continue
            if not (0 <= a.mb < m and 0 <= a.chunk < v):
                errs.append(f"rank {r}: {a.describe(v)}: micro-batch or chunk out of range (m={m}, chunks={v})")
                continue
            key = (a.op, a.mb, a.chunk)
            if key in seen:
                errs.append(f"rank {r}: {a.describe(v)}: appears twice (positions {seen[key]} and {i})")
            seen[key] = i
            st = s.stage(r, a.chunk)
            if a.op in COMM:
                want = {SEND_ACT: (r + 1) % p, RECV_GRAD: (r + 1) % p, RECV_ACT: (r - 1) % p,
                        SEND_GRAD: (r - 1) % p}[a.op]
                exists = st < last if a.op in (SEND_ACT, RECV_GRAD) else st > 0
                if not exists:
                    errs.append(f"rank {r}: {a.describe(v)}: virtual stage {st} has no such neighbour")
                elif a.peer != want:
                    errs.append(f"rank {r}: {a.describe(v)}: wrong peer (the neighbour is rank {want})")
        for mb in range(m):
            for c in range(v):
                st = s.stage(r, c)
                pos = {op: seen.get((op, mb, c)) for op in COMPUTE + COMM}
                tag = f"rank {r}: mb={mb}" + (f" chunk={c}" if v > 1 else "")
                if pos[FORWARD] is None:
                    errs.append(f"{tag}: no F")
                    continue
                if st > 0 and (pos[RECV_ACT] is None or pos[RECV_ACT] > pos[FORWARD]):
                    errs.append(f"{tag}: F runs without a recv act before it")
                if st < last and (pos[SEND_ACT] is None or pos[SEND_ACT] < pos[FORWARD]):
                    errs.append(f"{tag}: F's output has no send act after it")
                if not backward:
                    continue
                if pos[BACKWARD] is None:
                    errs.append(f"{tag}: no B")
                    continue
                if pos[BACKWARD] < pos[FORWARD]:
                    errs.append(f"{tag}: B before F")
                if st < last and (pos[RECV_GRAD] is None or pos[RECV_GRAD] > pos[BACKWARD]):
                    errs.append(f"{tag}: B runs without a recv grad before it")
                if st > 0 and (pos[SEND_GRAD] is None or pos[SEND_GRAD] < pos[BACKWARD]):
                    errs.append(f"{tag}: B's input gradient has no send grad after it")
                if s.split_backward and pos[WEIGHT] is None:
                    errs.append(f"{tag}: split backward but no W")
                if pos[WEIGHT] is not None and (not s.split_backward or pos[WEIGHT] < pos[BACKWARD]):
                    errs.append(f"{tag}: W " + ("before B" if s.split_backward else "in a schedule without split backward"))
    return errs


def _unfinished_errors(s: Schedule, pc: list, sent: dict, taken: dict) -> list[str]:
    """Why the run stopped short: each blocked rank's receive (its sender has no such rank, never
    sends it, or sends it only after its own blocked action: a deadlock) and each send nobody
    received. ``pc``: each rank's next action; ``sent``/``taken``: the messages and how many were
    received, per (source, destination, kind)."""
    p, v, errs = s.pp, s.chunks, []
    for r in (r for r in range(p) if pc[r] < len(s.actions[r])):
        a = s.actions[r][pc[r]]
        q = a.peer
        later = [b for b in s.actions[q][pc[q]:] if b.is_send and b.peer == r and b.kind == a.kind] \
            if 0 <= q < p else []
        if not 0 <= q < p:
            why = f"no rank {q}"
        elif not later:
            why = "never sent"
        else:
            blocker = s.actions[q][pc[q]] if pc[q] < len(s.actions[q]) else None
            why = (f"deadlock: rank {q} would send it ({later[0].describe(v)}) only after its own blocked "
                   f"action {blocker.describe(v)}" if blocker else "never sent")
        errs.append(f"rank {r}: {a.describe(v)}, {why} (blocked at action {pc[r]} of {len(s.actions[r])})")
    for key, queue in sorted(sent.items()):
        for mb, _, _, send, _ in queue[taken.get(key, 0):]:
            errs.append(f"rank {key[0]}: {send.describe(v)}, never received")
    return errs


def simulate(s: Schedule, costs=None, latency: float = 0.0, trace: list | None = None) -> SimResult:
    """Run every rank's list together (see the module doc) and collect all problems.

    ``costs``: a dict op -> time (default :func:`default_costs`) or a callable
    ``(rank, action) -> time``; ``latency`` is added to every message. ``trace``: a list that
    receives the run's order, ``(0, rank, action)`` per compute, ``(1, rank, message)`` per send
    and ``(2, rank, message)`` per receive with the number of the send it matched.
    """
    p, v = s.pp, s.chunks
    if costs is None:
        costs = default_costs(s.split_backward)
    cost = costs if callable(costs) else (lambda r, a: costs[a.op])
    errs = _structure_errors(s)
    if len(s.actions) != p:
        return SimResult(False, errs, [], 0.0, [], [], 0, s)
    pc, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    stash, peak = [0] * p, [0] * p
    timeline = [[] for _ in range(p)]
    sent: dict = {}       # (src, dst, kind) -> [(mb, sender stage, time, action)]
    taken: dict = {}      # (src, dst, kind) -> number consumed
    release = WEIGHT if s.split_backward else BACKWARD
    messages = 0
    progress = True
    while progress:
        progress = False
        for r in range(p):
            acts = s.actions[r]
            while pc[r] < len(acts):
                a = acts[pc[r]]
                if a.op in COMPUTE:
                    if trace is not None:
                        trace.append((0, r, a))
                    t0 = clock[r]
                    clock[r] += cost(r, a)
                    busy[r] += clock[r] - t0
                    timeline[r].append((t0, clock[r], a))
                    if a.op == FORWARD:
                        stash[r] += 1
                        peak[r] = max(peak[r], stash[r])
                    if a.op == release:
                        stash[r] -= 1
                elif a.is_send:
                    if not 0 <= a.peer < p:
                        errs.append(f"rank {r}: {a.describe(v)}: no rank {a.peer}")
                    else:
                        if trace is not None:
                            trace.append((1, r, messages))
                        sent.setdefault((r, a.peer, a.kind), []).append((a.mb, s.stage(r, a.chunk), clock[r], a,
                                                                         messages))
                        messages += 1
                elif a.is_recv:
                    key = (a.peer, r, a.kind)
                    queue, k = sent.get(key, []), taken.get(key, 0)
                    if k >= len(queue):
                        break  # blocked until the sender gets there (or forever)
                    taken[key] = k + 1
                    mb, src_stage, t_sent, send, number = queue[k]
                    if trace is not None:
                        trace.append((2, r, number))
                    st = s.stage(r, a.chunk)
                    want = st - 1 if a.kind == "act" else st + 1
                    if (mb, src_stage) != (a.mb, want):
                        errs.append(f"rank {r}: {a.describe(v)} receives rank {a.peer}'s message {send.describe(v)} "
                                    f"(FIFO order of sends and receives differs)")
                    clock[r] = max(clock[r], t_sent + latency)
                pc[r] += 1
                progress = True
    errs += _unfinished_errors(s, pc, sent, taken)
    makespan = max(clock) if clock else 0.0
    return SimResult(not errs, errs, timeline, makespan, busy, peak, messages, s)


def check(s: Schedule, costs=None) -> SimResult:
    """The pre-flight proof: :func:`simulate`, raising :class:`ScheduleError` on any problem."""
    result = simulate(s, costs)
    if not result.ok:
        raise ScheduleError(f"{s.name} schedule (pp={s.pp}, microbatches={s.microbatches}, chunks={s.chunks}) "
                            f"fails the pre-flight check: {result.report()}")
    return result


def theoretical_bubble(name: str, pp: int, microbatches: int, chunks: int = 1, costs=None) -> float:
    """The textbook bubble fraction (idle over total time): ``(p-1)/(m+p-1)`` for GPipe and 1F1B,
    ``(p-1)/(v m + p-1)`` for interleaved 1F1B (the bubble divided by v), and for ZB-H1 a bubble
    of ``(p-1)(F+B-W)`` against ``m (F+B+W)`` of work (a third of 1F1B's at F = B = W)."""
    name = canonical_name(name)
    p, m, v = pp, microbatches, chunks
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    c = costs or default_costs(True)
    work, gap = m * (c[FORWARD] + c[BACKWARD] + c[WEIGHT]), (p - 1) * max(c[FORWARD] + c[BACKWARD] - c[WEIGHT], 0)
    return gap / (work + gap)


def format_timeline(result: SimResult, width: int = 0) -> str:
    """One row per rank, one column per time unit (costs rounded to whole units): the action's
    label in each unit it runs, ``.`` where the rank is idle."""
    s = result.schedule
    v = s.chunks
    rows = []
    span = int(round(result.makespan))
    labels = [[None] * span for _ in result.timeline]
    for r, events in enumerate(result.timeline):
        for t0, t1, a in events:
            for t in range(int(round(t0)), int(round(t1))):
                if t < span:
                    labels[r][t] = a.label(v)
    w = width or max([len(x) for row in labels for x in row if x] + [1])
    for r, row in enumerate(labels):
        rows.append(f"rank {r} | " + " ".join((x or ".").ljust(w) for x in row).rstrip())
    return "\n".join(rows)


_PROGRAMS: dict = {}


def _program(s: Schedule) -> tuple:
    """``s`` proved once (:func:`simulate` with unit costs; ScheduleError names its first problem)
    and its run's order kept (``trace``), each compute as its cost slot ``(rank, op, chunk)``:
    messages are matched FIFO per (source, destination, kind) from the action lists alone, so
    any costs time the same program. Remembered per schedule object (the runtime's schedules
    are built once per shape)."""
    hit = _PROGRAMS.get(id(s))
    if hit is not None and hit[0] is s:
        return hit[1]
    trace: list = []
    proof = simulate(s, trace=trace)
    if not proof.ok:
        raise ScheduleError(f"schedule {s.name} pp={s.pp} m={s.microbatches} chunks={s.chunks}: {proof.errors[0]}")
    slots: dict = {}
    program = [(0, r, slots.setdefault((r, x.op, x.chunk), len(slots))) if kind == 0 else (kind, r, x)
               for kind, r, x in trace]
    if len(_PROGRAMS) >= 256:
        _PROGRAMS.clear()
    _PROGRAMS[id(s)] = (s, (program, list(slots), proof.messages, proof.peak_stash))
    return _PROGRAMS[id(s)][1]


def timed(s: Schedule, cost, latency: float = 0.0) -> SimResult:
    """:func:`simulate`'s makespan, busy time per rank and bubble for a schedule that passes its
    proof, with ``cost(rank, op, chunk)`` seconds per compute (the same for every micro-batch) and
    ``latency`` per message: the proof runs once per schedule, each call after it only times the
    flattened program (no timeline kept). ScheduleError for a schedule that fails the proof."""
    program, slots, messages, peak = _program(s)
    costs = [cost(r, op, chunk) for r, op, chunk in slots]
    clock, busy, at = [0.0] * s.pp, [0.0] * s.pp, [0.0] * messages
    for kind, r, x in program:
        if kind == 0:
            c = costs[x]
            clock[r] += c
            busy[r] += c
        elif kind == 1:
            at[x] = clock[r]
        elif at[x] + latency > clock[r]:
            clock[r] = at[x] + latency
    return SimResult(True, [], [], max(clock), busy, list(peak), messages, s)
