"""A sequence too long for one rank's memory budget trains under context parallelism within it.

    python bench/long_context.py                        # seq 4096, cp 4, a budget only cp 4 fits
    python bench/long_context.py --seq-len 8192 --layout="--cp=2 --tp=2" --budget 300MiB

Each step is a real `mpiexec -n RANKS python -m mpirt.train` run of a small GPT with attention
dropout (whose per-layer masks are the attention's largest activation, B H T^2 bytes):

1. predicts one rank's peak, data parallelism's and the layout's (:func:`mpirt.plan.memory.predict`),
   and picks the budget halfway between the layout's and the smaller of the other two unless
   ``--budget`` is given;
2. one rank under ``--memory-budget``: mpirt.train must refuse it before training;
3. one rank without a budget: the reference losses;
4. the layout under the budget, and ``--dp RANKS`` (data parallel, the same global batch, no
   budget) for throughput: the two take turns ``--repeats`` times (A B B A ...), each run's
   median step; tokens/s, the comm share (time blocked in MPI / step) and each rank's
   measured peak side by side.

The layout's losses must equal the single rank's (``--dtype float64``: 1e-10). Results go to
``bench/results/long_context.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import LoadMonitor, children_cpu_s, launch, workspace, write_results  # noqa: E402

from mpirt.core.modeling import load_model_config  # noqa: E402
from mpirt.plan.memory import format_size, parse_size, predict  # noqa: E402
from mpirt.run.config import parse_args  # noqa: E402
from mpirt.run.train import plan_layout  # noqa: E402


def train_args(a, layout: str, out: Path, extra=()) -> list[str]:
    return [f"--model={a.model}", *shlex.split(a.model_args), f"--model.n_positions={a.seq_len}",
            f"--data={a.data}", f"--out-dir={out}", f"--steps={a.steps}", f"--seq-len={a.seq_len}",
            f"--batch-size={a.batch_size}", f"--dtype={a.dtype}", "--eval-batches=1", "--eval-interval=0",
            "--progress=false", "--warmup-steps=1", "--overwrite", *shlex.split(layout), *extra]


def run(a, layout: str, ranks: int, out: Path, extra=()) -> dict:
    """One training run: its summary, per-step losses and the median comm share of its steps."""
    launch(["mpirt.train", *train_args(a, layout, out, extra)], ranks, a.timeout)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    share = statistics.median(r.get("mpi_wait_s", 0.0) / r["step_time_s"] for r in steps[1:] or steps)
    return {"summary": summary, "losses": [r["loss"] for r in steps], "comm_share": share}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--model-args", default="--model.n_layer=2 --model.n_embd=64 --model.n_head=4 "
                                            "--model.attn_pdrop=0.1")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layout", default="--cp=4")
    ap.add_argument("--budget", default="", help="per-rank --memory-budget (default: halfway between the "
                                                "single rank's predicted peak and the layout's)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each contender, taking turns")
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--data", default="", help="a prepared dataset (default: this repository's sources, bytes)")
    ap.add_argument("--out", default="", help="where the runs go (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--results", default="", help="where long_context.json/.md go (default bench/results)")
    a = ap.parse_args()

    out, a.data = workspace(a.out, a.data, "mpirt-long-context-")
    load = LoadMonitor().start()
    children_cpu0 = children_cpu_s()

    # 1. the predictions, from the config alone
    cfg = parse_args(train_args(a, a.layout, out / "p"))
    single_cfg = parse_args(train_args(a, "", out / "p"))
    model_cfg = load_model_config(cfg.model, cfg.model_overrides)
    single_peak = predict(single_cfg, model_cfg, plan_layout(single_cfg, 1), 0)["peak"]
    layout = plan_layout(cfg, a.ranks)
    layout_peak = max(predict(cfg, model_cfg, layout, r)["peak"] for r in range(a.ranks))
    dp_cfg = parse_args(train_args(a, f"--dp={a.ranks}", out / "p"))
    dp_peak = max(predict(dp_cfg, model_cfg, plan_layout(dp_cfg, a.ranks), r)["peak"] for r in range(a.ranks))
    budget = parse_size(a.budget) if a.budget else (min(single_peak, dp_peak) + layout_peak) // 2
    if not layout_peak < budget < single_peak:
        sys.exit(f"long_context: the budget {format_size(budget)} must lie between the layout's predicted peak "
                 f"{format_size(layout_peak)} and one rank's {format_size(single_peak)}")
    budget_flag = [f"--memory-budget={budget}"]

    # 2. one rank under the budget: refused before training
    refused, _, _ = launch(["mpirt.train", *train_args(a, "", out / "refused", budget_flag)], 1, a.timeout,
                           check=False)
    if refused.returncode == 0 or "memory_budget" not in refused.stderr:
        sys.exit(f"long_context: one rank under {format_size(budget)} was not refused:\n{refused.stderr[-2000:]}")

    # 3. the reference; 4. the layout under the budget and data parallelism, taking turns
    single = run(a, "", 1, out / "single")
    runs = {"layout": [], "dp": []}
    for i in range(a.repeats):
        order = ("layout", "dp") if i % 2 == 0 else ("dp", "layout")
        for name in order:
            if name == "layout":
                runs[name].append(run(a, a.layout, a.ranks, out / f"layout{i}", budget_flag))
            else:
                runs[name].append(run(a, f"--dp={a.ranks}", a.ranks, out / f"dp{i}"))
    worst = max(abs(x - y) / abs(y) for r in runs["layout"] for x, y in zip(r["losses"], single["losses"]))
    if worst > (1e-10 if a.dtype == "float64" else 1e-5):
        sys.exit(f"long_context: the layout's losses differ from one rank's by {worst:.2e}")

    def row(name: str, ranks: int, results: list) -> list:
        s = [r["summary"] for r in results]
        tok = [x["tokens_per_s"] for x in s]
        peaks = [max(x["peak_memory_bytes_per_rank"]) for x in s]
        predicted = max(s[0]["predicted_peak_bytes_per_rank"])
        comm = [r["comm_share"] for r in results]
        return [name, ranks, f"{statistics.median(tok):,.0f} ({min(tok):,.0f}-{max(tok):,.0f})",
                f"{100 * statistics.median(comm):.0f}%", format_size(predicted), format_size(max(peaks)),
                "yes" if max(peaks) <= budget else "no"]

    rows = [row(a.layout, a.ranks, runs["layout"]), row(f"--dp={a.ranks}", a.ranks, runs["dp"]),
            row("one rank", 1, [single])]
    notes = [f"seq_len {a.seq_len}, batch {a.batch_size}, {a.model} {a.model_args}, {a.dtype}, {a.steps} steps; "
             f"budget {format_size(budget)} per rank (one rank predicted {format_size(single_peak)}: refused before "
             f"training, exit {refused.returncode})",
             f"losses of {a.layout} against one rank: largest relative difference {worst:.1e}",
             "tokens/s: median of the runs (range); comm: median step's time blocked in MPI / step time (rank 0)"]
    write_results("long_context", "Long context: one rank's budget, context parallelism within it",
                  ["layout", "ranks", "tokens/s", "comm", "peak predicted", "peak measured", "within budget"],
                  rows, load.stop(children_cpu_s() - children_cpu0), {"budget": budget, "single_predicted": single_peak, "max_rel_loss_diff": worst,
                                      "runs": {k: [r["summary"] for r in v] for k, v in runs.items()},
                                      "single": single["summary"]},
                  notes, Path(a.results) if a.results else None)


if __name__ == "__main__":
    main()
