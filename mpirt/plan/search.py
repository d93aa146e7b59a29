"""The planner: every layout of a model on a cluster, predicted and ranked.

:func:`candidates` enumerates dp x tp x pp over the devices (tp within a node and dividing the
heads, pp at most the layers; cp and, for a mixture of experts, ep dividing dp and the experts),
the rows per micro-batch (powers of two dividing a replica's
rows), the pipeline schedule (1F1B, interleaved with 2 chunks where the micro-batches are a
multiple of pp, ZB-H1) and sequence parallelism, each kept only if the runtime's
:class:`~mpirt.parallel.layout.Layout` accepts it; for each it keeps the first memory setting,
in order of cost, whose largest rank fits the budget: ZeRO 0, 1, 2 (and 3 without pp), then the
same with selective and with full recomputation (``every=True`` keeps them all).
:func:`plan` predicts each (:func:`mpirt.plan.model.estimate`) and sorts by step time.
"""
from __future__ import annotations

import dataclasses

from mpirt.parallel.layout import Layout, LayoutError
from mpirt.plan.hardware import Cluster
from mpirt.plan.model import Estimate, estimate, peak_memory


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def base_config(batch_size: int, seq_len: int, dtype: str):
    from mpirt.run.config import TrainConfig

    return dataclasses.replace(TrainConfig(), batch_size=batch_size, seq_len=seq_len, dtype=dtype)


def tp_options(model_cfg, cluster: Cluster) -> list[int]:
    """The tensor-parallel sizes a plan tries: divisors of the device count that divide the heads
    (query and key/value) and fit in one node (tp spans the fast links of a node)."""
    heads = getattr(model_cfg, "n_head", 1)
    kv = getattr(model_cfg, "n_kv_head", None) or heads
    return [tp for tp in _divisors(cluster.devices)
            if tp <= max(cluster.devices_per_node, 1) and heads % tp == 0 and kv % tp == 0]


