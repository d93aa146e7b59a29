"""One GPT training step (forward, backward, AdamW) in mpirt and in PyTorch CPU eager, side by side,
and against its GEMM floor.

Same shapes, float32, same thread count, same global batch; PyTorch uses
``F.scaled_dot_product_attention`` and ``torch.optim.AdamW``. The GEMM floor is every linear
product of the step (qkv, proj, fc, fc2, the tied head; forward and both backward products) on
the GEMM library mpirt chose, split over its pool as in the step (:mod:`bench.gemm`); the
attention's batched products are not in it. A fourth contender is mpirt's step with its C kernels
off (the NumPy forms, :func:`mpirt.cpu.kernels.numpy_forms`). The contenders alternate step by step
(bench/common.py); the table gives median [min-max] ms and the per-step ratios' median
[min-max], and warns when the machine was too loaded for the figures to mean anything.

    python bench/step.py [--threads N] [--repeats 12] [--cases tiny,d512] [--quiet-wait 300]

``--ops`` runs mpirt's step alone instead and gives where it goes: per Function class its calls
per step and its forward and backward milliseconds (the fastest of the repeats: the least
disturbed), the optimizer step, zero_grad, and the rest (the autograd engine, Python).

``--bound`` measures what the step must do besides its linear products, each part alone with its
arrays in cache and against the floor in the same run (alternated; the fastest of the repeats):
the attention's products at the floor's own FLOP rate (a bound for any attention on this GEMM
library; mpirt's C attention alone beside it), GELU forward and backward, and the AdamW update (a
memory-bound pass, 28 bytes per parameter). When these alone exceed 0.15x the floor, no step on
this machine can be within 1.15x of its GEMM floor, however the rest is fused.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as BC  # noqa: E402
from torch_gpt import torch_gpt  # noqa: E402
from gemm import CASES, case_config, step_gemms, step_products  # noqa: E402


def set_threads(n: int) -> None:
    """Give PyTorch and mpirt the same number of threads. mpirt's pool runs its GEMMs too, with
    NumPy's OpenBLAS set to one thread per pool thread (see ``mpirt.cpu.threads``)."""
    import torch
    import mpirt.cpu.threads
    torch.set_num_threads(n)
    mpirt.cpu.threads.set_num_threads(n)


def mpirt_step(cfg, batch, seq_len, x, y, fused: bool = True):
    """mpirt's step; ``fused=False`` runs every op's NumPy form instead of the C kernels."""
    import contextlib
    from mpirt.cpu import kernels
    from mpirt.core.optim import AdamW
    from mpirt.core.modeling import build_model
    model = build_model(cfg, seed=0)
    opt = AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    model.zero_grad()

    def step():
        with contextlib.nullcontext() if fused else kernels.numpy_forms():
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return loss.item()
    return step, model.num_parameters()


