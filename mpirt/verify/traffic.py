"""The communication a verified step recorded, held to what the pre-flight proof predicts.

Each rank's calls during a side's first step come from the process's registry
(:data:`mpirt.comm.stats`: op, axis, bytes per call); the prediction is that rank's program of
one step (:class:`mpirt.parallel.preflight.StepPrograms`, on the side's layout), with the
pipeline's tied-embedding gradient sum added (:func:`tied_sum`: the proof leaves it out). Both
become a count per ``(axis, kind, bytes)`` on the axes whose calls the proof lists one by one
(:data:`AXES`): the pipeline's sends and receives, ring attention's, the experts' all-to-alls.
Not compared: ZeRO-3's gathers and reduce-scatters (the proof takes a chunk's blocks as one unit,
the runtime gathers per unit group), dp's gradient sync, tp's collectives inside ops, the loss's
average, peers (the registry records none) and dtypes (it records bytes). The experts' row
exchanges carry what routing sends, which the proof prices at balanced routing: their count is
compared, not their bytes.
"""
from __future__ import annotations

from collections import Counter

from mpirt.comm import stats
from mpirt.parallel.preflight import StepPrograms

AXES = ("pp", "cp", "ep")
KIND = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv", "alltoall": "alltoall"}
ANY_BYTES = -1   # an ep row exchange: compared by count only


def recorded(cursor: int) -> list[tuple]:
    """``(axis, kind, bytes)`` of this process's calls on :data:`AXES` since ``stats.cursor()`` was ``cursor``."""
    return [(r.axis, KIND[r.op], r.nbytes) for r in stats.since(cursor) if r.axis in AXES and r.op in KIND]


def tied_sum(stage) -> list[tuple]:
    """``(axis, kind, bytes)`` of the pipeline's tied-embedding gradient sum, which the proof
    leaves out: a send and a receive of each tied copy's gradient (under ZeRO-3 its shard)
    between the two pipeline ends (``stage``: the engine's :class:`PipelineStage`; none without pp)."""
    if getattr(stage, "pp", 1) == 1 or not stage.tied_names or not (stage.has_embed or stage.has_head):
        return []
    named = dict(stage.model.named_parameters())
    grads = stage.tied_grads() if stage.tied_grads else [named[name].grad for name in stage.tied_names]
    return [("pp", kind, g.nbytes) for g in grads for kind in ("send", "recv")]


def differences(layout, model_cfg, seq_len: int, itemsize: int, rank: int, cursor: int,
                known: list[tuple] = ()) -> list[str]:
    """What rank ``rank`` of ``layout`` recorded since ``cursor`` (:func:`recorded`, one step) more
    or fewer of than its program of one step predicts, one phrase per ``(axis, kind, bytes)``
    ("cp send of 4096 B: 3 recorded, 2 predicted"); empty when they are the same. ``known``: calls
    the proof leaves out that the rank also makes (:func:`tied_sum`)."""
    program = StepPrograms(layout, model_cfg, seq_len, itemsize)
    want = list(known)
    for op in program.program(rank):
        if op.comm not in AXES:
            continue
        if op.what == "exchange":
            want += [(op.comm, "send", n) for _, n in op.sends] + [(op.comm, "recv", n) for _, n in op.recvs]
        elif op.what != "wait":
            want.append((op.comm, KIND[op.what], op.nbytes))

    def tally(calls):
        return Counter((a, k, ANY_BYTES if a == "ep" and k == "alltoall" and n != program.counts_bytes else n)
                       for a, k, n in calls)
    mine, theirs = tally(recorded(cursor)), tally(want)
    out = []
    for key in sorted(set(mine) | set(theirs), key=str):
        if mine[key] != theirs[key]:
            axis, kind, n = key
            out.append(f"{axis} {kind} of {'the rows routed' if n == ANY_BYTES else f'{n} B'}: "
                       f"{mine[key]} recorded, {theirs[key]} predicted")
    return out
