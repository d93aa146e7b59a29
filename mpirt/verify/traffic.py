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
registry records none) and the order of the calls (the proof's simulation checks its programs'
order).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from mpirt.comm import stats
from mpirt.parallel.preflight import StepPrograms

KIND = {"isend": "send", "irecv": "recv", "iallreduce": "allreduce", "iallgather": "allgather"}  # one kind a call
ANY_BYTES = -1   # an ep row exchange: compared by count and dtype only


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


def predicted(layout, model_cfg, seq_len: int, dtype: str, rank: int, engine) -> list[tuple]:
    """``(axis, kind, bytes, dtype)`` of every call rank ``rank`` of ``layout`` makes in a step as
    its proof's program and sums and its ``engine``'s gradient sync list them."""
    program = StepPrograms(layout, model_cfg, seq_len, dtype, blocks_apart=True)
    dense = "dp_cp" if layout.cp > 1 else "dp"   # the grid's name for dp x cp
    want = []
    for op in program.program(rank) + program.sums(rank):
        axis = dense if op.comm == "dp_cp" else op.comm
        if op.what == "exchange":
            want += [(axis, "send", n, op.dtype) for _, n in op.sends] + [(axis, "recv", n, op.dtype) for _, n in op.recvs]
        elif op.what != "wait":
            want.append((axis, KIND.get(op.what, op.what), op.nbytes, op.dtype))
    return want + engine.step_calls()


def differences(layout, model_cfg, seq_len: int, dtype: str, rank: int, cursor: int, engine) -> list[str]:
    """What rank ``rank`` of ``layout`` (its ``engine``) recorded since ``cursor`` (one whole step
    in ``dtype``) differs in from :func:`predicted`, one phrase per ``(axis, kind, bytes, dtype)``
    ("cp send of 4096 B float64: 3 recorded, 2 predicted") or per call of a dtype the layout does
    not name (:func:`dtype_only`); empty when none."""
    loose = dtype_only(layout, dtype)

    def named(axis, kind):
        return loose.get((axis, kind))

    def tally(calls):
        return Counter((a, k, ANY_BYTES if a == "ep" and k == "alltoall" and t != "int64" else n, t)
                       for a, k, n, t in calls if named(a, k) is None)
    calls = recorded(cursor)
    mine, theirs = tally(calls), tally(predicted(layout, model_cfg, seq_len, dtype, rank, engine))
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
    return out
