"""Running every rank's step program together (pure: no MPI): the engine of the pre-flight proof
(:mod:`mpirt.parallel.preflight` makes the programs and says what they cover).

A collective is started in order on its group, whose members must agree on the n-th one's
operation, bytes and dtype, and completes once every member has started it; an exchange posts its sends
(non-blocking) and completes when each of its receives finds its send, matched first in, first out
per (source, destination, communicator) as MPI's non-overtaking rule matches them, of the same
size and dtype. :func:`simulate_step` names the first disagreement (ranks and operations) or, when ranks wait
on each other, what every stuck rank waits in.

Every rank only ever waits (for a message, for the members of a collective), never chooses: how
far each rank gets does not depend on the order in which the simulation runs them. Two
consequences make the proof cheap. A rank runs until it blocks and is woken only by what it waits
for, so a proof costs the programs' length, not passes over all ranks. And where every rank of a
pipeline stage runs the same program up to moving it along dp and cp (its peers shifted alike:
:func:`first_difference` checks it, rank by rank), the ranks of a stage reach the same point
together, so the stage's rank at dp 0, cp 0 stands for all of them (``symmetric=True``): a
message another rank of the stage would receive is the one the representative receives, moved
back.
"""
from __future__ import annotations

import functools
from collections import defaultdict, deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Op:
    """One communication step of a rank. ``what``: a collective on ``comm`` (``allgather``,
    ``reduce_scatter``, ``alltoall``: started and waited for; ``iallgather``: only started), ``wait`` (for the
    rank's collective number ``index`` on ``comm``, started earlier), or ``exchange``
    (non-blocking ``sends`` and ``recvs`` on ``comm``, each ``(world rank, bytes)``, waited for
    together); ``label`` says where in the step it is; ``dtype`` names the elements (the
    layout's, never a rank's values)."""

    what: str
    comm: str
    nbytes: int = 0
    sends: tuple = ()
    recvs: tuple = ()
    label: str = ""
    index: int = -1
    dtype: str = ""

    def describe(self) -> str:
        if self.what == "exchange":
            parts = [f"send {n} B {self.dtype} to rank {r}" for r, n in self.sends] + \
                    [f"receive {n} B {self.dtype} from rank {r}" for r, n in self.recvs]
            return f"{', '.join(parts)} on {self.comm} ({self.label})"
        if self.what == "wait":
            return f"wait for collective #{self.index} on {self.comm} ({self.label})"
        return f"{self.what} of {self.nbytes} B {self.dtype} on {self.comm} ({self.label})"


BLOCKING = ("allgather", "reduce_scatter", "alltoall")
STARTED = BLOCKING + ("iallgather",)


class StepCommError(ValueError):
    """The step's communication would mismatch or deadlock (:func:`simulate_step`)."""


class Grid3:
    """The proof's grid (tp 1): coordinates ``(dp, pp, cp)`` of a rank, its groups, and the moves
    along dp and cp that carry a stage's ranks onto each other."""

    def __init__(self, layout):
        self.dp, self.pp, self.cp, self.ep = layout.dp, layout.pp, layout.cp, layout.ep
        if layout.tp != 1:
            raise ValueError("the proof's grid has tp 1 (see preflight.reduced)")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, cp) of ``rank``: :func:`~mpirt.parallel.grid.grid_coords` at tp 1, unchecked
        (the proof asks it ~10^6 times)."""
        rest, c = divmod(rank, self.cp)
        d, p = divmod(rest, self.pp)
        return d, p, c

    def rank(self, d: int, p: int, c: int) -> int:
        """The rank at (dp, pp, cp), dp and cp taken round their rings."""
        return ((d % self.dp) * self.pp + p) * self.cp + c % self.cp

    def members(self, comm: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group on ``comm`` (dp_cp, cp, pp or ep), in rank order."""
        d, p, c = self.coords(rank)
        if comm == "cp":
            return tuple(self.rank(d, p, k) for k in range(self.cp))
        if comm == "pp":
            return tuple(self.rank(d, k, c) for k in range(self.pp))
        if comm == "dp_cp":
            return tuple(self.rank(j, p, k) for j in range(self.dp) for k in range(self.cp))
        if comm == "ep":  # consecutive dp ranks (grid.expert_groups)
            first = d // self.ep * self.ep
            return tuple(self.rank(j, p, c) for j in range(first, first + self.ep))
        raise ValueError(f"unknown communicator {comm!r}")

    def representative(self, rank: int) -> int:
        """The rank at dp 0, cp 0 of ``rank``'s stage."""
        return self.rank(0, self.coords(rank)[1], 0)

    def moved(self, rank: int, by: int) -> int:
        """``rank`` moved along dp and cp as far as ``by`` is from its stage's representative,
        backwards: the move that takes ``by`` to the representative takes ``rank`` to this."""
        d, p, c = self.coords(rank)
        bd, _, bc = self.coords(by)
        return self.rank(d - bd, p, c - bc)

    def relative(self, peer: int, rank: int) -> tuple[int, int, int]:
        """Where ``peer`` is seen from ``rank``: dp and cp as offsets, pp as it is."""
        d, p, c = self.coords(peer)
        rd, _, rc = self.coords(rank)
        return (d - rd) % self.dp, p, (c - rc) % self.cp


