"""The training script's finish (:mod:`mpirt.run.train`): the run's summary (summary.json on
rank 0, every rank's measured and predicted peaks beside each other) and the closing lines."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from mpirt import comm
from mpirt.core.modeling import num_parameters
from mpirt.monitor.live import format_seconds, monitor_lines
from mpirt.monitor.steps import owned_bytes
from mpirt.plan import format_lines as prediction_lines, self_check
from mpirt.plan.memory import busiest_expert_bound, expert_load_bound
from mpirt.run import health, jobctl


def _at_layer_loads(run, records) -> dict:
    """This rank's prediction at the routing its steps measured per layer (``moe_*_per_layer``):
    the largest over the distinct steps (a block keeps the rows its experts ran, and an earlier
    block whose experts ran more can make the step's peak, :func:`mpirt.plan.memory.predict`)."""
    seen = {(tuple(r.get("moe_expert_load_per_layer") or ()), tuple(r["moe_busiest_expert_load_per_layer"]))
            for r in records if r.get("moe_busiest_expert_load_per_layer")}
    preds = [run.prediction(run.ctx.rank, list(loads) or None, list(busiest)) for loads, busiest in seen]
    return max(preds, key=lambda p: p["peak"]) if preds else run.prediction(run.ctx.rank)


def finish(run) -> dict:
    """The end of a :class:`~mpirt.run.loop.TrainingRun` (collective): the monitor's last
    reductions, every rank's peaks, summary.json and the end block on rank 0, and the exit code
    every rank leaves with."""
    cfg, layout, metrics, world_comm = run.cfg, run.layout, run.metrics, run.world_comm
    monitored = run.monitor.finish(metrics.records)  # collective: trace, memory, stragglers
    run.engine.close()
    run.grid.free()
    peaks = world_comm.allgather_object(owned_bytes(peak=True))
    # a mixture of experts' rows follow the routing: the model is held at the rank's measured loads
    # per layer (its experts' rows under ep, each layer's busiest expert), the budget was checked at
    # their bounds (memory.expert_load_bound, busiest_expert_bound); the largest over the steps
    # (the deepest layer's busiest) are reported beside them
    def largest(key: str) -> list:  # every rank's largest over its steps (None: never measured)
        mine = [r[key] for r in metrics.records if key in r]
        return world_comm.allgather_object(max(mine) if mine else None)

    loads, busiest = largest("moe_expert_load"), largest("moe_busiest_expert_load")
    busiest = None if None in busiest else busiest  # None: no mixture of experts
    loads = None if busiest is None else loads if layout["ep"] > 1 else [1.0] * run.ctx.size  # one rank: every row
    planned = run.predicted_peaks()
    # a mixture of experts: each rank at its steps' loads per layer (the step that predicts the most)
    expected = run.predictions() if busiest is None else world_comm.allgather_object(
        _at_layer_loads(run, metrics.records))
    predicted = [p["peak"] for p in expected]
    summary = {
        "steps": run.step,
        "total_steps": cfg.steps,
        "first_loss": metrics.records[0]["loss"] if metrics.records else math.nan,
        "last_loss": metrics.records[-1]["loss"] if metrics.records else math.nan,
        "val_loss": run.val_loss,
        "tokens_per_s": metrics.median("tokens_per_s"),
        "step_time_s": metrics.median("step_time_s"),
        "mfu": metrics.median("mfu"),
        "peak_flops": run.monitor.peak_total,
        "wall_time_s": time.time() - run.started,
        "peak_memory_bytes": max(peaks),
        "peak_memory_bytes_per_rank": peaks,
        "world_size": run.ctx.size,
        # the grid and every other layout setting (the checkpoint's extra keeps the grid alone)
        "layout": {**run.summary_layout, "zero": cfg.zero, "sequence_parallel": cfg.sequence_parallel,
                   "schedule": cfg.schedule if layout["pp"] > 1 else None,
                   "microbatches": layout.microbatches if layout["pp"] > 1 else None,
                   "recompute": cfg.recompute},
        "num_parameters": num_parameters(run.model_cfg),
        "skipped_steps": sum(1 for r in metrics.records if r.get("skipped")),
        "overflow_steps": sum(1 for r in metrics.records if r.get("overflow")),
        "loss_scale": run.scaler.scale if run.scaler is not None else None,
        "stopped": run.stopped,
        "exit_code": run.exit_code,
        "last_checkpoint_step": run.last_save["step"],
        "loss_left_range": run.loss_range.describe() or None,
        "resume_advice": health.resume_advice(run.out / "ckpt", run.loss_range, cfg.dtype) if run.is_main else None,
        "predicted_peak_bytes": max(predicted),
        "predicted_peak_bytes_per_rank": predicted,
        "planned_peak_bytes_per_rank": planned,
        # what the report draws where no pipeline stash was measured (a whole model's activations)
        "predicted_activations_bytes_per_rank": [p["activations"] for p in expected],
        **({"moe_expert_load_per_rank": loads,
            "moe_expert_load_planned": expert_load_bound(cfg, run.model_cfg, layout["ep"])}
           if loads and layout["ep"] > 1 else {}),
        **({"moe_busiest_expert_load_per_rank": busiest,
            "moe_busiest_expert_load_planned": busiest_expert_bound(cfg, run.model_cfg)} if busiest else {}),
        "process_baseline_bytes_per_rank": run.baselines,
        "memory_budget_bytes": run.budget,
        **monitored,
    }
    if run.is_main:  # the performance model's prediction for this layout beside what was measured
        summary["prediction"] = self_check(cfg, run.model_cfg, layout, summary)
        write_json(run.out / "summary.json", summary)
        print(end_block(summary, run.out, run.start_step), file=sys.stderr, flush=True)
    if run.exit_code:
        comm.exit_together(run.exit_code)
    return summary


def end_block(summary: dict, out: Path, start_step: int) -> str:
    """The closing lines on rank 0: how the run went and where its files are."""
    s = summary
    lines = [f"mpirt: {'stopped' if s['stopped'] else 'done'} at step {s['steps']} of {s['total_steps']} "
             f"({s['steps'] - start_step} this run) in {format_seconds(s['wall_time_s'])}, world {s['world_size']}"
             + (f": {s['stopped']}" if s["stopped"] else ""),
             f"mpirt:   loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, val "
             + (f"{s['val_loss']:.4f}" if math.isfinite(s["val_loss"]) else "not measured")
             + (f", {s['skipped_steps']} steps skipped (non-finite)" if s["skipped_steps"] else ""),
             f"mpirt:   {s['tokens_per_s']:,.0f} tokens/s, step {1e3 * s['step_time_s']:.1f} ms (median), "
             f"MFU {100 * s['mfu']:.1f}%, peak memory {s['peak_memory_bytes'] / 2**20:.0f} MiB (largest rank)",
             "mpirt:   checkpoint " + (f"{out / 'ckpt'} (step {s['last_checkpoint_step']})"
                                       if s["last_checkpoint_step"] is not None else "none")
             + f", summary {out / 'summary.json'}, metrics {out / 'metrics'}/"] + monitor_lines(s, out)
    lines += [f"mpirt:   model: {line}" for line in prediction_lines(s.get("prediction"))]
    if s["stopped"]:
        lines.append("mpirt:   " + ("continue with the same command and --resume auto"
                                     if s["exit_code"] == jobctl.EXIT_STOPPED else
                                     "nothing was saved after the failure" + (
                                         f" ({s['loss_left_range']})" if s.get("loss_left_range") else "")
                                     + f": {s['resume_advice']}; "
                                     + STOP_ADVICE.get(s['exit_code'], 'fix the cause before resuming')))
    return "\n".join(lines)


# what to change before resuming a run that stopped with this exit code (end_block's last line)
STOP_ADVICE = {jobctl.EXIT_NONFINITE: "fix the cause (e.g. a lower --lr) before resuming",
               jobctl.EXIT_MEMORY: "lower the peak (--zero 1, --recompute full, a larger tp or pp, a smaller "
                                   "--batch-size) or raise --memory-budget before resuming"}


def write_json(path: Path, record: dict) -> None:
    """Write ``record`` to ``path`` atomically (a reader never sees half a file); non-finite
    numbers (a value never measured, a diverged loss) become null."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    tmp.write_text(json.dumps(clean, indent=2) + "\n")  # strict JSON: no NaN
    tmp.replace(path)
