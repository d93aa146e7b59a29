"""Tensor parallelism at tp = 1, 2, 4 (each with and without sequence parallelism) on one GPT:
step time, bytes moved per transformer layer per step against the theory, memory per rank.

    mpiexec -n 4 python bench/tp.py [--layers 4 --embd 256 --heads 8 --batch 4 --seq 128 --repeats 8]

For each tp, ranks 0..tp-1 form the tp group and train; the other ranks wait without spinning
(a non-blocking barrier polled with sleeps), so tp ranks share the machine's cores alone. A step is
forward, backward, the sequence-parallel gradient sum, AdamW and zero_grad (float32, one BLAS
thread per rank). The configurations take turns step by step (bench/common.py); the median
[min-max] over ``--repeats`` timed steps after ``--warmup`` is reported, with the machine load.

Bytes moved per layer: the registry (``mpirt.comm.stats``) records every tp collective of one
step; identity Functions placed around each transformer block mark where its forward and
backward begin and end, so each record is attributed to its layer. Each record is converted to
the bytes one rank sends (ring algorithms, nccl-tests' bus bytes): allreduce ``2 (t-1)/t n``,
allgather and reduce-scatter ``(t-1)/t n`` (``n`` the full tensor). Theory per layer and step:
``8 b s h (t-1)/t`` elements (2 allreduces forward, 2 backward); with sequence parallelism the
same ``8 b s h (t-1)/t`` plus ``2 b s h (t-1)/t`` for re-gathering the two column-parallel inputs
in backward (Megatron's choice, which saves their memory).

Memory per rank: parameters, gradients and AdamW state (this rank's shards) and the activations
kept for backward (:func:`mpirt.core.nn.kept_bytes`) against the model's formula
(:func:`mpirt.core.modeling.activation_bytes`). Prints a table and writes bench/results/tp.{md,json}
(rank 0).
"""
from __future__ import annotations

import argparse
import os
import socket
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
from mpi4py import MPI  # noqa: E402

from mpirt import comm as C  # noqa: E402
from mpirt.comm import Comm  # noqa: E402
from mpirt.core.nn import kept_bytes  # noqa: E402
from mpirt.core.modeling import activation_bytes  # noqa: E402
from mpirt.parallel.layout import Layout  # noqa: E402
from mpirt.core.optim import AdamW  # noqa: E402
from mpirt.parallel import tensor as TP  # noqa: E402
from mpirt.parallel.flat import FlatParams  # noqa: E402
from mpirt.core.tensor import Function  # noqa: E402
from mpirt.models import GPT, GPTConfig  # noqa: E402

BUS = {"allreduce": lambda t: 2 * (t - 1) / t, "allgather": lambda t: (t - 1) / t,
       "reduce_scatter": lambda t: (t - 1) / t}


class Mark(Function):
    """Identity; logs the registry position when its forward and its backward run."""

    def forward(self, x, tag=None, log=None):
        self.tag, self.log = tag, log
        log.append((tag, "fwd", len(C.stats.records)))
        return x

    def backward(self, g):
        self.log.append((self.tag, "bwd", len(C.stats.records)))
        return (g,)


def mark_blocks(model, log):
    for i, block in enumerate(model.h):
        inner = block.forward

        def forward(x, inner=inner, i=i):
            return Mark.apply(inner(Mark.apply(x, tag=("in", i), log=log)), tag=("out", i), log=log)
        object.__setattr__(block, "forward", forward)


def per_layer_bytes(log, records, t, n_layer):
    """Bytes one rank moves per layer (mean over layers) and the record counts of one layer."""
    pos = {(tag, d): p for tag, d, p in log}
    moved, ops = [], []
    for i in range(n_layer):
        spans = [(pos[(("in", i), "fwd")], pos[(("out", i), "fwd")]),
                 (pos[(("out", i), "bwd")], pos[(("in", i), "bwd")])]
        recs = [r for a, b in spans for r in records[a:b] if r.axis == "tp"]
        moved.append(sum(BUS[r.op](t) * r.nbytes for r in recs))
        ops.append(sorted(r.op for r in recs))
    return statistics.mean(moved), ops[0]


def idle_until_released(world):
    """Wait for the active ranks without burning a core (MPICH's blocking barrier spins)."""
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