def first_difference(grid: Grid3, rank: int, ops: list, rep_ops: list) -> str | None:
    """Where ``rank``'s program ``ops`` is not its stage representative's ``rep_ops`` moved along
    dp and cp (other operations, bytes, dtypes or labels, or peers not at the same offsets), in words;
    None when it is."""
    rep = grid.representative(rank)

    def shape(op: Op, me: int) -> tuple:
        peers = tuple((grid.relative(r, me), n) for r, n in op.sends), \
            tuple((grid.relative(r, me), n) for r, n in op.recvs)
        return op.what, op.comm, op.nbytes, op.dtype, op.label, op.index, peers

    for i in range(max(len(ops), len(rep_ops))):
        mine = ops[i] if i < len(ops) else None
        theirs = rep_ops[i] if i < len(rep_ops) else None
        if mine is None or theirs is None or shape(mine, rank) != shape(theirs, rep):
            have = mine.describe() if mine else "nothing (its program ends)"
            want = theirs.describe() if theirs else "nothing (its program ends)"
            return f"operation #{i}: rank {rank} runs {have}, its stage's rank {rep} {want}"
    return None


def simulate_step(layout, programs: dict[int, list[Op]], symmetric: bool = False) -> None:
    """Run ``programs`` (rank -> its :class:`Op` list on ``layout``, tp 1) together;
    StepCommError naming the ranks and operations of the first disagreement, or of a deadlock.
    ``symmetric``: ``programs`` holds one rank per pipeline stage (dp 0, cp 0), standing for every
    rank of its stage (see the module docstring; the caller has checked that they run its
    program)."""
    grid = Grid3(layout)
    if symmetric:
        if sorted(programs) != [grid.rank(0, p, 0) for p in range(grid.pp)]:
            raise ValueError("a symmetric simulation takes the program of each stage's rank at dp 0, cp 0, "
                             "and only those")
        if grid.ep not in (1, grid.dp):  # a move along dp must carry ep groups onto ep groups
            raise ValueError(f"a symmetric simulation needs ep 1 or ep = dp (the proof's grid), not ep {grid.ep} "
                             f"of dp {grid.dp}")
    _Simulation(grid, programs, symmetric).run_all()


