"""``python -m mpirt.report RUN_DIR``: plots and a short report of a training run.

Reads what ``python -m mpirt.train`` left in RUN_DIR (``summary.json``, ``metrics/rank*.jsonl``,
``trace.json``) and writes into ``RUN_DIR/report/`` (or ``--out``) PNGs made with matplotlib (the
``monitor`` extra) and ``report.md`` with the headline figures:

- ``loss.png``: training loss per step and the validation loss where it was measured, a dashed
  line where a job resumed from a checkpoint;
- ``step_breakdown.png``: per rank, the median step split into its parts (forward, backward,
  weight gradients, pipeline bubble, gradient sync, optimizer, ...) and, beside it, the same
  step split into the rank's own compute and its time waiting in MPI (a straggler computes
  longest; the others wait for it);
- ``comm.png``: per communication axis (dp, tp, pp, cp, ep, world; dp_cp: the gradient sync over
  dp x cp, edp: the experts' over dp / ep; each named under its bar), time per step (blocked, and
  in flight for non-blocking calls) and the achieved bandwidth (bytes over in-flight time);
- ``timeline.png``: the last traced step, a row per rank coloured by forward / backward /
  weight gradient / optimizer / MPI wait, idle left blank: the pipeline schedule and its bubble;
- ``memory.png``: per rank, parameters, gradients, optimizer state, activations (a pipeline's
  measured stash, else the run's prediction: what cp or recomputation saves shows) and the rest
  of the peak resident memory, against the budget;
- ``moe.png`` (mixture of experts): tokens per expert against the even share, the imbalance and
  the dropped assignments per step;
- ``gpu.png`` (GPU runs): utilisation and memory-bandwidth utilisation over time per rank.

``report.md`` also has the performance model's prediction for the run's layout beside the
measured step time, its parts, the bubble and the peak memory, with the error in percent
(``summary["prediction"]``, :func:`mpirt.plan.self_check`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from mpirt.monitor.report_text import MIB, headline, prediction_section  # noqa: F401  (the report's text)

PARTS = (("data", "data", "#bbbbbb"), ("forward", "forward", "#4c72b0"), ("backward", "backward", "#dd8452"),
         ("weight_grad", "weight grad", "#55a868"), ("bubble", "pipeline bubble", "#f0e442"),
         ("grad_sync", "gradient sync", "#937860"), ("optimizer", "optimizer", "#8172b3"),
         ("injected", "injected delay", "#000000"), ("other", "other", "#e5e5e5"))
# what each communication axis is, under its name on comm.png (dp_cp and edp are internal groups)
AXIS_NAMES = {"dp": "dp\n(gradient sync)", "tp": "tp\n(tensor parallel)", "pp": "pp\n(pipeline sends)",
              "cp": "cp\n(ring attention)", "dp_cp": "dp_cp\n(gradient sync\nover dp x cp)",
              "ep": "ep\n(expert all-to-alls)", "edp": "edp\n(experts' gradient\nsync: dp / ep)",
              "world": "world\n(loss, flags)"}
AXIS_COLORS = {"dp": "#c44e52", "tp": "#4c72b0", "pp": "#55a868", "cp": "#8172b2", "dp_cp": "#dd8452",
               "world": "#8c8c8c", "ep": "#937860", "edp": "#da8bc3"}


def load_run(run: Path) -> dict:
    """summary.json, the per-rank metrics (lists of records by rank) and trace.json (or None)."""
    summary = json.loads((run / "summary.json").read_text())
    ranks = {}
    for path in sorted((run / "metrics").glob("rank*.jsonl"), key=lambda p: int(p.stem[4:])):
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line cut short by a killed job
                pass
        ranks[int(path.stem[4:])] = records
    trace = run / "trace.json"
    return {"summary": summary, "ranks": ranks, "trace": json.loads(trace.read_text()) if trace.exists() else None}


def median_of(records: list[dict], key: str) -> float:
    """Median of ``key`` over the records after the first (warm-up) step."""
    values = [r[key] for r in records[1:] or records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else 0.0


def _figure(rows: int = 1, cols: int = 1, width: float = 10, height: float = 4.5):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    return plt, fig, axes[0] if rows == 1 else axes


def _legend_below(ax, **kwargs) -> None:
    """A legend centred under ``ax``, a fixed 36 points below it (tick labels and the axis
    label sit in between), however short the figure: a fraction of the axes' height would put
    it over the axis label of a short one. ``tight_layout`` then makes room for it."""
    from matplotlib.transforms import ScaledTranslation
    below = ax.transAxes + ScaledTranslation(0, -36 / 72, ax.figure.dpi_scale_trans)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=below, **kwargs)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(run: dict, path: Path) -> Path:
    plt, fig, (ax,) = _figure()
    records = run["ranks"][0]
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="training loss", color="#4c72b0")
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", color="#dd8452")
    for i, r in enumerate(r for r in records if r.get("resumed_from") is not None):  # each job that resumed
        ax.axvline(r["resumed_from"] + 0.5, color="#55a868", linestyle="--", linewidth=1,
                   label="resumed from a checkpoint" if i == 0 else None)
        ax.annotate(f"resumed from step {r['resumed_from']}", (r["resumed_from"] + 0.5, 1), xytext=(3, -12),
                    xycoords=("data", "axes fraction"), textcoords="offset points", fontsize=8, color="#55a868")
    ax.set(xlabel="step", ylabel="loss (cross-entropy, nats/token)", title="Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_breakdown(run: dict, path: Path) -> Path:
    plt, fig, (ax, ax2) = _figure(1, 2, width=12, height=max(4.0, 0.45 * len(run["ranks"]) + 2.8))
    ranks = sorted(run["ranks"])
    labels = [f"rank {r}" for r in ranks]
    left = [0.0] * len(ranks)
    for key, name, color in PARTS:
        ms = [1e3 * median_of(run["ranks"][r], f"{key}_s") for r in ranks]
        if any(v > 0 for v in ms):
            ax.barh(labels, ms, left=left, color=color, label=name, edgecolor="white", linewidth=0.5)
            left = [a + b for a, b in zip(left, ms)]
    ax.invert_yaxis()
    ax.set(xlabel="milliseconds per step (median)", title="Step time by part, per rank")
    _legend_below(ax, ncol=3)
    compute = [1e3 * median_of(run["ranks"][r], "compute_s") for r in ranks]
    wait = [1e3 * median_of(run["ranks"][r], "mpi_wait_s") for r in ranks]
    ax2.barh(labels, compute, color="#4c72b0", label="own compute")
    ax2.barh(labels, wait, left=compute, color="#c44e52", label="waiting in MPI")
    # the run's own straggler figure names it (report.md says the same); else the longest compute here
    named = ((run["summary"].get("monitor") or {}).get("stragglers") or {}).get("slowest_rank")
    slowest = ranks.index(named) if named in ranks else max(range(len(ranks)), key=lambda i: compute[i])
    if len(ranks) > 1:
        ax2.annotate("slowest", (compute[slowest], slowest), xytext=(4, 0), textcoords="offset points",
                     va="center", fontsize=8, color="white" if wait[slowest] > compute[slowest] / 4 else "black")
    ax2.invert_yaxis()
    ax2.set(xlabel="milliseconds per step (median)", title="Compute vs waiting (stragglers compute longest)")
    _legend_below(ax2, ncol=2)
    return _save(plt, fig, path)


def comm_table(run: dict) -> dict:
    """Per axis: median per step over the ranks of bytes, blocked and in-flight seconds, and the
    achieved bandwidth (bytes / in-flight seconds), from the per-rank records."""
    axes = sorted({k[5:-6] for recs in run["ranks"].values() for r in recs for k in r
                   if k.startswith("comm_") and k.endswith("_bytes")})
    table = {}
    for axis in axes:
        per_rank = [(median_of(recs, f"comm_{axis}_bytes"), median_of(recs, f"comm_{axis}_wait_s"),
                     median_of(recs, f"comm_{axis}_s")) for recs in run["ranks"].values()]
        per_rank = [p for p in per_rank if p[0] > 0 or p[2] > 0]
        if not per_rank:
            continue
        nbytes, wait, flight = (statistics.median(v) for v in zip(*per_rank))
        table[axis] = {"bytes": nbytes, "wait_s": wait, "in_flight_s": flight,
                       "bandwidth": nbytes / flight if flight > 0 else 0.0}
    return table


def plot_comm(run: dict, path: Path) -> Path | None:
    """None (no figure) when nothing was communicated: one rank, or no axis moved a byte."""
    table = comm_table(run)
    if run["summary"].get("world_size", 1) < 2 or not table:
        return None
    plt, fig, (ax, ax2) = _figure(1, 2, width=11)
    names = list(table)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [1e3 * table[a]["wait_s"] for a in names], 0.4, label="blocked (rank waits)",
           color=[AXIS_COLORS.get(a, "#999999") for a in names])
    ax.bar([i + 0.2 for i in x], [1e3 * table[a]["in_flight_s"] for a in names], 0.4, label="in flight (post to done)",
           color=[AXIS_COLORS.get(a, "#999999") for a in names], alpha=0.4, hatch="//")
    labels = [AXIS_NAMES.get(a, a) for a in names]
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set(ylabel="milliseconds per step (median rank)", title="Communication time per axis")
    ax.legend(fontsize=8)
    bw = [table[a]["bandwidth"] / 1e9 for a in names]
    bars = ax2.bar(list(x), bw, color=[AXIS_COLORS.get(a, "#999999") for a in names])
    ax2.set_xticks(list(x), labels, fontsize=8)
    for bar, a in zip(bars, names):
        ax2.annotate(f"{table[a]['bytes'] / MIB:.2f} MiB/step", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                     ha="center", va="bottom", fontsize=8)
    ax2.set(ylabel="GB/s (bytes / in-flight time)", title="Achieved bandwidth per axis")
    if not names:
        for a in (ax, ax2):
            a.text(0.5, 0.5, "no communication (one rank)", ha="center", va="center", transform=a.transAxes)
    return _save(plt, fig, path)


def _kind(name: str) -> str:
    for kind in ("forward", "backward", "weight_grad", "bubble", "optimizer", "grad_sync", "data"):
        if name.startswith(kind):
            return kind
    return "other"


def plot_timeline(run: dict, path: Path) -> Path | None:
    trace = run["trace"]
    if not trace:
        return None
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [e["args"]["step"] for e in events if "step" in e.get("args", {})]
    if not steps:
        return None
    step = max(steps)
    events = [e for e in events if e.get("args", {}).get("step") == step]
    t0 = min(e["ts"] for e in events)
    pids = sorted({e["pid"] for e in events})
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    plt, fig, (ax,) = _figure(width=12, height=max(2.5, 0.5 * len(pids) + 1.8))
    colors = {k: c for k, _, c in PARTS}
    for row, pid in enumerate(pids):
        for e in events:
            if e["pid"] != pid:
                continue
            start, width = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            if e["tid"] == 0:
                kind = _kind(e["name"])
                if kind != "bubble":  # the bubble is the blank between computes
                    ax.broken_barh([(start, width)], (row - 0.4, 0.8), color=colors.get(kind, "#999999"))
            elif e["tid"] == 1:  # blocked in MPI: a thin bar at the bottom of the row
                ax.broken_barh([(start, width)], (row + 0.25, 0.15), color="#c44e52")
    ax.set_yticks(range(len(pids)), [names.get(p, f"rank {p}") for p in pids], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel=f"milliseconds into step {step}", title=f"Timeline of step {step} (blank = idle)")
    from matplotlib.patches import Patch
    shown = [("forward", "forward"), ("backward", "backward"), ("weight_grad", "weight grad"),
             ("grad_sync", "gradient sync"), ("optimizer", "optimizer"), ("data", "data")]
    handles = [Patch(color=colors[k], label=n) for k, n in shown] + [Patch(color="#c44e52", label="blocked in MPI")]
    _legend_below(ax, handles=handles, ncol=4)
    return _save(plt, fig, path)


def plot_memory(run: dict, path: Path) -> Path | None:
    s = run["summary"]
    memory = (s.get("monitor") or {}).get("memory_per_rank")
    if not memory:
        return None
    plt, fig, (ax,) = _figure(width=10, height=max(3.5, 0.45 * len(memory) + 2.8))
    labels = [f"rank {r}" for r in range(len(memory))]
    # a pipeline measures its stash; a whole model's activations are the run's prediction (cp's saving shows)
    stashed = any(m.get("activations_peak") for m in memory)
    predicted_acts = s.get("predicted_activations_bytes_per_rank") or [0] * len(memory)
    memory = [{**m, "activations": m.get("activations_peak", 0) if stashed else a} for m, a in zip(memory, predicted_acts)]
    cats = (("params", "parameters", "#4c72b0", None), ("grads", "gradients", "#dd8452", None),
            ("optimizer", "optimizer state", "#55a868", None),
            ("activations", "pipeline activations (peak stash)" if stashed else
             "activations kept for backward (predicted)", "#8172b3", None if stashed else "//"))
    left = [0.0] * len(memory)
    for key, name, color, hatch in cats:
        v = [m.get(key, 0) / MIB for m in memory]
        if any(v):
            ax.barh(labels, v, left=left, color=color, label=name, hatch=hatch, edgecolor="white" if hatch else None)
            left = [a + b for a, b in zip(left, v)]
    peak_key = "gpu_pool_peak" if any("gpu_pool_peak" in m for m in memory) else "host_peak"
    rest = [max(0.0, m.get(peak_key, 0) / MIB - lo) for m, lo in zip(memory, left)]
    ax.barh(labels, rest, left=left, color="#e5e5e5", label="rest of peak "
            + ("GPU pool" if peak_key == "gpu_pool_peak" else "memory owned (runtime, temporaries)"))
    predicted = s.get("predicted_peak_bytes_per_rank")
    if predicted:
        ax.plot([p / MIB for p in predicted], range(len(predicted)), "kD", markersize=5, label="predicted peak")
    # the --memory-budget when one was set, else the rank's share of its node's memory (not a budget)
    budget = s.get("memory_budget_bytes")
    limit, what = (budget, "budget") if budget else (memory[0].get("budget"), "memory per rank on the node")
    top = max(lo + r for lo, r in zip(left, rest))
    if limit and limit / MIB <= 3 * top:
        ax.axvline(limit / MIB, color="#c44e52", linestyle="--" if budget else ":",
                   label=f"{what} {limit / MIB:,.0f} MiB")
        title_budget = ""
    else:
        title_budget = f" ({what} {limit / MIB:,.0f} MiB, off scale)" if limit else ""
    ax.invert_yaxis()
    ax.set(xlabel="MiB (peak of the run)", title="Memory per rank" + title_budget)
    _legend_below(ax, ncol=3)
    return _save(plt, fig, path)


def plot_moe(run: dict, path: Path) -> Path | None:
    """A mixture of experts' routing from rank 0's records (its layers, each step's last
    micro-batch): tokens per expert over the run against the even share, and per step the busiest
    expert over the mean (imbalance) and the assignments dropped over capacity. None without MoE."""
    records = [r for r in run["ranks"].get(0, []) if r.get("moe_tokens_per_expert")]
    if not records:
        return None
    plt, fig, (ax, ax2) = _figure(1, 2, width=12)
    counts = [sum(r["moe_tokens_per_expert"][e] for r in records) / len(records)
              for e in range(len(records[0]["moe_tokens_per_expert"]))]
    ax.bar(range(len(counts)), counts, color="#8172b3")
    ax.axhline(sum(counts) / len(counts), color="#c44e52", linestyle="--", label="even share")
    ax.set_xticks(range(len(counts)), [f"expert {e}" for e in range(len(counts))], fontsize=8)
    ax.set(ylabel="tokens routed per step (mean, rank 0's layers)", title="Tokens per expert")
    ax.legend(fontsize=8)
    steps = [r["step"] for r in records]
    ax2.plot(steps, [r["moe_imbalance"] for r in records], "o-", color="#4c72b0", label="imbalance (busiest / mean)")
    ax2.axhline(1.0, color="#4c72b0", linestyle=":", linewidth=1)
    ax2.set(xlabel="step", ylabel="busiest expert's tokens / mean", title="Routing imbalance and dropped tokens")
    dropped = ax2.twinx()
    dropped.bar(steps, [r.get("moe_dropped", 0) for r in records], color="#c44e52", alpha=0.35,
                label="dropped (over capacity)")
    dropped.set_ylabel("assignments dropped")
    dropped.set_ylim(bottom=0, top=max(1, max(r.get("moe_dropped", 0) for r in records)) * 1.2)
    lines, names = ax2.get_legend_handles_labels()
    more, more_names = dropped.get_legend_handles_labels()
    ax2.legend(lines + more, names + more_names, fontsize=8, loc="upper right")
    ax2.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_gpu(run: dict, path: Path) -> Path | None:
    series = {r: [(x["step"], x["gpu_util"], x["gpu_mem_bw_util"]) for x in recs if "gpu_util" in x]
              for r, recs in run["ranks"].items()}
    series = {r: v for r, v in series.items() if v}
    if not series:
        return None
    plt, fig, (ax, ax2) = _figure(1, 2, width=12)
    for r, v in sorted(series.items()):
        steps, util, bw = zip(*v)
        ax.plot(steps, util, label=f"rank {r}")
        ax2.plot(steps, bw, label=f"rank {r}")
    ax.set(xlabel="step", ylabel="%", ylim=(0, 105), title="GPU utilisation (NVML)")
    ax2.set(xlabel="step", ylabel="%", ylim=(0, 105), title="Memory-controller utilisation (bandwidth)")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    return _save(plt, fig, path)


def write_report(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Write the PNGs and report.md for ``run_dir``; returns the files written."""
    run = load_run(run_dir)
    out = out or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = [("loss.png", plot_loss, "training and validation loss per step"),
             ("step_breakdown.png", plot_breakdown, "each rank's median step by part, and its own compute "
              "against its time waiting in MPI"),
             ("comm.png", plot_comm, "communication time and achieved bandwidth per axis"),
             ("timeline.png", plot_timeline, "the last traced step, a row per rank (blank = idle)"),
             ("memory.png", plot_memory, "memory per rank by category against the budget"),
             ("moe.png", plot_moe, "a mixture of experts' routing: tokens per expert, imbalance, dropped"),
             ("gpu.png", plot_gpu, "GPU and memory-bandwidth utilisation over the run")]
    written, md = [], []
    for name, fn, what in plots:
        path = fn(run, out / name)
        if path is not None:
            written.append(path)
            md.append(f"- `{name}`: {what}")
    table = comm_table(run)
    text = ["# Run report", "", f"Run: `{run_dir}`", "", "## Headline", "", *headline(run, table), "",
            "## Predicted vs measured", "", *prediction_section(run["summary"]), "", "## Plots", "", *md, ""]
    (out / "report.md").write_text("\n".join(text))
    written.append(out / "report.md")
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mpirt.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the --out-dir of a training run")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    if not (args.run_dir / "summary.json").is_file():
        print(f"error: {args.run_dir} holds no summary.json (not a finished mpirt.train run)", file=sys.stderr)
        sys.exit(2)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: the report needs matplotlib (pip install mpirt[monitor])", file=sys.stderr)
        sys.exit(2)
    for path in write_report(args.run_dir, args.out):
        print(path)
