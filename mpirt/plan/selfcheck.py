"""After a run: the performance model's prediction for that run's layout beside what was measured.

    summary["prediction"] = self_check(cfg, model_cfg, layout, summary, data_bytes=...)

``measured`` is the run's summary (``step_time_s``, ``peak_memory_bytes(_per_rank)`` and the
monitor's median breakdown ``monitor.breakdown``: ``forward_s``, ``backward_s``, ``weight_grad_s``,
``bubble_s``, ``grad_sync_s``, ``optimizer_s``). The hardware is :func:`this_machine`: the
calibrated ``local`` preset on a CPU when ``--calibrate`` saved one (else the uncalibrated ``cpu``
preset with this machine's cores), on a GPU the preset its name matches.
"""
from __future__ import annotations

import dataclasses
import os

from mpirt.plan import hardware

PARTS = ("forward", "backward", "weight_grad", "bubble", "grad_sync", "optimizer")


def this_machine(world: int) -> hardware.Cluster:
    """The cluster this process runs on, for ``world`` ranks on one node (see the module docstring)."""
    import mpirt.core.backend as B

    info = B.device_info() if B.name == "cupy" else None
    if info is not None:
        name = info["name"].lower()
        for key in ("h200", "h100", "a100"):
            if key in name:
                return hardware.load(key).with_shape(1, world)
    try:
        cluster = hardware.load("local")
    except (ValueError, KeyError, TypeError):  # none saved, or saved by an older mpirt: recalibrate
        cluster = hardware.load("cpu")
        cluster.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cluster.with_shape(1, world)


def _err(pred: float, meas) -> dict:
    if meas is None:
        return {"predicted": pred, "measured": None, "error_pct": None}
    return {"predicted": pred, "measured": meas,
            "error_pct": 100.0 * (pred - meas) / meas if meas else None}


def self_check(cfg, model_cfg, layout: dict, measured: dict, data_bytes: int = 0, cluster=None) -> dict:
    """Predicted vs measured step time, its parts, the bubble and the peak memory for the run's
    layout (``layout``: the sizes ``{"dp", "pp", "tp"}`` and optionally cp, or the :class:`~mpirt.parallel.layout.Layout`
    :func:`mpirt.run.train.plan_layout` returns). Errors
    are ``100 (predicted - measured) / measured``. Never raises: a failure is reported in ``error``."""
    from mpirt.plan.model import estimate

    try:
        cp = layout.get("cp", 1)
        world = layout["dp"] * layout["pp"] * cp * layout["tp"]
        cluster = cluster or this_machine(world)
        run_cfg = dataclasses.replace(cfg, dp=layout["dp"], pp=layout["pp"], tp=layout["tp"], cp=cp)
        est = estimate(run_cfg, model_cfg, cluster, data_bytes=data_bytes, memory_ranks="all")
    except Exception as err:  # the check must never fail a finished run
        return {"error": f"{type(err).__name__}: {err}"}
    br = (measured.get("monitor") or {}).get("breakdown", {})
    # the run's own memory prediction (from the baselines its ranks measured) where it made one: a
    # run's output names one predicted peak, not the banner's and the planner's planned baselines
    peak = measured.get("predicted_peak_bytes", est.memory["peak"])
    peaks = dict(enumerate(measured["predicted_peak_bytes_per_rank"])) if measured.get(
        "predicted_peak_bytes_per_rank") else est.memory["per_rank"]
    out = {"hardware": cluster.name, "hardware_source": hardware.describe_source(cluster),
           "step_time_s": _err(est.step_s, measured.get("step_time_s")),
           "tokens_per_s": _err(est.tokens_per_s, measured.get("tokens_per_s")),
           "peak_memory_bytes": _err(peak, measured.get("peak_memory_bytes")),
           "parts_s": {p: _err(est.parts[p], br.get(f"{p}_s")) for p in PARTS},
           # rank 0's idle time inside the schedule over its step, as the monitor measures it
           "bubble_fraction": {"predicted": est.parts["bubble"] / est.step_s, "schedule_all_ranks": est.bubble,
                               "measured": (br.get("bubble_s", 0.0) / measured["step_time_s"])
                               if measured.get("step_time_s") else None},
           "bottleneck": est.bottleneck, "notes": est.notes}
    per_rank = measured.get("peak_memory_bytes_per_rank")
    if per_rank:
        out["peak_memory_per_rank"] = [_err(peaks[r], m) for r, m in enumerate(per_rank) if r in peaks]
    return out


def format_lines(pred: dict) -> list[str]:
    """The prediction in a few lines for the end of a run and the report."""
    if not pred or "error" in pred:
        return [f"prediction failed: {pred.get('error')}"] if pred else []

    def fmt(d: dict, scale: float = 1.0, unit: str = "") -> str:
        if d.get("measured") is None:
            return f"{d['predicted'] * scale:.3g}{unit} predicted"
        return f"{d['predicted'] * scale:.3g}{unit} predicted vs {d['measured'] * scale:.3g}{unit} ({d['error_pct']:+.1f}%)"

    lines = [f"step {fmt(pred['step_time_s'], 1e3, ' ms')}; peak memory "
             f"{fmt(pred['peak_memory_bytes'], 2**-20, ' MiB')} [{pred['hardware']}, {pred['hardware_source']}]"]
    lines.append("parts (ms): " + ", ".join(
        f"{p} {v['predicted'] * 1e3:.1f}/{v['measured'] * 1e3:.1f}" for p, v in pred["parts_s"].items()
        if v.get("measured") is not None and (v["predicted"] > 1e-4 or v["measured"] > 1e-4))
        + " (predicted/measured)")
    return lines
