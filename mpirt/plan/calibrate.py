"""``python -m mpirt.plan --calibrate``: this machine's constants for the performance model.

Measured in this process (one BLAS thread, then the node's cores):

- GEMM rate of :func:`mpirt.cpu.threads.matmul` on layer-shaped products (512 rows, ``d x 4d``:
  forward, input and weight gradients) for ``d`` from 32 to 512 (``gemm_rates``, per core; the
  model interpolates in log d: small-matrix rates do not follow one curve, cache sizes show);
  a second thread's speed-up at ``d = 256`` (``threads_per_core``);
- elementwise bandwidth: ``a * b + c`` on 4 M float32 elements (bytes read and written);
- the cost of one autograd Function: one block of the model on a 2 x 4 batch, forward and
  backward, over twice its Functions (``op_overhead_s``);
- ``ew_passes``: what is left of a block's forward + backward on the ``--calib-model`` (default
  ``tiny``) at 4 x 128 tokens after its GEMMs and Functions, in kept-activation bytes at the
  measured bandwidth (the non-GEMM passes' traffic per kept byte).

Measured under ``mpiexec -n N`` for each N of ``--ranks`` (the ranks oversubscribe the cores as the
training runs do): every rank's median forward + backward of the calibration block at once, over
one rank's alone (``compute_by_ranks[N]["slowdown"]``: what sharing the cores costs each rank,
measured rather than assumed); for every group size g dividing N, all groups at once (consecutive ranks),
allreduce, allgather and reduce-scatter of 64 B to 4 MiB, and one-way point-to-point between
neighbours (ping-pong / 2), each timed as 10 calls back to back (the ranks in lockstep, as a
layer's collectives run; a barrier before every single call would add a rescheduling of the
oversubscribed ranks to each); each fitted ``alpha + beta n`` (alpha: the 64-byte time; beta: the
slope to 4 MiB). The process baseline of memory: a 2-rank run of a one-block model
(:func:`measure_process_bytes`). Saved as the preset ``--save-as`` (default ``local``) in
:func:`mpirt.plan.hardware.plan_cache`.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from mpirt.parallel.layout import Layout

SIZES = (64, 256 * 2**10, 4 * 2**20)
REPS = 10  # calls timed back to back per sample


def _timeit(fn, seconds: float = 0.2, min_reps: int = 3, stat=min) -> float:
    """The fastest of repeated calls (least disturbed by other processes), or ``stat`` of them
    (the median for work that spans scheduler time slices: what a rank sharing a core gets)."""
    fn()
    times, t_end = [], time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return stat(times)


def _cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _set_threads(n: int) -> None:
    from mpirt.cpu import threads
    from mpirt.cpu.threads import set_blas_threads

    try:
        set_blas_threads(n)
    except RuntimeError:
        pass
    threads.set_num_threads(n)


def _products_rate(d: int) -> float:
    from mpirt.cpu import threads
    from mpirt.monitor.flops import layer_products

    prods = layer_products(d, 4 * d, 512, "float32")
    flops = sum(2.0 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in prods)
    return flops / _timeit(lambda: [threads.matmul(a, b) for a, b in prods])


def measure_compute(calib_model: str = "tiny", dims=(32, 64, 128, 256, 512)) -> dict:
    """One rank's compute constants on its current threads (under ``mpiexec -n N`` all ranks
    measure at once, so the figures are what each of N concurrent ranks gets): GEMM rates by
    smallest dimension, elementwise bandwidth, the cost of one autograd Function, ``ew_passes``
    (a block's forward + backward less its GEMMs and Functions, in kept bytes at that bandwidth)
    and AdamW's step (``opt_tensor_s`` per parameter tensor, ``opt_byte_s`` per parameter byte,
    from the calibration model at two widths)."""
    from mpirt.core import modeling
    from mpirt.core.modeling import activation_bytes, layer_costs
    from mpirt.core.optim import AdamW
    from mpirt.plan.work import ops_per_block
    from mpirt.core.tensor import Tensor

    rates = {float(d): _products_rate(d) for d in dims}
    a, b, c = (np.random.default_rng(0).random(4 * 2**20, dtype=np.float32) for _ in range(3))
    out = np.empty_like(a)
    t = _timeit(lambda: (np.multiply(a, b, out=out), np.add(out, c, out=out)))
    bandwidth = 6 * a.nbytes / t  # read a, b; write, read, read c, write

    cfg = modeling.load_model_config(calib_model)
    block = modeling.block_class(cfg)(cfg, "float32").initialize(0)
    n_ops = ops_per_block(cfg)

    def fb(shape):
        x = Tensor(np.random.default_rng(1).standard_normal(shape).astype(np.float32), requires_grad=True)
        y = block(x)
        y.backward(np.ones(y.shape, dtype=np.float32))

    op_s = _timeit(lambda: fb((2, 4, cfg.n_embd)), 0.3) / (2 * n_ops)
    rows, seq = 4, 128
    full = _timeit(lambda: fb((rows, seq, cfg.n_embd)), 0.6, 5, statistics.median)
    fwd = layer_costs(cfg, seq)[1].flops / 3 * rows * seq
    dim = min(rows * seq, cfg.n_embd, cfg.hidden)
    ds = sorted(rates)
    gemm = 3 * fwd / float(np.interp(np.log(dim), np.log(ds), [rates[k] for k in ds]))
    kept = activation_bytes(cfg, Layout.micro_batch(rows, seq), itemsize=4)["block"]
    ew_passes = max(0.5, (full - gemm - 2 * n_ops * op_s) * bandwidth / kept)
    opt = []
    for width in (cfg.n_embd // 4, cfg.n_embd):
        small = modeling.build_model(modeling.apply_overrides(cfg, {"n_embd": width}), "float32", seed=0)
        params = list(small.parameters())
        for p in params:
            p.grad = np.zeros_like(p.data)
        adam = AdamW(params, lr=1e-3)
        opt.append((len(params), sum(p.data.nbytes for p in params), _timeit(adam.step, 0.3)))
    (n1, b1, t1), (n2, b2, t2) = opt
    per_byte = max(0.0, (t2 - t1) / (b2 - b1))
    per_tensor = max(0.0, (t1 - per_byte * b1) / n1)
    return {"gemm_rates": rates, "bandwidth": bandwidth, "op_overhead_s": op_s, "ew_passes": ew_passes,
            "block_fb_s": full, "block_gemm_s": gemm, "opt_tensor_s": per_tensor, "opt_byte_s": per_byte}


def measure_block(calib_model: str = "tiny") -> float:
    """Median seconds of one block's forward + backward at 4 x 128 tokens on this rank (under
    ``mpiexec -n N`` every rank at once: what sharing the cores costs each of them)."""
    from mpirt.core import modeling
    from mpirt.core.tensor import Tensor

    cfg = modeling.load_model_config(calib_model)
    block = modeling.block_class(cfg)(cfg, "float32").initialize(0)
    x0 = np.random.default_rng(1).standard_normal((4, 128, cfg.n_embd)).astype(np.float32)

    def fb():
        x = Tensor(x0, requires_grad=True)
        y = block(x)
        y.backward(np.ones(y.shape, dtype=np.float32))

    return _timeit(fb, 1.0, 5, statistics.median)


def measure_local(calib_model: str = "tiny") -> dict:
    """The in-process constants at one thread, and a second thread's GEMM speed-up."""
    cores = _cores()
    _set_threads(1)
    out = measure_compute(calib_model)
    one = _products_rate(256)
    _set_threads(cores)
    many = _products_rate(256)
    _set_threads(1)
    out.update(cores=cores, threads_per_core=max(0.0, (many / one - 1) / max(cores - 1, 1)),
               calib_model=calib_model)
    return out


