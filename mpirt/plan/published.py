"""The planner against published results (docs/planner.md; ``bench/plan_published.py`` prints them).

- :func:`zero_table`: ZeRO's per-device model-state memory (Rajbhandari et al., SC20, Figure 1:
  a 7.5B-parameter model on 64 GPUs, mixed-precision Adam, K = 12): 120, 31.4, 16.6 and 1.9 GB
  for stages 0-3 (``(2 + 2 + K) Psi``, ``4 Psi + K Psi / N``, ``2 Psi + (2 + K) Psi / N``,
  ``(4 + K) Psi / N``);
- :data:`MEGATRON`: Narayanan et al., SC21, Table 1 (GPT models, vocabulary 51,200, sequence
  2048, A100 80 GB, 8 per node): layout, batch and the achieved teraFLOP/s per GPU, counted with
  their formula ``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` (activation recomputation included);
- :func:`bubble_table`: 1F1B, interleaved and ZB-H1 at p = 8, m = 32 simulated from the action
  lists against the papers' formulas;
- :data:`FRONTIER`: the layouts the largest published models trained on 80 GB GPUs (Korthikanti
  et al. 2022's 175B and 1T GPT, Llama 3 405B at 8K with grouped-query attention), and
  :func:`frontier_rows`, mpirt's predicted peak of their largest rank.
"""
from __future__ import annotations

import dataclasses

from mpirt.parallel.layout import Layout

# (params in billions, heads, hidden, layers, tp, pp, GPUs, batch, teraFLOP/s per GPU, % of peak)
MEGATRON = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
]
ZERO_PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}

DROPOUT = {"embd_pdrop": 0.1, "attn_pdrop": 0.1, "resid_pdrop": 0.1}  # the paper's masks (1 byte each)
# name: (model config fields, layout and training keys) as published; every one trained on 80 GB
FRONTIER = {
    # Korthikanti et al. 2022, table 3: micro-batch 1, SP + selective recomputation, dp 1
    "GPT 175B (Korthikanti et al.)": ({"model_type": "gpt2", "n_layer": 96, "n_embd": 12288, "n_head": 96,
                                       "vocab_size": 51200, "n_positions": 2048, **DROPOUT},
                                      {"tp": 8, "pp": 8, "dp": 1, "batch_size": 64, "seq_len": 2048,
                                       "recompute": "selective", "sequence_parallel": True}),
    "GPT 1T (Korthikanti et al.)": ({"model_type": "gpt2", "n_layer": 128, "n_embd": 25600, "n_head": 160,
                                     "vocab_size": 51200, "n_positions": 2048, **DROPOUT},
                                    {"tp": 8, "pp": 64, "dp": 1, "batch_size": 512, "seq_len": 2048,
                                     "recompute": "selective", "sequence_parallel": True}),
    # Llama 3 (Dubey et al. 2024): 16K H100s, tp 8 x pp 16 x dp 128, 16M-token batches of 8K
    # sequences, interleaved pipeline, no recomputation; FSDP also shards the parameters (ZeRO-3),
    # the row keeps ZeRO-1, the setting its published peak was checked against
    "Llama 3 405B (Dubey et al.)": ({"model_type": "llama", "n_layer": 126, "n_embd": 16384, "n_head": 128,
                                     "n_kv_head": 8, "n_inner": 53248, "vocab_size": 128256, "n_positions": 8192,
                                     "rope_theta": 500000.0},
                                    {"tp": 8, "pp": 16, "dp": 128, "batch_size": 2048, "seq_len": 8192,
                                     "schedule": "interleaved", "chunks": 2, "recompute": "none",
                                     "sequence_parallel": True, "zero": 1}),
}


