"""Pipeline schedules measured against their theory: bubble fraction, activation memory, throughput.

    mpiexec -n 4 python bench/pipeline.py [--pp 2 4] [--microbatches 4 8 16] [--repeats 5]

For each pp (the first pp ranks of the world run the pipeline; the other ranks sleep until it is
done, so that they take no CPU), each schedule (gpipe, 1f1b, interleaved with 2 chunks, zb-h1) and
each number of micro-batches m, a compute-dominated MLP language model (wide blocks, tiny
vocabulary; float32, one BLAS thread per rank) is trained for ``warmup + repeats`` steps, each
started together on the pipeline ranks (a barrier before it, not timed); the schedules of one
(pp, m) take their steps in turn, step by step, so that outside load hits them alike. Reported
(medians over the repeats; the step time also with its spread):

- ``bubble``: idle time over step time, from the executor's per-rank timers: ``1 - compute_r /
  step``, with ``compute_r`` rank r's time in F/B/W and ``step`` the longest rank's schedule wall
  time (all ranks start together), averaged over the ranks;
- ``theory``: ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v m+p-1)`` interleaved, and for
  ZB-H1 ``(p-1)(F+B-W)`` over ``m(F+B+W) + (p-1)(F+B-W)`` with this run's measured F, B and W;
- ``model``: the bubble that the schedule simulator predicts from this run's measured per-rank
  op times (the performance model of :mod:`mpirt.parallel.pipeline.check`);
- ``peak stash``: activations (micro-batch x chunk) stashed at once, most loaded rank, and their
  bytes (estimated from the arrays the autograd graph keeps alive);
- step time (the executor's), tokens/s, and ZB-H1's step time over 1F1B's.

Ranks that share cores distort idle time: when more pipeline ranks compute at once than there are
cores, each op slows down; ``--wait poll`` (default) makes a waiting rank sleep between MPI tests
instead of spinning on a core. The header prints the core count; judge pp > cores accordingly.
Prints a table with the machine load (bench/common.py) and writes bench/results/pipeline.{md,json}
(rank 0).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common as BC  # noqa: E402
import numpy as np  # noqa: E402

from mpirt.comm import Comm, world_comm  # noqa: E402
from mpirt.parallel.grid import Grid  # noqa: E402
from mpirt.core.optim import AdamW  # noqa: E402
from mpirt.parallel.pipeline.stage import PipelineStage  # noqa: E402
from mpirt.parallel.pipeline.check import simulate, theoretical_bubble  # noqa: E402
from mpirt.parallel.pipeline.schedules import BACKWARD, FORWARD, WEIGHT, build  # noqa: E402
from mpirt.models import GPTConfig  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def wait_sleeping(comm: Comm, source: int, tag: int = 77) -> None:
    """Block until ``source`` sends a token, sleeping between tests (takes no CPU)."""
    buf = np.zeros(1)
    h = comm.irecv(buf, source, tag)
    while not h.test():
        time.sleep(0.005)


def run_round_robin(g, cfg, names, m, args) -> list:
    """Train one stage per schedule, their steps taking turns (bench/common.py: so that load from
    elsewhere on the machine hits every schedule alike); returns the per-schedule summaries."""
    pp = g.comm["pp"]
    stages, opts, steps = {}, {}, {}
    for name in names:
        chunks = 2 if name == "interleaved" else 1
        stages[name] = PipelineStage.standalone(cfg, g, name, m, chunks, dtype="float32", seed=0, wait=args.wait)
        opts[name] = AdamW(stages[name].parameters(), lr=1e-4)
        steps[name] = []
    rng = np.random.default_rng(0)
    rows = args.rows * m
    x = rng.integers(0, cfg.vocab_size, (rows, args.seq))
    y = rng.integers(0, cfg.vocab_size, (rows, args.seq))

    def contender(name):
        def step():
            opts[name].zero_grad()  # the stage adds to the gradients it finds
            t0 = time.perf_counter()
            stages[name].train_step(x, y)
            wall = time.perf_counter() - t0
            opts[name].step()
            steps[name].append(dict(stages[name].stats, wall_s=wall))
        return step
    BC.alternate({name: contender(name) for name in names}, args.repeats, warmup=args.warmup, before=pp.barrier)
    steps = {name: s[args.warmup:] for name, s in steps.items()}
    return [summarize(g, name, m, steps[name], rows, args) for name in names]


def summarize(g, name, m, steps, rows, args) -> dict:
    """Per-rank medians gathered over pp; bubble against theory and the simulator's model."""
    chunks = 2 if name == "interleaved" else 1
    mine = {k: statistics.median(s[k] for s in steps) for k in ("step_s", "compute_s", "wall_s")}
    mine["op_s"] = {op: statistics.median(s["op_s"][op] / max(s["op_count"][op], 1) for s in steps)
                    for op in steps[0]["op_s"]}
    mine["peak_stash"] = steps[-1]["peak_stash"]
    mine["peak_stash_bytes"] = steps[-1]["peak_stash_bytes"]
    every = g.comm["pp"].allgather_object(mine)
    per_rank = g.comm["pp"].allgather_object([s["step_s"] for s in steps])
    p = g.pp
    sched = build(name, p, m, chunks)
    op_cost = [e["op_s"] for e in every]
    model = simulate(sched, costs=lambda r, a: op_cost[r][a.op] if a.op in op_cost[r] else 0.0)
    mean_op = {op: statistics.mean(c[op] for c in op_cost) for op in op_cost[0]}
    theory = theoretical_bubble(name, p, m, chunks, costs=mean_op if name == "zb-h1" else None)
    step = max(e["step_s"] for e in every)  # the pipeline's step: all ranks started together
    idle = [1.0 - e["compute_s"] / step for e in every]
    return {
        "schedule": name, "pp": p, "microbatches": m, "chunks": chunks,
        "bubble": statistics.mean(idle), "bubble_per_rank": idle,
        "theory": theory, "model": model.bubble, "model_step_s": model.makespan,
        "step_s": step, "step_spread_s": BC.spread(max(ts) for ts in zip(*per_rank)),
        "wall_s": max(e["wall_s"] for e in every),
        "tokens_per_s": rows * args.seq / max(e["wall_s"] for e in every),
        "op_s": mean_op,
        "peak_stash": [e["peak_stash"] for e in every], "peak_stash_bytes": [e["peak_stash_bytes"] for e in every],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--wait", choices=["poll", "block"], default="poll")
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="wait up to this many seconds for a quiet machine before starting")
    ap.add_argument("--name", default="pipeline", help="results file name under bench/results")
    args = ap.parse_args()

    world = world_comm()
    cfg = GPTConfig(n_layer=args.layers, n_head=1, n_embd=args.embd, n_inner=args.hidden, n_positions=args.seq,
                    vocab_size=args.vocab, model_type="mlp")
    results = []
    if world.rank == 0:
        BC.wait_for_quiet(args.quiet_wait)
    world.barrier()
    load = BC.LoadMonitor().start()
    for p in args.pp:
        if p > world.size:
            continue
        active = world.rank < p
        sub = world.split(0 if active else 1, key=world.rank)
        if not active:
            wait_sleeping(world, 0)
            sub.free()
            continue
        g = Grid(dp=1, pp=p, tp=1, comm=sub)
        for m in args.microbatches:
            names = [n for n in args.schedules if not (n == "interleaved" and (m % p or args.layers < 2 * p))]
            row = {r["schedule"]: r for r in run_round_robin(g, cfg, names, m, args)}
            for r in row.values():
                if "1f1b" in row:
                    r["vs_1f1b"] = r["step_s"] / row["1f1b"]["step_s"]
                results.append(r)
        g.free()
        sub.free()
        if world.rank == 0:
            for r in range(p, world.size):
                world.send(np.zeros(1), r, 77)
    load.stop(world.mpi.allreduce(load.own_since_start()))
    if world.rank == 0:
        table = [[r["pp"], r["microbatches"], r["schedule"], f"{100 * r['bubble']:.1f}%",
                  f"{100 * r['theory']:.1f}%", f"{100 * r['model']:.1f}%", BC.fmt_spread(r["step_spread_s"]),
                  f"{r['tokens_per_s']:.0f}", "/".join(f"{1e3 * r['op_s'].get(k, 0):.1f}"
                                                            for k in (FORWARD, BACKWARD, WEIGHT)),
                  max(r["peak_stash"]), f"{max(r['peak_stash_bytes']) / 2**20:.1f}",
                  f"{r['vs_1f1b']:.2f}" if "vs_1f1b" in r else ""] for r in results]
        header = ["pp", "m", "schedule", "bubble", "theory", "model", "step ms", "tok/s", "F/B/W ms",
                  "peak stash", "stash MB", "vs 1f1b"]
        notes = [f"MLP n_layer={args.layers} n_embd={args.embd} hidden={args.hidden} vocab={args.vocab} "
                 f"T={args.seq}, {args.rows} rows/micro-batch, float32, world {world.size} ranks on "
                 f"{BC.cores()} cores, wait={args.wait}; step: median [min-max] of {args.repeats} "
                 "(slowest rank), schedules alternated step by step; other columns: medians"]
        BC.write_results(args.name, "Pipeline schedules against their theory", header, table, load,
                         {"world_size": world.size, "model": vars(args) | {"type": "mlp"}, "results": results},
                         notes)


if __name__ == "__main__":
    main()
