"""Hold one side of a verification against the other: per step the loss, the gradient norm before
clipping, the routing of a mixture of experts, and every parameter tensor, read back from the two
sides' snapshots (sharded checkpoints: each rank of the launch reads and compares its share of the
tensors, one whole tensor at a time, so no rank ever holds a whole model).

Relative differences are L2 over a tensor, ``||run - ref|| / ||ref||`` (``|run - ref| / |ref|`` for
the loss and the norm); a tensor, loss or norm *parts* when its difference exceeds the tolerance
(:data:`TOLERANCES`, by dtype: float64 rounding for verify).
"""
from __future__ import annotations

import math

import numpy as np

from mpirt.checkpoint.store import CheckpointReader
from mpirt.run.health import LossRange

# float64 holds every layout to ~1e-15 of the single rank (the parity tests measure 1e-16..1e-13
# over a few AdamW steps); 1e-9 leaves room for summation order at real widths and none for a bug
TOLERANCES = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
WORST_SHOWN = 5


def comparable(name: str, a: np.ndarray) -> np.ndarray:
    """``a`` with the part whose gradient is identically zero set to 0: the key bias of attention
    (q.(k + b) shifts a whole row of scores, which softmax ignores). Its gradient is rounding
    noise, which AdamW normalises into steps of size lr, so its values are noise in any layout
    (the fused qkv bias: its middle third; also on a tp slice, whose middle third is its k part)."""
    if name.endswith("attn.c_attn.bias"):
        a = np.array(a, copy=True)
        c = a.shape[0] // 3
        a[c:2 * c] = 0
    return a


def rel_diff(got, ref) -> float:
    """``||got - ref|| / ||ref||`` (L2, float64; the denominator floored at 1e-300, so against an
    all-zero ``ref`` any difference counts); infinite where either holds a NaN or infinity, which
    is never equal."""
    got, ref = np.asarray(got, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    if not (np.isfinite(got).all() and np.isfinite(ref).all()):
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))


def _holder(entry: dict, index: tuple) -> int | None:
    """The rank whose file holds element ``index`` of a checkpoint tensor (``entry``: its meta)."""
    for shard in entry["shards"]:
        if all(s <= i < s + n for i, s, n in zip(index, shard["start"], shard["shape"])):
            return int(shard["file"].split("-")[1].split(".")[0])
    return None


def compare_tensors(comm, run: dict, ref: dict) -> list[dict]:
    """Every parameter tensor of every step: ``run`` and ``ref`` map step -> snapshot path. Each
    rank of ``comm`` compares its share of the tensors; returns on every rank the rows
    ``{"step", "tensor", "rel_diff", "rank", "index"}`` (``rank``: the run's rank that holds the most
    different element ``index``), or ``"missing": side`` for a tensor one side lacks."""
    rows = []
    for step in sorted(run):
        got, want = CheckpointReader(run[step], verify=False), CheckpointReader(ref[step], verify=False)
        names = sorted(set(got.meta["params"]) | set(want.meta["params"]))
        for name in names[comm.rank::comm.size]:
            if name not in want.meta["params"] or name not in got.meta["params"]:
                rows.append({"step": step, "tensor": name, "rel_diff": float("inf"),
                             "missing": "reference" if name in got.meta["params"] else "layout"})
                continue
            a, b = (comparable(name, r.read("params", name)) for r in (got, want))
            if a.shape != b.shape:
                rows.append({"step": step, "tensor": name, "rel_diff": float("inf"),
                             "missing": f"shape {a.shape} vs {b.shape}"})
                continue
            diff = np.abs(a.astype(np.float64) - b)
            index = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape)) if diff.size else ()
            rows.append({"step": step, "tensor": name, "rel_diff": rel_diff(a, b), "index": list(index),
                         "rank": _holder(got.meta["params"][name], index)})
    return [row for part in comm.allgather_object(rows) for row in part]


def _where(row: dict, position) -> str:
    """`` (rank 3: dp 1, pp 0, tp 1)``: the run's rank that holds the tensor's most different element."""
    if row.get("missing"):
        return f" (missing on the {row['missing']})" if row["missing"] in ("layout", "reference") \
            else f" ({row['missing']})"
    if row.get("rank") is None or not row["rel_diff"]:
        return ""
    coords = ", ".join(f"{k} {v}" for k, v in position(row["rank"]).items())
    return f" (element {tuple(row['index'])}, held by rank {row['rank']}" + (f": {coords})" if coords else ")")


