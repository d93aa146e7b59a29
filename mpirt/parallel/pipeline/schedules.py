"""Pipeline schedules as data: the action vocabulary and the generators.

A schedule says, for every pipeline rank, the ordered list of :class:`Action` it runs in one
training step::

    F(mb, chunk)          forward of micro-batch ``mb`` through this rank's model chunk
    B(mb, chunk)          backward; with a split backward (zero-bubble) only the input-gradient pass
    W(mb, chunk)          the deferred weight-gradient pass (split schedules only)
    send_act / recv_act   activations of (mb, chunk) to / from the next / previous virtual stage
    send_grad / recv_grad gradients of (mb, chunk) to / from the next / previous virtual stage

With ``v`` chunks per rank on ``p`` ranks there are ``S = p * v`` virtual stages; chunk ``c`` of
rank ``r`` is virtual stage ``s = c * p + r`` (Megatron's interleaving), so activations leave
rank ``r`` for rank ``(r + 1) % p`` and gradients for ``(r - 1) % p``.

Generators (:func:`build`): ``gpipe`` (all F, then all B), ``1f1b`` (PipeDream-flush),
``interleaved`` (Megatron's interleaved 1F1B, ``v >= 2``, ``m`` a multiple of ``p``) and ``zb-h1``
(zero-bubble H1: B split into B and W, W deferred into the bubbles; at most ``p`` micro-batches in
flight on any rank, the peak of 1F1B, which 1F1B reaches on its first stage). Each generator
yields the compute order only;
:func:`add_communication` inserts every recv right before the compute that needs it and every send
right after the compute that produced it.

The pre-flight proof (``simulate`` / ``check``), the performance model and the timeline picture
are in :mod:`mpirt.parallel.pipeline.check`.

Pure Python: no MPI, no NumPy. ``python -m mpirt.schedule`` is the command line.
"""

from dataclasses import dataclass

# the actions, spelled out; their values are the zero-bubble paper's letters, which timelines and
# summaries print
FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "send_act", "recv_act", "send_grad", "recv_grad"
COMPUTE = (FORWARD, BACKWARD, WEIGHT)
COMM = (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)
# The schedule names, one set for every entry point (``mpirt.train --schedule``, the config's
# ``schedule`` key, ``python -m mpirt.schedule``, :func:`build`): the canonical names, which help
# texts list and which the runtime stores, and other spellings accepted for them (case-insensitive).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
ALIASES = {"interleaved-1f1b": "interleaved", "interleaved_1f1b": "interleaved",
           "zb": "zb-h1", "zbh1": "zb-h1", "zb_h1": "zb-h1", "zero-bubble": "zb-h1"}


