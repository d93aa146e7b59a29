"""The performance model against this machine: predicted vs measured step time and peak memory.

    python -m mpirt.plan --calibrate --ranks 2,4,8      # first: this machine's constants (preset "local")
    python bench/plan_validate.py [--steps 12] [--rounds 2] [--only NAME,...]

Each layout is one ``mpiexec -n N python -m mpirt.train`` run of the tiny GPT (batch 8 x 128,
float32; the ranks oversubscribe the cores, which the model includes) for ``--steps`` steps; the
layouts take turns round by round (``--rounds``), so load drifting during the run hits them alike.
Measured: the median step time of each run (the first step dropped) and the summary's per-rank
peak RSS; the median over rounds is reported with its min-max. Predicted:
:func:`mpirt.plan.self_check` with the calibrated ``local`` preset (time, parts) and
:func:`mpirt.plan.memory.predict` (memory, every rank; the largest compared). Then the planner's
ranking at 4 ranks against the measured times of the 4-rank layouts. Each layout's least
disturbed round (the lowest CPU share other processes took around it) is compared too: on a
shared machine the median mixes loaded and quiet rounds. Machine load is recorded
around every run (bench/common.py); writes bench/results/planner_validation.{md,json}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as BC  # noqa: E402

from mpirt.run.config import TrainConfig  # noqa: E402
from mpirt.core.modeling import load_model_config  # noqa: E402
from mpirt.plan import estimate, hardware, self_check  # noqa: E402
from mpirt.plan.search import describe, plan  # noqa: E402

# (name, ranks, flags): DP, ZeRO stages, TP, SP, PP schedules, recompute, composed
LAYOUTS = [
    ("single", 1, {}),
    ("dp2", 2, {"dp": 2}),
    ("dp2-zero1", 2, {"dp": 2, "zero": 1}),
    ("dp2-zero2", 2, {"dp": 2, "zero": 2}),
    ("dp2-zero3", 2, {"dp": 2, "zero": 3}),
    ("dp2-recompute-full", 2, {"dp": 2, "recompute": "full"}),
    ("tp2", 2, {"tp": 2}),
    ("tp2-sp", 2, {"tp": 2, "sequence_parallel": True}),
    ("tp2-sp-selective", 2, {"tp": 2, "sequence_parallel": True, "recompute": "selective"}),
    ("pp2-gpipe-m4", 2, {"pp": 2, "microbatches": 4, "schedule": "gpipe"}),
    ("pp2-1f1b-m4", 2, {"pp": 2, "microbatches": 4, "schedule": "1f1b"}),
    ("pp2-interleaved-m4", 2, {"pp": 2, "microbatches": 4, "schedule": "interleaved", "chunks": 2}),
    ("pp2-zbh1-m4", 2, {"pp": 2, "microbatches": 4, "schedule": "zb-h1"}),
    ("dp4", 4, {"dp": 4}),
    ("dp2-tp2", 4, {"dp": 2, "tp": 2}),
    ("tp4-sp", 4, {"tp": 4, "sequence_parallel": True}),
    ("dp2-pp2-1f1b", 4, {"dp": 2, "pp": 2, "microbatches": 2, "schedule": "1f1b"}),
    ("pp4-1f1b-m8", 4, {"pp": 4, "microbatches": 8, "schedule": "1f1b"}),
    ("dp8", 8, {"dp": 8}),
    ("dp2-pp2-tp2", 8, {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2, "schedule": "1f1b"}),
]


def flags_of(kw: dict) -> list[str]:
    out = []
    for k, v in kw.items():
        key = "--" + k.replace("_", "-")
        out += [key] if v is True else [f"{key}={v}"]
    return out


def flags_from(layout: dict) -> dict:
    """train.py flags of a planner layout (Estimate.layout)."""
    kw = {"dp": layout["dp"], "tp": layout["tp"], "pp": layout["pp"], "zero": layout["zero"],
          "recompute": layout["recompute"]}
    if layout["sequence_parallel"]:
        kw["sequence_parallel"] = True
    if layout["pp"] > 1:
        kw.update(microbatches=layout["microbatches"], schedule=layout["schedule"], chunks=layout["chunks"])
    elif layout["microbatches"] > 1:
        kw["grad_accum"] = layout["microbatches"]
    return {k: v for k, v in kw.items() if v not in (0, "none") or k in ("dp", "tp", "pp")}


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_one(name: str, n: int, kw: dict, steps: int, out_root: Path) -> dict:
    out = out_root / name
    cmd = (["mpiexec", "-n", str(n)] if n > 1 else []) + [sys.executable, "-m", "mpirt.train", "--model", "tiny",
                                                          "--steps", str(steps), "--out-dir", str(out), "--overwrite",
                                                          "--progress", "false", "--eval-interval", "0",
                                                          "--eval-batches", "1", "--trace-steps", "0",
                                                          "--log-interval", str(steps)] + flags_of(kw)
    load = BC.LoadMonitor().start()
    cpu0 = children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    load.stop(own=children_cpu() - cpu0)
    if proc.returncode:
        raise RuntimeError(f"{name}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(x) for x in (out / "metrics" / "rank0.jsonl").read_text().splitlines() if x.strip()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r][1:]  # the first step warms up
    summary["step_time_s"] = statistics.median(times)
    return {"summary": summary, "load": load.as_dict(), "others": load.others_share}


def recompare(log: Path, preset: str, out: Path) -> None:
    """The current preset's predictions against the measured medians of an earlier run's printed
    table (``--recompare LOG``): for a run measured on a quiet machine whose calibration was not."""
    import re

    model_cfg, base = load_model_config("tiny"), TrainConfig()
    cluster = hardware.load(preset)
    known = {name: (n, kw) for name, n, kw in LAYOUTS}
    rows, errs = [], []
    for line in log.read_text().splitlines():
        m = re.match(r"^(\S+)\s+(\d+)\s+[\d.]+\s+([\d.]+) \[([\d.]+)-([\d.]+)\]", line)
        if not m or m.group(1) not in known:
            continue
        name, (n, kw) = m.group(1), known[m.group(1)]
        est = estimate(dataclasses.replace(base, **kw), model_cfg, cluster.with_shape(1, n))
        med = float(m.group(3))
        err = 100 * (1e3 * est.step_s - med) / med
        if n >= 2:
            errs.append(abs(err))
        rows.append([name, n, f"{1e3 * est.step_s:.1f}", f"{med:.1f} [{m.group(4)}-{m.group(5)}]", f"{err:+.1f}%",
                     f"{100 * est.parts['bubble'] / est.step_s:.1f}%", est.bottleneck])
    header = ["layout", "ranks", "step pred ms", "step meas ms [min-max]", "err", "bubble pred", "bottleneck"]
    md = [f"# Performance model ({preset}, {cluster.notes[:60]}) vs the step times of `{log.name}`", "",
          BC.markdown_table(header, rows), "",
          f"{sum(e <= 10 for e in errs)} of {len(errs)} multi-rank layouts within 10%; median |error| "
          f"{statistics.median(errs):.1f}%", ""]
    out.write_text("\n".join(md))
    print("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recompare", default="", help="a saved log of this script: predict its measured layouts again")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="")
    ap.add_argument("--preset", default="local")
    a = ap.parse_args()
    if a.recompare:
        recompare(Path(a.recompare), a.preset, BC.RESULTS / "planner_validation_recompared.md")
        return
    model_cfg = load_model_config("tiny")
    base = TrainConfig()
    layouts = [x for x in LAYOUTS if not a.only or x[0] in a.only.split(",")]
    if not a.only:  # the planner's own top 3 at 4 ranks run too: is its best the measured best?
        top, _ = plan(model_cfg, hardware.load(a.preset).with_shape(1, 4), base.batch_size, base.seq_len, "float32",
                      every=True)
        for i, e in enumerate(top[:3], 1):
            layouts.append((f"plan4-top{i}", 4, flags_from(e.layout)))
    data_dir = Path.home() / ".cache" / "mpirt" / "stdlib-py311-bytes"
    data_bytes = sum((data_dir / f).stat().st_size for f in ("train.bin", "val.bin") if (data_dir / f).exists())
    cluster_all = hardware.load(a.preset)
    BC.wait_for_quiet(60)
    load_all = BC.LoadMonitor().start()
    cpu0 = children_cpu()
    runs: dict = {name: [] for name, _, _ in layouts}
    failed: dict = {}
    with tempfile.TemporaryDirectory(prefix="plan_validate_") as tmp:
        for r in range(a.rounds):
            order = layouts[r % len(layouts):] + layouts[:r % len(layouts)]
            for name, n, kw in order:
                if name in failed:
                    continue
                try:
                    runs[name].append(run_one(name, n, kw, a.steps, Path(tmp)))
                except RuntimeError as err:  # a layout the runtime refuses today (e.g. ZeRO with tp/pp)
                    failed[name] = str(err).splitlines()[-1][:300]
                    print(f"round {r + 1}: {name}: FAILED {failed[name]}", file=sys.stderr)
                    continue
                print(f"round {r + 1}: {name}: {1e3 * runs[name][-1]['summary']['step_time_s']:.1f} ms", file=sys.stderr)
    load_all.stop(own=children_cpu() - cpu0)
    layouts = [x for x in layouts if x[0] not in failed]

    rows, data = [], {}
    for name, n, kw in layouts:
        meas = sorted(runs[name], key=lambda x: x["summary"]["step_time_s"])
        mid = meas[len(meas) // 2]["summary"]
        step_times = [x["summary"]["step_time_s"] for x in meas]
        mid["step_time_s"] = statistics.median(step_times)
        mid["peak_memory_bytes_per_rank"] = [max(x["summary"]["peak_memory_bytes_per_rank"][i] for x in meas)
                                             for i in range(n)]
        mid["peak_memory_bytes"] = max(mid["peak_memory_bytes_per_rank"])
        mid["tokens_per_s"] = base.batch_size * base.seq_len / mid["step_time_s"]
        dp = kw.get("dp", 1)
        cfg = dataclasses.replace(base, **{k: v for k, v in kw.items()})
        layout = {"dp": dp, "pp": kw.get("pp", 1), "tp": kw.get("tp", 1)}
        pred = self_check(cfg, model_cfg, layout, mid, data_bytes=data_bytes,
                          cluster=cluster_all.with_shape(1, n))
        t, m = pred["step_time_s"], pred["peak_memory_bytes"]
        others = statistics.median(x["others"] or 0.0 for x in meas)
        # the round other processes disturbed least (their CPU share measured around each run)
        quiet = min(meas, key=lambda x: x["others"] or 0.0)
        q_step = quiet["summary"]["step_time_s"]
        pred_load = {"predicted": t["predicted"], "measured": q_step, "others": quiet["others"],
                     "error_pct": 100 * (t["predicted"] - q_step) / q_step}
        rows.append([name, n, f"{1e3 * t['predicted']:.1f}",
                     f"{1e3 * t['measured']:.1f} [{1e3 * min(step_times):.1f}-{1e3 * max(step_times):.1f}]",
                     f"{t['error_pct']:+.1f}%",
                     f"{1e3 * q_step:.1f} ({100 * (quiet['others'] or 0):.0f}%)", f"{pred_load['error_pct']:+.1f}%",
                     f"{m['predicted'] / 2**20:.1f}", f"{m['measured'] / 2**20:.1f}",
                     f"{m['error_pct']:+.1f}%", f"{100 * pred['bubble_fraction']['predicted']:.1f}%",
                     f"{100 * (pred['bubble_fraction']['measured'] or 0):.1f}%", f"{100 * others:.0f}%"])
        data[name] = {"ranks": n, "flags": kw, "prediction": pred, "quietest_round": pred_load, "measured_step_times": step_times,
                      "loads": [x["load"] for x in meas]}
    # the planner's ranking at 4 ranks against what was measured there
    ests, _ = plan(model_cfg, cluster_all.with_shape(1, 4), base.batch_size, base.seq_len, "float32", every=True)
    measured4 = {name: data[name]["prediction"]["step_time_s"]["measured"] for name, n, _ in layouts if n == 4}
    notes = []
    if measured4:
        best_meas = min(measured4, key=measured4.get)
        pred4 = {name: data[name]["prediction"]["step_time_s"]["predicted"] for name in measured4}
        best_pred = min(pred4, key=pred4.get)
        gap = 100 * (measured4[best_pred] - measured4[best_meas]) / measured4[best_meas]
        spread = max(data[best_meas]["measured_step_times"]) / min(data[best_meas]["measured_step_times"]) - 1
        notes.append(f"4 ranks: the model's best of the measured layouts is {best_pred} (measured "
                     f"{1e3 * measured4[best_pred]:.1f} ms), the measured best {best_meas} "
                     f"({1e3 * measured4[best_meas]:.1f} ms): {gap:+.1f}% (the best's run-to-run spread "
                     f"{100 * spread:.1f}%)")
        notes.append("planner's top 5 at 4 ranks (all layouts it considers): " +
                     "; ".join(f"{describe(e)} {1e3 * e.step_s:.1f} ms" for e in ests[:5]))
        data["planner_4_ranks"] = {"best_predicted_of_measured": best_pred, "best_measured": best_meas,
                                   "gap_pct": gap, "top": [(describe(e), e.step_s) for e in ests[:10]]}
    errs_t = [abs(data[n]["prediction"]["step_time_s"]["error_pct"]) for n, k, _ in layouts if k >= 2]
    errs_l = [abs(data[n]["quietest_round"]["error_pct"]) for n, k, _ in layouts if k >= 2]
    errs_m = [abs(data[n]["prediction"]["peak_memory_bytes"]["error_pct"]) for n, _, _ in layouts]
    notes.append(f"time: {sum(e <= 10 for e in errs_t)} of {len(errs_t)} multi-rank layouts within 10% "
                 f"(median |error| {statistics.median(errs_t):.1f}%); against each layout's least disturbed round "
                 f"{sum(e <= 10 for e in errs_l)} of {len(errs_l)} (median {statistics.median(errs_l):.1f}%); memory: {sum(e <= 5 for e in errs_m)} of "
                 f"{len(errs_m)} within 5% (median |error| {statistics.median(errs_m):.1f}%)")
    for name, why in failed.items():
        notes.append(f"{name} did not run: {why}")
    notes.append(f"hardware preset: {cluster_all.name} ({cluster_all.source}): {cluster_all.notes[:200]}")
    header = ["layout", "ranks", "step pred ms", "step meas ms [min-max]", "err", "quietest round ms (others' CPU)",
              "err",
              "peak pred MiB",
              "peak meas MiB", "err", "bubble pred", "bubble meas", "others' CPU"]
    BC.write_results("planner_validation", "Performance model vs measured (tiny GPT, batch 8 x 128, float32)",
                     header, rows, load_all, {"layouts": data}, notes)


if __name__ == "__main__":
    main()
