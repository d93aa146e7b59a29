"""The body of the budget benchmarks (``long_context.py``, ``moe.py``): a model that one rank
cannot hold within a per-rank ``--memory-budget`` trains split by a layout within it.

Each step is a real `mpiexec -n RANKS python -m mpirt.train` run:

1. predicts one rank's peak, data parallelism's and the layout's (:func:`mpirt.plan.memory.predict`),
   and picks the budget halfway between the layout's and the smaller of the other two unless
   ``--budget`` is given;
2. one rank under ``--memory-budget``: mpirt.train must refuse it before training;
3. one rank without a budget: the reference losses;
4. the layout under the budget, and ``--dp RANKS`` (data parallel, the same global batch, no
   budget) for throughput: the two take turns ``--repeats`` times (A B B A ...), each run's
   median step; tokens/s, the comm share (time blocked in MPI / step), the bytes the layout's
   own axis sends a step and each rank's measured peak side by side.

The layout's losses must equal the single rank's (``--dtype float64``: 1e-10). Results go to
``bench/results/NAME.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from common import LoadMonitor, children_cpu_s, launch, workspace, write_results

from mpirt.core.modeling import load_model_config
from mpirt.plan.memory import predict
from mpirt.core.settings import format_size, parse_size
from mpirt.run.config import parse_args
from mpirt.run.train import plan_layout


def parser(doc: str, *, model: str, model_args: str, seq_len: int, batch_size: int, layout: str,
           steps: int = 4) -> argparse.ArgumentParser:
    """The benchmark's options, with its defaults."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=model)
    ap.add_argument("--model-args", default=model_args)
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--batch-size", type=int, default=batch_size)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layout", default=layout)
    ap.add_argument("--budget", default="", help="per-rank --memory-budget (default: halfway between the "
                                                "layout's predicted peak and the smaller of one rank's and dp's)")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each contender, taking turns")
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--data", default="", help="a prepared dataset (default: this repository's sources, bytes)")
    ap.add_argument("--out", default="", help="where the runs go (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--results", default="", help="where NAME.json/.md go (default bench/results)")
    return ap


def train_args(a, layout: str, out: Path, extra=()) -> list[str]:
    return [f"--model={a.model}", *shlex.split(a.model_args), f"--model.n_positions={a.seq_len}",
            f"--data={a.data}", f"--out-dir={out}", f"--steps={a.steps}", f"--seq-len={a.seq_len}",
            f"--batch-size={a.batch_size}", f"--dtype={a.dtype}", "--eval-batches=1", "--eval-interval=0",
            "--progress=false", "--warmup-steps=1", "--overwrite", *shlex.split(layout), *extra]


def run(a, layout: str, ranks: int, out: Path, axis: str, extra=()) -> dict:
    """One training run: its summary, per-step losses, the median comm share of its steps and the
    median bytes rank 0 sent on ``axis``."""
    launch(["mpirt.train", *train_args(a, layout, out, extra)], ranks, a.timeout)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    timed = steps[1:] or steps
    share = statistics.median(r.get("mpi_wait_s", 0.0) / r["step_time_s"] for r in timed)
    sent = statistics.median(r.get(f"comm_{axis}_bytes", 0) for r in timed)
    return {"summary": summary, "losses": [r["loss"] for r in steps], "comm_share": share, "axis_bytes": sent}


def routing_notes(summary: dict, layout: str) -> list[str]:
    """A mixture of experts' measured loads beside what the budget was planned at (none without
    experts): the peak predicted is at the measured loads, the plan at their bounds."""
    if "moe_busiest_expert_load_per_rank" not in summary:
        return []
    loads = summary.get("moe_expert_load_per_rank")
    mib = " / ".join(f"{m / 2**20:.1f}" for m in summary["peak_memory_bytes_per_rank"])
    predicted = " / ".join(f"{p / 2**20:.1f}" for p in summary["predicted_peak_bytes_per_rank"])
    planned = " / ".join(f"{p / 2**20:.1f}" for p in summary["planned_peak_bytes_per_rank"])
    return [(f"{layout}, first run, per rank: " + (f"expert load {', '.join(f'{x:.2f}' for x in loads)} (planned at "
             f"{summary['moe_expert_load_planned']:g}); " if loads else "") + "busiest expert's load (deepest layer) "
             f"{', '.join(f'{x:.2f}' for x in summary['moe_busiest_expert_load_per_rank'])} (planned at "
             f"{summary['moe_busiest_expert_load_planned']:g}); peak measured / predicted at those loads / planned MiB: "
             f"{mib}; {predicted}; {planned}")]


def main(a, name: str, title: str, axis: str, what: str) -> None:
    """Run the benchmark (see the module docstring) and write ``NAME.json``/``.md``. ``axis``: the
    layout's own communicator, whose bytes a step get a column; ``what``: a line on the model."""
    out, a.data = workspace(a.out, a.data, f"mpirt-{name}-")
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
        sys.exit(f"{name}: the budget {format_size(budget)} must lie between the layout's predicted peak "
                 f"{format_size(layout_peak)} and one rank's {format_size(single_peak)}")
    budget_flag = [f"--memory-budget={budget}"]

    # 2. one rank under the budget: refused before training
    refused, _, _ = launch(["mpirt.train", *train_args(a, "", out / "refused", budget_flag)], 1, a.timeout,
                           check=False)
    if refused.returncode == 0 or "memory_budget" not in refused.stderr:
        sys.exit(f"{name}: one rank under {format_size(budget)} was not refused:\n{refused.stderr[-2000:]}")

    # 3. the reference; 4. the layout under the budget and data parallelism, taking turns
    single = run(a, "", 1, out / "single", axis)
    runs = {"layout": [], "dp": []}
    for i in range(a.repeats):
        order = ("layout", "dp") if i % 2 == 0 else ("dp", "layout")
        for contender in order:
            if contender == "layout":
                runs[contender].append(run(a, a.layout, a.ranks, out / f"layout{i}", axis, budget_flag))
            else:
                runs[contender].append(run(a, f"--dp={a.ranks}", a.ranks, out / f"dp{i}", axis))
    worst = max(abs(x - y) / abs(y) for r in runs["layout"] for x, y in zip(r["losses"], single["losses"]))
    if worst > (1e-10 if a.dtype == "float64" else 1e-5):
        sys.exit(f"{name}: the layout's losses differ from one rank's by {worst:.2e}")

    def row(label: str, ranks: int, results: list) -> list:
        s = [r["summary"] for r in results]
        tok = [x["tokens_per_s"] for x in s]
        peaks = [max(x["peak_memory_bytes_per_rank"]) for x in s]
        predicted = max(s[0]["predicted_peak_bytes_per_rank"])
        comm = [r["comm_share"] for r in results]
        sent = statistics.median(r["axis_bytes"] for r in results)
        return [label, ranks, f"{statistics.median(tok):,.0f} ({min(tok):,.0f}-{max(tok):,.0f})",
                f"{100 * statistics.median(comm):.0f}%", f"{sent / 2**20:.2f}", format_size(predicted),
                format_size(max(peaks)), "yes" if max(peaks) <= budget else "no"]

    rows = [row(a.layout, a.ranks, runs["layout"]), row(f"--dp={a.ranks}", a.ranks, runs["dp"]),
            row("one rank", 1, [single])]
    notes = [f"{what}; seq_len {a.seq_len}, batch {a.batch_size}, {a.model} {a.model_args}, {a.dtype}, {a.steps} "
             f"steps; budget {format_size(budget)} per rank (one rank predicted {format_size(single_peak)}: refused "
             f"before training, exit {refused.returncode})",
             f"losses of {a.layout} against one rank: largest relative difference {worst:.1e}",
             f"tokens/s: median of the runs (range); comm: median step's time blocked in MPI / step time (rank 0); "
             f"{axis} MiB: sent on the {axis} axis a step (rank 0, median)"]
    notes += routing_notes(runs["layout"][0]["summary"], a.layout)
    write_results(name, title, ["layout", "ranks", "tokens/s", "comm", f"{axis} MiB/step", "peak predicted",
                                "peak measured", "within budget"],
                  rows, load.stop(children_cpu_s() - children_cpu0),
                  {"budget": budget, "single_predicted": single_peak, "max_rel_loss_diff": worst,
                   "runs": {k: [r["summary"] for r in v] for k, v in runs.items()}, "single": single["summary"]},
                  notes, Path(a.results) if a.results else None)
