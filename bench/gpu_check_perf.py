"""Timing parts of bench/gpu_check.py: a large bf16/fp16 matmul beside ``torch.matmul``, allreduce
through each available comm engine, and single-GPU bf16 GPT training (about 350M and 1.3B
parameters) beside PyTorch eager with ``F.scaled_dot_product_attention`` on the same model and batch.

Times are wall clock around synchronized work (the device queue drained before each clock read),
medians over repeats after warm-ups, on random data (never zeros). The training parts record their
timed window so the report can give NVML's means over exactly those steps.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import mpirt.core.backend as B
from gpu_check import (H200_BF16_PEAK, ROOT, device_name, fmt_err, gib, rel_err, save, select, short_error, sync,
                       verdict)
from torch_gpt import torch_gpt


def timed(fn, sync_fn, warmup: int, rounds: int, per_round: int = 1) -> list[float]:
    """Seconds per call of ``fn``: ``rounds`` rounds of ``per_round`` calls, each round between two
    drained queues, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync_fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        sync_fn()
        out.append((time.perf_counter() - t0) / per_round)
    return out


# --- matmul ----------------------------------------------------------------------------------------------
def part_matmul(args) -> None:
    import torch

    from mpirt.cpu import threads
    t0, rows, data = time.time(), [], {}
    select(args.cpu)
    torch.backends.cuda.matmul.allow_tf32 = False   # the float32 references are float32
    tsync = (lambda: None) if args.cpu else torch.cuda.synchronize
    shapes = [(128, 128, 128), (64, 96, 128)] if args.cpu else [(8192, 8192, 8192), (8192, 2048, 8192)]
    warmup, rounds, per_round = (1, 3, 1) if args.cpu else (3, 5, 10)
    xp = B.xp
    for dtype in ("bfloat16", "float16"):
        for m, k, n in shapes:
            label = f"{dtype} {m}x{k}x{n}"
            try:
                a32 = xp.asarray(np.random.default_rng(0).standard_normal((m, k), dtype=np.float32))
                b32 = xp.asarray(np.random.default_rng(1).standard_normal((k, n), dtype=np.float32))
                a, b = a32.astype(dtype), b32.astype(dtype)
                ta = torch.from_dlpack(a32).to(getattr(torch, dtype))
                tb = torch.from_dlpack(b32).to(getattr(torch, dtype))
                flops = 2.0 * m * k * n
                t_m = timed(lambda: threads.matmul(a, b), sync, warmup, rounds, per_round)
                t_t = timed(lambda: torch.matmul(ta, tb), tsync, warmup, rounds, per_round)
                c = threads.matmul(a, b)
                tc = torch.matmul(ta, tb)
                err_m = rel_err(B.to_host(c.astype("float32")), B.to_host(xp.matmul(a.astype("float32"), b.astype("float32"))))
                err_t = rel_err(tc.float().cpu().numpy(), torch.matmul(ta.float(), tb.float()).cpu().numpy())
                cross = rel_err(B.to_host(c[:256, :256].astype("float32")), tc[:256, :256].float().cpu().numpy())
                rate_m, rate_t = flops / statistics.median(t_m), flops / statistics.median(t_t)
                ok = max(err_m, err_t, cross) < 2e-2
                data[label] = {"mpirt_s": t_m, "torch_s": t_t, "mpirt_flops": rate_m, "torch_flops": rate_t,
                               "err_mpirt": err_m, "err_torch": err_t, "err_cross": cross}
                rows.append(["matmul", label, f"mpirt (threads.matmul -> {B.name}.matmul) {rate_m / 1e12:.1f} TFLOP/s "
                             f"({100 * rate_m / H200_BF16_PEAK:.0f}% of peak), torch.matmul {rate_t / 1e12:.1f} "
                             f"TFLOP/s: {rate_m / rate_t:.2f}x; rel err vs float32 {fmt_err(err_m)} / "
                             f"{fmt_err(err_t)}, mpirt vs torch {fmt_err(cross)}", verdict(ok)])
                del a, b, a32, b32, ta, tb, c, tc
            except Exception as err:  # noqa: BLE001
                rows.append(["matmul", label, short_error(err), "FAIL"])
                data[label] = short_error(err)
    save(args.work, "matmul", rows, data, t0)