class Config:
    """One (tp, sp) configuration: ranks ``0..tp-1`` train, the others idle through its steps."""

    def __init__(self, cfg, args, tp, sp, world):
        self.cfg, self.args, self.tp, self.sp = cfg, args, tp, sp
        self.active = world.rank < tp
        self.sub = world.Split(0 if self.active else MPI.UNDEFINED, world.rank)
        self.act, self.records, self.log = None, [], []
        if self.active:
            self.comm = Comm(self.sub, "tp")
            rng = np.random.default_rng(0)
            self.x = rng.integers(0, cfg.vocab_size, (args.batch, args.seq))
            self.y = rng.integers(0, cfg.vocab_size, (args.batch, args.seq))
            model = GPT(cfg, dtype="float32")
            self.model = TP.parallelize(model, self.comm, sequence_parallel=sp, seed=1) if tp > 1 \
                else model.initialize(1)
            self.store = FlatParams(list(self.model.parameters()))  # the engine's store: SP grads summed there
            self.opt = AdamW(self.model.parameters(), lr=1e-4)
            mark_blocks(self.model, self.log)

    def step(self) -> None:
        """One training step on the active ranks (the caller starts all ranks together)."""
        if not self.active:
            return
        self.log.clear()
        C.stats.reset()
        _, loss = self.model(self.x, self.y)
        if self.act is None:
            self.act = kept_bytes(loss)
        loss.backward()
        if self.tp > 1:
            self.store.sync_partial_grads(self.comm)
        self.opt.step()
        self.opt.zero_grad()
        self.records = list(C.stats.records)

    def summary(self, seconds: list[float]) -> dict:
        """This configuration's row (computed on the active ranks)."""
        cfg, args, tp, sp = self.cfg, self.args, self.tp, self.sp
        moved, layer_ops = per_layer_bytes(self.log, self.records, tp, cfg.n_layer) if tp > 1 else (0.0, [])
        b, s, h, it = args.batch, args.seq, cfg.n_embd, 4
        theory = 8 * b * s * h * (tp - 1) / tp * it
        theory_sp = theory + 2 * b * s * h * (tp - 1) / tp * it if sp else theory
        state = sum(p.data.nbytes + p.grad.nbytes for p in self.model.parameters())
        state += sum(a.nbytes for st in self.opt.state for a in st.values())
        per = activation_bytes(cfg, Layout.micro_batch(b, s, tp=tp, sequence_parallel=sp))
        predicted = per["embed"] + cfg.n_layer * per["block"] + per["head"]
        step = statistics.median(seconds)
        return {"tp": tp, "sp": sp, "step_s": BC.spread(seconds), "tokens_per_s": b * s / step,
                "layer_bytes": moved, "layer_bytes_theory": theory_sp, "layer_bytes_8bsh": theory,
                "layer_ops": layer_ops, "state_bytes": state, "act_bytes": self.act, "act_bytes_formula": predicted,
                "comm_s_per_step": sum(r.seconds for r in self.records if r.axis == "tp")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="wait up to this many seconds for a quiet machine before starting")
    parser.add_argument("--name", default="tp", help="results file name under bench/results")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd, n_positions=args.seq,
                    vocab_size=args.vocab)
    sizes = [t for t in (1, 2, 4, 8) if t <= world.size]
    configs = {f"tp={tp} sp={'yes' if sp else 'no'}": Config(cfg, args, tp, sp, world)
               for tp in sizes for sp in ([False] if tp == 1 else [False, True])}
    if world.rank == 0:
        BC.wait_for_quiet(args.quiet_wait)
    world.Barrier()
    load = BC.LoadMonitor().start()
    # configurations take turns step by step; idle ranks sleep until the step's ranks are done
    times = BC.alternate({k: c.step for k, c in configs.items()}, args.repeats, warmup=args.warmup,
                         before=lambda: idle_until_released(world))
    idle_until_released(world)
    times = BC.slowest_rank(times, world)
    load.stop(world.allreduce(load.own_since_start()))
    rows = [world.bcast(c.summary(times[k]) if c.active and c.sub.rank == 0 else None, root=0)
            for k, c in configs.items()]
    for c in configs.values():
        if c.active:
            c.sub.Free()
    if world.rank == 0:
        cores = BC.cores()
        mb = 1 / 2**20
        table = [[r["tp"], "yes" if r["sp"] else "no", BC.fmt_spread(r["step_s"]), f"{r['tokens_per_s']:.0f}",
                  f"{r['comm_s_per_step'] * 1e3:.1f}", f"{r['layer_bytes'] * mb:.3f}",
                  f"{r['layer_bytes_theory'] * mb:.3f}", f"{r['layer_bytes_8bsh'] * mb:.3f}",
                  f"{r['state_bytes'] * mb:.2f}", f"{r['act_bytes'] * mb:.2f}", f"{r['act_bytes_formula'] * mb:.2f}"]
                 for r in rows]
        notes = [f"GPT L={cfg.n_layer} h={cfg.n_embd} heads={cfg.n_head} V={cfg.vocab_size}, b={args.batch} "
                 f"s={args.seq}, float32; {world.size} ranks on {cores} cores ({socket.gethostname()}); "
                 f"step: median [min-max] of {args.repeats}, configurations alternated step by step"]
        notes += [f"tp={r['tp']} sp={r['sp']}: one layer's tp collectives per step: {r['layer_ops']}"
                  for r in rows if r["tp"] > 1]
        header = ["tp", "sp", "step ms", "tok/s", "comm ms", "layer MB", "theory MB", "8bsh MB", "state MB",
                  "act MB", "formula MB"]
        BC.write_results(args.name, "Tensor parallelism: step time, bytes per layer, memory per rank", header,
                         table, load, {"config": vars(args), "world_size": world.size, "rows": rows,
                                       "seconds": times}, notes)


if __name__ == "__main__":
    main()