def _fit(times: dict) -> list:
    small, big = times[SIZES[0]], times[SIZES[-1]]
    return [small, max(big - small, 0.0) / (SIZES[-1] - SIZES[0])]


def mpi_worker() -> None:
    """Run under ``mpiexec -n N``: rank 0 prints one JSON line ``{group: {op: [alpha, beta]}}``."""
    from mpirt.comm import world_comm

    _set_threads(1)
    world = world_comm()
    n = world.size
    world.barrier()
    mine = measure_block()
    result = {"compute": {"block_fb_s": statistics.median(world.allgather_object(mine))}}
    for g in [g for g in range(2, n + 1) if n % g == 0]:
        comm = world.split(world.rank // g, world.rank, axis="calib")
        fits = {}
        for op in ("allreduce", "allgather", "reduce_scatter"):
            times = {}
            for size in SIZES:
                elems = max(g, size // 4 // g * g)
                x = np.ones(elems, dtype=np.float32)
                shard = np.ones(elems // g, dtype=np.float32)
                fn = {"allreduce": lambda: comm.allreduce(x, out=x),
                      "allgather": lambda: comm.allgather_flat(shard, elems, out=x),
                      "reduce_scatter": lambda: comm.reduce_scatter(x, out=shard)}[op]
                samples = []
                for _ in range(3):  # back to back, as a layer's collectives follow each other in lockstep
                    world.barrier()
                    t0 = time.perf_counter()
                    for _ in range(REPS):
                        fn()
                    samples.append((time.perf_counter() - t0) / REPS)
                times[size] = statistics.median(world.allgather_object(statistics.median(samples)))
            fits[op] = _fit(times)
        if g == 2:
            times = {}
            for size in SIZES:
                x = np.ones(max(1, size // 4), dtype=np.float32)
                peer = comm.rank ^ 1
                samples = []
                for _ in range(3):
                    world.barrier()
                    t0 = time.perf_counter()
                    for _ in range(REPS // 2):
                        if comm.rank == 0:
                            comm.send(x, peer)
                            comm.recv(x, peer)
                        else:
                            comm.recv(x, peer)
                            comm.send(x, peer)
                    samples.append((time.perf_counter() - t0) / REPS)
                times[size] = statistics.median(world.allgather_object(statistics.median(samples)))
            fits["p2p"] = _fit(times)
        result[g] = fits
        comm.free()
    if world.rank == 0:
        print("CALIB " + json.dumps(result), flush=True)


def measure_mpi(ranks: list[int], launcher: str = "mpiexec") -> dict:
    """``{N: {g: {op: [alpha, beta]}}}`` from one ``mpiexec -n N`` worker per N."""
    out = {}
    for n in ranks:
        if n < 2:
            continue
        proc = subprocess.run([launcher, "-n", str(n), sys.executable, "-m", "mpirt.plan.calibrate"],
                              capture_output=True, text=True, timeout=600)
        line = [x for x in proc.stdout.splitlines() if x.startswith("CALIB ")]
        if proc.returncode or not line:
            raise RuntimeError(f"MPI calibration at {n} ranks failed: {proc.stderr.strip()[-500:]}")
        got = json.loads(line[0][6:])
        compute = got.pop("compute")
        out[n] = {int(g): v for g, v in got.items()}
        out[n][0] = compute  # group 0: the block time each of the N concurrent ranks measured
    return out


def measure_process_bytes(launcher: str = "mpiexec") -> dict:
    """The process baseline: a 2-rank data-parallel run of a one-block, 32-wide GPT for 3 steps
    (its model, activations and checkpoint are a few MiB); the baseline is
    :data:`mpirt.plan.memory.PROCESS_BYTES` plus rank 1's measured peak memory owned
    (:func:`mpirt.monitor.steps.owned_bytes`) less :func:`mpirt.plan.memory.predict` (rank 0's writer is
    :data:`mpirt.plan.memory.WRITER_BYTES`, added by :func:`mpirt.plan.memory.planned_baseline`)."""
    import dataclasses
    import tempfile
    from pathlib import Path

    from mpirt.plan import memory
    from mpirt.run.config import TrainConfig
    from mpirt.core.modeling import load_model_config

    over = {"n_layer": 1, "n_embd": 32, "n_head": 2}
    with tempfile.TemporaryDirectory(prefix="mpirt_calib_") as tmp:
        cmd = [launcher, "-n", "2", sys.executable, "-m", "mpirt.train", "--model", "tiny", "--steps", "3",
               "--batch-size", "4", "--seq-len", "64", "--out-dir", tmp, "--progress", "false",
               "--eval-interval", "0", "--eval-batches", "1", "--trace-steps", "0"] + \
            [f"--model.{k}={v}" for k, v in over.items()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"memory calibration run failed: {proc.stderr.strip()[-500:]}")
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    cfg = dataclasses.replace(TrainConfig(), batch_size=4, seq_len=64)
    model_cfg = load_model_config("tiny", over)
    layout = {"dp": 2, "pp": 1, "tp": 1}
    resid = [m - memory.predict(cfg, model_cfg, layout, r)["peak"]
             for r, m in enumerate(summary["peak_memory_bytes_per_rank"])]
    # rank 1's: rank 0 also holds its TensorBoard writer, which planned_baseline adds on its own
    return {"process_bytes": memory.PROCESS_BYTES + resid[1], "residual_per_rank": resid}


LOAD_MAX = 0.5      # 1-minute load average per core above which a calibration is not started
OTHERS_MAX = 0.10   # share of the machine's CPU time other processes may take while it measures
SHARE_SLACK = 1.2   # a rank of N on C cores may measure up to this times its C/N share (timer noise)


class BusyMachine(ValueError):
    """A calibration taken, or about to be taken, while other processes loaded the machine: its
    figures would describe that load, not the machine (the message names the load)."""


def _own_cpu_s() -> float:
    """CPU seconds of this process and the children it waited for (the MPI workers, the memory run)."""
    import resource
    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime


def check_quiet(cores: int) -> None:
    """Refuse (:class:`BusyMachine`) to start on a machine whose 1-minute load is above
    :data:`LOAD_MAX` per core: one rank's speed alone, the figure every slowdown divides by, would
    be taken under that load."""
    load = os.getloadavg()[0]
    if load > LOAD_MAX * cores:
        raise BusyMachine(f"calibrate: the machine is busy (1-minute load {load:.2f} on {cores} cores, above "
                          f"{LOAD_MAX * cores:.1f}): its figures would describe that load; nothing measured, rerun "
                          f"when it is quiet")


def check_measured_quietly(before, own_before: float, compute: dict, cores: int) -> None:
    """Refuse (:class:`BusyMachine`) what was measured when other processes took more than
    :data:`OTHERS_MAX` of the CPU time meanwhile (``before``: :func:`mpirt.cpu.sysinfo.cpu_seconds`
    at the start, ``own_before``: :func:`_own_cpu_s` then), or when N ranks sharing ``cores`` cores
    each ran faster than their share of a core allows (the one rank alone was slowed by load)."""
    from mpirt.cpu.sysinfo import cpu_seconds

    after, load = cpu_seconds(), os.getloadavg()[0]
    if before is not None and after is not None and after[1] > before[1]:
        others = max(0.0, after[0] - before[0] - (_own_cpu_s() - own_before)) / (after[1] - before[1])
        if others > OTHERS_MAX:
            raise BusyMachine(f"calibrate: other processes took {100 * others:.0f}% of the CPU time while it "
                              f"measured (more than {100 * OTHERS_MAX:.0f}%; 1-minute load now {load:.2f} on "
                              f"{cores} cores): the figures describe that load; nothing saved, rerun when it is quiet")
    for n, c in sorted(compute.items()):
        share, most = 1 / c["slowdown"], min(1.0, cores / n)
        if n > 1 and share > SHARE_SLACK * most:
            raise BusyMachine(f"calibrate: {n} ranks on {cores} cores each ran at {share:.2f} of a core, more than "
                              f"the {most:.2f} they can share: one rank alone was measured slowed by other load "
                              f"(1-minute load now {load:.2f}); nothing saved, rerun when it is quiet")


def calibrate(ranks: list[int], name: str = "local", calib_model: str = "tiny"):
    """Measure this machine (see the module docstring); returns the :class:`Cluster` (not saved).
    Raises :class:`BusyMachine` naming the load when other processes would have shaped the figures."""
    from mpirt.cpu.sysinfo import cpu_seconds
    from mpirt.plan import hardware

    cores = _cores()
    check_quiet(cores)
    before, own_before = cpu_seconds(), _own_cpu_s()
    loc = measure_local(calib_model)
    loc.update(measure_process_bytes())
    coll = measure_mpi(ranks)
    # per rank count: each concurrent rank's block time over one rank's alone (1 thread)
    compute = {n: {"block_fb_s": coll[n].pop(0)["block_fb_s"]} for n in coll}
    compute[1] = {"block_fb_s": loc["block_fb_s"]}
    for n in compute:
        compute[n]["slowdown"] = compute[n]["block_fb_s"] / loc["block_fb_s"]
    check_measured_quietly(before, own_before, compute, cores)
    p2p = coll.get(min(coll), {}).get(2, {}).get("p2p", [2e-6, 1 / 5e9]) if coll else [2e-6, 1 / 5e9]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peak = max(loc["gemm_rates"].values())
    return hardware.Cluster(name=name, devices_per_node=max(ranks + [1]), nodes=1,
                   peak_flops={"float32": peak, "float64": peak / 2, "bfloat16": peak},
                   memory_bytes=float(total), memory_bandwidth=loc["bandwidth"], gemm_efficiency=1.0,
                   gemm_half_dim=0.0, intra_latency=p2p[0], intra_bandwidth=1 / max(p2p[1], 1e-12),
                   inter_latency=p2p[0], inter_bandwidth=1 / max(p2p[1], 1e-12), op_overhead_s=loc["op_overhead_s"],
                   ew_passes=loc["ew_passes"], overlap=False, cores=cores, opt_tensor_s=loc["opt_tensor_s"],
                   opt_byte_s=loc["opt_byte_s"],
                   threads_per_core=loc["threads_per_core"], process_bytes=loc["process_bytes"],
                   compute_by_ranks=compute, collectives=coll, gemm_rates=loc["gemm_rates"], source="calibrated",
                   runtime=hardware.runtime_fingerprint(),
                   notes=f"calibrated {time.strftime('%Y-%m-%d %H:%M')} at ranks {ranks}; load "
                         f"{os.getloadavg()[0]:.2f}; local: " + json.dumps(
                             {k: v for k, v in loc.items() if k != "gemm_rates"}, default=str))


if __name__ == "__main__":
    mpi_worker()