# --- allreduce -------------------------------------------------------------------------------------------
def _sizes(cpu: bool, ranks: int) -> list[tuple[int, str]]:
    """(bytes, dtype) cases."""
    if cpu:
        return [(64 << 10, "float32"), (1 << 20, "float32"), (256 << 10, "bfloat16")]
    if ranks > 1:
        return [(1 << 20, "float32"), (16 << 20, "float32"), (64 << 20, "float32"), (16 << 20, "bfloat16")]
    return [(1 << 20, "float32"), (16 << 20, "float32"), (256 << 20, "float32"), (64 << 20, "bfloat16")]


def _time_allreduce(comm, engines: list, cpu: bool, ranks: int) -> tuple[list, dict]:
    """Rows and data for in-place sum allreduces of each size through each engine."""
    from mpirt.comm import stats
    rows, data = [], {}
    rounds = 3 if cpu else 10
    for engine in engines:
        os.environ["MPIRT_COMM_ENGINE"] = "auto" if engine == "host" else engine
        for nbytes, dtype in _sizes(cpu, ranks):
            label = f"{engine} {ranks} rank(s) {nbytes / 2**20:g} MiB {dtype}"
            try:
                n = nbytes // np.dtype(dtype).itemsize
                base = np.random.default_rng(comm.rank).integers(-8, 8, n).astype(np.float32)
                x = B.asarray(base.astype(dtype))
                want = sum(np.random.default_rng(r).integers(-8, 8, n).astype(np.float32) for r in range(comm.size))
                got = comm.allreduce(x, "sum")
                exact = bool(np.array_equal(B.to_host(got).astype(np.float32), want))
                cursor = stats.cursor()
                times = timed(lambda: comm.allreduce(x, "sum", out=x), sync, 2, rounds)
                t = statistics.median(times)
                used = sorted({r.engine for r in stats.since(cursor)}) or ["?"]
                used = "/".join(used)
                data[label] = {"seconds": times, "exact": exact, "engine_used": used}
                rows.append(["allreduce", label, f"{t * 1e3:.3f} ms, {nbytes / t / 1e9:.1f} GB/s algbw, engine used "
                             f"{used}, result {'exact' if exact else 'WRONG'}", verdict(exact)])
            except Exception as err:  # noqa: BLE001
                rows.append(["allreduce", label, short_error(err), "FAIL"])
                data[label] = short_error(err)
    os.environ.pop("MPIRT_COMM_ENGINE", None)
    return rows, data


def _engines(cpu: bool) -> tuple[list, list]:
    """(engines to time, rows saying why others are not)."""
    if cpu:
        return ["host"], [["allreduce", "engines", "dry run: NumPy arrays take the host engine", "n/a"]]
    from mpirt.comm.engines import cuda_aware_mpi, nccl_available
    engines, notes = [], []
    if nccl_available():
        engines.append("nccl")
    else:
        notes.append(["allreduce", "nccl", "cupy.cuda.nccl not available", "FAIL"])
    engines.append("staged")
    if cuda_aware_mpi():
        engines.append("cuda-aware")
    else:
        notes.append(["allreduce", "cuda-aware", "this MPI does not report CUDA support: not timed", "n/a"])
    return engines, notes


def part_allreduce_ranks(args) -> None:
    """Under mpiexec (2 ranks on the one GPU): host-staged (and CUDA-aware, if any) allreduce."""
    from mpirt.comm import world_comm
    select(args.cpu)
    comm = world_comm()
    B.bind_device(comm.rank)
    engines = [e for e in _engines(args.cpu)[0] if e != "nccl"]   # NCCL refuses two ranks on one GPU
    rows, data = _time_allreduce(comm, engines, args.cpu, comm.size)
    note = ["allreduce", f"{comm.size} ranks: engines", f"{', '.join(engines)}, ranks sharing one "
            f"{'CPU' if args.cpu else 'GPU'} (NCCL needs a GPU per rank: not timed)", "n/a"]
    if comm.rank == 0:
        (args.work / "allreduce-ranks.out.json").write_text(json.dumps({"rows": [note] + rows, "data": data},
                                                                       default=str))


