"""One GPT training step (forward, backward, AdamW) in mpirt and in PyTorch CPU eager, side by side,
and against its GEMM floor.

Same shapes, float32, same thread count, same global batch; PyTorch uses
``F.scaled_dot_product_attention`` and ``torch.optim.AdamW``. The GEMM floor is every linear
product of the step (qkv, proj, fc, fc2, the tied head; forward and both backward products) on
the GEMM library mpirt chose, split over its pool as in the step (:mod:`bench.gemm`); the
attention's batched products are not in it. The three contenders alternate step by step
(bench/common.py); the table gives median [min-max] ms and the per-step ratios' median
[min-max], and warns when the machine was too loaded for the figures to mean anything.

    python bench/step.py [--threads N] [--repeats 12] [--cases tiny,d512] [--quiet-wait 300]
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
    NumPy's OpenBLAS set to one thread per pool thread (see ``mpirt.threads``)."""
    import torch
    import mpirt.threads
    torch.set_num_threads(n)
    mpirt.threads.set_num_threads(n)


def mpirt_step(cfg, batch, seq_len, x, y):
    from mpirt.optim import AdamW
    from mpirt.modeling import build_model
    model = build_model(cfg, seed=0)
    opt = AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    model.zero_grad()

    def step():
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
    args = parser.parse_args()
    import mpirt.threads
    from mpirt import blas
    threads = args.threads or mpirt.threads.default_num_threads()
    set_threads(threads)
    gemm_library = blas.describe()

    BC.wait_for_quiet(args.quiet_wait)
    load = BC.LoadMonitor().start()
    rows, data = [], {"threads": threads, "gemm": gemm_library, "cases": {}}
    for name in args.cases.split(","):
        cfg, batch, seq_len = case_config(name)
        rng = np.random.default_rng(0)
        x = rng.integers(0, cfg.vocab_size, (batch, seq_len), dtype=np.int64)
        y = rng.integers(0, cfg.vocab_size, (batch, seq_len), dtype=np.int64)
        m_step, n_params = mpirt_step(cfg, batch, seq_len, x, y)
        products = step_products(cfg, batch, seq_len)
        times = BC.alternate({"mpirt": m_step, "torch": torch_step(cfg, batch, seq_len, x, y),
                              "floor": lambda: step_gemms(products)}, args.repeats,
                             before=lambda: time.sleep(args.pause))
        s = {k: BC.spread(v) for k, v in times.items()}
        vs_torch = BC.paired_ratio(times["mpirt"], times["torch"])
        vs_floor = BC.paired_ratio(times["mpirt"], times["floor"])
        tokens = batch * seq_len
        rows.append([name, f"{n_params:,}", f"{batch} x {seq_len}", BC.fmt_spread(s["mpirt"]),
                     BC.fmt_spread(s["torch"]), BC.fmt_spread(s["floor"]), BC.fmt_ratio(vs_torch),
                     BC.fmt_ratio(vs_floor), f"{tokens / s['mpirt']['median']:,.0f}",
                     f"{tokens / s['torch']['median']:,.0f}"])
        data["cases"][name] = {"params": n_params, "batch": batch, "seq_len": seq_len, "config": dataclasses.asdict(cfg), "seconds": times,
                               "mpirt_vs_torch": vs_torch, "mpirt_vs_floor": vs_floor}
    load.stop()
    header = ["case", "params", "B x T", "mpirt ms", "torch ms", "GEMM floor ms", "mpirt/torch",
              "mpirt/floor", "mpirt tok/s", "torch tok/s"]
    notes = [f"float32, {threads} threads each; median [min-max] of {args.repeats} steps, the three "
             "alternated step by step; ratios: median [min-max] of the per-round ratios.",
             f"mpirt GEMM: {gemm_library}"]
    BC.write_results(args.name, "One GPT training step: mpirt, PyTorch eager, GEMM floor", header, rows,
                     load, data, notes)


if __name__ == "__main__":
    main()
