"""One GPT training step (forward, backward, AdamW) in mpirt and in PyTorch CPU eager, side by side.

Same shapes, float32, same thread count, same global batch; PyTorch uses
``F.scaled_dot_product_attention`` and ``torch.optim.AdamW``. Prints a table (median step time,
tokens/s, mpirt/PyTorch ratio) and writes JSON.

    python bench/step.py [--threads N] [--repeats 12] [--json bench/results/step.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

CASES = {  # name -> (model overrides on the tiny preset, batch, seq_len)
    "tiny": ({}, 8, 128),
    "d512": ({"n_layer": 4, "n_head": 8, "n_embd": 512, "n_positions": 256, "vocab_size": 50257}, 4, 256),
}


def set_threads(n: int) -> None:
    """Give PyTorch and mpirt the same number of threads. mpirt's pool runs its GEMMs too, with
    NumPy's OpenBLAS set to one thread per pool thread (see ``mpirt.threads``)."""
    import torch
    import mpirt.threads
    torch.set_num_threads(n)
    mpirt.threads.set_num_threads(n)


def time_steps(steps, repeats: int, rounds: int = 3) -> list[float]:
    """Median seconds per call of each function in ``steps``.

    The contenders take turns, ``rounds`` times: a pause (BLAS and OpenMP worker threads spin for
    a while after their last call and would steal a core from the next contender), one untimed
    warm-up call, then ``repeats // rounds`` timed calls. Turns spread background load on a
    shared machine over all contenders.
    """
    times = [[] for _ in steps]
    for _ in range(rounds):
        for step, ts in zip(steps, times):
            time.sleep(0.3)
            step()
            for _ in range(max(1, repeats // rounds)):
                t0 = time.perf_counter()
                step()
                ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


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
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            c = cfg.n_embd
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)
            self.c_attn, self.c_proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)
            self.c_fc, self.m_proj = torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)

        def forward(self, h):
            b, t, c = h.shape
            q, k, v = self.c_attn(self.ln_1(h)).split(c, dim=2)
            q, k, v = (z.view(b, t, cfg.n_head, c // cfg.n_head).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            h = h + self.c_proj(a)
            return h + self.m_proj(F.gelu(self.c_fc(self.ln_2(h)), approximate="tanh"))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = torch.nn.Embedding(cfg.n_positions, cfg.n_embd)
            self.h = torch.nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = torch.nn.LayerNorm(cfg.n_embd)

        def forward(self, idx, targets):
            h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h:
                h = block(h)
            logits = self.ln_f(h) @ self.wte.weight.T
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    torch.manual_seed(0)
    model = GPT()
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
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "step.json"))
    args = parser.parse_args()
    set_threads(args.threads)
    import dataclasses
    from mpirt.models.presets import load_model_config

    rows = []
    for name in args.cases.split(","):
        overrides, batch, seq_len = CASES[name]
        cfg = load_model_config("tiny", overrides)
        rng = np.random.default_rng(0)
        x = rng.integers(0, cfg.vocab_size, (batch, seq_len), dtype=np.int64)
        y = rng.integers(0, cfg.vocab_size, (batch, seq_len), dtype=np.int64)
        m_step, n_params = mpirt_step(cfg, batch, seq_len, x, y)
        t_step = torch_step(cfg, batch, seq_len, x, y)
        t_mpirt, t_torch = time_steps([m_step, t_step], args.repeats)
        tokens = batch * seq_len
        rows.append({"case": name, "params": n_params, "batch": batch, "seq_len": seq_len,
                     "config": dataclasses.asdict(cfg), "threads": args.threads,
                     "mpirt_step_s": t_mpirt, "torch_step_s": t_torch,
                     "mpirt_tokens_per_s": tokens / t_mpirt, "torch_tokens_per_s": tokens / t_torch,
                     "ratio": t_mpirt / t_torch})
    print(f"{'case':6} {'params':>10} {'B x T':>9} {'mpirt ms':>9} {'torch ms':>9} {'mpirt tok/s':>12} "
          f"{'torch tok/s':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['case']:6} {r['params']:>10,} {r['batch']:>4} x {r['seq_len']:<4}"
              f"{1e3 * r['mpirt_step_s']:>9.1f} {1e3 * r['torch_step_s']:>9.1f} "
              f"{r['mpirt_tokens_per_s']:>12,.0f} {r['torch_tokens_per_s']:>12,.0f} {r['ratio']:>6.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