def part_allreduce(args) -> None:
    t0, rows, data = time.time(), [], {}
    mpiexec = os.environ.get("MPIEXEC") or __import__("shutil").which("mpiexec")
    # two ranks first, before this process initialises MPI as a singleton
    if mpiexec:
        cmd = [mpiexec, "-n", "2", sys.executable, str(ROOT / "bench" / "gpu_check.py"), "allreduce-ranks",
               "--work", str(args.work)] + (["--cpu"] if args.cpu else [])
        try:
            env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # Open MPI as root
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=40 if not args.cpu else 60, env=env)
            out = args.work / "allreduce-ranks.out.json"
            if r.returncode == 0 and out.exists():
                got = json.loads(out.read_text())
                rows += got["rows"]
                data["2 ranks"] = got["data"]
            else:
                tail = " / ".join((r.stderr or r.stdout).strip().splitlines()[-2:])[:200]
                rows.append(["allreduce", "2 ranks (mpiexec)", f"exit {r.returncode}: {tail}", "FAIL"])
        except subprocess.TimeoutExpired:
            rows.append(["allreduce", "2 ranks (mpiexec)", "timed out", "FAIL"])
    else:
        rows.append(["allreduce", "2 ranks (mpiexec)", "no mpiexec: not timed (carry the MPICH wheel)", "n/a"])
    try:
        from mpirt.comm import world_comm
        select(args.cpu)
        engines, notes = _engines(args.cpu)
        r1, d1 = _time_allreduce(world_comm(), engines, args.cpu, 1)
        rows += notes + r1
        data["1 rank"] = d1
    except Exception as err:  # noqa: BLE001 - no MPI library: NCCL alone, without mpirt.comm
        rows.append(["allreduce", "1 rank through mpirt.comm", short_error(err), "FAIL"])
        if not args.cpu:
            rows += _raw_nccl()
    save(args.work, "allreduce", rows, data, t0)


def _raw_nccl() -> list:
    """World-size-1 NCCL allreduce straight through cupy.cuda.nccl (when mpi4py has no MPI library)."""
    try:
        import cupy
        from cupy.cuda import nccl
        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        x = cupy.random.standard_normal(64 << 18, dtype=cupy.float32)
        stream = cupy.cuda.get_current_stream().ptr
        t = statistics.median(timed(lambda: comm.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32,
                                                           nccl.NCCL_SUM, stream), sync, 2, 10))
        return [["allreduce", "raw NCCL 1 rank 64 MiB float32", f"{t * 1e3:.3f} ms, {x.nbytes / t / 1e9:.1f} GB/s "
                 "(cupy.cuda.nccl directly: no MPI for mpirt.comm)", "ok"]]
    except Exception as err:  # noqa: BLE001
        return [["allreduce", "raw NCCL 1 rank", short_error(err), "FAIL"]]


TRAIN_TIMED_S = 40.0   # at most this long in timed steps (at least 3)


# --- training --------------------------------------------------------------------------------------------
def train_setup(model: str, cpu: bool):
    """(GPTConfig, batch, seq_len, warm-up steps, timed steps). GPU: GPT-2 medium (355M) and a
    GPT-3 XL shape (24 x 2048, 1.3B), 8 x 1024 tokens a step (the 1.3B in bf16 with float32
    masters: about 49 GiB by mpirt.plan.memory.predict, well inside 141 GB)."""
    from mpirt.models.model_config import GPTConfig
    if cpu:
        width = 32 if model == "350m" else 48
        return GPTConfig(n_layer=2, n_head=2, n_embd=width, n_positions=32, vocab_size=128), 2, 32, 1, 3
    if model == "350m":
        return GPTConfig(n_layer=24, n_head=16, n_embd=1024, n_positions=1024, vocab_size=50257), 8, 1024, 3, 25
    return GPTConfig(n_layer=24, n_head=16, n_embd=2048, n_positions=1024, vocab_size=50257), 8, 1024, 3, 15