def gpt_config(hidden: int, layers: int, heads: int, vocab: int = 51200, seq: int = 2048):
    from mpirt.core.modeling import config_class

    return config_class("gpt2")(n_layer=layers, n_head=heads, n_embd=hidden, n_positions=seq, vocab_size=vocab)


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int = 51200) -> float:
    """FLOPs of one step as Narayanan et al. count them (forward, recomputed forward, backward)."""
    return 96.0 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def zero_table(psi: float = 7.5e9, devices: int = 64) -> list[dict]:
    """Per ZeRO stage: model states per device in GB (1e9) from :func:`mpirt.plan.memory.predict` for
    the 7.5B GPT of :data:`MEGATRON` (bfloat16, AdamW) and from ``bytes_per_parameter`` at exactly
    ``psi`` parameters, against the paper. mpirt's ZeRO-2 also holds, while backward runs, its
    staging bucket and the gradients being filled (``transient_gb``), which the paper's
    steady-state figure leaves out."""
    from mpirt.plan import memory
    from mpirt.core.modeling import num_parameters
    from mpirt.plan.search import base_config
    from mpirt.core.precision import bytes_per_parameter

    model_cfg = gpt_config(4096, 36, 32)
    n = num_parameters(model_cfg)
    rows = []
    for stage in range(4):
        cfg = dataclasses.replace(base_config(devices, 2048, "bfloat16"), dp=devices, zero=stage)
        p = memory.predict(cfg, model_cfg, {"dp": devices, "pp": 1, "tp": 1}, 1)
        transient = p["gradients"] - n * 2 / devices if stage == 2 else 0  # beside the bf16 shard
        states = p["parameters"] + p["gradients"] - transient + p["optimizer_state"]
        exact = sum(bytes_per_parameter("bfloat16", devices, stage).values()) * psi
        paper = ZERO_PAPER_GB[stage]
        rows.append({"stage": stage, "paper_gb": paper, "model_gb": states / 1e9, "params": n,
                     "model_err_pct": 100 * (states / 1e9 - paper) / paper, "exact_psi_gb": exact / 1e9,
                     "exact_err_pct": 100 * (exact / 1e9 - paper) / paper, "transient_gb": transient / 1e9})
    return rows


def bubble_table(p: int = 8, m: int = 32, chunks=(2, 4)) -> list[dict]:
    """Simulated bubble (idle over total, unit costs F = 1, B = 2, or F = B = W = 1 split) of the
    schedules' action lists against the textbook fractions, and against the papers' way of stating
    them (bubble over ideal time: ``(p-1)/m``, ``(p-1)/(v m)``; ZB-H1: a third of 1F1B's)."""
    from mpirt.parallel.pipeline.check import simulate, theoretical_bubble
    from mpirt.parallel.pipeline.schedules import build

    rows = []
    for name, v in [("gpipe", 1), ("1f1b", 1)] + [("interleaved", c) for c in chunks] + [("zb-h1", 1)]:
        sim = simulate(build(name, p, m, v))
        theory = theoretical_bubble(name, p, m, v)
        over_ideal = sim.bubble / (1 - sim.bubble)
        paper = {"gpipe": (p - 1) / m, "1f1b": (p - 1) / m, "interleaved": (p - 1) / (v * m),
                 "zb-h1": (p - 1) / (3 * m)}[name]
        rows.append({"schedule": name, "chunks": v, "simulated": sim.bubble, "theory": theory,
                     "simulated_over_ideal": over_ideal, "paper_over_ideal": paper, "peak_stash": max(sim.peak_stash)})
    return rows


