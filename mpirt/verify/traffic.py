"""The communication a verified step recorded, held to what its layout predicts.

Each rank's calls during a side's first whole step (forward, backward, gradient sync, clip and
update) come from the process's registry (:data:`mpirt.comm.stats`: op, axis, bytes and dtype per
call; objects and barriers carry no dtype and are left out: they are the start-up agreements).
The prediction has two sources, which become a count per ``(axis, kind, bytes, dtype)`` that
must equal the recorded one:

- the pre-flight proof's program of that rank (:class:`mpirt.parallel.preflight.StepPrograms` on
  the side's layout): the pipeline's sends and receives, ring attention's exchanges, the experts'
  all-to-alls, and the scalar sums that close the step (the loss's broadcast and average, the
  gradient norm's sums: float64 whatever the run's dtype);
- what the engine's parts list themselves (:meth:`mpirt.parallel.engine.Engine.step_calls`):
  tp's calls inside the modules and the sum of sequence parallelism's partial gradients,
  DataParallel's buckets, ZeRO-1's gradient average, ZeRO-1/2's parameter gather, the pipeline's
  tied-embedding gradient sum.

Calls whose number the layout alone does not fix are held to their dtype only (:func:`dtype_only`):
ZeRO-2's streamed reduce-scatters, ZeRO-3's gathers and reduce-scatters. The experts' row exchanges carry what routing sends, which the proof prices at
balanced routing: their count and dtype are compared, not their bytes. Not compared: peers (the
registry records none).

The order (:func:`order_differences`): on the axes whose programs the proof simulates (pp, cp,
ep), each axis's sends, receives and collectives, as three streams (MPI matches messages in the
order they are posted), come in the order of the rank's program, then the tied embedding's sum
and the scalar sums: the program the proof checked is the one the runtime ran.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from mpirt.comm import stats
from mpirt.parallel.preflight import StepPrograms

KIND = {"isend": "send", "irecv": "recv", "iallreduce": "allreduce", "iallgather": "allgather"}  # one kind a call
ANY_BYTES = -1   # an ep row exchange: compared by count and dtype only
ORDERED_AXES = ("pp", "cp", "ep")   # the proof's programs give these axes' order


def recorded(cursor: int) -> list[tuple]:
    """``(axis, kind, bytes, dtype)`` of this process's array calls since ``stats.cursor()`` was ``cursor``."""
    return [(r.axis, KIND.get(r.op, r.op), r.nbytes, np.dtype(r.dtype).name)
            for r in stats.since(cursor) if r.dtype is not None]


def dtype_only(layout, dtype: str) -> dict[tuple, set]:
    """``(axis, kind) -> the dtypes the layout names there`` for the calls held to their dtype only:
    ZeRO-2's streamed and ZeRO-3's gradient reduce-scatters and parameter gathers (the run's dtype)."""
    run = np.dtype(dtype).name
    loose = {}
    dense, edp = ("dp_cp" if layout.cp > 1 else "dp"), ("edp" if layout.ep > 1 else "dp")
    if layout.zero == 2:
        loose.update({(dense, "reduce_scatter"): {run}, (edp, "reduce_scatter"): {run}})
    if layout.zero == 3:
        loose.update({(dense, "reduce_scatter"): {run}, (dense, "allgather"): {run}})
    return loose


def proof_calls(layout, model_cfg, dtype: str, rank: int) -> list[tuple]:
    """``(axis, kind, bytes, dtype, label)`` of rank ``rank``'s proof program, then its scalar
    sums, call by call in program order (an exchange: its sends, then its receives)."""
    program = StepPrograms(layout, model_cfg, dtype, blocks_apart=True)
    dense = "dp_cp" if layout.cp > 1 else "dp"   # the grid's name for dp x cp
    out = []
    for op in program.program(rank) + program.sums(rank):
        axis = dense if op.comm == "dp_cp" else op.comm
        if op.what == "exchange":
            out += [(axis, kind, n, op.dtype, op.label) for kind, pairs in (("send", op.sends), ("recv", op.recvs))
                    for _, n in pairs]
        elif op.what != "wait":
            out.append((axis, KIND.get(op.what, op.what), op.nbytes, op.dtype, op.label))
    return out


