"""Data-parallel training step at dp=2: mpirt (overlap by hook Testall, with and without the bound
on allreduces in flight, by a comm thread, and none) against PyTorch DDP (gloo), same GPT, same
global batch, float32, one thread per rank.

    mpiexec -n 2 python bench/dp.py [--layers 4 --embd 256 --batch 8 --seq 64 --repeats 12]

A step is forward, backward, gradient averaging, AdamW and zero_grad, started together on all
ranks (a barrier before each, not timed); configurations take turns step by step. For mpirt,
the *exposed* communication is the time spent waiting in ``DataParallel.finish()``; the *allreduce time* is finish()'s time without overlap (every bucket
allreduced, blocking, after backward). ``hidden = 1 - exposed / allreduce`` (the brief's figure);
``hidden_incl_tests`` also counts the time spent inside the progress ``test()`` calls made from the
gradient hooks as exposed (with ``progress="test"`` the reduction work happens in those calls on
the main thread), and ``saved`` = (step without overlap - step with overlap) / allreduce time is
what overlap actually gains on the step. Prints a table with the spread (median [min-max]) and
the machine load, and writes bench/results/dp.{md,json} (rank 0; bench/common.py).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common as BC  # noqa: E402
from torch_gpt import torch_gpt  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpirt.comm import Comm  # noqa: E402
from mpirt.core.optim import AdamW  # noqa: E402
from mpirt.parallel.ddp import MAX_IN_FLIGHT, DataParallel  # noqa: E402
from mpirt.models import GPT, GPTConfig  # noqa: E402


def init_torch_distributed(world) -> None:
    """gloo process group over a TCP store on localhost; rank and size from MPI."""
    import torch.distributed as dist
    port = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    store = dist.TCPStore("127.0.0.1", port, world.size, is_master=world.rank == 0)
    dist.init_process_group("gloo", store=store, rank=world.rank, world_size=world.size)


class MpirtRunner:
    def __init__(self, cfg, comm, x, y, overlap, progress, bucket_bytes, max_in_flight=MAX_IN_FLIGHT):
        self.model = GPT(cfg, seed=0)
        self.dp = DataParallel(self.model, comm, bucket_bytes=bucket_bytes, overlap=overlap, progress=progress,
                               max_in_flight=max_in_flight)
        self.opt = AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        self.x, self.y = x, y
        self.waits, self.tests = [], []

    def step(self) -> float:
        t_hooks = self.dp.stats["hook_test_s"]
        _, loss = self.dp(self.x, self.y)
        loss.backward()
        self.dp.finish()
        self.waits.append(self.dp.stats["last_wait_s"])
        self.tests.append(self.dp.stats["hook_test_s"] - t_hooks)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


class TorchRunner:
    def __init__(self, cfg, x, y, bucket_mb):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        self.model = DDP(torch_gpt(cfg), bucket_cap_mb=bucket_mb)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)
        self.waits, self.tests = [], []

    def step(self) -> float:
        loss = self.model(self.x, self.y)
        loss.backward()  # DDP's reducer allreduces buckets from autograd hooks and waits at the end
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=2.0, help="bucket size for mpirt and DDP")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="wait up to this many seconds for a quiet machine before starting")
    parser.add_argument("--name", default="dp", help="results file name under bench/results")
    args = parser.parse_args()

    import torch
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = Comm(world, "dp")
    if args.batch % comm.size:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {comm.size} ranks")
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd, n_positions=args.seq,
                    vocab_size=args.vocab)
    rng = np.random.default_rng(0)
    xg = rng.integers(0, cfg.vocab_size, (args.batch, args.seq + 1), dtype=np.int64)
    rows = slice(comm.rank * args.batch // comm.size, (comm.rank + 1) * args.batch // comm.size)
    x, y = np.ascontiguousarray(xg[rows, :-1]), np.ascontiguousarray(xg[rows, 1:])
    init_torch_distributed(world)

    bucket_bytes = int(args.bucket_mb * 2**20)
    runners = {
        "mpirt overlap (hook test)": MpirtRunner(cfg, comm, x, y, True, "test", bucket_bytes),
        "mpirt overlap (hook test, no bound)": MpirtRunner(cfg, comm, x, y, True, "test", bucket_bytes, 0),
        "mpirt overlap (comm thread)": MpirtRunner(cfg, comm, x, y, True, "thread", bucket_bytes),
        "mpirt no overlap": MpirtRunner(cfg, comm, x, y, False, "test", bucket_bytes),
        "torch DDP (gloo)": TorchRunner(cfg, x, y, args.bucket_mb),
    }
    if world.rank == 0:
        BC.wait_for_quiet(args.quiet_wait)
    world.Barrier()
    load = BC.LoadMonitor().start()
    # a step ends when its slowest rank ends: every figure below is per round the slowest rank's
    times = BC.slowest_rank(BC.alternate({k: r.step for k, r in runners.items()}, args.repeats,
                                         warmup=args.warmup, before=world.Barrier), world)
    # the allreduce alone (no compute), for reference: all buckets, blocking
    ref = runners["mpirt no overlap"].dp

    def allreduce_alone():
        for b in ref.buckets:
            comm.allreduce(b.flat, op="avg", out=b.flat)
    alone = BC.slowest_rank(BC.alternate({"alone": allreduce_alone}, args.repeats, before=world.Barrier),
                            world)["alone"]
    waits = BC.slowest_rank({k: r.waits[-args.repeats:] for k, r in runners.items() if r.waits}, world)
    tests = BC.slowest_rank({k: r.tests[-args.repeats:] for k, r in runners.items() if r.tests}, world)
    load.stop(world.allreduce(load.own_since_start()))

    med = statistics.median
    allreduce_s = med(waits["mpirt no overlap"])
    n_params = runners["mpirt no overlap"].model.num_parameters()
    data = {"config": {**vars(args), "dp": comm.size, "params": n_params, "grad_bytes": 4 * n_params,
                       "buckets": len(ref.buckets)},
            "allreduce_alone_s": BC.spread(alone), "allreduce_in_step_s": allreduce_s, "seconds": times,
            "rows": []}
    rows = []
    for name in runners:
        row = {"name": name, "step_s": BC.spread(times[name]),
               "vs_torch_ddp": BC.paired_ratio(times[name], times["torch DDP (gloo)"])}
        if name in waits:
            row["exposed_wait_s"], row["hook_test_s"] = BC.spread(waits[name]), BC.spread(tests[name])
            if name != "mpirt no overlap":
                wait, test = med(waits[name]), med(tests[name])
                row["hidden"] = 1 - wait / allreduce_s
                row["hidden_incl_tests"] = 1 - (wait + test) / allreduce_s
                row["saved"] = (med(times["mpirt no overlap"]) - med(times[name])) / allreduce_s
        data["rows"].append(row)

        def pct(k):
            return f"{100 * row[k]:.0f}%" if k in row else ""
        rows.append([name, BC.fmt_spread(row["step_s"]), BC.fmt_ratio(row["vs_torch_ddp"]),
                     BC.fmt_spread(row["exposed_wait_s"]) if name in waits else "",
                     BC.fmt_spread(row["hook_test_s"]) if name in waits else "",
                     pct("hidden"), pct("hidden_incl_tests"), pct("saved")])
    if comm.rank == 0:
        c = data["config"]
        notes = [f"dp={comm.size}: GPT {args.layers}x{args.embd} vocab {args.vocab}, {n_params:,} params "
                 f"({c['grad_bytes'] / 2**20:.1f} MiB grads, {c['buckets']} buckets of {args.bucket_mb} MiB), "
                 f"global batch {args.batch}x{args.seq}, float32, 1 thread/rank; median [min-max] of "
                 f"{args.repeats} steps (slowest rank per step), configurations alternated step by step",
                 f"allreduce of all buckets alone {BC.fmt_spread(data['allreduce_alone_s'])} ms, "
                 f"after backward {1e3 * allreduce_s:.1f} ms",
                 f"hook test: at most {MAX_IN_FLIGHT} allreduces in flight, a full bucket beyond them launched "
                 "by a later hook or finish(), whose waits for room count as exposed (the default); no bound: "
                 "every bucket launched as it fills"]
        header = ["configuration", "step ms", "/DDP", "wait ms", "tests ms", "hidden", "+tests", "saved"]
        BC.write_results(args.name, "Data-parallel step: mpirt against PyTorch DDP", header, rows, load, data, notes)
    for r in runners.values():
        if isinstance(r, MpirtRunner):
            r.dp.close()
    import torch.distributed as dist
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