def torch_step(cfg, batch, seq_len, x, y):
    import torch

    model = torch_gpt(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        loss = model(tx, ty)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.item()
    return step


def attention_flops(cfg, batch: int, seq_len: int) -> float:
    """FLOPs of the attention's six products in one step (scores, probabilities times V; and
    their four gradients), causal: query i against keys 0..i; no recomputation counted."""
    return cfg.n_layer * 6 * 2 * batch * cfg.n_embd * seq_len * (seq_len + 1) / 2


INNER = 3  # --bound: calls of a part back to back per round; per-call time = round / INNER


def bound_rows(cfg, batch, seq_len, repeats: int, pause: float) -> tuple[list, dict]:
    """One table row of ``--bound`` (see the module docstring) and its figures in seconds."""
    from mpirt.core.modeling import build_model
    from mpirt.core.ops.attention import CausalSelfAttentionOp
    from mpirt.core.ops.fused import Gelu
    from mpirt.core.optim import AdamW

    rng = np.random.default_rng(0)
    c, heads, tokens = cfg.n_embd, cfg.n_head, batch * seq_len
    products = step_products(cfg, batch, seq_len)
    qkv = rng.standard_normal((batch, seq_len, 3 * c), dtype=np.float32)
    g_att = rng.standard_normal((batch, seq_len, c), dtype=np.float32)
    hidden = rng.standard_normal((tokens, cfg.hidden), dtype=np.float32)
    g_hidden = rng.standard_normal((tokens, cfg.hidden), dtype=np.float32)
    params = build_model(cfg, seed=0).parameters()
    for p in params:
        p.grad = rng.standard_normal(p.data.shape, dtype=np.float32)
    opt = AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def layers(op, x, g, **kwargs):                        # the Function's passes, no autograd engine
        def run():
            for _ in range(cfg.n_layer):
                f = op()
                f.needs_input_grad = (True,)                   # as Function.apply sets it
                f.forward(x, **kwargs)
                f.backward(g)
        return run

    def warm(fn):                                          # INNER calls back to back: caches and
        def run():                                         # allocator as in a step
            for _ in range(INNER):
                fn()
        return run
    contenders = {"floor": lambda: step_gemms(products), "attention": layers(CausalSelfAttentionOp, qkv, g_att, n_head=heads),
                  "gelu": layers(Gelu, hidden, g_hidden), "adamw": opt.step}
    times = BC.alternate({k: warm(fn) for k, fn in contenders.items()}, repeats, before=lambda: time.sleep(pause))
    times = {k: [t / INNER for t in v] for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    linear_flops = sum(layer["count"] * sum(2 * a.shape[0] * a.shape[1] * b.shape[1]
                                            for a, b in layer["products"].values()) for layer in products)
    best["attention_at_floor_rate"] = attention_flops(cfg, batch, seq_len) * best["floor"] / linear_flops
    needed = best["attention_at_floor_rate"] + best["gelu"] + best["adamw"]
    n_params = sum(p.data.size for p in params)
    ms = lambda v: f"{1e3 * v:.2f}"  # noqa: E731
    row = [ms(best["floor"]), ms(0.15 * best["floor"]), ms(best["attention_at_floor_rate"]), ms(best["attention"]),
           ms(best["gelu"]), f"{ms(best['adamw'])} ({28 * n_params / best['adamw'] / 1e9:.0f} GB/s)", ms(needed),
           f"{1 + needed / best['floor']:.2f}"]
    return row, {"seconds": times, "best": best, "linear_flops": linear_flops,
                 "attention_flops": attention_flops(cfg, batch, seq_len), "params": n_params}


def op_profile(cfg, batch, seq_len, x, y, repeats: int, pause: float) -> list[list]:
    """Rows (part, calls per step, forward ms, backward ms) of mpirt's step, each the minimum
    over ``repeats`` steps. A Function's backward counts once, with the passes it runs inside."""
    import collections
    import statistics
    from mpirt.core.optim import AdamW
    from mpirt.core.modeling import build_model
    from mpirt.core.tensor import Function

    model = build_model(cfg, seed=0)
    opt = AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    model.zero_grad()
    spent, calls, depth = collections.defaultdict(float), collections.Counter(), [0]
    restore = []

    def timed(cls, name, fn, phase):
        def wrapper(self, *a, **k):
            if depth[0]:                                   # inside another op's backward: its time
                return fn(self, *a, **k)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                depth[0] -= 1
                spent[cls.__name__, phase] += time.perf_counter() - t0
                calls[cls.__name__, phase] += 1
        return wrapper

    def subclasses(c):
        for sub in c.__subclasses__():
            yield sub
            yield from subclasses(sub)
    for cls in set(subclasses(Function)):
        for name, phase in (("forward", "fwd"), ("backward", "bwd"), ("backward_input", "bwd"),
                            ("backward_weight", "bwd")):
            if name in cls.__dict__:
                restore.append((cls, name, cls.__dict__[name]))
                setattr(cls, name, timed(cls, name, cls.__dict__[name], phase))
    per_step = collections.defaultdict(list)
    try:
        for r in range(repeats + 1):
            spent.clear()
            calls.clear()
            time.sleep(pause)
            t0 = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad()
            t3 = time.perf_counter()
            if r == 0:
                continue                                   # warm-up
            per_step["step", ""].append(t3 - t0)
            per_step["optimizer step", ""].append(t2 - t1)
            per_step["zero_grad", ""].append(t3 - t2)
            per_step["engine and Python (rest)", ""].append(t1 - t0 - sum(spent.values()))
            for key, v in spent.items():
                per_step[key].append(v)
            step_calls = dict(calls)
    finally:
        for cls, name, fn in restore:
            setattr(cls, name, fn)
    ops = sorted({k[0] for k in per_step if k[1]}, key=lambda n: -sum(min(per_step.get((n, ph), [0])) for ph in ("fwd", "bwd")))
    ms = lambda key: f"{1e3 * min(per_step[key]):.2f}" if key in per_step else ""  # noqa: E731
    rows = [["step", "", "", "", f"{1e3 * min(per_step['step', '']):.2f} (median {1e3 * statistics.median(per_step['step', '']):.2f})"]]
    for name in ops:
        total = sum(min(per_step.get((name, ph), [0])) for ph in ("fwd", "bwd"))
        rows.append([name, str(step_calls.get((name, "fwd"), 0)), ms((name, "fwd")), ms((name, "bwd")), f"{1e3 * total:.2f}"])
    for key in ("optimizer step", "zero_grad", "engine and Python (rest)"):
        rows.append([key, "", "", "", ms((key, ""))])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="default: what training uses here")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--pause", type=float, default=0.05,
                        help="seconds of sleep before each step (spinning thread pools settle)")
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="wait up to this many seconds for a quiet machine before starting")
    parser.add_argument("--name", default="step", help="results file name under bench/results")
    parser.add_argument("--ops", action="store_true",
                        help="profile mpirt's step per op instead of racing (results NAME_ops)")
    parser.add_argument("--bound", action="store_true",
                        help="the step's non-GEMM work that no fusion removes, against the floor (results NAME_bound)")
    args = parser.parse_args()
    import mpirt.cpu.threads
    from mpirt.cpu import blas
    threads = args.threads or mpirt.cpu.threads.default_num_threads()
    set_threads(threads)
    gemm_library = blas.describe()
    from mpirt.cpu import kernels
    kernels_note = kernels.describe()

    BC.wait_for_quiet(args.quiet_wait)
    if args.ops:
        load, rows = BC.LoadMonitor().start(), []
        for name in args.cases.split(","):
            cfg, batch, seq_len = case_config(name)
            rng = np.random.default_rng(0)
            x = rng.integers(0, cfg.vocab_size, (batch, seq_len), dtype=np.int64)
            y = rng.integers(0, cfg.vocab_size, (batch, seq_len), dtype=np.int64)
            rows += [[name] + row for row in op_profile(cfg, batch, seq_len, x, y, args.repeats, args.pause)]
        load.stop()
        BC.write_results(f"{args.name}_ops", "Where mpirt's step goes, per op", ["case", "part", "calls",
                         "forward ms", "backward ms", "ms"], rows, load, {"threads": threads, "gemm": gemm_library},
                         [f"float32, {threads} threads; each figure the fastest of {args.repeats} steps "
                          "(the parts' minima need not add up to the step's).",
                          f"mpirt GEMM: {gemm_library}; kernels: {kernels_note}"])
        return
    if args.bound:
        load, rows, data = BC.LoadMonitor().start(), [], {"threads": threads, "gemm": gemm_library, "cases": {}}
        for name in args.cases.split(","):
            row, data["cases"][name] = bound_rows(*case_config(name), args.repeats, args.pause)
            rows.append([name, *row])
        load.stop()
        BC.write_results(f"{args.name}_bound", "What a step must do besides its linear products, against its GEMM floor",
                         ["case", "floor ms", "0.15 x floor ms", "attention products at the floor's rate ms",
                          "mpirt attention ms", "GELU ms", "AdamW ms", "attention at rate + GELU + AdamW ms",
                          "step >= x floor"], rows, load, data,
                         [f"float32, {threads} threads; each part alone, its arrays in cache ({INNER} calls back "
                          f"to back, per call), alternated with the floor; the fastest of {args.repeats} rounds; "
                          "attention and GELU: their Functions' passes without the autograd engine. The last column is 1 + (attention at "
                          "the floor's rate + GELU + AdamW) / floor: what even a step with nothing else would be.",
                          f"mpirt GEMM: {gemm_library}; kernels: {kernels_note}"])
        return
    load = BC.LoadMonitor().start()
    rows, data = [], {"threads": threads, "gemm": gemm_library, "cases": {}}
    for name in args.cases.split(","):
        cfg, batch, seq_len = case_config(name)
        rng = np.random.default_rng(0)
        x = rng.integers(0, cfg.vocab_size, (batch, seq_len), dtype=np.int64)
        y = rng.integers(0, cfg.vocab_size, (batch, seq_len), dtype=np.int64)
        m_step, n_params = mpirt_step(cfg, batch, seq_len, x, y)
        products = step_products(cfg, batch, seq_len)
        times = BC.alternate({"mpirt": m_step, "mpirt_numpy": mpirt_step(cfg, batch, seq_len, x, y, fused=False)[0],
                              "torch": torch_step(cfg, batch, seq_len, x, y),
                              "floor": lambda: step_gemms(products)}, args.repeats,
                             before=lambda: time.sleep(args.pause))
        s = {k: BC.spread(v) for k, v in times.items()}
        vs_torch = BC.paired_ratio(times["mpirt"], times["torch"])
        vs_floor = BC.paired_ratio(times["mpirt"], times["floor"])
        vs_numpy = BC.paired_ratio(times["mpirt"], times["mpirt_numpy"])
        tokens = batch * seq_len
        rows.append([name, f"{n_params:,}", f"{batch} x {seq_len}", BC.fmt_spread(s["mpirt"]),
                     BC.fmt_spread(s["mpirt_numpy"]), BC.fmt_spread(s["torch"]), BC.fmt_spread(s["floor"]),
                     BC.fmt_ratio(vs_numpy), BC.fmt_ratio(vs_torch), BC.fmt_ratio(vs_floor),
                     f"{tokens / s['mpirt']['median']:,.0f}", f"{tokens / s['torch']['median']:,.0f}"])
        data["cases"][name] = {"params": n_params, "batch": batch, "seq_len": seq_len, "config": dataclasses.asdict(cfg), "seconds": times,
                               "mpirt_vs_torch": vs_torch, "mpirt_vs_floor": vs_floor, "mpirt_vs_numpy_forms": vs_numpy}
    load.stop()
    header = ["case", "params", "B x T", "mpirt ms", "mpirt NumPy forms ms", "torch ms", "GEMM floor ms",
              "mpirt/NumPy forms", "mpirt/torch", "mpirt/floor", "mpirt tok/s", "torch tok/s"]
    notes = [f"float32, {threads} threads each; median [min-max] of {args.repeats} steps, the four "
             "alternated step by step; ratios: median [min-max] of the per-round ratios. "
             "\"NumPy forms\": mpirt's step with the C kernels off (MPIRT_KERNELS=numpy).",
             f"mpirt GEMM: {gemm_library}; kernels: {kernels_note}"]
    BC.write_results(args.name, "One GPT training step: mpirt, PyTorch eager, GEMM floor", header, rows,
                     load, data, notes)


if __name__ == "__main__":
    main()
