"""Tensor parallelism at tp = 1, 2, 4 (each with and without sequence parallelism) on one GPT:
step time, bytes moved per transformer layer per step against the theory, memory per rank.

    mpiexec -n 4 python bench/tp.py [--layers 4 --embd 256 --heads 8 --batch 4 --seq 128 --repeats 8]

For each tp, ranks 0..tp-1 form the tp group and train; the other ranks wait without spinning
(a non-blocking barrier polled with sleeps), so tp ranks share the machine's cores alone. A step is
forward, backward, the sequence-parallel gradient sum, AdamW and zero_grad (float32, one BLAS
thread per rank); the median over ``--repeats`` timed steps after ``--warmup`` is reported.

Bytes moved per layer: the registry (``mpirt.comm.stats``) records every tp collective of one
step; identity Functions placed around each transformer block mark where its forward and
backward begin and end, so each record is attributed to its layer. Each record is converted to
the bytes one rank sends (ring algorithms, nccl-tests' bus bytes): allreduce ``2 (t-1)/t n``,
allgather and reduce-scatter ``(t-1)/t n`` (``n`` the full tensor). Theory per layer and step:
``8 b s h (t-1)/t`` elements (2 allreduces forward, 2 backward); with sequence parallelism the
same ``8 b s h (t-1)/t`` plus ``2 b s h (t-1)/t`` for re-gathering the two column-parallel inputs
in backward (Megatron's choice, which saves their memory).

Memory per rank: parameters, gradients and AdamW state (this rank's shards) and the activations
saved for backward (:func:`mpirt.parallel.tensor.saved_activation_bytes`) against
:func:`mpirt.parallel.tensor.activation_bytes`. Prints a table and writes JSON (rank 0).
"""
from __future__ import annotations

import argparse
import json
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

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpirt import comm as C  # noqa: E402
from mpirt.comm import Comm  # noqa: E402
from mpirt.optim import AdamW  # noqa: E402
from mpirt.parallel import tensor as TP  # noqa: E402
from mpirt.tensor import Function  # noqa: E402
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


def run_config(cfg, args, tp, sp, world):
    active = world.rank < tp
    sub = world.Split(0 if active else MPI.UNDEFINED, world.rank)
    out = None
    if active:
        comm = Comm(sub, "tp")
        rng = np.random.default_rng(0)
        x = rng.integers(0, cfg.vocab_size, (args.batch, args.seq))
        y = rng.integers(0, cfg.vocab_size, (args.batch, args.seq))
        model = GPT(cfg, dtype="float32")
        model = TP.parallelize(model, comm, sequence_parallel=sp, seed=1) if tp > 1 else model.initialize(1)
        opt = AdamW(model.parameters(), lr=1e-4)
        log = []
        mark_blocks(model, log)
        times = []
        for i in range(args.warmup + args.repeats):
            sub.Barrier()
            log.clear()
            C.stats.reset()
            t0 = time.perf_counter()
            _, loss = model(x, y)
            if i == 0:
                act = TP.saved_activation_bytes(loss)
            loss.backward()
            if tp > 1:
                TP.sync_sequence_parallel_grads(model, comm)
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times.append(dt)
        records = list(C.stats.records)
        moved, layer_ops = per_layer_bytes(log, records, tp, cfg.n_layer) if tp > 1 else (0.0, [])
        b, s, h, it = args.batch, args.seq, cfg.n_embd, 4
        theory = 8 * b * s * h * (tp - 1) / tp * it
        theory_sp = theory + 2 * b * s * h * (tp - 1) / tp * it if sp else theory
        state = sum(p.data.nbytes + p.grad.nbytes for p in model.parameters())
        state += sum(a.nbytes for st in opt.state for a in st.values())
        predicted = TP.activation_bytes(n_layer=cfg.n_layer, n_embd=h, n_head=cfg.n_head, hidden=cfg.hidden,
                                        vocab_size=cfg.vocab_size, batch=b, seq_len=s, tp=tp, sequence_parallel=sp)
        step = statistics.median(times)
        step = sub.allreduce(step, op=MPI.MAX)
        out = {"tp": tp, "sp": sp, "step_ms": step * 1e3, "tokens_per_s": b * s / step,
               "layer_bytes": moved, "layer_bytes_theory": theory_sp, "layer_bytes_8bsh": theory,
               "layer_ops": layer_ops, "state_bytes": state, "act_bytes": act, "act_bytes_formula": predicted,
               "comm_s_per_step": sum(r.seconds for r in records if r.axis == "tp")}
        sub.Free()
    idle_until_released(world)
    return world.bcast(out, root=0)


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
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "tp.json"))
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd, n_positions=args.seq,
                    vocab_size=args.vocab)
    sizes = [t for t in (1, 2, 4, 8) if t <= world.size]
    rows = []
    for tp in sizes:
        for sp in ([False] if tp == 1 else [False, True]):
            rows.append(run_config(cfg, args, tp, sp, world))
    if world.rank == 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        print(f"GPT L={cfg.n_layer} h={cfg.n_embd} heads={cfg.n_head} V={cfg.vocab_size}, b={args.batch} "
              f"s={args.seq}, float32; {world.size} ranks on {cores} cores ({socket.gethostname()})")
        print(f"{'tp':>3} {'sp':>3} {'step ms':>9} {'tok/s':>8} {'comm ms':>8} {'layer MB':>9} {'theory MB':>10} "
              f"{'8bsh MB':>8} {'state MB':>9} {'act MB':>8} {'formula':>8}")
        mb = 1 / 2**20
        for r in rows:
            print(f"{r['tp']:>3} {'yes' if r['sp'] else 'no':>3} {r['step_ms']:>9.1f} {r['tokens_per_s']:>8.0f} "
                  f"{r['comm_s_per_step'] * 1e3:>8.1f} {r['layer_bytes'] * mb:>9.3f} {r['layer_bytes_theory'] * mb:>10.3f} "
                  f"{r['layer_bytes_8bsh'] * mb:>8.3f} {r['state_bytes'] * mb:>9.2f} {r['act_bytes'] * mb:>8.2f} "
                  f"{r['act_bytes_formula'] * mb:>8.2f}")
        for r in rows:
            if r["tp"] > 1:
                print(f"tp={r['tp']} sp={r['sp']}: one layer's tp collectives per step: {r['layer_ops']}")
        result = {"config": vars(args), "world_size": world.size, "cores": cores, "host": socket.gethostname(),
                  "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
