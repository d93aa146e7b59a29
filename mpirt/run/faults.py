"""Fault injection for the tests of what a job does when something goes wrong.

``MPIRT_FAULT`` (read once per process) lists faults as ``KIND@RANK:STEP`` separated by commas,
e.g. ``MPIRT_FAULT=stall@1:3`` makes world rank 1 sleep forever at the start of step 3 (counted
from 1, the step the metrics call ``step``). Kinds:

- ``stall``  sleep (for ``stall=SECONDS@RANK:STEP``, else forever): a hung node or a deadlock;
- ``exit``   ``sys.exit(3)``: a rank that quits on its own;
- ``vanish`` ``os._exit(0)``: a library calling ``exit(0)`` mid-run (no summary, no checkpoint,
  exit code 0: what a job script must not read as finished);
- ``kill``   SIGKILL to itself: a rank killed by the OOM killer or a node failure;
- ``raise``  a RuntimeError: a bug on one rank;
- ``signal`` SIGTERM to itself: the scheduler's notice on one rank only;
- ``diskfull`` from then on no file of this process may grow past 64 KiB (RLIMIT_FSIZE, writes
  fail with EFBIG): a full disk or quota, after MPI started (its shared memory is unaffected);
- ``slow``   ``slow=SECONDS@RANK:STEP``: from step STEP on, every step of that rank sleeps
  SECONDS inside its compute (:func:`slowdown`, which the training loop calls within the step):
  a straggler (a slower node, a throttled GPU) that the others then wait for;
- ``alloc``  ``alloc=MIB@RANK:STEP``: that rank allocates and touches MIB MiB it never frees (a
  leak, or a step that needs more memory than predicted: the memory budget's in-run stop);
- ``overflow`` that rank seeds the step's backward with an infinite loss scale
  (:func:`loss_scale_factor`), so its gradients overflow: a float16 overflow on one rank.

Without the variable :func:`inject`, :func:`slowdown` and :func:`loss_scale_factor` are one loop
over an empty list.
"""
from __future__ import annotations

import os
import resource
import signal
import sys
import time
from typing import NamedTuple

KINDS = ("stall", "exit", "vanish", "kill", "raise", "signal", "diskfull", "slow", "alloc", "overflow")
_HELD: list = []  # what alloc faults took


class Fault(NamedTuple):
    kind: str
    rank: int
    step: int
    seconds: float | None = None


def parse(text: str) -> list[Fault]:
    """The faults of a ``MPIRT_FAULT`` value; ValueError names the bad entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            what, where = entry.split("@")
            kind, _, seconds = what.partition("=")
            rank, step = (int(v) for v in where.split(":"))
            if kind not in KINDS or (seconds and kind not in ("stall", "slow", "alloc")) or (
                    kind in ("slow", "alloc") and not seconds):
                raise ValueError
            faults.append(Fault(kind, rank, step, float(seconds) if seconds else None))
        except ValueError:
            raise ValueError(f"MPIRT_FAULT: cannot read {entry!r}; expected KIND@RANK:STEP with KIND one of "
                             f"{', '.join(KINDS)} (stall=SECONDS@RANK:STEP for a finite stall, slow=SECONDS@RANK:STEP)") from None
    return faults


_FAULTS = parse(os.environ.get("MPIRT_FAULT", ""))


def inject(rank: int, step: int) -> None:
    """Trigger the faults listed for world rank ``rank`` at step ``step`` (no-op when none)."""
    for fault in _FAULTS:
        if fault.rank != rank or fault.step != step or fault.kind in ("slow", "overflow"):
            continue
        print(f"mpirt.run.faults: rank {rank} step {step}: injecting {fault.kind}", file=sys.stderr, flush=True)
        if fault.kind == "stall":
            if fault.seconds is None:
                while True:
                    time.sleep(3600)
            time.sleep(fault.seconds)
        elif fault.kind == "exit":
            sys.exit(3)
        elif fault.kind == "vanish":
            os._exit(0)
        elif fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "raise":
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
        elif fault.kind == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.kind == "alloc":
            _HELD.append(bytearray(b"\1" * int(fault.seconds * 2**20)))  # written: resident, not just mapped
        elif fault.kind == "diskfull":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def slowdown(rank: int, step: int) -> float:
    """Sleep for the ``slow`` faults of world rank ``rank`` active at step ``step``; returns the
    seconds slept (0.0 when none)."""
    seconds = sum((f.seconds for f in _FAULTS if f.kind == "slow" and f.rank == rank and step >= f.step), 0.0)
    if seconds:
        time.sleep(seconds)
    return seconds


def loss_scale_factor(rank: int, step: int) -> float:
    """``inf`` when an ``overflow`` fault is listed for world rank ``rank`` at step ``step``, else 1.0:
    the training loop multiplies the loss scale of that step by it."""
    hit = any(f.kind == "overflow" and f.rank == rank and f.step == step for f in _FAULTS)
    if hit:
        print(f"mpirt.run.faults: rank {rank} step {step}: injecting overflow", file=sys.stderr, flush=True)
    return float("inf") if hit else 1.0
