"""The headline run: a GPT too big for one rank's memory budget trains on 8 ranks within it.

    python bench/fit.py                       # gpt2-medium on dp2 x tp4, ZeRO-1, the budget from its prediction
    python bench/fit.py --plan-only           # the prediction and the budget only (seconds)
    python bench/fit.py --model gpt2 --budget 700MiB --single --layout="--dp=2 --tp=4 --zero=1"

What it does, each step a real `mpiexec -n RANKS python -m mpirt.train` (or mpirt.checkpoint) run:

1. predicts, from the config alone (:func:`mpirt.plan.memory.predict`), the single-rank training
   memory (weights, gradients, AdamW state, one micro-batch's activations, the process) and each
   rank's peak under the layout; the budget (``--budget auto``, the default) is the largest rank's
   predicted peak plus :data:`HEADROOM` (what a measured peak may exceed its prediction by),
   rounded up; refuses to go on when the single rank needs < ``--min-ratio`` (4) x the budget;
2. trains ``--steps`` steps under ``--memory-budget`` (the run itself refuses a layout predicted not
   to fit and stops with exit 5 when a rank's measured peak passes the budget) and writes a
   sharded checkpoint;
3. resumes that checkpoint on another layout (``--then``) for two more steps, under the budget;
4. exports the checkpoint to a Hugging Face GPT-2 directory, tensor by tensor, and records the
   exporting process's peak;
5. with ``--single``, trains the same steps on one rank without a budget and compares the losses.

It prints, per rank, the predicted and measured peak and the measured parameters, gradients and
optimizer state against the budget, and the step times; with ``--save`` it writes them to
``bench/results/fit.json`` and ``fit.md`` (tracked: only when asked), with ``--results DIR`` there.
The runs (checkpoints and the export: about 9 GB for gpt2-medium) go to ``--out``, kept; without
it to a temporary directory, named at the start and removed at the end (kept, and named, when a
step fails).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import LoadMonitor, children_cpu_s, launch, workspace, write_results  # noqa: E402

from mpirt.run.config import parse_args  # noqa: E402
from mpirt.plan.memory import CATEGORIES, predict  # noqa: E402
from mpirt.core.settings import format_size, parse_size  # noqa: E402
from mpirt.core.modeling import load_model_config, num_parameters  # noqa: E402
from mpirt.run.train import open_dataset, plan_layout, vocab_from_data  # noqa: E402


def train_args(a, layout: str, out: Path, steps: int, extra=()) -> list[str]:
    return [f"--model={a.model}", *shlex.split(a.model_args), f"--data={a.data}", f"--out-dir={out}", f"--steps={steps}",
            f"--seq-len={a.seq_len}", f"--batch-size={a.batch_size}", f"--lr={a.lr}", "--eval-batches=1", "--eval-interval=0",
            "--log-interval=1", "--progress=false", "--warmup-steps=1", "--overwrite", *shlex.split(layout), *extra]


HEADROOM = 0.15   # a rank's measured peak over its pre-run prediction (gpt2-medium, dp2 x tp4: +6%), with margin


def auto_budget(largest_peak: int) -> int:
    """The per-rank budget the layout is run under by default: its largest rank's predicted peak
    plus :data:`HEADROOM`, rounded up to 10 MiB below 1 GiB and to 0.05 GiB above."""
    step = 10 * 2**20 if largest_peak < 2**30 else 2**30 // 20
    return math.ceil(round(largest_peak * (1 + HEADROOM) / step, 6)) * step   # round: 115.00000000000001 is 115


def losses_of(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--model-args", default="--model.vocab_size=50257",
                    help="--model.<field>=... overrides (default: GPT-2's vocabulary, which training from "
                         "scratch would otherwise take from the byte-level data: 256)")
    ap.add_argument("--budget", default="auto", help="per-rank --memory-budget (auto: the layout's largest "
                                                      "predicted peak plus 15%%, rounded up)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--layout", default="--dp=2 --tp=4 --zero=1 --recompute=selective")
    ap.add_argument("--then", default="--tp=8", help="the layout the checkpoint resumes on")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--data", default="", help="a prepared dataset (default: this repository's sources, bytes)")
    ap.add_argument("--out", default="", help="where the runs go, kept (default: a temporary directory, removed "
                                              "at the end)")
    ap.add_argument("--plan-only", action="store_true", help="print the prediction and the budget, run nothing")
    ap.add_argument("--save", action="store_true", help="write fit.json/fit.md to bench/results (tracked)")
    ap.add_argument("--single", action="store_true", help="also train on one rank and compare the losses")
    ap.add_argument("--min-ratio", type=float, default=4.0, help="single-rank need / budget at least this")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--results", default="", help="write fit.json/fit.md to this directory")
    a = ap.parse_args()

    out, a.data = workspace(a.out, a.data, "mpirt-fit-")
    if not a.out:
        print(f"fit: the runs go to {out} (removed at the end; --out DIR keeps them)", flush=True)
    try:
        run(a, out)
    except BaseException:
        if not a.out:
            print(f"fit: stopped; the runs are kept in {out} (remove it when done)", file=sys.stderr)
        raise
    if not a.out:
        shutil.rmtree(out)
        print(f"fit: removed {out}")


def run(a, out: Path) -> None:
    """Steps 1-5 of the module docstring, the runs under ``out``."""
    load = LoadMonitor().start()
    children_cpu0 = children_cpu_s()

    # 1. the prediction, from the config alone
    cfg = parse_args(train_args(a, a.layout, out / "run", a.steps))
    layout = plan_layout(cfg, a.ranks)
    model_cfg = vocab_from_data(cfg, load_model_config(cfg.model, cfg.model_overrides), open_dataset(cfg.data),
                                layout["tp"])  # the model train.py builds
    data_bytes = sum(f.stat().st_size for f in Path(a.data).glob("*.bin"))
    single_cfg = dataclasses.replace(cfg, dp=1, pp=1, tp=1, zero=0, recompute="none", microbatches=0,
                                     sequence_parallel=False, memory_budget="")
    single = predict(single_cfg, model_cfg, {"dp": 1, "pp": 1, "tp": 1}, 0, data_bytes)
    predicted = [predict(cfg, model_cfg, layout, r, data_bytes) for r in range(a.ranks)]
    largest = max(p["peak"] for p in predicted)
    budget = auto_budget(largest) if a.budget == "auto" else parse_size(a.budget)
    a.budget = f"{budget}B"
    cfg = dataclasses.replace(cfg, memory_budget=a.budget)
    ratio = single["peak"] / budget
    print(f"fit: {a.model}: single rank needs {format_size(single['peak'])} "
          f"({', '.join(f'{k} {format_size(single[k])}' for k in CATEGORIES)}) = {ratio:.2f}x the budget "
          f"{format_size(budget)}; on {a.ranks} ranks ({a.layout}) the largest predicted peak is "
          f"{format_size(largest)}", flush=True)
    if ratio < a.min_ratio:
        sys.exit(f"fit: the single rank needs only {ratio:.2f}x the budget {format_size(budget)} (< {a.min_ratio}), "
                 f"its layout's largest rank {format_size(largest)}: pick a bigger model, a layout that shards more "
                 "(a larger tp, --zero 2 or 3) or a smaller --budget")
    if a.plan_only:
        return

    # 2. train under the budget, 3. resume on another layout, 4. export
    run, then = out / "run", out / "then"
    first, first_wall, _ = launch(["mpirt.train", *train_args(a, a.layout, run, a.steps,
                                                               [f"--memory-budget={a.budget}"])],
                                  a.ranks, a.timeout)
    summary = json.loads((run / "summary.json").read_text())
    _, then_wall, _ = launch(["mpirt.train", *train_args(a, a.then, then, a.steps + 2,
                                                         [f"--memory-budget={a.budget}", f"--init-from={run / 'ckpt'}"])],
                             a.ranks, a.timeout)
    resumed = json.loads((then / "summary.json").read_text())
    hf = out / "hf"
    _, export_wall, export_peak = launch(["mpirt.checkpoint", "export", str(then / "ckpt"), str(hf)], 1, a.timeout)
    compare = None
    if a.single:
        launch(["mpirt.train", *train_args(a, "", out / "single", a.steps)], 1, a.timeout)
        ref, got = losses_of(out / "single"), losses_of(run)
        compare = {"single_losses": ref, "layout_losses": got,
                   "max_rel_err": max(abs(x - y) / abs(y) for x, y in zip(got, ref))}

    # the table
    memory = summary["monitor"]["memory_per_rank"]
    rows = []
    for r in range(a.ranks):
        # the run's own prediction (summary.json's): from the baseline each rank measured, no dataset
        # bytes (the run reads its token files window by window); the pre-run one assumes PROCESS_BYTES
        m = memory[r]
        p = predict(cfg, model_cfg, layout, r, process_bytes=summary["process_baseline_bytes_per_rank"][r])
        rows.append({"rank": r, "predicted_peak": p["peak"],
                     "measured_peak": summary["peak_memory_bytes_per_rank"][r],
                     "budget": budget, "params": m["params"], "grads": m["grads"], "optimizer": m["optimizer"],
                     "activations_peak": m["activations_peak"],
                     "predicted": {k: p[k] for k in CATEGORIES}})
    within = all(row["measured_peak"] <= budget for row in rows) and resumed["peak_memory_bytes"] <= budget
    notes = [f"{a.model} {a.model_args}: {num_parameters(model_cfg) / 1e6:.1f}M parameters. "
             f"Single rank needs {format_size(single['peak'])} = {ratio:.2f}x the budget (predicted: "
             + ", ".join(f"{k} {format_size(single[k])}" for k in CATEGORIES) + ").",
             f"Layout `{a.layout}`: {a.steps} steps, median step {summary['step_time_s']:.2f} s, loss "
             f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, wall {first_wall:.0f} s.",
             f"Resumed on `{a.then}`: to step {a.steps + 2}, loss {resumed['last_loss']:.4f}, largest peak "
             f"{format_size(resumed['peak_memory_bytes'])}, median step {resumed['step_time_s']:.2f} s, "
             f"wall {then_wall:.0f} s.",
             f"Exported to a Hugging Face directory in {export_wall:.0f} s (largest peak RSS of any child of "
             f"this script so far, training ranks included: {format_size(export_peak)}).",
             f"Every rank within the budget: {'yes' if within else 'NO'}."]
    if compare:
        notes.append(f"One rank, same steps: losses {compare['single_losses']}, layout {compare['layout_losses']}, "
                     f"max relative difference {compare['max_rel_err']:.2e}.")
    header = ["rank", "predicted peak", "measured peak", "budget", "params", "grads", "optimizer", "activation stash"]
    table = [[row["rank"], format_size(row["predicted_peak"]), format_size(row["measured_peak"]), format_size(budget),
              format_size(row["params"]), format_size(row["grads"]), format_size(row["optimizer"]),
              format_size(row["activations_peak"])] for row in rows]
    write_results("fit", f"bench/fit.py: {a.model} on {a.ranks} ranks within {format_size(budget)} per rank",
                  header, table, load.stop(own=children_cpu_s() - children_cpu0),
                  {"model": a.model, "budget": budget, "ranks": a.ranks, "layout": a.layout, "then": a.then,
                   "single_rank_prediction": single, "ratio": ratio, "rows": rows, "summary": summary,
                   "resumed": resumed, "export_s": export_wall, "compare": compare, "within_budget": within},
                  notes, directory=Path(a.results) if a.results else None, save=bool(a.results or a.save))
    if not within:
        sys.exit(1)


if __name__ == "__main__":
    main()