def mpirt_trainer(cfg, x, y):
    from mpirt.core.modeling import build_model
    from mpirt.core.optim import AdamW, clip_grad_norm
    model = build_model(cfg, dtype="bfloat16", seed=0)
    params = model.parameters()
    opt = AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    opt.zero_grad()
    x, y = B.asarray(x), B.asarray(y)

    def step():
        _, loss = model(x, y)
        loss.backward()
        clip_grad_norm(params, 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()
    return step, model.num_parameters()


def torch_trainer(cfg, x, y, cpu: bool):
    """float32 weights, autocast to bfloat16 (PyTorch's mixed precision: 16 bytes of state per
    parameter, as mpirt's bf16 + float32 masters), AdamW (fused on the GPU), clipping at 1.0."""
    import torch
    device = "cpu" if cpu else "cuda"
    model = torch_gpt(cfg, device, init_std=0.02)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), **({} if cpu else {"fused": True}))
    tx, ty = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(tx, ty)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    wte = model.wte.weight.numel()
    return step, sum(p.numel() for p in model.parameters()) - wte + wte   # tied head: counted once


def part_train(args) -> None:
    from mpirt.core import modeling
    from mpirt.run.config import TrainConfig
    from mpirt.monitor.flops import gpu_peak
    from mpirt.plan.memory import predict
    from mpirt.core.settings import format_size
    _, model_name, framework = args.part.split("-")
    t0 = time.time()
    cfg, batch, seq, warmup, steps = train_setup(model_name, args.cpu)
    select(args.cpu)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (batch, seq)) for _ in range(2))   # one batch, repeated
    if framework == "torch":
        import torch  # (its import is not the build's time)
    tb = time.perf_counter()
    if framework == "mpirt":
        step, n_params = mpirt_trainer(cfg, x, y)
        sync_fn, peak_mem = sync, lambda: B.pool_bytes()[1]
    else:
        step, n_params = torch_trainer(cfg, x, y, args.cpu)
        sync_fn = (lambda: None) if args.cpu else torch.cuda.synchronize
        peak_mem = (lambda: 0) if args.cpu else torch.cuda.max_memory_allocated
    build_s = time.perf_counter() - tb
    losses, times = [], []
    for i in range(warmup + steps):
        if i == warmup:
            window0, timed0 = time.time(), time.perf_counter()
        elif i >= warmup + 3 and time.perf_counter() - timed0 > TRAIN_TIMED_S:
            break   # a slow step: fewer timed steps rather than a part killed at its limit
        s0 = time.perf_counter()
        losses.append(step())
        sync_fn()
        times.append(time.perf_counter() - s0)
    steps = len(times) - warmup
    window = (window0, time.time())
    timed_s = times[warmup:]
    med = statistics.median(timed_s)
    tokens = batch * seq
    tps = tokens / med
    flops_tok = modeling.flops_per_token(cfg, seq)
    peak = gpu_peak(device_name(args.cpu), "bfloat16") or H200_BF16_PEAK
    mfu = flops_tok * tps / peak
    mem = peak_mem()
    predicted = predict(TrainConfig(dtype="bfloat16", batch_size=batch, seq_len=seq), cfg,
                        {"dp": 1, "pp": 1, "tp": 1}, 0)["peak"]
    learned = bool(np.isfinite(losses).all() and losses[-1] < losses[0])
    mem_text = (f"pool held {gib(mem)} (mpirt.plan.memory predicts {format_size(predicted)})" if framework == "mpirt"
                else f"max allocated {gib(mem)}")
    first_s = times[0]
    data = {"params": n_params, "batch": batch, "seq": seq, "warmup": warmup, "steps": steps, "step_s": timed_s,
            "first_step_s": first_s, "build_s": build_s, "tokens_per_s": tps, "mfu": mfu, "peak_flops": peak,
            "flops_per_token": flops_tok, "losses": losses, "memory_bytes": mem, "predicted_peak": predicted}
    what = "bf16, float32 masters" if framework == "mpirt" else "autocast bf16, float32 weights, SDPA"
    row = (f"{n_params / 1e6:.{0 if n_params > 1e7 else 2}f}M params, {batch}x{seq} tokens: {tps:,.0f} tok/s, MFU {100 * mfu:.1f}%, "
           f"{med * 1e3:.0f} ms/step [{min(timed_s) * 1e3:.0f}-{max(timed_s) * 1e3:.0f}] over {steps} steps "
           f"(first {first_s:.1f} s, build {build_s:.1f} s); loss {losses[0]:.3f} -> {losses[-1]:.3f}; {mem_text}")
    save(args.work, args.part, [["train", f"GPT-{model_name} {framework} ({what})", row, verdict(learned)]], data, t0,
         window=window)


