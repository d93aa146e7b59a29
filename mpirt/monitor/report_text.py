"""The text of ``python -m mpirt.report``'s report.md: the headline figures and the performance
model's prediction beside what the run measured (:mod:`mpirt.monitor.report` draws the plots)."""
from __future__ import annotations

MIB = 2 ** 20


def headline(run: dict, table: dict) -> list[str]:
    """The report's headline figures, one per line (markdown bullets)."""
    s = run["summary"]
    mon = s.get("monitor") or {}
    b = mon.get("breakdown", {})
    t = s["step_time_s"]
    cp, ep = s["layout"].get("cp", 1), s["layout"].get("ep", 1)
    lines = [f"- layout dp {s['layout']['dp']} x pp {s['layout']['pp']} x " + (f"cp {cp} x " if cp > 1 else "") +
             f"tp {s['layout']['tp']} " + (f"(experts over ep {ep}) " if ep > 1 else "") +
             f"({s['world_size']} ranks), {s['num_parameters'] / 1e6:.2f}M parameters, {s['steps']} steps",
             f"- loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, validation "
             + (f"{s['val_loss']:.4f}" if s.get("val_loss") is not None else "not measured"),
             f"- {s['tokens_per_s']:,.0f} tokens/s, step {1e3 * t:.1f} ms (median)",
             f"- MFU {100 * s['mfu']:.1f}% of {s['peak_flops'] / 1e12:.3g} TFLOP/s (peak, all ranks) "
             f"({s.get('peak_flops_source')}: {s.get('peak_flops_detail')})"]
    if s.get("step_over_gemm_floor"):
        lines.append(f"- step / GEMM floor {s['step_over_gemm_floor']:.2f}x (GEMM rate "
                     f"{s['gemm_rate_flops'] / 1e12:.3g} TFLOP/s, all ranks, on the model's layer shapes)")
    if b and t > 0:
        comm, bubble = 100 * b.get("comm_s", 0) / t, 100 * b.get("bubble_s", 0) / t
        lines.append(f"- step on rank 0: compute {100 - comm - bubble:.0f}%, communication {comm:.0f}%, "
                     f"pipeline bubble {bubble:.0f}%")
    for axis, v in table.items():
        lines.append(f"- {axis}: {v['bytes'] / MIB:.2f} MiB per step, blocked {1e3 * v['wait_s']:.2f} ms, in flight "
                     f"{1e3 * v['in_flight_s']:.2f} ms, {v['bandwidth'] / 1e9:.2f} GB/s")
    agg = mon.get("stragglers")
    if agg and s["world_size"] > 1:
        c, w = agg["ranks"]["compute_s"], agg["ranks"]["mpi_wait_s"]
        lines.append(f"- slowest rank {agg['slowest_rank']}: compute {agg['slowest_compute_over_median']:.2f}x the "
                     f"median (compute {1e3 * c['min']:.1f}-{1e3 * c['max']:.1f} ms, MPI wait "
                     f"{1e3 * w['min']:.1f}-{1e3 * w['max']:.1f} ms over the ranks)")
    lines.append(f"- peak memory {s['peak_memory_bytes'] / MIB:.0f} MiB (largest rank); GPU: {mon.get('gpu', 'n/a')}")
    return lines


def prediction_section(summary: dict) -> list[str]:
    """The performance model's prediction for the run's layout beside what was measured
    (``summary["prediction"]``, :func:`mpirt.plan.self_check`): a table of quantity, predicted,
    measured and the error in percent."""
    pred = summary.get("prediction")
    if not pred:
        return ["No prediction in summary.json (a run before the planner's self-check)."]
    if "error" in pred:
        return [f"The prediction failed: {pred['error']}"]

    def row(name: str, d: dict, scale: float, unit: str) -> str:
        meas = d.get("measured")
        err = d.get("error_pct")
        return (f"| {name} | {d['predicted'] * scale:.3g} {unit} | "
                + (f"{meas * scale:.3g} {unit}" if meas is not None else "n/a") + " | "
                + (f"{err:+.1f}%" if err is not None else "n/a") + " |")

    lines = [f"Hardware model: `{pred['hardware']}` ({pred['hardware_source']}); predicted bottleneck: "
             f"{pred['bottleneck']}." + (" " + "; ".join(pred.get("notes", [])) if pred.get("notes") else ""), "",
             "| quantity | predicted | measured | error |", "|---|---|---|---|",
             row("step time", pred["step_time_s"], 1e3, "ms"), row("tokens/s", pred["tokens_per_s"], 1, ""),
             row("peak memory (largest rank)", pred["peak_memory_bytes"], 1 / MIB, "MiB")]
    for part, d in pred["parts_s"].items():
        if d.get("measured") or d["predicted"] > 0:
            lines.append(row(part.replace("_", " "), d, 1e3, "ms"))
    bub = pred.get("bubble_fraction") or {}
    if bub.get("predicted"):
        meas = bub.get("measured")
        lines.append(f"| pipeline bubble (share of the step) | {100 * bub['predicted']:.1f}% | "
                     + (f"{100 * meas:.1f}%" if meas is not None else "n/a") + " | |")
    return lines