class ScheduleError(ValueError):
    """An impossible schedule request, or a schedule that fails the pre-flight check."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's program. ``peer`` is the other rank of a send/recv (-1 for compute)."""

    op: str
    mb: int
    chunk: int = 0
    peer: int = -1

    @property
    def kind(self) -> str:
        """``"act"`` or ``"grad"`` for communication, else the op."""
        return "act" if self.op in (SEND_ACT, RECV_ACT) else "grad" if self.op in (SEND_GRAD, RECV_GRAD) else self.op

    @property
    def is_send(self) -> bool:
        return self.op in (SEND_ACT, SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self.op in (RECV_ACT, RECV_GRAD)

    def label(self, chunks: int = 1) -> str:
        """Short name for the timeline: ``F3`` (``F3.1`` for chunk 1 when chunks > 1)."""
        return f"{self.op}{self.mb}" + (f".{self.chunk}" if chunks > 1 else "")

    def describe(self, chunks: int = 1) -> str:
        c = f" chunk={self.chunk}" if chunks > 1 else ""
        if self.op in COMPUTE:
            return f"{self.op} mb={self.mb}{c}"
        verb, prep = ("send", "to") if self.is_send else ("recv", "from")
        return f"{verb} {self.kind} mb={self.mb}{c} {prep} rank {self.peer}"

    def __str__(self) -> str:
        return self.describe(2 if self.chunk else 1)


@dataclass
class Schedule:
    """Per-rank action lists plus the shape of the pipeline they were made for."""

    name: str
    pp: int
    microbatches: int
    chunks: int
    actions: list
    split_backward: bool = False

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage of ``chunk`` on ``rank``."""
        return chunk * self.pp + rank

    def compute(self, rank: int) -> list:
        return [a for a in self.actions[rank] if a.op in COMPUTE]

    def forward_only(self) -> "Schedule":
        """The same forward order without backward: for evaluation."""
        order = [[a for a in self.compute(r) if a.op == FORWARD] for r in range(self.pp)]
        return Schedule(self.name + "/forward", self.pp, self.microbatches, self.chunks,
                        add_communication(order, self.pp, self.chunks, backward=False), False)


# ---------------------------------------------------------------------------------------------
# generators (compute order only)

def canonical_name(name: str) -> str:
    """The canonical name of schedule ``name`` (one of :data:`SCHEDULES` or an :data:`ALIASES` key,
    any case); :class:`ScheduleError` for an unknown name, listing the canonical ones."""
    key = name.lower() if isinstance(name, str) else name
    if key in SCHEDULES:
        return key
    if key in ALIASES:
        return ALIASES[key]
    raise ScheduleError(f"schedule: unknown {name!r}; expected one of {', '.join(SCHEDULES)}")


def check_shape(name: str, pp: int, microbatches: int, chunks: int = 1) -> None:
    """Refuse a (schedule, p, m, v) combination the generator cannot serve, saying why."""
    name = canonical_name(name)
    for what, n in (("pp", pp), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ScheduleError(f"{what}: must be a positive integer, got {n!r}")
    if name == "interleaved":
        if chunks < 2:
            raise ScheduleError(f"interleaved 1F1B needs chunks >= 2 model chunks per rank, got chunks={chunks} "
                                "(with one chunk use 1f1b)")
        if pp < 2:
            raise ScheduleError("interleaved 1F1B needs pp >= 2")
        if microbatches % pp:
            lo, hi = (microbatches // pp) * pp, (microbatches // pp + 1) * pp
            ok = f"{lo} or {hi}" if lo else f"{hi}"
            raise ScheduleError(f"interleaved 1F1B needs microbatches to be a multiple of pp: microbatches="
                                f"{microbatches}, pp={pp} (use {ok}, or the 1f1b / zb-h1 schedules, which "
                                "take any number)")
    elif chunks != 1:
        raise ScheduleError(f"{name}: chunks={chunks}, but only the interleaved schedule runs several model "
                            "chunks per rank")


def gpipe_order(p: int, m: int) -> list:
    """All forwards, then all backwards (micro-batch order): m activations stashed per stage."""
    return [[Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in range(m)] for _ in range(p)]


def one_f_one_b_order(p: int, m: int) -> list:
    """1F1B: ``p - r - 1`` warm-up forwards on rank r, then one forward one backward, then the
    cool-down backwards; at most ``p - r`` activations stashed on rank r."""
    order = []
    for r in range(p):
        warm = min(p - r - 1, m)
        seq = [Action(FORWARD, i) for i in range(warm)]
        for i in range(m - warm):
            seq += [Action(FORWARD, warm + i), Action(BACKWARD, i)]
        seq += [Action(BACKWARD, i) for i in range(m - warm, m)]
        order.append(seq)
    return order


def interleaved_order(p: int, m: int, v: int) -> list:
    """Megatron's interleaved 1F1B: forwards visit the chunks in groups of p micro-batches, the
    backwards in reverse chunk order; warm-up ``2 (p - r - 1) + (v - 1) p`` forwards on rank r."""
    total = m * v

    def ident(k, backward):
        group = (k % (p * v)) // p
        return (k // (p * v)) * p + k % p, (v - 1 - group) if backward else group

    order = []
    for r in range(p):
        warm = total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total)
        seq = [Action(FORWARD, *ident(k, False)) for k in range(warm)]
        for k in range(total - warm):
            seq += [Action(FORWARD, *ident(warm + k, False)), Action(BACKWARD, *ident(k, True))]
        seq += [Action(BACKWARD, *ident(k, True)) for k in range(total - warm, total)]
        order.append(seq)
    return order


def zb_h1_order(p: int, m: int) -> list:
    """Zero-bubble H1 (Qi et al., 2023): 1F1B with the backward split into B (input gradient,
    on the critical path) and W (weight gradient), the W passes deferred into the bubbles.

    Rank r runs ``p - r - 1`` warm-up forwards, ``r`` pairs (F, B), one F, then ``m - p`` triples
    (B, W, F), ``p - r - 1`` pairs (B, W), the last B and its remaining ``r + 1`` W passes. At
    F = B = W its bubble is ``(p - 1)`` units per rank against 1F1B's ``3 (p - 1)``. Every rank
    holds at most ``p`` micro-batches in flight (F done, W not done): the peak of 1F1B, which
    1F1B reaches on its first stage only (later ZB-H1 stages hold more than under 1F1B, never
    more than 1F1B's first stage). Needs ``m >= p``; for ``m < p`` a list scheduler fills in.
    """
    if m < p:
        return _zb_greedy_order(p, m)
    order = []
    for r in range(p):
        count, seq = {FORWARD: 0, BACKWARD: 0, WEIGHT: 0}, []

        def run(*ops):
            for op in ops:
                seq.append(Action(op, count[op]))
                count[op] += 1

        run(*[FORWARD] * (p - r - 1))
        for _ in range(r):
            run(FORWARD, BACKWARD)
        run(FORWARD)
        for _ in range(m - p):
            run(BACKWARD, WEIGHT, FORWARD)
        for _ in range(p - r - 1):
            run(BACKWARD, WEIGHT)
        run(BACKWARD, *[WEIGHT] * (r + 1))
        order.append(seq)
    return order


def _zb_greedy_order(p: int, m: int) -> list:
    """ZB-H1 for m < p by list scheduling in unit time (F = B = W = 1): each free rank runs a
    ready B, else a ready F (at most p in flight), else a pending W."""
    f_end = [[None] * m for _ in range(p)]
    b_end = [[None] * m for _ in range(p)]
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    order = [[] for _ in range(p)]
    t = 0
    while any(n < m for n in nw):
        if t > 8 * (m + p) + 16:  # cannot happen; guards against an endless loop
            raise ScheduleError(f"zb-h1 generator made no progress for p={p}, m={m}")
        for r in range(p):
            i, j = nb[r], nf[r]
            if i < nf[r] and f_end[r][i] <= t and (r == p - 1 or (b_end[r + 1][i] or t + 1) <= t):
                b_end[r][i] = t + 1
                nb[r] += 1
                order[r].append(Action(BACKWARD, i))
            elif j < m and nf[r] - nw[r] < p and (r == 0 or (f_end[r - 1][j] or t + 1) <= t):
                f_end[r][j] = t + 1
                nf[r] += 1
                order[r].append(Action(FORWARD, j))
            elif nw[r] < nb[r]:
                order[r].append(Action(WEIGHT, nw[r]))
                nw[r] += 1
        t += 1
    return order


def add_communication(order: list, p: int, v: int = 1, backward: bool = True) -> list:
    """Insert the sends and receives around a compute order: recv act before F and recv grad
    before B (unless first / last virtual stage), send act after F and send grad after B."""
    last = p * v - 1
    out = []
    for r, seq in enumerate(order):
        acts = []
        for a in seq:
            s = a.chunk * p + r
            if a.op == FORWARD:
                if s > 0:
                    acts.append(Action(RECV_ACT, a.mb, a.chunk, (r - 1) % p))
                acts.append(a)
                if s < last:
                    acts.append(Action(SEND_ACT, a.mb, a.chunk, (r + 1) % p))
            elif a.op == BACKWARD:
                if s < last and backward:
                    acts.append(Action(RECV_GRAD, a.mb, a.chunk, (r + 1) % p))
                acts.append(a)
                if s > 0 and backward:
                    acts.append(Action(SEND_GRAD, a.mb, a.chunk, (r - 1) % p))
            else:
                acts.append(a)
        out.append(acts)
    return out


def build(name: str, pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule ``name`` for ``pp`` ranks, ``microbatches`` micro-batches and ``chunks`` model
    chunks per rank (refused with :class:`ScheduleError` when the combination is impossible)."""
    name = canonical_name(name)
    check_shape(name, pp, microbatches, chunks)
    p, m, v = pp, microbatches, chunks
    if name == "gpipe":
        order = gpipe_order(p, m)
    elif name == "1f1b":
        order = one_f_one_b_order(p, m)
    elif name == "interleaved":
        order = interleaved_order(p, m, v)
    else:
        order = zb_h1_order(p, m)
    return Schedule(name, p, m, v, add_communication(order, p, v), split_backward=name == "zb-h1")