def predicted(proof: list[tuple], engine) -> list[tuple]:
    """``(axis, kind, bytes, dtype)`` of every call a rank makes in a step as its proof's calls
    (:func:`proof_calls`) and its ``engine``'s parts list them."""
    return [call[:4] for call in proof] + engine.step_calls()


def differences(layout, model_cfg, dtype: str, rank: int, cursor: int, engine) -> list[str]:
    """What rank ``rank`` of ``layout`` (its ``engine``) recorded since ``cursor`` (one whole step
    in ``dtype``) differs in from :func:`predicted`, one phrase per ``(axis, kind, bytes, dtype)``
    ("cp send of 4096 B float64: 3 recorded, 2 predicted") or per call of a dtype the layout does
    not name (:func:`dtype_only`), then where the calls leave the program's order
    (:func:`order_differences`); empty when none."""
    loose = dtype_only(layout, dtype)

    def named(axis, kind):
        return loose.get((axis, kind))

    def tally(calls):
        return Counter((a, k, ANY_BYTES if a == "ep" and k == "alltoall" and t != "int64" else n, t)
                       for a, k, n, t in calls if named(a, k) is None)
    calls, proof = recorded(cursor), proof_calls(layout, model_cfg, dtype, rank)
    mine, theirs = tally(calls), tally(predicted(proof, engine))
    out = []
    for key in sorted(set(mine) | set(theirs), key=str):
        if mine[key] != theirs[key]:
            axis, kind, n, t = key
            out.append(f"{axis} {kind} of {'the rows routed' if n == ANY_BYTES else f'{n} B'} {t}: "
                       f"{mine[key]} recorded, {theirs[key]} predicted")
    for axis, kind, n, t in sorted(set(calls), key=str):
        allowed = named(axis, kind)
        if allowed is not None and t not in allowed:
            out.append(f"{axis} {kind} of {n} B in {t}: the layout names {' or '.join(sorted(allowed))} there")
    return out + _order(calls, proof, engine)


def order_differences(layout, model_cfg, dtype: str, rank: int, cursor: int, engine) -> list[str]:
    """Where rank ``rank``'s recorded calls on the proof's axes (pp, cp, ep) leave the order of its
    program, one phrase per axis and stream (empty when none); :func:`differences` includes them.
    MPI matches messages in the order they are posted, so each axis's sends, its receives and its
    collectives are three streams whose order must be the program's: a receive posted early (the
    pipeline's, ahead of its compute) keeps its place among the receives. The experts' row
    exchanges compare by dtype (what routing sends). The program is the proof's, then the tied
    embedding's gradient sum and the scalar sums that close the step."""
    return _order(recorded(cursor), proof_calls(layout, model_cfg, dtype, rank), engine)


def _stream(axis: str, kind: str) -> tuple:
    return axis, kind if kind in ("send", "recv") else "collective"


def _order(calls: list[tuple], proof: list[tuple], engine) -> list[str]:
    """:func:`order_differences` of recorded ``calls`` against the rank's ``proof`` calls."""
    tied = [(*call, "the tied embedding's gradient") for call in engine.local.tied_calls()]  # after the backward
    want: dict = {}
    for axis, kind, n, t, label in proof + tied:
        if axis in ORDERED_AXES:
            want.setdefault(_stream(axis, kind), []).append((n, t, label))
    got: dict = {}
    for axis, kind, n, t in calls:
        if axis in ORDERED_AXES:
            got.setdefault(_stream(axis, kind), []).append((n, t))
    out = []
    for key in sorted(set(want) | set(got)):
        mine, theirs = got.get(key, []), want.get(key, [])
        fuzzy = key == ("ep", "collective")
        for i in range(max(len(mine), len(theirs))):
            m = mine[i] if i < len(mine) else None
            w = theirs[i] if i < len(theirs) else None
            same = m is not None and w is not None and m[1] == w[1] and (m[0] == w[0] or (fuzzy and w[1] != "int64"))
            if not same:
                out.append(f"{key[0]} {key[1]} #{i}: recorded {f'{m[0]} B {m[1]}' if m else 'none'}, the program "
                           f"{f'{w[0]} B {w[1]} ({w[2]})' if w else 'none'}")
                break
    return out
