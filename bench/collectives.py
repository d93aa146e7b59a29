"""Collective and point-to-point bandwidth, nccl-tests style: mpirt's Comm against raw mpi4py.

For allreduce, reduce_scatter, allgather (float32) and a send/recv ping-pong between ranks 0 and 1,
at sizes from 8 B to 64 MiB, both implementations run on the same preallocated arrays in one run,
called alternately (mpirt, raw, raw, mpirt, ...) so that both see the same machine load. Every
call is timed; the table shows, over the repeats, the median [min-max] of each repeat's median call
on the slowest rank, and the machine load with a warning when it was too high (bench/common.py). Bytes follow nccl-tests: the array for allreduce,
the full input for reduce_scatter, the full output for allgather, the message for p2p.

    algbw = bytes / time            busbw = algbw * factor
    factor: allreduce 2(n-1)/n, reduce_scatter and allgather (n-1)/n, p2p 1

    mpiexec -n 2 python bench/collectives.py [--min-bytes 8] [--max-bytes 64M] [--factor 2]
                                             [--repeats 5] [--quiet-wait 300]

mpirt's calls are the ones its parallel code makes: ``allreduce(x, out=x)`` in place,
``reduce_scatter(x, out=chunk)``, ``allgather_flat(chunk, n, out=full)`` and ``send``/``recv``;
raw mpi4py uses the same MPI calls on the same buffers.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as BC  # noqa: E402
from mpirt import comm as C  # noqa: E402

W = MPI.COMM_WORLD
OPS = ("allreduce", "reduce_scatter", "allgather", "p2p")


def parse_size(s: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


def bus_factor(op: str, n: int) -> float:
    return {"allreduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "allgather": (n - 1) / n}.get(op, 1.0)


def make_calls(op: str, nbytes: int, comm: C.Comm):
    """(mpirt call, raw mpi4py call, bytes moved) for ``op`` on float32 arrays of about ``nbytes``."""
    n, rank, mpi = comm.size, comm.rank, comm.mpi
    count = max(1, nbytes // 4)
    if op == "allreduce":
        x = np.ones(count, np.float32)
        return (lambda: comm.allreduce(x, out=x),
                lambda: mpi.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM), x.nbytes)
    if op in ("reduce_scatter", "allgather"):
        count = max(n, count // n * n)  # equal chunks, as nccl-tests uses
        x, full = np.ones(count, np.float32), np.ones(count, np.float32)
        chunk = np.ones(count // n, np.float32)
        if op == "reduce_scatter":
            return (lambda: comm.reduce_scatter(x, out=chunk),
                    lambda: mpi.Reduce_scatter_block([x, MPI.FLOAT], [chunk, MPI.FLOAT], MPI.SUM), x.nbytes)
        return (lambda: comm.allgather_flat(chunk, count, out=full),
                lambda: mpi.Allgather([chunk, MPI.FLOAT], [full, MPI.FLOAT]), full.nbytes)
    x = np.ones(count, np.float32)
    if rank == 0:
        def mpirt_pp():
            comm.send(x, 1)
            comm.recv(x, 1)

        def raw_pp():
            mpi.Send([x, MPI.FLOAT], 1)
            mpi.Recv([x, MPI.FLOAT], 1)
    elif rank == 1:
        def mpirt_pp():
            comm.recv(x, 0)
            comm.send(x, 0)

        def raw_pp():
            mpi.Recv([x, MPI.FLOAT], 0)
            mpi.Send([x, MPI.FLOAT], 0)
    else:
        def mpirt_pp():
            pass
        raw_pp = mpirt_pp
    return mpirt_pp, raw_pp, x.nbytes


def time_pairs(mine, raw, iters: int) -> tuple[list, list]:
    """Per-call seconds of ``mine`` and of ``raw``, called alternately (the order flipping every
    iteration, so that both see the same load), after a barrier."""
    W.Barrier()
    clock = time.perf_counter
    t_mine, t_raw = [], []
    for i in range(iters):
        if i % 2:
            t0 = clock(); raw(); t1 = clock(); mine(); t2 = clock()  # noqa: E702
            t_raw.append(t1 - t0)
            t_mine.append(t2 - t1)
        else:
            t0 = clock(); mine(); t1 = clock(); raw(); t2 = clock()  # noqa: E702
            t_mine.append(t1 - t0)
            t_raw.append(t2 - t1)
    return t_mine, t_raw


def run(op: str, nbytes: int, comm: C.Comm, repeats: int, budget: float) -> dict:
    mine, raw, nbytes = make_calls(op, nbytes, comm)
    for fn in (mine, raw, mine, raw):  # warm-up
        fn()
    # choose the loop length from a few timed pairs so that all repeats take about ``budget`` s
    probe = W.bcast(sum(map(statistics.median, time_pairs(mine, raw, 4))), root=0)
    iters = 2 * int(min(500, max(2, budget / repeats / 2 / max(probe, 1e-7))))
    per_repeat = {"mpirt": [], "raw": []}                   # each repeat's median call
    for _ in range(repeats):
        a, b = time_pairs(mine, raw, iters)
        per_repeat["mpirt"].append(statistics.median(a))
        per_repeat["raw"].append(statistics.median(b))
    per_repeat = BC.slowest_rank(per_repeat, W)             # the slowest rank's, per repeat
    if op == "p2p":  # one round trip is two messages
        per_repeat = {k: [t / 2 for t in v] for k, v in per_repeat.items()}
    tm, tr = (statistics.median(per_repeat[k]) for k in ("mpirt", "raw"))
    f = bus_factor(op, comm.size)
    row = {"op": op, "bytes": nbytes, "iters": iters, "ranks": comm.size,
           "mpirt_s": BC.spread(per_repeat["mpirt"]), "raw_s": BC.spread(per_repeat["raw"]),
           "mpirt_us": tm * 1e6, "raw_us": tr * 1e6,
           "mpirt_algbw": nbytes / tm / 1e9, "raw_algbw": nbytes / tr / 1e9}
    row["mpirt_busbw"], row["raw_busbw"] = row["mpirt_algbw"] * f, row["raw_algbw"] * f
    row["ratio"] = row["mpirt_busbw"] / row["raw_busbw"]
    row["time_ratio"] = BC.paired_ratio(per_repeat["mpirt"], per_repeat["raw"])  # mpirt/raw time
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--min-bytes", default="8")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--factor", type=int, default=2, help="size step (2 or 4)")
    ap.add_argument("--repeats", type=int, default=5, help="barrier-separated loops of calls")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds per (op, size), both implementations")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="wait up to this many seconds for a quiet machine before starting")
    ap.add_argument("--name", default="collectives", help="results file name under bench/results")
    args = ap.parse_args(argv)
    if W.size < 2:
        sys.exit("run under mpiexec with at least 2 ranks: mpiexec -n 2 python bench/collectives.py")
    comm = C.Comm(W, axis="bench")
    C.stats.enabled = True  # the registry stays on: its cost is part of what is measured
    sizes, s = [], parse_size(args.min_bytes)
    while s <= parse_size(args.max_bytes):
        sizes.append(s)
        s *= args.factor
    if W.rank == 0:
        BC.wait_for_quiet(args.quiet_wait)
    W.Barrier()
    load = BC.LoadMonitor().start()
    rows = [run(op, nbytes, comm, args.repeats, args.budget) for op in args.ops.split(",") for nbytes in sizes]
    load.stop(W.allreduce(load.own_since_start()))
    if W.rank == 0:
        big = [r["ratio"] for r in rows if r["bytes"] >= 2**20]
        summary = {"ranks": W.size, "min_ratio_ge_1MiB": min(big) if big else None,
                   "median_ratio_ge_1MiB": statistics.median(big) if big else None}
        table = [[r["op"], r["bytes"], BC.fmt_spread(r["mpirt_s"], 1e6), BC.fmt_spread(r["raw_s"], 1e6),
                  f"{r['mpirt_algbw']:.3f}", f"{r['raw_algbw']:.3f}", f"{r['mpirt_busbw']:.3f}",
                  f"{r['raw_busbw']:.3f}", f"{r['ratio']:.2f}", BC.fmt_ratio(r["time_ratio"])] for r in rows]
        header = ["op", "bytes", "mpirt us", "raw us", "mpirt algbw", "raw algbw", "mpirt busbw", "raw busbw",
                  "ratio", "time ratio"]
        notes = [f"{W.size} ranks, float32; call times: median [min-max] over {args.repeats} repeats of each "
                 "repeat's median call (slowest rank), mpirt and raw alternated call by call; bandwidths in "
                 "GB/s from the medians; ratio = mpirt/raw busbw; time ratio = mpirt/raw per repeat",
                 (f"mpirt/raw busbw at >= 1 MiB: min {summary['min_ratio_ge_1MiB']:.3f}, median "
                  f"{summary['median_ratio_ge_1MiB']:.3f}") if big else "no sizes >= 1 MiB",
                 f"MPI: {MPI.Get_library_version().splitlines()[0]}"]
        BC.write_results(args.name, "Collectives: mpirt Comm against raw mpi4py", header, table, load,
                         {"summary": summary, "rows": rows}, notes)


if __name__ == "__main__":
    main()