def megatron_rows(cluster_name: str = "a100", search: bool = False, schedules=("1f1b", "interleaved")) -> list[dict]:
    """Each :data:`MEGATRON` row: the model's prediction for the paper's layout (1F1B and
    interleaved with 2 chunks where it applies; micro-batches of 1 sequence; full recomputation as
    the paper ran), and with ``search`` the planner's best layout on the same GPUs and batch."""
    from mpirt.plan import hardware
    from mpirt.plan.model import estimate
    from mpirt.plan.search import base_config, describe, plan, runs

    out = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, tflops, pct in MEGATRON:
        model_cfg = gpt_config(hidden, layers, heads)
        cluster = hardware.load(cluster_name).with_shape(max(1, gpus // 8), min(8, gpus))
        dp = gpus // (tp * pp)
        flops = megatron_flops(batch, 2048, layers, hidden)
        row = {"params_b": params, "layout": f"tp {tp} pp {pp} dp {dp}", "gpus": gpus, "batch": batch,
               "shape": (layers, hidden),
               "paper_tflops": tflops, "paper_pct": pct}
        for sched in schedules if pp > 1 else ("1f1b",):
            m = batch // dp
            cfg = dataclasses.replace(base_config(batch, 2048, "bfloat16"), dp=dp, tp=tp, pp=pp, schedule=sched,
                                      chunks=2 if sched == "interleaved" else 1, microbatches=m if pp > 1 else 0,
                                      grad_accum=1 if pp > 1 else m, recompute="full", sequence_parallel=False)
            if not runs(cfg, model_cfg, gpus):
                continue
            est = estimate(cfg, model_cfg, cluster)
            row[f"pred_tflops_{sched}"] = flops / est.step_s / gpus / 1e12
            row[f"pred_mem_gib_{sched}"] = est.memory["peak"] / 2**30
            row[f"bottleneck_{sched}"] = est.bottleneck
        if search:
            ests, _ = plan(model_cfg, cluster, batch, 2048, "bfloat16", max_rows=4)
            if ests:
                best = ests[0]
                row["planner_best"] = describe(best)
                row["planner_tflops_model"] = best.mfu * cluster.peak("bfloat16") / 1e12
                row["planner_step_s"] = best.step_s
        out.append(row)
    return out


def frontier_rows() -> list[dict]:
    """Each :data:`FRONTIER` layout in bfloat16 (micro-batches of one sequence, every micro-batch
    of a dp rank's share in one step): mpirt's predicted peak GiB of the largest rank (over the
    pipeline stages, GPU process baseline left out), its categories, and one block's kept
    activation bytes in units of ``s b h`` beside Korthikanti et al.'s formula for tp + SP +
    selective recomputation, ``34 / t`` (GPT rows: their f = 4h, heads of q, k and v alike)."""
    from mpirt.plan import memory
    from mpirt.core.modeling import activation_bytes, config_from_dict, num_parameters
    from mpirt.plan.search import base_config

    out = []
    for name, (model_fields, train) in FRONTIER.items():
        model_cfg = config_from_dict(model_fields)
        layout = {k: train[k] for k in ("dp", "pp", "tp")}
        cfg = dataclasses.replace(base_config(train["batch_size"], train["seq_len"], "bfloat16"), **train,
                                  microbatches=train["batch_size"] // train["dp"], grad_accum=1)
        peaks = [memory.predict(cfg, model_cfg, layout, stage * layout["tp"], process_bytes=0)
                 for stage in range(layout["pp"])]
        worst = max(range(layout["pp"]), key=lambda i: peaks[i]["peak"])
        s, h, t = train["seq_len"], model_cfg.n_embd, layout["tp"]
        acts = activation_bytes(model_cfg, Layout.micro_batch(1, s, tp=t, sequence_parallel=True), itemsize=2)
        selective = acts["block"] - acts["core"] if train["recompute"] == "selective" else acts["block"]
        out.append({"name": name, "params_b": num_parameters(model_cfg) / 1e9, "layout": layout,
                    "schedule": cfg.schedule, "recompute": cfg.recompute, "stage": worst,
                    "peak_gib": peaks[worst]["peak"] / 2**30,
                    "categories_gib": {k: v / 2**30 for k, v in peaks[worst].items() if k != "peak"},
                    "block_sbh": selective / (s * h),
                    "paper_block_sbh": 34 / t if model_cfg.model_type == "gpt2" else None})
    return out


# Korthikanti et al. 2022 (A100 80 GB, sequence 2048, vocabulary 51,200), table 3's layouts and
# table 5's model FLOPs utilization with sequence parallelism and selective recomputation:
# (name, heads, hidden, layers, tp, pp, GPUs, global batch, micro-batch, MFU %)
KORTHIKANTI = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 41.5),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 51.4),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 56.0),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 56.3),
]
# Llama 3 405B (Dubey et al. 2024, table 4): 8K sequences, 16M-token batches, tp 8 x pp 16, BF16 MFU
# (GPUs, dp, MFU %); the model and the rest of the layout are FRONTIER's row
LLAMA3 = [(8192, 64, 43.0), (16384, 128, 41.0)]
# Mixtral 8x22B on H100 (Liu et al. 2025, MoE Parallel Folding, Megatron-Core): 49.3 % MFU; planned
# here on 128 GPUs at 256 sequences of 4096 tokens
MIXTRAL_8X22B = ({"model_type": "mixtral", "n_layer": 56, "n_embd": 6144, "n_head": 48, "n_kv_head": 8,
                  "n_inner": 16384, "n_expert": 8, "vocab_size": 32768, "n_positions": 4096}, 128, 256, 4096, 49.3)


