"""Print a pipeline schedule's timeline and its pre-flight check (pure: no MPI).

    python -m mpirt.schedule --pp 4 --microbatches 8 --schedule 1f1b
    python -m mpirt.schedule --pp 4 --microbatches 8 --schedule interleaved --chunks 2
    python -m mpirt.schedule --pp 4 --microbatches 8 --schedule zb-h1 --costs 1,1,1

One row per rank, one column per time unit: ``F3`` is the forward of micro-batch 3 (``F3.1`` on
model chunk 1), ``B3`` its backward (input gradient only under zb-h1), ``W3`` its deferred weight
gradient, ``.`` an idle unit. Default costs: F = 1, B = 2 (B = W = 1 when the backward is split).
Exit status 0 when the check passes, 1 when it fails, 2 for an impossible request.
"""
from __future__ import annotations

import argparse
import sys

from mpirt.parallel.pipeline.check import default_costs, format_timeline, simulate, theoretical_bubble
from mpirt.parallel.pipeline.schedules import (ALIASES, BACKWARD, FORWARD, SCHEDULES, WEIGHT, ScheduleError, build,
                                              canonical_name)


def parse_costs(text: str | None, split: bool) -> dict:
    costs = default_costs(split)
    if text:
        parts = text.split(",")
        if len(parts) not in (2, 3):
            raise ScheduleError(f"--costs: expected F,B[,W] such as 1,2 or 1,1,1, got {text!r}")
        try:
            values = [float(x) for x in parts]
        except ValueError:
            raise ScheduleError(f"--costs: expected numbers, got {text!r}") from None
        if any(x < 0 for x in values):
            raise ScheduleError(f"--costs: costs must be >= 0, got {text!r}")
        costs.update(zip((FORWARD, BACKWARD, WEIGHT), values))
    return costs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpirt.schedule", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    ap.add_argument("--microbatches", "-m", type=int, required=True, help="micro-batches per step")
    ap.add_argument("--schedule", default="1f1b",
                    help=f"one of {', '.join(SCHEDULES)} (the names `mpirt.train --schedule` takes; "
                         f"also accepted: {', '.join(ALIASES)})")
    ap.add_argument("--chunks", type=int, default=None,
                    help="model chunks per rank (interleaved only; default 2 there, else 1)")
    ap.add_argument("--costs", default=None, help="F,B[,W] time units (default 1,2 or 1,1,1 for zb-h1)")
    args = ap.parse_args(argv)
    try:
        name = canonical_name(args.schedule)
        chunks = args.chunks if args.chunks is not None else (2 if name == "interleaved" else 1)
        sched = build(name, args.pp, args.microbatches, chunks)
        costs = parse_costs(args.costs, sched.split_backward)
    except ScheduleError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = simulate(sched, costs)
    c = ", ".join(f"{k}={costs[k]:g}" for k in (FORWARD, BACKWARD, WEIGHT) if sched.split_backward or k != WEIGHT)
    print(f"{sched.name}: pp={sched.pp} microbatches={sched.microbatches} chunks={sched.chunks} ({c})")
    print(format_timeline(result) if result.ok or result.timeline else "(no timeline)")
    print()
    if result.busy:
        for r in range(sched.pp):
            print(f"rank {r}: busy {result.busy[r]:g}, idle {result.idle[r]:g}, "
                  f"peak stashed activations {result.peak_stash[r]}")
        theory = theoretical_bubble(sched.name, sched.pp, sched.microbatches, sched.chunks, costs)
        print(f"bubble: {100 * result.bubble:.1f}% simulated, {100 * theory:.1f}% in theory "
              f"(makespan {result.makespan:g})")
    print(f"check: {result.report()}")
    return 0 if result.ok else 1