# --- attention -------------------------------------------------------------------------------------------
def part_attention(args) -> None:
    """The CUDA flash attention (mpirt.gpu.cuda) at the training shapes, forward and backward,
    against PyTorch's ``scaled_dot_product_attention`` (is_causal) on the same bf16/fp16 inputs and
    against mpirt's own xp form in float32 (the fallback it replaces); then the times of each."""
    import torch

    from mpirt.core.ops.attention import CausalSelfAttentionOp
    from mpirt.core.tensor import Tensor
    t0, rows, data = time.time(), [], {}
    select(args.cpu)
    xp = B.xp
    shapes = [(2, 64, 2, 32, "bfloat16")] if args.cpu else [
        (8, 1024, 16, 128, "bfloat16"), (8, 1024, 16, 64, "bfloat16"), (2, 1000, 4, 128, "float16"),
        (2, 777, 6, 64, "bfloat16")]
    device = "cpu" if args.cpu else "cuda"
    tsync = (lambda: None) if args.cpu else torch.cuda.synchronize
    for b, t, h, d, dtype in shapes:
        label = f"{dtype} B{b} T{t} H{h} D{d}"
        try:
            c = h * d
            rng = np.random.default_rng(t)
            qkv32 = rng.standard_normal((b, t, 3 * c), dtype=np.float32)
            gout32 = rng.standard_normal((b, t, c), dtype=np.float32)
            qkv, gout = xp.asarray(qkv32).astype(dtype), xp.asarray(gout32).astype(dtype)

            def run_mpirt(a=qkv, g=gout):
                x = Tensor(a, requires_grad=True)
                y = CausalSelfAttentionOp.apply(x, n_head=h)
                y.backward(g)
                return y.data, x.grad

            tq = torch.from_dlpack(qkv.astype("float32")).to(getattr(torch, dtype)).requires_grad_(True)
            tg = torch.from_dlpack(gout.astype("float32")).to(getattr(torch, dtype))

            def run_torch():
                tq.grad = None
                q, k, v = (z.view(b, t, h, d).transpose(1, 2) for z in tq.split(c, dim=-1))
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                y = y.transpose(1, 2).reshape(b, t, c)
                y.backward(tg)
                return y, tq.grad

            out, dqkv = run_mpirt()
            ty, tgrad = run_torch()
            to_np = (lambda z: z.detach().float().cpu().numpy())
            err_out = rel_err(B.to_host(out.astype("float32")), to_np(ty))
            err_grad = rel_err(B.to_host(dqkv.astype("float32")), to_np(tgrad))
            # the xp form in float32 (what ran before the kernel), same inputs
            ref_out, ref_grad = run_mpirt(qkv.astype("float32"), gout.astype("float32"))
            err_ref = max(rel_err(B.to_host(out.astype("float32")), B.to_host(ref_out)),
                          rel_err(B.to_host(dqkv.astype("float32")), B.to_host(ref_grad)))
            tm = statistics.median(timed(run_mpirt, sync, 2, 5))
            tt = statistics.median(timed(run_torch, tsync, 2, 5))
            tx = statistics.median(timed(lambda: run_mpirt(qkv.astype("float32"), gout.astype("float32")), sync, 1, 3))
            flops = 3.5 * 2 * 2 * b * h * t * t * d / 2      # causal forward (2 products) + backward (2.5x)
            ok = max(err_out, err_grad) < 2e-2 and err_ref < 2e-2
            data[label] = {"mpirt_s": tm, "torch_s": tt, "xp_float32_s": tx, "err_out_vs_torch": err_out,
                           "err_grad_vs_torch": err_grad, "err_vs_xp_float32": err_ref}
            rows.append(["attention", label, f"fwd+bwd {tm * 1e3:.2f} ms ({flops / tm / 1e12:.0f} TFLOP/s), torch SDPA "
                         f"{tt * 1e3:.2f} ms: {tm / tt:.2f}x torch; xp float32 form {tx * 1e3:.1f} ms; rel err vs torch "
                         f"out {fmt_err(err_out)} grad {fmt_err(err_grad)}, vs xp float32 {fmt_err(err_ref)}", verdict(ok)])
        except Exception as err:  # noqa: BLE001
            rows.append(["attention", label, short_error(err), "FAIL"])
            data[label] = short_error(err)
    save(args.work, "attention", rows, data, t0)