def cp_options(cluster: Cluster, tp: int) -> list[int]:
    """The context-parallel sizes a plan tries with ``tp``: divisors of the device count whose ring
    stays on a node with its tp groups (cp x tp within a node: the ring passes keys and values
    every layer); the sequence must cut into 2 cp chunks (:func:`runs` checks)."""
    per_node = max(cluster.devices_per_node, 1)
    return [cp for cp in _divisors(cluster.devices // tp) if cp * tp <= per_node]


def ep_options(model_cfg, dp: int) -> list[int]:
    """The expert-parallel sizes a plan tries: divisors of dp that divide the model's experts (1
    for a model without experts)."""
    experts = getattr(model_cfg, "n_expert", 0)
    return [ep for ep in _divisors(dp) if experts and experts % ep == 0] or [1]


def runs(cfg, model_cfg, world: int) -> bool:
    """Whether the runtime would start ``cfg`` for ``model_cfg`` on ``world`` ranks: the
    :class:`~mpirt.parallel.layout.Layout`'s rules, so the planner never proposes a layout that
    ``mpirt.train`` refuses."""
    try:
        Layout.resolve(cfg, world).check_model(cfg, model_cfg)
    except LayoutError:
        return False
    return True


def candidates(model_cfg, cluster: Cluster, batch_size: int, seq_len: int, dtype: str,
               schedules=("1f1b", "interleaved", "zb-h1"), max_rows: int = 64) -> list[list]:
    """Groups of configs: each group one parallel shape that runs (:func:`runs`), its memory
    settings in order of cost. Micro-batches of up to ``max_rows`` rows, at least pp of them."""
    world = cluster.devices
    base = base_config(batch_size, seq_len, dtype)
    groups = []
    for tp, cp in ((tp, cp) for tp in tp_options(model_cfg, cluster) for cp in cp_options(cluster, tp)):
        for pp in _divisors(world // (tp * cp)):
            dp = world // (tp * cp * pp)
            if batch_size % dp:
                continue
            rows_per_dp = batch_size // dp
            sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_rows and rows_per_dp % b == 0]
            for b in sizes:
                m = rows_per_dp // b
                if pp > 1 and m < pp:
                    continue
                scheds = [(s, 2 if s == "interleaved" else 1) for s in schedules] if pp > 1 else [("1f1b", 1)]
                for sched, chunks in scheds:
                    for sp, ep in ((sp, ep) for sp in ([False, True] if tp > 1 else [False])
                                   for ep in ep_options(model_cfg, dp)):
                        shape = dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, schedule=sched, chunks=chunks,
                                     sequence_parallel=sp, microbatches=m if pp > 1 else 0,
                                     grad_accum=1 if pp > 1 else m)
                        group = []
                        for rc in ("none", "selective", "full"):
                            for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                                cfg = dataclasses.replace(base, **shape, zero=zero, recompute=rc)
                                if runs(cfg, model_cfg, world):
                                    group.append(cfg)
                        if group:
                            groups.append(group)
    return groups


class EstimateError(RuntimeError):
    """An estimate raised for a layout the runtime accepts: a bug in the model of the step, never
    a reason to call the layout infeasible. Names the layout and the error."""


def config_phrase(cfg) -> str:
    """``dp 2 tp 4 pp 2 1f1b m=8 zero 1 recompute none``: a candidate config in one phrase."""
    return (f"dp {cfg.dp} ep {cfg.ep} tp {cfg.tp} cp {cfg.cp} pp {cfg.pp} {cfg.schedule} m={cfg.microbatches} "
            f"accum {cfg.grad_accum} sp {cfg.sequence_parallel} zero {cfg.zero} recompute {cfg.recompute}")


def plan(model_cfg, cluster: Cluster, batch_size: int, seq_len: int, dtype: str, budget: float | None = None,
         every: bool = False, **kw) -> tuple[list[Estimate], int]:
    """(feasible estimates sorted by step time, layouts tried). ``budget``: bytes per device
    (default the cluster's device memory). A layout is infeasible only by its predicted peak; an
    estimate that raises is :class:`EstimateError`."""
    budget = budget or cluster.memory_bytes
    out, tried = [], 0
    for group in candidates(model_cfg, cluster, batch_size, seq_len, dtype, **kw):
        for cfg in group:
            tried += 1
            try:  # memory first: only a layout that fits is timed
                memory = peak_memory(cfg, model_cfg, cluster)
                if memory["peak"] > budget:
                    continue
                out.append(estimate(cfg, model_cfg, cluster, memory=memory))
            except Exception as err:
                raise EstimateError(f"the estimate of {config_phrase(cfg)} failed: "
                                    f"{type(err).__name__}: {err}") from err
            if not every:
                break
    out.sort(key=lambda e: e.step_s)
    return out, tried


def describe(est: Estimate) -> str:
    """``dp 8 tp 1 pp 8 1f1b m=32 b=2 zero 1 recompute none`` (``ep 4`` after dp, ``cp 2`` after tp
    when > 1): a layout in one phrase."""
    l = est.layout
    sched = f" {l['schedule']}" + (f"(v={l['chunks']})" if l["chunks"] > 1 else "") + f" m={l['microbatches']}" \
        if l["pp"] > 1 else (f" accum {l['microbatches']}" if l["microbatches"] > 1 else "")
    extra = (" sp" if l["sequence_parallel"] else "") + (f" zero {l['zero']}" if l["zero"] else "") + \
        (f" recompute {l['recompute']}" if l["recompute"] != "none" else "")
    cp = f" cp {l['cp']}" if l.get("cp", 1) > 1 else ""
    ep = f" ep {l['ep']}" if l.get("ep", 1) > 1 else ""
    return f"dp {l['dp']}{ep} tp {l['tp']}{cp} pp {l['pp']}{sched} b={l['rows_per_microbatch']}{extra}"


def training_flags(est: Estimate, batch_size: int, seq_len: int, model_cfg, base_model_cfg) -> list[str]:
    """The ``mpirt.train`` arguments of a planned layout beside its grid sizes: the batch, the
    schedule, ZeRO, sequence parallelism, recomputation and dtype, and ``--model.FIELD=VALUE``
    for every field of ``model_cfg`` that differs from ``base_model_cfg`` (the preset's)."""
    l = est.layout
    flags = [f"--batch-size={batch_size}", f"--seq-len={seq_len}", f"--dtype={l['dtype']}",
             f"--zero={l['zero']}", f"--recompute={l['recompute']}"]
    if l["pp"] > 1:
        flags += [f"--schedule={l['schedule']}", f"--microbatches={l['microbatches']}"]
        if l["chunks"] > 1:
            flags.append(f"--chunks={l['chunks']}")
    elif l["microbatches"] > 1:
        flags.append(f"--grad-accum={l['microbatches']}")
    if l["sequence_parallel"]:
        flags.append("--sequence-parallel")
    flags += [f"--model.{k}={v}" for k, v in vars(model_cfg).items() if getattr(base_model_cfg, k, None) != v]
    return flags


def table(ests: list[Estimate], top: int = 15) -> str:
    """The ranked layouts as a Markdown table."""
    rows = ["| # | layout | step s | tokens/s | MFU | peak mem/rank | bottleneck | bubble |",
            "|---|---|---|---|---|---|---|---|"]
    for i, e in enumerate(ests[:top], 1):
        rows.append(f"| {i} | {describe(e)} | {e.step_s:.3g} | {e.tokens_per_s:,.0f} | {100 * e.mfu:.1f}% | "
                    f"{e.memory['peak'] / 2**30:.2f} GiB | {e.bottleneck} | {100 * e.bubble:.1f}% |")
    return "\n".join(rows)