class _Simulation:
    """The ranks' programs run together: each rank runs until it blocks (a receive not yet sent, a
    collective its group has not all started), and a rank another one unblocks runs again."""

    def __init__(self, grid: "Grid3", programs: dict, symmetric: bool):
        self.grid, self.programs = grid, programs
        self.here, self.moved = (grid.representative, grid.moved) if symmetric else ((lambda r: r), (lambda r, by: r))
        self.at = dict.fromkeys(programs, 0)
        self.posted = dict.fromkeys(programs, False)
        self.waiting: dict = {}                         # rank -> the receives its exchange still waits for
        self.channels: dict = defaultdict(deque)        # (source, destination, comm) -> [(bytes, dtype, label)]
        self.started: dict = defaultdict(list)          # (comm, rank) -> the collectives it started, in order
        self.sleepers: dict = defaultdict(set)          # what a blocked rank waits on -> the ranks
        self.ready = deque(sorted(programs))
        self.channel = functools.cache(self._channel)
        self.group = functools.cache(self._group)

    def _channel(self, src, r, comm) -> tuple:
        """The channel from ``src`` to ``r`` as the sender's stand-in fills it."""
        return self.here(src), self.moved(r, src), comm

    def _group(self, comm, r) -> tuple:
        return tuple(dict.fromkeys(self.here(m) for m in self.grid.members(comm, r)))

    def wake(self, key) -> None:
        woken = self.sleepers.pop(key, None)
        if woken:
            self.ready.extend(sorted(woken))

    def start(self, r, op) -> int:
        mine = self.started[(op.comm, r)]
        n = len(mine)
        for m in self.group(op.comm, r):
            theirs = self.started[(op.comm, m)]
            if m != r and len(theirs) > n and \
                    (theirs[n].what, theirs[n].nbytes, theirs[n].dtype) != (op.what, op.nbytes, op.dtype):
                raise StepCommError(f"{op.comm} group {list(self.grid.members(op.comm, r))}, collective #{n}: "
                                    f"rank {m} runs {theirs[n].describe()}, rank {r} {op.describe()}")
        mine.append(op)
        self.wake(("started", op.comm, r))
        return n

    def complete(self, r, comm, index) -> bool:
        late = [m for m in self.group(comm, r) if len(self.started[(comm, m)]) <= index]
        for m in late:
            self.sleepers[("started", comm, m)].add(r)
        return not late

    def receive(self, r, op) -> bool:
        """Take what has arrived of the exchange's receives; whether all have."""
        for src, n in list(self.waiting[r]):
            key = self.channel(src, r, op.comm)
            queue = self.channels[key]
            if not queue:
                self.sleepers[("channel", key)].add(r)
                continue
            sent, dtype, label = queue.popleft()
            if (sent, dtype) != (n, op.dtype):
                raise StepCommError(f"rank {r} receives {n} B {op.dtype} from rank {src} ({op.label}) but rank {src} "
                                    f"sent {sent} B {dtype} ({label})")
            self.waiting[r].remove((src, n))
        return not self.waiting[r]

    def run(self, r) -> None:
        """Run rank ``r``'s program until it blocks or ends."""
        ops, at, posted, waiting = self.programs[r], self.at, self.posted, self.waiting
        while at[r] < len(ops):
            op = ops[at[r]]
            if op.what == "exchange":
                if not posted[r]:
                    for dst, n in op.sends:
                        self.channels[(r, dst, op.comm)].append((n, op.dtype, op.label))
                        self.wake(("channel", (r, dst, op.comm)))
                    posted[r], waiting[r] = True, list(op.recvs)
                if not self.receive(r, op):
                    return
            elif op.what in STARTED:
                if not posted[r]:
                    posted[r], waiting[r] = True, self.start(r, op)
                if op.what in BLOCKING and not self.complete(r, op.comm, waiting[r]):
                    return
            elif not self.complete(r, op.comm, op.index):  # a wait
                return
            at[r], posted[r] = at[r] + 1, False

    def run_all(self) -> None:
        """Run until no rank can go on; StepCommError for a rank left blocked or a message unread."""
        while self.ready:
            self.run(self.ready.popleft())
        programs, at = self.programs, self.at
        stuck = {r: programs[r][at[r]] for r in sorted(programs) if at[r] < len(programs[r])}
        if stuck:
            raise StepCommError("deadlock: " + "; ".join(f"rank {r} waits in {op.describe()}" for r, op in stuck.items()))
        unread = {k: q for k, q in self.channels.items() if q}
        if unread:
            (src, dst, comm), q = next(iter(unread.items()))
            raise StepCommError(f"rank {src} sends {q[0][0]} B to rank {dst} on {comm} ({q[0][2]}) that it never receives")