def build_report(run: list[dict], ref: list[dict], tensors: list[dict], tolerance: float, position) -> dict:
    """The verdict of the two sides' step records (:func:`mpirt.verify.sides.run_side`) and tensor
    rows (:func:`compare_tensors`): ``{"equal", "tolerance", "steps": [...], "worst_tensors",
    "first_difference", "verdict"}``. ``position(rank)``: the run's coordinates of a rank."""
    steps, first = [], None
    for mine, theirs in zip(run, ref):
        s = mine["step"]
        at = sorted((t for t in tensors if t["step"] == s), key=lambda t: -t["rel_diff"])
        row = {"step": s, "loss_reference": theirs["loss"], "loss": mine["loss"],
               "loss_rel_diff": rel_diff(mine["loss"], theirs["loss"]),
               "grad_norm_reference": theirs["grad_norm"], "grad_norm": mine["grad_norm"],
               "grad_norm_rel_diff": rel_diff(mine["grad_norm"], theirs["grad_norm"]),
               "worst_tensor": at[0]["tensor"] if at else None, "worst_tensor_rel_diff": at[0]["rel_diff"] if at else 0.0,
               "tensors_differing": sum(t["rel_diff"] > tolerance for t in at)}
        if mine["tokens_per_expert"] is not None and theirs["tokens_per_expert"] is not None:
            row.update(tokens_per_expert_reference=theirs["tokens_per_expert"],
                       tokens_per_expert=mine["tokens_per_expert"],
                       routing_equal=mine["tokens_per_expert"] == theirs["tokens_per_expert"])
        steps.append(row)
        if first is None:
            first = _first_difference(row, at, tolerance, position)
    last = max((r["step"] for r in run), default=0)
    shown = first["step"] if first else last
    worst = sorted((t for t in tensors if t["step"] == shown), key=lambda t: -t["rel_diff"])[:WORST_SHOWN]
    worst = [dict(t, where=_where(t, position).strip(" ()")) for t in worst]
    verdict = (f"equal: every step's loss, gradient norm and all {len({t['tensor'] for t in tensors})} parameter "
               f"tensors within {tolerance:.0e} of the reference" if first is None else first["text"])
    return {"equal": first is None, "tolerance": tolerance, "steps": steps, "worst_tensors": worst,
            "worst_tensors_step": shown, "first_difference": first, "verdict": verdict}


def _first_difference(row: dict, at: list[dict], tolerance: float, position) -> dict | None:
    """What parts at this step (None: nothing): the most different tensor, else the loss, the
    gradient norm or the routing, with the other figures beside it."""
    figures = [(name, row[key]) for name, key in (("the loss", "loss_rel_diff"),
                                                  ("the gradient norm", "grad_norm_rel_diff"))
               if row[key] > tolerance]
    routing_parts = row.get("routing_equal") is False
    worst = at[0] if at and at[0]["rel_diff"] > tolerance else None
    if worst is None and not figures and not routing_parts:
        return None
    parts = []
    if worst is not None:
        parts.append(f"{worst['tensor']} differs by {worst['rel_diff']:.1e}{_where(worst, position)}")
    parts += [f"{name} differs by {value:.1e}" for name, value in figures]
    if routing_parts:
        parts.append(f"tokens per expert {row['tokens_per_expert']} vs {row['tokens_per_expert_reference']}")
    return {"step": row["step"], "tensor": worst["tensor"] if worst else None,
            "rel_diff": worst["rel_diff"] if worst else max((v for _, v in figures), default=0.0),
            "text": f"step {row['step']}: " + "; ".join(parts)}


def format_table(report: dict, run_name: str, ref_name: str) -> str:
    """The step table, the worst tensors and the verdict, as the command prints them."""
    lines = [f"{'step':>4}  {'loss ' + ref_name:>22}  {'loss ' + run_name:>22}  {'rel diff':>8}  "
             f"{'grad norm rel diff':>18}  {'worst tensor rel diff':>21}"]
    for r in report["steps"]:
        lines.append(f"{r['step']:>4}  {r['loss_reference']:>22.15f}  {r['loss']:>22.15f}  {r['loss_rel_diff']:>8.1e}  "
                     f"{r['grad_norm_rel_diff']:>18.1e}  {r['worst_tensor_rel_diff']:>21.1e}"
                     + ("" if r.get("routing_equal", True) else "  routing differs"))
    routed = [r for r in report["steps"] if "routing_equal" in r]
    if routed:
        lines.append("routing (tokens per expert, summed over the MoE layers): " + ", ".join(
            f"step {r['step']} {r['tokens_per_expert']}" + ("" if r["routing_equal"] else
                                                            f" vs {r['tokens_per_expert_reference']}")
            for r in routed))
    lines.append(f"worst tensors after step {report['worst_tensors_step']}:")
    lines += [f"  {t['rel_diff']:.1e}  {t['tensor']}" + (f"  ({t['where']})" if t["where"] else "")
              for t in report["worst_tensors"]]
    return "\n".join(lines)


def abnormal_steps(steps: list[dict], record: list[dict]) -> str | None:
    """Where replayed steps (the report's rows) leave the run's recent record (``record``: the
    run's metrics up to the checkpoint, each with ``step``, ``loss``, ``grad_norm``): the loss or
    the gradient norm the run's layout computed out of its range as
    :class:`mpirt.run.health.LossRange` judges a training loss (above the recent highest by more
    than the recent spread); a sentence naming the first such figure, None when all are in range
    or the record is too short to judge."""
    if not record:
        return None
    span = f"steps {record[0]['step']}-{record[-1]['step']}"
    for key, name in (("loss", "loss"), ("grad_norm", "gradient norm")):
        seen = LossRange()
        for r in record:
            if r.get(key) is not None:
                seen.observe(int(r["step"]), float(r[key]))
        for row in steps:
            if not seen.in_range(row[key]):
                lo, hi = seen.bounds() or (math.nan, math.nan)
                return (f"step {row['step']}'s {name} {row[key]:.4g} is outside the run's recent range "
                        f"{lo:.4g}..{hi:.4g} ({span})")
            seen.observe(row["step"], row[key])
    return None