# --- profile ---------------------------------------------------------------------------------------------
def _function_classes():
    """Every :class:`mpirt.core.tensor.Function` subclass defined so far."""
    from mpirt.core.tensor import Function
    seen, todo = [], [Function]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


def part_profile(args) -> None:
    """Where the 1.3B mpirt bf16 step spends its time: every Function's forward and backward passes,
    the gradient clip and AdamW, each timed between two drained queues (so launch overhead and host
    work count; the sum is above an uninstrumented step's time by the synchronisations)."""
    from mpirt.core import optim
    t0 = time.time()
    cfg, batch, seq, warmup, _ = train_setup("1.3b", args.cpu)
    select(args.cpu)
    spent: dict = {}
    active = [False]

    def wrap(owner, name, label):
        method = getattr(owner, name)

        def timed_call(*a, **k):
            if not active[0]:
                return method(*a, **k)
            sync()
            s0 = time.perf_counter()
            out = method(*a, **k)
            sync()
            cell = spent.setdefault(label, [0.0, 0])
            cell[0] += time.perf_counter() - s0
            cell[1] += 1
            return out
        setattr(owner, name, timed_call)

    for cls in _function_classes():
        for m in ("forward", "backward", "backward_input", "backward_weight"):
            if m in cls.__dict__:
                wrap(cls, m, f"{cls.__name__}.{m}")
    wrap(optim, "clip_grad_norm", "clip_grad_norm")
    wrap(optim.AdamW, "step", "AdamW.step")
    from mpirt.cpu import threads
    wrap(threads, "_gemm", "(inside) threads._gemm: the GEMM library's calls")
    wrap(threads, "sum_rows", "(inside) threads.sum_rows: bias gradients")
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (batch, seq)) for _ in range(2))
    step, _ = mpirt_trainer(cfg, x, y)
    plain = timed(step, sync, warmup, 3)
    active[0] = True
    rounds = 2
    s0 = time.perf_counter()
    for _ in range(rounds):
        step()
    sync()
    total = (time.perf_counter() - s0) / rounds
    ranked = sorted(spent.items(), key=lambda kv: -kv[1][0])
    rows = [["profile", "1.3B step", f"{statistics.median(plain) * 1e3:.0f} ms uninstrumented, {total * 1e3:.0f} ms "
             f"instrumented, of which timed calls {sum(v[0] for v in spent.values()) / rounds * 1e3:.0f} ms", "ok"]]
    rows += [["profile", label, f"{sec / rounds * 1e3:.2f} ms/step ({n // rounds} calls)", "ok"]
             for label, (sec, n) in ranked[:30]]
    save(args.work, "profile", rows, {"plain_s": plain, "instrumented_s": total,
                                      "spent": {k: [v[0] / rounds, v[1] // rounds] for k, v in ranked}}, t0)


if __name__ == "__main__":
    print("run through bench/gpu_check.py", file=sys.stderr)
    sys.exit(2)
