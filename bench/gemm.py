"""The GEMM candidates (NumPy's OpenBLAS, BLIS, MKL) on the products of the bench/step.py cases.

For each case and each linear layer of its GPT step (``qkv``, ``proj``, ``fc``, ``fc2`` and the
tied ``head``), the three products a step runs: forward ``x w``, input gradient ``g w^T`` and
weight gradient ``x^T g`` (the head: ``h wte^T``, ``g wte``, ``g^T h``), float32, through
``mpirt.cpu.threads.matmul`` with the thread count training uses, so each product is split over
mpirt's pool exactly as in a step. Candidates alternate product by product (order rotating), and
each cell is the median [min-max] ms over the repeats. The last rows give the step's whole GEMM
time per candidate (every product times its count in a step): the GEMM floor of bench/step.py.

    python bench/gemm.py [--threads N] [--repeats 7] [--cases tiny,d512] [--quiet-wait 300]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as BC  # noqa: E402

CASES = {  # name -> (model overrides on the tiny preset, batch, seq_len); bench/step.py runs these
    "tiny": ({}, 8, 128),
    "d512": ({"n_layer": 4, "n_head": 8, "n_embd": 512, "n_positions": 256, "vocab_size": 50257}, 4, 256),
}


def case_config(name: str):
    """(GPTConfig, batch, seq_len) of a case."""
    from mpirt.models.presets import load_model_config
    overrides, batch, seq_len = CASES[name]
    return load_model_config("tiny", overrides), batch, seq_len


def step_products(cfg, batch: int, seq_len: int, dtype=np.float32) -> list[dict]:
    """The linear layers' products of one GPT step: per layer kind its count per step and the
    arrays of its forward and of its two backward products (laid out as the step has them)."""
    rng = np.random.default_rng(0)
    m, c = batch * seq_len, cfg.n_embd

    def arr(*shape):
        return rng.standard_normal(shape, dtype=dtype)

    layers = []
    for name, k, n in (("qkv", c, 3 * c), ("proj", c, c), ("fc", c, cfg.hidden), ("fc2", cfg.hidden, c)):
        x, w, g = arr(m, k), arr(k, n), arr(m, n)
        layers.append({"layer": name, "count": cfg.n_layer, "shape": f"{m}x{k}x{n}",
                       "products": {"fwd": (x, w), "grad_in": (g, w.T), "grad_w": (x.T, g)}})
    h, wte, g = arr(m, c), arr(cfg.vocab_size, c), arr(m, cfg.vocab_size)
    layers.append({"layer": "head", "count": 1, "shape": f"{m}x{c}x{cfg.vocab_size}",
                   "products": {"fwd": (h, wte.T), "grad_in": (g, wte), "grad_w": (g.T, h)}})
    return layers


def run_product(a, b) -> None:
    """One product as mpirt's layers run it (split over the pool)."""
    from mpirt.cpu.threads import matmul
    matmul(a, b)


def step_gemms(layers) -> None:
    """Every linear product of one step, each as often as the step runs it (the GEMM floor)."""
    for layer in layers:
        for _ in range(layer["count"]):
            for a, b in layer["products"].values():
                run_product(a, b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="default: what training uses here")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--candidates", default=None, help="comma-separated; default: all installed")
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="wait up to this many seconds for a quiet machine before starting")
    parser.add_argument("--name", default="gemm", help="results file name under bench/results")
    args = parser.parse_args()

    from mpirt.cpu import blas, threads
    threads.set_num_threads(args.threads or threads.default_num_threads())
    found, missing = blas.available()
    names = args.candidates.split(",") if args.candidates else list(found)
    names = [n for n in names if n in found]

    def contender(name, a, b):
        def call():
            blas.choose(name)
            run_product(a, b)
        return call

    BC.wait_for_quiet(args.quiet_wait)
    load = BC.LoadMonitor().start()
    rows, data = [], {"threads": threads.num_threads(), "candidates": {n: found[n].version for n in names},
                      "missing": missing, "cases": {}}
    floors = {}
    for case in args.cases.split(","):
        cfg, batch, seq_len = case_config(case)
        layers = step_products(cfg, batch, seq_len)
        per_step = {n: [0.0] * args.repeats for n in names}
        data["cases"][case] = []
        for layer in layers:
            for kind, (a, b) in layer["products"].items():
                times = BC.alternate({n: contender(n, a, b) for n in names}, args.repeats)
                for n in names:
                    per_step[n] = [s + layer["count"] * t for s, t in zip(per_step[n], times[n])]
                cells = {n: BC.spread(times[n]) for n in names}
                best = min(names, key=lambda n: cells[n]["median"])
                macs = a.shape[0] * a.shape[1] * b.shape[1]
                rows.append([case, layer["layer"], kind, f"{a.shape[0]}x{a.shape[1]}x{b.shape[1]}"]
                            + [BC.fmt_spread(cells[n], digits=2) for n in names]
                            + [best, f"{2 * macs / cells[best]['median'] / 1e9:.0f}"])
                data["cases"][case].append({"layer": layer["layer"], "product": kind, "count": layer["count"],
                                            "m_k_n": [a.shape[0], a.shape[1], b.shape[1]],
                                            "seconds": times})
        floors[case] = {n: BC.spread(v) for n, v in per_step.items()}
        best = min(names, key=lambda n: floors[case][n]["median"])
        rows.append([case, "**step GEMMs**", "all", ""] + [f"**{BC.fmt_spread(floors[case][n])}**" for n in names]
                    + [best, ""])
    load.stop()
    data["floor_s"] = floors
    header = ["case", "layer", "product", "M x K x N"] + [f"{n} ms" for n in names] + ["fastest", "GF/s"]
    notes = [f"float32, {threads.num_threads()} threads (mpirt's pool splits each product); "
             f"median [min-max] of {args.repeats} alternated repeats; "
             "step GEMMs = every linear product of one step, each as often as the step runs it.",
             "candidates: " + ", ".join(f"{n} {found[n].version}" for n in names)
             + ("; missing: " + ", ".join(missing) if missing else "")]
    BC.write_results(args.name, "GEMM candidates on the GPT step's products", header, rows, load, data, notes)


if __name__ == "__main__":
    main()