def ranking(model_cfg, cluster, batch: int, seq: int, sizes: dict, rows: int) -> dict:
    """The planner's search on ``cluster`` for ``batch`` sequences of ``seq`` tokens, and where the
    best layout with the published ``sizes`` (dp, tp, pp; cp 1, ep 1 unless given) and ``rows``
    sequences per micro-batch ranks (schedule, ZeRO and recomputation as the planner picks them):
    its place (1-based, None when none fits), its step time over the first's, both MFUs."""
    from mpirt.plan.search import describe, plan

    ests, tried = plan(model_cfg, cluster, batch, seq, "bfloat16")
    want = {"cp": 1, "ep": 1, **sizes}
    place = next((i for i, e in enumerate(ests) if e.layout["rows_per_microbatch"] == rows
                  and all(e.layout.get(k, 1) == v for k, v in want.items())), None)
    out = {"feasible": len(ests), "tried": tried, "best": describe(ests[0]), "best_mfu": ests[0].mfu, "place": None}
    if place is not None:
        e = ests[place]
        out.update(place=place + 1, layout=describe(e), ratio=e.step_s / ests[0].step_s, mfu=e.mfu)
    return out


def korthikanti_row(name: str) -> dict:
    """:func:`ranking` of :data:`KORTHIKANTI`'s row ``name`` on its A100s, with the paper's MFU."""
    _, heads, hidden, layers, tp, pp, gpus, batch, micro, mfu = next(r for r in KORTHIKANTI if r[0] == name)
    from mpirt.plan import hardware

    cluster = hardware.load("a100").with_shape(max(1, gpus // 8), min(8, gpus))
    row = ranking(gpt_config(hidden, layers, heads), cluster, batch, 2048,
                  {"dp": gpus // (tp * pp), "tp": tp, "pp": pp}, micro)
    return {"name": name, "published": f"tp {tp} pp {pp} dp {gpus // (tp * pp)} b={micro}", "gpus": gpus,
            "batch": batch, "paper_mfu": mfu / 100, **row}


def llama3_rows(chunks=(2, 4)) -> list[dict]:
    """Llama 3 405B's published layout (:data:`FRONTIER`'s row: tp 8, pp 16, interleaved, no
    recomputation, SP, ZeRO-1) on 8,192 and 16,384 H100s with ``chunks`` model chunks per rank (the
    paper does not give them): mpirt's predicted MFU and largest rank's peak against the paper's MFU."""
    from mpirt.core.modeling import config_from_dict
    from mpirt.plan import hardware
    from mpirt.plan.model import estimate
    from mpirt.plan.search import base_config

    fields, train = FRONTIER["Llama 3 405B (Dubey et al.)"]
    model_cfg = config_from_dict(fields)
    out = []
    for gpus, dp, mfu in LLAMA3:
        cluster = hardware.load("h100").with_shape(gpus // 8, 8)
        for v in chunks:
            cfg = dataclasses.replace(base_config(train["batch_size"], train["seq_len"], "bfloat16"),
                                      **{**train, "dp": dp, "chunks": v}, microbatches=train["batch_size"] // dp,
                                      grad_accum=1)
            est = estimate(cfg, model_cfg, cluster)
            out.append({"gpus": gpus, "layout": f"tp 8 pp 16 dp {dp} interleaved(v={v}) zero 1", "chunks": v,
                        "mfu": est.mfu, "paper_mfu": mfu / 100, "peak_gib": est.memory["peak"] / 2**30,
                        "bubble_s": est.parts["bubble"], "step_s": est.step_s})
    return out


def mixtral_row() -> dict:
    """Mixtral 8x22B (:data:`MIXTRAL_8X22B`) planned on 128 H100s: the best layout and the best
    with expert parallelism, their MFU, against the paper's."""
    from mpirt.core.modeling import config_from_dict
    from mpirt.plan import hardware
    from mpirt.plan.search import describe, plan

    fields, gpus, batch, seq, mfu = MIXTRAL_8X22B
    ests, tried = plan(config_from_dict(fields), hardware.load("h100").with_shape(gpus // 8, 8), batch, seq,
                       "bfloat16")
    with_ep = next((e for e in ests if e.layout.get("ep", 1) > 1), None)
    return {"gpus": gpus, "batch": batch, "seq": seq, "paper_mfu": mfu / 100, "feasible": len(ests), "tried": tried,
            "best": describe(ests[0]), "best_mfu": ests[0].mfu,
            "best_ep": describe(with_ep) if with_ep else None, "best_ep_mfu": with_ep.mfu if with_ep else None,
            "best_ep_comm_s": with_ep.comm["ep"]["s"] if with_ep else None,
            "best_ep_step_s": with_ep.step_s if with_ep else None}


# A DeepSeek-V3-like fine-grained MoE as the mixtral model type expresses it (256 experts of width
# 2048, top-8, 61 layers, hidden 7168, 128 heads; no MLA, shared expert or dense first layers) in
# DeepSeek-V3's layout (pp 16, ep 64 over dp 128, ZeRO-1; 2048 GPUs, 15,360 sequences of 4096):
# the report gives GPU hours in FP8, not an MFU, so there is no published figure to hold it to
DEEPSEEK_V3_LIKE = ({"model_type": "mixtral", "n_layer": 61, "n_embd": 7168, "n_head": 128, "n_kv_head": 128,
                     "n_inner": 2048, "n_expert": 256, "top_k": 8, "vocab_size": 129280, "n_positions": 4096},
                    {"dp": 128, "ep": 64, "tp": 1, "pp": 16, "schedule": "zb-h1", "zero": 1, "batch_size": 15360,
                     "seq_len": 4096, "microbatches": 120}, 2048)


def deepseek_like_row() -> dict:
    """:data:`DEEPSEEK_V3_LIKE` estimated on H100s: MFU, the exposed all-to-all, the largest rank's peak."""
    from mpirt.core.modeling import config_from_dict
    from mpirt.plan import hardware
    from mpirt.plan.model import estimate
    from mpirt.plan.search import base_config

    fields, train, gpus = DEEPSEEK_V3_LIKE
    cfg = dataclasses.replace(base_config(train["batch_size"], train["seq_len"], "bfloat16"), **train, grad_accum=1)
    est = estimate(cfg, config_from_dict(fields), hardware.load("h100").with_shape(gpus // 8, 8))
    return {"gpus": gpus, "layout": "dp 128 ep 64 tp 1 pp 16 zb-h1 m=120 b=1 zero 1", "mfu": est.mfu,
            "step_s": est.step_s, "ep_s": est.comm["ep"]["s"], "peak_gib": est.memory["peak"] / 2**30}
