"""The whole step's communication, proven before the first step (pure: no MPI, nothing built).

Each rank's program for one training step is derived from the :class:`~mpirt.parallel.layout.Layout`
(:func:`step_programs`): the pipeline schedule's sends and receives (pp); ring attention's
exchanges (cp: per block and micro-batch, ``cp - 1`` key/value passes forward; backward the
forward's again where the block reruns, then ``cp`` steps each passing the keys' gradient, with
the keys and values but the last); ZeRO-3's unit gathers (the next unit's started, not waited
for, while a unit runs) and gradient reduce-scatters (over dp x cp); a mixture of experts' token
exchanges under ep (per MoE chunk and micro-batch, on the ep group: the counts, the rows out and
the outputs back forward, again where the block reruns, then the two gradients' exchanges
backward; each all-to-all priced at the rows a rank sends when routing is balanced, which every
member passes alike). :func:`simulate_step` runs
all ranks' programs together: a collective is started in order on its group, whose members must
agree on the n-th one's operation and bytes, and completes once every member has started it; an
exchange posts its sends (non-blocking) and completes when each of its
receives finds its send, matched first in, first out per (source, destination, communicator) as
MPI's non-overtaking rule matches them, of the same size. It names the first disagreement (ranks
and operations) or, when ranks wait on each other, what every stuck rank waits in.

What it covers of the runtime: the operations that interleave across communicators within a
step, in the order the engine issues them (the executor walks the schedule; ring attention posts
a step's sends and receives and waits for them before the next; the experts' all-to-alls are
blocking collectives; ZeRO-3's unit gathers the way :class:`~mpirt.parallel.zero3.ShardedParams`
takes and starts them). Left out: the gradient sync of ZeRO-1/2 and data parallelism (buckets on
dp x cp, the experts' on edp, each rank in the same order), the pipeline's tied-embedding sum
and the loss's average after the step, and tp's collectives inside ops.

The grid is reduced for the proof: at most two dp ranks (ep at most 2 with them) and one tp
rank (every dp and tp rank of a stage runs the same program, and tp's collectives live inside
ops), and each chunk's blocks as one block (the ranks of a cp ring, a dp or an ep group hold the
same stage).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from dataclasses import dataclass

from mpirt.parallel.grid import axis_groups, expert_groups, grid_rank
from mpirt.parallel.pipeline.schedules import Action, BACKWARD, FORWARD, WEIGHT


@dataclass(frozen=True)
class Op:
    """One communication step of a rank. ``what``: a collective on ``comm`` (``allgather``,
    ``reduce_scatter``, ``alltoall``: started and waited for; ``iallgather``: only started), ``wait`` (for the
    rank's collective number ``index`` on ``comm``, started earlier), or ``exchange``
    (non-blocking ``sends`` and ``recvs`` on ``comm``, each ``(world rank, bytes)``, waited for
    together); ``label`` says where in the step it is."""

    what: str
    comm: str
    nbytes: int = 0
    sends: tuple = ()
    recvs: tuple = ()
    label: str = ""
    index: int = -1

    def describe(self) -> str:
        if self.what == "exchange":
            parts = [f"send {n} B to rank {r}" for r, n in self.sends] + \
                    [f"receive {n} B from rank {r}" for r, n in self.recvs]
            return f"{', '.join(parts)} on {self.comm} ({self.label})"
        if self.what == "wait":
            return f"wait for collective #{self.index} on {self.comm} ({self.label})"
        return f"{self.what} of {self.nbytes} B on {self.comm} ({self.label})"


BLOCKING = ("allgather", "reduce_scatter", "alltoall")
STARTED = BLOCKING + ("iallgather",)


class StepCommError(ValueError):
    """The step's communication would mismatch or deadlock (:func:`simulate_step`)."""


def reduced(layout):
    """``layout`` on the grid the proof runs on: dp at most 2 (ep at most 2 with it), tp 1."""
    return dataclasses.replace(layout, dp=min(layout.dp, 2), ep=min(layout.ep, 2), tp=1, sequence_parallel=False)


class _Gathers:
    """ZeRO-3's gathers as :class:`~mpirt.parallel.zero3.ShardedParams` issues them: a unit takes
    the gather in flight when it is its own (waits for it), else completes and drops it and
    gathers; then starts its neighbour's (``prefetch``)."""

    def __init__(self, ops: list):
        self.ops, self.count, self.pending = ops, 0, None

    def _start(self, what: str, nbytes: int, label: str) -> int:
        self.ops.append(Op(what, "dp_cp", nbytes, label=label))
        self.count += 1
        return self.count - 1

    def gather(self, unit: tuple, prefetch: tuple | None, label: str) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            self.ops.append(Op("wait", "dp_cp", label=label, index=pending[1]))
        if pending is None or pending[0] != unit:
            self._start("allgather", unit[1], label)
        if prefetch is not None:
            self.pending = (prefetch, self._start("iallgather", prefetch[1], f"{label}, prefetching {prefetch[0]}"))

    def reduce_scatter(self, unit: tuple, label: str) -> None:
        self._start("reduce_scatter", unit[1], label)


def step_programs(layout, model_cfg, seq_len: int, itemsize: int) -> dict[int, list[Op]]:
    """Every rank's program of one step on ``layout`` (resolved with the model; use
    :func:`reduced` for the proof's grid), for ``model_cfg`` at ``seq_len`` in ``itemsize``-byte
    elements (ring attention's keys and values travel in float32 in half precision)."""
    from mpirt.core.modeling import layer_costs

    costs = layer_costs(model_cfg, seq_len)
    dp, pp, cp, tp = layout.dp, layout.pp, layout.cp, layout.tp
    held = seq_len // cp
    kv_heads = getattr(model_cfg, "n_kv_head", None) or model_cfg.n_head
    kv_bytes = layout.rows * held * 2 * kv_heads * (model_cfg.n_embd // model_cfg.n_head) // tp * max(itemsize, 4)
    act_bytes = layout.rows * held * model_cfg.n_embd * itemsize
    experts = getattr(model_cfg, "n_expert", 0)
    routed = act_bytes * getattr(model_cfg, "top_k", 1)  # a rank's rows out to the experts (balanced)
    counts_bytes = experts // layout.ep * 8 * layout.ep
    stages = layout.stages

    def world(pos: dict, **moved) -> int:
        c = {**pos, **moved}
        return grid_rank((c["dp"], c["pp"], c["cp"], c["tp"]), dp, pp, tp, cp)

    def units(chunk: int, p: int) -> list[tuple[str, int, bool]]:
        """(name, parameter bytes, whether it is blocks) of the units of chunk ``chunk`` on pp
        rank ``p``, in forward order (a chunk's blocks as one)."""
        s = chunk * pp + p
        lo, hi = layout.bounds[s]
        out = [("embed", costs[0].params, False)] if s == 0 else []
        if hi > lo:
            out.append((f"h.{lo}-{hi - 1}", sum(costs[1 + i].params for i in range(lo, hi)), True))
        if s == stages - 1:
            out.append(("head", costs[-1].params, False))
        return [(name, int(n // tp * itemsize), blocks) for name, n, blocks in out]

    programs = {}
    for rank in range(layout.world_size):
        pos = layout.position(rank)
        nxt, prv = world(pos, cp=(pos["cp"] + 1) % cp), world(pos, cp=(pos["cp"] - 1) % cp)

        def ring(label: str, backward: bool) -> list[Op]:
            if cp == 1:
                return []
            if not backward:
                return [Op("exchange", "cp", sends=((nxt, kv_bytes),), recvs=((prv, kv_bytes),),
                           label=f"{label} ring step {s}") for s in range(cp - 1)]
            return [Op("exchange", "cp", sends=((nxt, kv_bytes),) * (2 if s < cp - 1 else 1),
                       recvs=((prv, kv_bytes),) * (2 if s < cp - 1 else 1), label=f"{label} ring backward step {s}")
                    for s in range(cp)]

        def exchanges(label: str, backward: bool) -> list[Op]:
            """A MoE layer's all-to-alls on the ep group (none without expert parallelism)."""
            if layout.ep == 1 or not experts:
                return []
            if backward:
                return [Op("alltoall", "ep", routed, label=f"{label} {step}")
                        for step in ("outputs' gradient out", "rows' gradient back")]
            return [Op("alltoall", "ep", counts_bytes, label=f"{label} expert counts"),
                    Op("alltoall", "ep", routed, label=f"{label} rows out"),
                    Op("alltoall", "ep", routed, label=f"{label} outputs back")]

        recomputed = set(layout.recomputed)
        ops: list[Op] = []
        gathers = _Gathers(ops)
        actions = layout.pipeline_schedule.actions[pos["pp"]] if pp > 1 else \
            [Action(op, mb) for mb in range(layout.microbatches) for op in (FORWARD, BACKWARD)]
        for a in actions:
            tag = f"{a.op} mb {a.mb}" + (f" chunk {a.chunk}" if layout.chunks > 1 else "")
            if a.op not in (FORWARD, BACKWARD, WEIGHT):   # the pipeline's messages, one micro-batch each
                peer = world(pos, pp=a.peer)
                one = ((peer, act_bytes),)
                ops.append(Op("exchange", "pp", sends=one if a.is_send else (), recvs=() if a.is_send else one,
                              label=f"{a.op} mb {a.mb}"))
                continue
            mine = units(a.chunk, pos["pp"])
            lo, hi = layout.bounds[a.chunk * pp + pos["pp"]]
            rerun = layout.zero == 3 or any(i in recomputed for i in range(lo, hi))
            order = list(range(len(mine))) if a.op == FORWARD else list(reversed(range(len(mine))))
            for k, j in enumerate(order):            # a chunk's units prefetch their neighbours in it
                unit = mine[j]
                name, _, blocks = unit
                label = f"{tag} {name}"
                if layout.zero == 3 and a.op != WEIGHT:
                    gathers.gather(unit, mine[order[k + 1]] if k + 1 < len(order) else None, label)
                if blocks and a.op == FORWARD:
                    ops += ring(label, backward=False) + exchanges(label, backward=False)
                if blocks and a.op == BACKWARD:
                    if rerun:
                        ops += ring(label + " rerun", backward=False) + exchanges(label + " rerun", backward=False)
                    ops += exchanges(label, backward=True) + ring(label, backward=True)
                if layout.zero == 3 and (a.op == WEIGHT or (a.op == BACKWARD and not layout.split_backward)):
                    gathers.reduce_scatter(unit, label)
        programs[rank] = ops
    return programs


def simulate_step(layout, programs: dict[int, list[Op]]) -> None:
    """Run ``programs`` (:func:`step_programs` on ``layout``) together; StepCommError naming the
    ranks and operations of the first disagreement, or of a deadlock. A collective is started in
    order (members must agree on the n-th collective of a group: MPI matches them by order) and
    completes once every member has started it."""
    groups = {}
    for comm in ("dp_cp", "cp", "pp"):
        for members in axis_groups(comm, layout.dp, layout.pp, layout.tp, layout.cp):
            for r in members:
                groups[(comm, r)] = tuple(members)
    for members in axis_groups("dp", layout.dp, layout.pp, layout.tp, layout.cp):  # ep: within each dp group
        for ep_group in expert_groups(layout.dp, layout.ep)[0]:
            for d in ep_group:
                groups[("ep", members[d])] = tuple(members[i] for i in ep_group)
    at = {r: 0 for r in programs}
    posted = {r: False for r in programs}
    waiting = {r: None for r in programs}          # the receives an exchange still waits for
    channels: dict = defaultdict(deque)             # (source, destination, comm) -> [(bytes, label)]
    started: dict = defaultdict(list)               # (comm, rank) -> the collectives it started, in order

    def current(r):
        return programs[r][at[r]] if at[r] < len(programs[r]) else None

    def start(r, op) -> int:
        mine = started[(op.comm, r)]
        n = len(mine)
        for m in groups[(op.comm, r)]:
            theirs = started[(op.comm, m)]
            if m != r and len(theirs) > n and (theirs[n].what, theirs[n].nbytes) != (op.what, op.nbytes):
                raise StepCommError(f"{op.comm} group {list(groups[(op.comm, r)])}, collective #{n}: rank {m} runs "
                                    f"{theirs[n].describe()}, rank {r} {op.describe()}")
        mine.append(op)
        return n

    def complete(r, comm, index) -> bool:
        return all(len(started[(comm, m)]) > index for m in groups[(comm, r)])

    progress = True
    while progress:
        progress = False
        for r in programs:
            op = current(r)
            if op is None:
                continue
            if op.what == "exchange":
                if not posted[r]:
                    for dst, n in op.sends:
                        channels[(r, dst, op.comm)].append((n, op.label))
                    posted[r], waiting[r], progress = True, list(op.recvs), True
                for src, n in list(waiting[r]):
                    queue = channels[(src, r, op.comm)]
                    if queue:
                        sent, label = queue.popleft()
                        if sent != n:
                            raise StepCommError(f"rank {r} receives {n} B from rank {src} ({op.label}) but rank {src} "
                                                f"sent {sent} B ({label})")
                        waiting[r].remove((src, n))
                        progress = True
                if not waiting[r]:
                    at[r], posted[r], progress = at[r] + 1, False, True
            elif op.what in STARTED:
                if not posted[r]:
                    posted[r], waiting[r], progress = True, start(r, op), True
                if op.what not in BLOCKING or complete(r, op.comm, waiting[r]):
                    at[r], posted[r], progress = at[r] + 1, False, True
            elif complete(r, op.comm, op.index):       # a wait
                at[r], progress = at[r] + 1, True
    stuck = {r: current(r) for r in programs if current(r) is not None}
    if stuck:
        raise StepCommError("deadlock: " + "; ".join(f"rank {r} waits in {op.describe()}" for r, op in stuck.items()))
    unread = {k: q for k, q in channels.items() if q}
    if unread:
        (src, dst, comm), q = next(iter(unread.items()))
        raise StepCommError(f"rank {src} sends {q[0][0]} B to rank {dst} on {comm} ({q[0][1]}) that it never receives")


def check_step(layout, model_cfg, seq_len: int, itemsize: int) -> None:
    """The pre-flight proof of ``layout``'s step (see the module docstring); StepCommError when it
    fails. Nothing to prove without cp, pp, ep or ZeRO-3."""
    if layout.cp == 1 and layout.pp == 1 and layout.ep == 1 and layout.zero != 3:
        return
    small = reduced(layout)
    simulate_step(small, step_programs(small, model_cfg, seq_len, itemsize))
