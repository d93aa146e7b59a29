"""The whole step's communication, proven before the first step (pure: no MPI, nothing built).

Each rank's program for one training step is derived from the :class:`~mpirt.parallel.layout.Layout`
(:func:`step_programs`): the pipeline schedule's sends and receives (pp); ring attention's
exchanges (cp: per block and micro-batch, ``cp - 1`` key/value passes forward; backward the
forward's again where the block reruns, then ``cp`` steps each passing the keys' gradient, with
the keys and values but the last; in float32 under half precision); ZeRO-3's unit gathers (the next unit's started, not waited
for, while a unit runs) and gradient reduce-scatters (over dp x cp); a mixture of experts' token
exchanges under ep (per MoE chunk and micro-batch, on the ep group: the counts, the rows out and
the outputs back forward, again where the block reruns, then the two gradients' exchanges
backward; the counts in int64, each rows' all-to-all priced at the rows a rank sends when routing
is balanced, which every member passes alike). Every operation names its dtype, which its peers
must name alike (a collective's dtype comes from the layout, never from a rank's values). :func:`~mpirt.parallel.step_simulation.simulate_step` runs the programs
together (a collective completes once every member of its group started it, members agreeing
on the n-th one's operation and bytes; an exchange's receives match its peers' sends first in,
first out), naming the first disagreement (ranks and operations) or, when ranks wait on each
other, what every stuck rank waits in.

What it covers of the runtime: the operations that interleave across communicators within a
step, in the order the engine issues them (the executor walks the schedule; ring attention posts
a step's sends and receives and waits for them before the next; the experts' all-to-alls are
blocking collectives; ZeRO-3's unit gathers the way :class:`~mpirt.parallel.zero3.ShardedParams`
takes and starts them). Left out of the simulation: the gradient sync of ZeRO-1/2 and data
parallelism (buckets on dp x cp, the experts' on edp, each rank in the same order), the
pipeline's tied-embedding sum, tp's collectives inside ops, and the scalar sums that close the
step (:meth:`StepPrograms.sums` lists them; ``python -m mpirt.verify`` holds a step's recorded
calls to the programs, the sums and the sync's own list, :mod:`mpirt.verify.traffic`).

The grid is reduced for the proof: at most two dp ranks (ep at most 2 with them) and one tp
rank (every dp and tp rank of a stage runs the same program, and tp's collectives live inside
ops), and each chunk's blocks as one block (the ranks of a cp ring, a dp or an ep group hold the
same stage). And it scales with the pipeline's depth, not the world (:func:`check_step`): each
rank checks that its own program is its stage's moved along dp and cp, and the stages' programs,
one rank each, stand for all their ranks in the simulation (65,536 ranks, tp 8 x pp 64 x cp 32:
64 programs; ``bench/preflight_scale.py``).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mpirt.core.precision import is_half
from mpirt.parallel.context import ring_message_bytes, ring_program
from mpirt.parallel.experts import count_bytes, exchange_program, routed_bytes
from mpirt.parallel.grid import grid_rank
from mpirt.parallel.pipeline.schedules import Action, BACKWARD, FORWARD, WEIGHT
from mpirt.parallel.pipeline.stage import message_bytes
from mpirt.parallel.step_simulation import Grid3, Op, StepCommError, first_difference, simulate_step
from mpirt.parallel.zero3 import GatherProgram

__all__ = ["Op", "StepCommError", "StepPrograms", "check_step", "proof_rank", "reduced", "simulate_step",
           "step_programs"]


def reduced(layout):
    """``layout`` on the grid the proof runs on: dp at most 2 (ep at most 2 with it), tp 1."""
    return dataclasses.replace(layout, dp=min(layout.dp, 2), ep=min(layout.ep, 2), tp=1, sequence_parallel=False)


class StepPrograms:
    """The programs of one step on ``layout`` (resolved with the model, at the run's sequence
    length; use :func:`reduced` for the proof's grid), for ``model_cfg`` in ``dtype`` (the run's, a name: ring
    attention's keys and values travel in float32 in half precision): :meth:`program` makes one
    rank's, from what every rank shares (made once here); :meth:`sums` the scalar sums that close
    its step. The proof takes a chunk's blocks as one unit (its programs stay short at any depth);
    ``blocks_apart`` makes each block its own, as the runtime runs them (what a step records)."""

    def __init__(self, layout, model_cfg, dtype: str, blocks_apart: bool = False):
        from mpirt.core.modeling import layer_costs
        self.layout, self.dtype, self.blocks_apart = layout, np.dtype(dtype).name, blocks_apart
        self.itemsize = np.dtype(dtype).itemsize
        self.ring_dtype = "float32" if is_half(dtype) else self.dtype
        self.costs = layer_costs(model_cfg, layout.seq_len)
        # each axis's message sizes, as its module sends them (the planner prices the same)
        self.kv_bytes = ring_message_bytes(layout, model_cfg, dtype)
        self.act_bytes = message_bytes(layout, model_cfg, dtype)
        self.experts = getattr(model_cfg, "n_expert", 0)
        self.routed = routed_bytes(layout, model_cfg, dtype) if self.experts else 0
        self.counts_bytes = count_bytes(layout, model_cfg) if self.experts else 0

    def world(self, pos: dict, **moved) -> int:
        lay, c = self.layout, {**pos, **moved}
        return grid_rank((c["dp"], c["pp"], c["cp"], c["tp"]), dp=lay.dp, pp=lay.pp, cp=lay.cp, tp=lay.tp)

    def units(self, chunk: int, p: int) -> list[tuple[str, int, range]]:
        """(name, parameter bytes, the blocks it holds) of the units of chunk ``chunk`` on pp rank
        ``p``, in forward order (a chunk's blocks as one, or each its own with ``blocks_apart``)."""
        lay, costs = self.layout, self.costs
        s = chunk * lay.pp + p
        lo, hi = lay.bounds[s]
        out = [("embed", costs[0].params, range(0))] if s == 0 else []
        if hi > lo:
            groups = [range(i, i + 1) for i in range(lo, hi)] if self.blocks_apart else [range(lo, hi)]
            out += [(f"h.{g[0]}-{g[-1]}", sum(costs[1 + i].params for i in g), g) for g in groups]
        if s == lay.stages - 1:
            out.append(("head", costs[-1].params, range(0)))
        return [(name, int(n // lay.tp * self.itemsize), blocks) for name, n, blocks in out]

    def exchanges(self, label: str, backward: bool) -> list[Op]:
        """A MoE layer's all-to-alls on the ep group (none without expert parallelism)."""
        if self.layout.ep == 1 or not self.experts:
            return []
        return exchange_program(label, backward, self.counts_bytes, self.routed, self.dtype)

    def program(self, rank: int) -> list[Op]:
        """Rank ``rank``'s program of one step."""
        lay = self.layout
        pp, cp = lay.pp, lay.cp
        pos = lay.position(rank)
        nxt, prv = self.world(pos, cp=(pos["cp"] + 1) % cp), self.world(pos, cp=(pos["cp"] - 1) % cp)

        def ring(label: str, backward: bool) -> list[Op]:
            return ring_program(label, backward, cp, nxt, prv, self.kv_bytes, self.ring_dtype)

        recomputed = set(lay.recomputed)
        ops: list[Op] = []
        gathers = GatherProgram(ops, self.dtype)
        actions = lay.pipeline_schedule.actions[pos["pp"]] if pp > 1 else \
            [Action(op, mb) for mb in range(lay.microbatches) for op in (FORWARD, BACKWARD)]
        for a in actions:
            tag = f"{a.op} mb {a.mb}" + (f" chunk {a.chunk}" if lay.chunks > 1 else "")
            if a.op not in (FORWARD, BACKWARD, WEIGHT):   # the pipeline's messages, one micro-batch each
                one = ((self.world(pos, pp=a.peer), self.act_bytes),)
                ops.append(Op("exchange", "pp", sends=one if a.is_send else (), recvs=() if a.is_send else one,
                              label=f"{a.op} mb {a.mb}", dtype=self.dtype))
                continue
            mine = self.units(a.chunk, pos["pp"])
            order = list(range(len(mine))) if a.op == FORWARD else list(reversed(range(len(mine))))
            for k, j in enumerate(order):            # a chunk's units prefetch their neighbours in it
                unit = mine[j]
                name, _, blocks = unit
                rerun = lay.zero == 3 or any(i in recomputed for i in blocks)
                label = f"{tag} {name}"
                if lay.zero == 3 and a.op != WEIGHT:
                    gathers.gather(unit, mine[order[k + 1]] if k + 1 < len(order) else None, label)
                if blocks and a.op == FORWARD:
                    ops += ring(label, backward=False) + self.exchanges(label, backward=False)
                if blocks and a.op == BACKWARD:
                    if rerun:
                        ops += ring(label + " rerun", backward=False) + self.exchanges(label + " rerun", backward=False)
                    ops += self.exchanges(label, backward=True) + ring(label, backward=True)
                if lay.zero == 3 and (a.op == WEIGHT or (a.op == BACKWARD and not lay.split_backward)):
                    gathers.reduce_scatter(unit, label)
        return ops

    def sums(self, rank: int) -> list[Op]:
        """Rank ``rank``'s scalar sums that close its step, each one float64 (8 B) whatever the
        run's dtype: the last stage's loss broadcast over pp, the loss's average over dp x cp, then
        the gradient norm's sums of squares: ZeRO's shards over dp x cp, the experts' shards over
        edp and their part over ep (under ep, on a stage that holds experts), tp's and pp's slices. The axes
        are the grid's communicators' names (dp x cp is ``dp`` when cp is 1, edp ``dp`` when ep is 1)."""
        lay = self.layout
        dense, edp = ("dp_cp" if lay.cp > 1 else "dp"), ("edp" if lay.ep > 1 else "dp")
        p = lay.position(rank)["pp"]
        experts = self.experts and lay.ep > 1 and lay.zero < 3 and \
            any(lo < hi for lo, hi in (lay.bounds[c * lay.pp + p] for c in range(lay.chunks)))
        axes = [("pp", "broadcast", "the loss from the last stage")] if lay.pp > 1 else []
        axes.append((dense, "allreduce", "the loss's average"))
        if lay.zero and lay.replicas > 1:
            axes.append((dense, "allreduce", "the norm's sum over ZeRO's shards"))
        if experts and lay.zero and lay.dp // lay.ep > 1:
            axes.append((edp, "allreduce", "the norm's sum over the experts' shards"))
        if experts:
            axes.append(("ep", "allreduce", "the norm's sum over the experts"))
        axes += [(axis, "allreduce", f"the norm's sum over {axis}") for axis in ("tp", "pp")
                 if getattr(lay, axis) > 1]
        return [Op(what, axis, 8, label=label, dtype="float64") for axis, what, label in axes]


def step_programs(layout, model_cfg, dtype: str) -> dict[int, list[Op]]:
    """Every rank's program of one step (:class:`StepPrograms`), rank -> its operations."""
    make = StepPrograms(layout, model_cfg, dtype)
    return {rank: make.program(rank) for rank in range(layout.world_size)}


def proof_rank(layout, rank: int) -> int:
    """Where world rank ``rank`` of ``layout`` stands on the proof's grid (:func:`reduced`)."""
    small = reduced(layout)
    pos = layout.position(rank)
    return grid_rank((pos["dp"] % small.dp, pos["pp"], pos["cp"], 0), dp=small.dp, pp=small.pp, cp=small.cp, tp=1)


def check_step(layout, model_cfg, dtype: str, rank: int | None = None) -> None:
    """The pre-flight proof of ``layout``'s step (see the module docstring); StepCommError when it
    fails. Nothing to prove without cp, pp, ep or ZeRO-3.

    Two parts: ``rank``'s own program is its pipeline stage's moved along dp and cp (every rank
    checks its own, in the time of one program; ``rank=None`` checks every rank of the proof's
    grid, one after the other), and the stages' programs, one rank each, run together without a
    mismatch or a deadlock (:func:`~mpirt.parallel.step_simulation.simulate_step`, symmetric)."""
    if layout.cp == 1 and layout.pp == 1 and layout.ep == 1 and layout.zero != 3:
        return
    small = reduced(layout)
    make = StepPrograms(small, model_cfg, dtype)
    grid = Grid3(small)
    stages = {grid.rank(0, p, 0): make.program(grid.rank(0, p, 0)) for p in range(small.pp)}
    mine = range(small.world_size) if rank is None else [proof_rank(layout, rank)]
    for r in mine:
        rep = grid.representative(r)
        why = None if r == rep else first_difference(grid, r, make.program(r), stages[rep])
        if why:
            who = f"rank {r} of the proof's grid" if rank is None else f"rank {rank} (the proof's rank {r})"
            raise StepCommError(f"{who} does not run its pipeline stage's step program, which the proof takes "
                                f"every rank of a stage to run: {why}")
    simulate_step(small, stages, symmetric=True)
