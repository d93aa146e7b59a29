"""The performance model and planner (mpirt.plan): pure, no MPI except the CLI subprocess."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from mpirt.run.config import TrainConfig
from mpirt.core.modeling import load_model_config
from mpirt.parallel.pipeline.check import simulate, theoretical_bubble
from mpirt.parallel.pipeline.schedules import build
from mpirt.plan import Cluster, coll_time, estimate, hardware, plan, self_check
from mpirt.plan.search import describe as plan_describe
from mpirt.plan.published import bubble_table, frontier_rows, megatron_flops, zero_table
from mpirt.plan.work import ops_per_block


def cpu(cores=2, **kw) -> Cluster:
    c = dataclasses.replace(hardware.PRESETS["cpu"], cores=cores, **kw)
    return c


def cfg(**kw) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), **kw)


TINY = load_model_config("tiny")


def test_alpha_beta_formulas():
    c = Cluster("x", 8, 2, {"float32": 1e12}, 1e10, 1e11, 1.0, 0, intra_latency=1e-6, intra_bandwidth=1e9,
                inter_latency=1e-5, inter_bandwidth=1e8)
    n, g = 8e6, 4
    assert coll_time(c, "allreduce", n, g, 16, False) == pytest.approx(2 * (g - 1) * (1e-6 + n / (g * 1e9)))
    assert coll_time(c, "allgather", n, g, 16, False) == pytest.approx((g - 1) * (1e-6 + n / (g * 1e9)))
    assert coll_time(c, "reduce_scatter", n, g, 16, True) == pytest.approx((g - 1) * (1e-5 + n / (g * 1e8)))
    assert coll_time(c, "p2p", n, 2, 16, False) == pytest.approx(1e-6 + n / 1e9)
    assert coll_time(c, "allreduce", n, 1, 16, False) == 0.0
    # measured fits replace the formula at that world and group size
    c.collectives = {16: {4: {"allreduce": [1e-3, 1e-9]}}}
    assert coll_time(c, "allreduce", n, 4, 16, False) == pytest.approx(1e-3 + 8e-3)
    assert coll_time(c, "reduce_scatter", n, 4, 16, False) == pytest.approx((g - 1) * (1e-6 + n / (g * 1e9)))


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_bubble_is_the_simulated_schedule(name, chunks):
    """The estimate's bubble is the simulator's on the executor's action lists with the model's
    per-action times, and with equal stages it equals the textbook fraction."""
    model = dataclasses.replace(TINY, n_layer=8)
    c = cfg(pp=4, microbatches=8, schedule=name, chunks=chunks)
    est = estimate(c, model, cpu(cores=64))
    assert 0 < est.bubble < 0.5
    assert len(est.parts["bubble_per_rank"]) == 4
    sim = simulate(build(name, 4, 8, chunks))
    assert sim.bubble == pytest.approx(theoretical_bubble(name, 4, 8, chunks), abs=1e-12)


def test_published_bubbles_and_zero_table():
    for row in bubble_table(8, 32):
        assert row["simulated"] == pytest.approx(row["theory"], abs=1e-12)
        assert row["simulated_over_ideal"] == pytest.approx(row["paper_over_ideal"], rel=1e-9)
    for row in zero_table():
        assert abs(row["model_err_pct"]) < 2 and abs(row["exact_err_pct"]) < 2
    # Narayanan et al.'s count for the 1T model's step: ~ 6.6e21 FLOPs per 3072-sequence batch
    assert megatron_flops(3072, 2048, 128, 25600) == pytest.approx(96 * 3072 * 2048 * 128 * 25600**2 * (
        1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600)))


def test_the_largest_published_layouts_are_predicted_to_fit_where_they_ran():
    """Korthikanti et al.'s 175B and 1T GPT (tp 8 + SP + selective) and Llama 3 405B at 8K (tp 8,
    pp 16, interleaved, grouped-query attention, no recomputation) trained on 80 GB GPUs: mpirt's
    largest rank fits in 80 GiB, and a GPT block keeps the paper's 34 sbh / t (plus mpirt's per-row
    statistics, 8 / h of it)."""
    rows = {r["name"].split(" (")[0]: r for r in frontier_rows()}
    assert set(rows) == {"GPT 175B", "GPT 1T", "Llama 3 405B"}
    assert rows["Llama 3 405B"]["params_b"] == pytest.approx(405, rel=0.01)    # 126 layers, 8 KV heads
    assert rows["GPT 1T"]["params_b"] == pytest.approx(1008, rel=0.001)
    for name, r in rows.items():
        assert r["peak_gib"] <= 80, (name, r["categories_gib"])
        if r["paper_block_sbh"] is not None:
            assert r["paper_block_sbh"] <= r["block_sbh"] <= r["paper_block_sbh"] * 1.001, name


def test_oversubscription_slows_every_rank():
    """Twice the ranks on the same cores: each rank computes half the rows at half a core's share."""
    c = cpu(cores=2)
    two = estimate(cfg(dp=2), TINY, c.with_shape(1, 2))
    four = estimate(cfg(dp=4), TINY, c.with_shape(1, 4))
    assert four.parts["forward"] == pytest.approx(two.parts["forward"], rel=0.05)
    assert any("4 ranks on 2 cores" in n for n in four.notes)
    roomy = estimate(cfg(dp=4), TINY, cpu(cores=8).with_shape(1, 4))
    assert roomy.parts["forward"] < 0.6 * four.parts["forward"]


def test_memory_is_memory_predict_and_parts_add_up():
    from mpirt.plan import memory

    est = estimate(cfg(dp=2, zero=2), TINY, cpu(), memory_ranks="all")
    for rank in (0, 1):  # rank 0 also holds its TensorBoard writer (where tensorboard is installed)
        p = memory.predict(cfg(dp=2, zero=2), TINY, {"dp": 2, "pp": 1, "tp": 1}, rank,
                           process_bytes=memory.planned_baseline(rank), checkpoint_gather=False)
        assert est.memory["per_rank"][rank] == p["peak"]
    assert memory.planned_baseline(1) == memory.PROCESS_BYTES
    parts = est.parts
    assert est.step_s == pytest.approx(parts["forward"] + parts["backward"] + parts["grad_sync"] + parts["optimizer"]
                                       + parts["other"])
    assert est.comm["dp"]["bytes"] > 0 and est.comm["tp"]["bytes"] == 0


def test_memory_predict_defaults_unchanged():
    from mpirt.plan import memory

    c, lay = cfg(dp=2), {"dp": 2, "pp": 1, "tp": 1}
    base = memory.predict(c, TINY, lay, 0)
    assert memory.predict(c, TINY, lay, 0, process_bytes=memory.PROCESS_BYTES) == base
    assert base["baseline"] == memory.PROCESS_BYTES


def test_tp_sp_and_zero3_communicate():
    tp = estimate(cfg(tp=2, sequence_parallel=True), TINY, cpu())
    assert tp.comm["tp"]["bytes"] > 0 and tp.comm["tp"]["s"] > 0
    z3 = estimate(cfg(dp=2, zero=3), TINY, cpu())
    z0 = estimate(cfg(dp=2), TINY, cpu())
    assert z3.comm["dp"]["bytes"] > z0.comm["dp"]["bytes"]
    assert z3.parts["backward"] > z0.parts["backward"]  # ZeRO-3 recomputes every unit


def test_ops_per_block_counts_functions():
    assert ops_per_block(TINY) >= 5
    assert ops_per_block(load_model_config("llama-tiny")) >= ops_per_block(TINY)


@pytest.mark.parametrize("preset, fields", [
    ("llama-tiny", {"n_embd": 4096, "n_head": 32, "n_kv_head": 8, "n_inner": 14336}),   # Llama 3 8B's ratios
    ("llama-tiny", {"n_embd": 16384, "n_head": 128, "n_kv_head": 8, "n_inner": 53248}),  # 405B's: 16 per KV head
    ("mixtral-tiny", {"n_embd": 4096, "n_head": 32, "n_kv_head": 8, "n_inner": 14336, "n_expert": 8}),
], ids=["llama3-8b", "llama3-405b", "mixtral-8x7b"])
def test_ops_are_counted_on_a_copy_that_keeps_the_head_ratios(preset, fields):
    """The narrow copy the Function count runs keeps heads per KV head (it was 2 heads beside 8 KV
    heads: the attention refused it, and the planner read every layout as infeasible)."""
    model = load_model_config(preset, fields)
    assert ops_per_block(model) == ops_per_block(load_model_config(preset, {"n_kv_head": 2}))


def test_an_estimate_that_raises_is_a_planner_bug_naming_the_layout(monkeypatch, capsys):
    """An error inside an estimate never reads as "does not fit": the search raises EstimateError
    with the layout and the exception, and the CLI exits 3 on one line saying so."""
    import mpirt.plan.search as search
    from mpirt.plan.__main__ import main

    def broken(cfg, model_cfg, cluster, **kw):
        raise ZeroDivisionError("injected")
    monkeypatch.setattr(search, "estimate", broken)
    with pytest.raises(search.EstimateError, match=r"the estimate of dp \d+ ep 1 tp \d+ .* failed: ZeroDivisionError: injected"):
        plan(TINY, cpu(), 8, 64, "float32")
    assert main(["--model", "tiny", "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--global-batch", "8",
                 "--seq-len", "64"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: planner bug: the estimate of dp ") and "injected" in err[0], err


def test_planner_ranks_feasible_layouts_and_respects_budget():
    c = cpu(cores=2).with_shape(1, 4)
    ests, tried = plan(TINY, c, 8, 128, "float32")
    assert ests and tried >= len(ests)
    assert [e.step_s for e in ests] == sorted(e.step_s for e in ests)
    assert all(e.layout["dp"] * e.layout["tp"] * e.layout["pp"] * e.layout["cp"] == 4 for e in ests)
    every, _ = plan(TINY, c, 8, 128, "float32", every=True)  # ZeRO-3 runs inside pipeline stages too
    assert any(e.layout["zero"] == 3 and e.layout["pp"] > 1 for e in every)
    assert {e.layout["cp"] for e in every} == {1, 2, 4}  # context parallelism is searched
    budget = sorted(e.memory["peak"] for e in ests)[len(ests) // 2]
    tight, _ = plan(TINY, c, 8, 128, "float32", budget=budget)
    assert tight and all(e.memory["peak"] <= budget for e in tight)
    # ZeRO with tp or pp is a layout the planner may choose (every=True lists all settings that fit)
    every, _ = plan(TINY, c, 8, 128, "float32", every=True)
    assert any(e.layout["zero"] and (e.layout["tp"] > 1 or e.layout["pp"] > 1) for e in every)


def test_a_long_sequence_that_fits_only_split_is_planned_with_context_parallelism():
    """One attention head (tp cannot split it) and a budget below every layout without cp
    (attention dropout's masks grow with T^2): the plan is context parallel, each of its layouts
    within the budget."""
    model = dataclasses.replace(TINY, n_positions=4096, attn_pdrop=0.1, n_head=1)
    c = cpu(cores=2).with_shape(1, 4)
    every, _ = plan(model, c, 4, 4096, "float32", every=True)
    budget = min(e.memory["peak"] for e in every if e.layout["cp"] == 1) - 1
    tight, _ = plan(model, c, 4, 4096, "float32", budget=budget, every=True)
    assert tight and all(e.layout["cp"] > 1 and e.memory["peak"] <= budget for e in tight)


def test_expert_parallelism_is_searched_and_priced():
    """A mixture of 16 wide experts on 4 ranks: the plan tries ep 1, 2 and 4; splitting the experts
    shrinks a rank's weights by exactly the experts' share (the dense ones stay) and its peak, and
    adds the all-to-alls: the routed rows out and back, forward and backward, 3/4 of them sent;
    the optimizer updates a quarter of the experts."""
    model = load_model_config("mixtral-tiny", {"n_expert": 16, "n_inner": 1024})
    c = cpu(cores=2).with_shape(1, 4)
    every, _ = plan(model, c, 8, 128, "float32", every=True)
    assert {e.layout["ep"] for e in every} == {1, 2, 4}
    one, two, four = (estimate(cfg(dp=4, ep=ep, zero=1, batch_size=8, seq_len=128), model, c) for ep in (1, 2, 4))
    experts = 4 * 3 * 16 * 128 * 1024 * 4  # bytes of the 4 blocks' expert weights, float32
    assert one.memory["parameters"] - four.memory["parameters"] == pytest.approx(experts * 3 / 4, rel=1e-6)
    assert one.memory["peak"] > two.memory["peak"] > four.memory["peak"]
    assert one.comm["ep"]["bytes"] == 0
    routed = 2 * 128 * 2 * 128 * 4  # a rank's 2 rows x 128 tokens x top-2, 128 wide, float32
    assert four.comm["ep"]["bytes"] == pytest.approx(4 * 4 * routed * 3 / 4)  # 4 blocks, 4 exchanges each
    # each exchange: the rank's whole buffer, 3/4 of it leaving in 3 messages (not 3/4 per peer)
    assert four.comm["ep"]["s"] == pytest.approx(4 * 4 * 3 * (c.intra_latency + routed / 4 / c.intra_bandwidth))
    assert four.comm["ep"]["s"] > 0 and four.parts["optimizer"] < one.parts["optimizer"]  # 1/4 of the experts
    assert "dp 4 ep 4 tp 1" in plan_describe(four)


def test_large_model_plan_on_gpus():
    model = load_model_config("gpt2-xl", {"n_positions": 2048})
    ests, _ = plan(model, hardware.load("h100").with_shape(2, 8), 64, 2048, "bfloat16")
    assert ests
    best = ests[0]
    assert best.memory["peak"] <= 80 * 2**30 and 0 < best.mfu < 1
    assert best.bottleneck in ("compute", "dp comm", "tp comm", "bubble", "memory")


def test_self_check_reports_errors():
    measured = {"step_time_s": 0.1, "tokens_per_s": 10000.0, "peak_memory_bytes": 150 * 2**20,
                "peak_memory_bytes_per_rank": [150 * 2**20, 140 * 2**20],
                "monitor": {"breakdown": {"forward_s": 0.03, "backward_s": 0.06, "bubble_s": 0.0,
                                          "grad_sync_s": 0.004, "optimizer_s": 0.005, "weight_grad_s": 0.0}}}
    out = self_check(cfg(dp=2), TINY, {"dp": 2, "pp": 1, "tp": 1}, measured, cluster=cpu().with_shape(1, 2))
    t = out["step_time_s"]
    assert t["error_pct"] == pytest.approx(100 * (t["predicted"] - 0.1) / 0.1)
    assert set(out["parts_s"]) >= {"forward", "backward", "grad_sync", "optimizer", "bubble"}
    assert len(out["peak_memory_per_rank"]) == 2
    json.dumps(out)  # goes into summary.json
    assert "error" in self_check(cfg(dp=2), TINY, {"dp": 2, "pp": 1}, measured)  # never raises


def test_hardware_presets_and_saved(tmp_path):
    for name in ("a100", "h100", "h200", "cpu"):
        c = hardware.load(name)
        assert c.peak("bfloat16") > 0 and c.memory_bytes > 0
    c = cpu(collectives={4: {2: {"p2p": [1e-5, 1e-9]}}}, gemm_rates={64.0: 5e10})
    path = hardware.save(dataclasses.replace(c, name="mine"), tmp_path / "mine.json")
    back = hardware.load(str(path))
    assert back.collectives == c.collectives and back.gemm_rates == c.gemm_rates
    with pytest.raises(ValueError, match="unknown hardware"):
        hardware.load("no-such-gpu")


def test_a_calibration_from_another_mpirt_says_so(tmp_path):
    """A calibration records which mpirt it measured; the end-of-run line tells a stale one (a
    faster runtime made the old op costs over-predict by 28 %) from a current one."""
    measured = {"step_time_s": 0.1, "tokens_per_s": 10000.0, "peak_memory_bytes": 150 * 2**20}
    layout = {"dp": 1, "pp": 1, "tp": 1}
    current = cpu(source="calibrated", runtime=hardware.runtime_fingerprint())
    assert self_check(cfg(), TINY, layout, measured, cluster=current)["hardware_source"] == "calibrated"
    saved = hardware.load(str(hardware.save(dataclasses.replace(current, runtime="0" * 16), tmp_path / "old.json")))
    source = self_check(cfg(), TINY, layout, measured, cluster=saved)["hardware_source"]
    assert source == "calibrated with another mpirt version: rerun python -m mpirt.plan --calibrate"


def test_cli_lists_layouts():
    out = subprocess.run([sys.executable, "-m", "mpirt.plan", "--model", "gpt2-xl", "--nodes", "2",
                          "--gpus-per-node", "8", "--gpu", "h100", "--global-batch", "64", "--seq-len", "2048",
                          "--top", "3"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "feasible of" in out.stdout and "| 1 |" in out.stdout and "best: dp" in out.stdout
    tight = subprocess.run([sys.executable, "-m", "mpirt.plan", "--model", "gpt2-xl", "--nodes", "1",
                            "--gpus-per-node", "1", "--gpu", "h100", "--global-batch", "8", "--seq-len", "1024",
                            "--memory-budget", "1GiB"], capture_output=True, text=True, timeout=240)
    assert tight.returncode == 1 and "no layout fits" in tight.stdout


def test_cli_refusals_are_one_line(tmp_path):
    """An uncalibrated preset (`--gpu local` before --calibrate) and an unknown model: one line, exit 2."""
    env = dict(os.environ, MPIRT_PLAN_CACHE=str(tmp_path))   # no calibration saved here
    for args, message in ((["--gpu", "local"], "python -m mpirt.plan --calibrate --save-as local"),
                          (["--model", "no-such-model"], "no-such-model")):
        out = subprocess.run([sys.executable, "-m", "mpirt.plan", *args], capture_output=True, text=True, timeout=240,
                             env=env)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
            out.stderr


def test_report_section_shows_prediction_against_measured():
    from mpirt.monitor.report import prediction_section

    measured = {"step_time_s": 0.2, "tokens_per_s": 5000.0, "peak_memory_bytes": 150 * 2**20,
                "monitor": {"breakdown": {"forward_s": 0.05, "backward_s": 0.1, "bubble_s": 0.04}}}
    pred = self_check(cfg(pp=2, microbatches=4), TINY, {"dp": 1, "pp": 2, "tp": 1}, measured,
                      cluster=cpu().with_shape(1, 2))
    text = "\n".join(prediction_section({"prediction": pred}))
    assert "| step time |" in text and "| peak memory (largest rank) |" in text and "pipeline bubble" in text
    assert f"{pred['step_time_s']['error_pct']:+.1f}%" in text
    assert "No prediction" in prediction_section({})[0]


def test_calibration_measures_compute_and_mpi_at_a_rank_count():
    """--calibrate's MPI part at 2 ranks: the compute figures each rank got and the fits per
    collective (alpha, beta >= 0), which the model then uses at that world and group size."""
    from mpirt.plan.calibrate import measure_mpi

    got = measure_mpi([2])[2]
    compute = got.pop(0)
    assert compute["block_fb_s"] > 0
    compute["slowdown"] = 2.0
    for op in ("allreduce", "allgather", "reduce_scatter", "p2p"):
        alpha, beta = got[2][op]
        assert alpha > 0 and beta >= 0
    c = cpu(cores=2, collectives={2: got}, compute_by_ranks={2: compute}).with_shape(1, 2)
    est = estimate(cfg(dp=2), TINY, c)
    assert est.parts["grad_sync"] >= got[2]["allreduce"][0]
    alone = estimate(cfg(dp=2), TINY, dataclasses.replace(c, compute_by_ranks={}))
    assert est.parts["forward"] == pytest.approx(2 * alone.parts["forward"], rel=1e-6)  # cores / 2 = 1: no slowdown


@pytest.mark.parametrize("model, fields, nodes, gpu", [
    ("tiny", [], 1, "cpu"),
    ("llama-tiny", ["n_head=8", "n_kv_head=2", "n_embd=128"], 2, "h100"),
], ids=["tiny-cpu", "gqa-2-nodes"])
def test_the_best_layout_is_written_as_a_job_script_that_mpirt_train_accepts(tmp_path, capsys, model, fields, nodes,
                                                                             gpu):
    """``--emit-slurm FILE`` writes the best layout's sbatch script; its training arguments (the
    grid, batch, schedule, ZeRO, recomputation, dtype and the model's overrides) resolve as
    mpirt.train resolves them, batch rules included, on the job's rank count."""
    import shlex

    from mpirt.parallel.layout import Layout
    from mpirt.plan.__main__ import main
    from mpirt.run.config import parse_args

    script = tmp_path / "job.sbatch"
    overrides = [arg for f in fields for arg in ("--model-override", f)]
    assert main(["--model", model, *overrides, "--gpu", gpu, "--nodes", str(nodes), "--gpus-per-node", "4",
                 "--global-batch", "16", "--seq-len", "128", "--emit-slurm", str(script)]) == 0
    best = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("best: "))
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert f"#SBATCH --nodes={nodes}" in text and "#SBATCH --ntasks-per-node=4" in text
    train = shlex.split(next(line for line in text.splitlines() if line.startswith("TRAIN_ARGS="))[len("TRAIN_ARGS=("):-1])
    cfg = parse_args(train)
    model_cfg = load_model_config(cfg.model, cfg.model_overrides)
    Layout.resolve(cfg, 4 * nodes).check_model(cfg, model_cfg)  # raises if mpirt.train would refuse it
    assert f"dp {cfg.dp} " in best and f"tp {cfg.tp} " in best and f"pp {cfg.pp}" in best, (best, train)
    assert model_cfg == load_model_config(model, {k: int(v) for k, v in (f.split("=") for f in fields)})


LLAMA3 = {"n_head": 32, "n_kv_head": 8, "vocab_size": 128256, "n_positions": 8192}
PUBLISHED_SHAPES = {  # name: (preset, fields, nodes of 8 H100, global batch, sequence)
    "Llama 3 8B": ("llama-tiny", {**LLAMA3, "n_layer": 32, "n_embd": 4096, "n_inner": 14336}, 2, 64, 8192),
    "Llama 3 70B": ("llama-tiny", {**LLAMA3, "n_layer": 80, "n_embd": 8192, "n_head": 64, "n_inner": 28672}, 4, 32,
                    8192),
    "Mixtral 8x7B": ("mixtral-tiny", {"n_layer": 32, "n_embd": 4096, "n_head": 32, "n_kv_head": 8, "n_inner": 14336,
                                      "n_expert": 8, "vocab_size": 32000, "n_positions": 4096}, 4, 32, 4096),
}


@pytest.mark.parametrize("name", PUBLISHED_SHAPES)
def test_published_shapes_with_grouped_query_attention_plan(name):
    """Llama 3 and Mixtral shapes (8 KV heads) have feasible layouts on the GPUs they need (every
    layout was "infeasible" while the Function count's copy broke their head ratio)."""
    preset, fields, nodes, batch, seq = PUBLISHED_SHAPES[name]
    cluster = hardware.load("h100").with_shape(nodes, 8)
    ests, tried = plan(load_model_config(preset, fields), cluster, batch, seq, "bfloat16", schedules=("1f1b",))
    assert ests and tried > len(ests), (name, len(ests), tried)


@pytest.mark.parametrize("preset", ["tiny", "mlp", "llama-tiny", "mixtral-tiny", "gpt2", "gpt2-medium"])
def test_every_bundled_preset_plans(preset):
    ests, _ = plan(load_model_config(preset), cpu(cores=4).with_shape(1, 4), 8, 64, "float32")
    assert ests, preset


def test_calibration_under_load_is_refused_naming_the_load(monkeypatch):
    """A calibration never saves a machine that load shaped: over 0.5 load per core it does not
    start; when others took the CPU meanwhile, or 4 ranks on 2 cores each 'ran at 1.42 of a core'
    (the one rank alone was slowed), it refuses naming the load. Measured quietly, it returns."""
    from mpirt.plan import calibrate as cal

    local = {"gemm_rates": {256.0: 1e10}, "bandwidth": 1e10, "op_overhead_s": 1e-5, "ew_passes": 2.0,
             "block_fb_s": 0.01, "opt_tensor_s": 1e-6, "opt_byte_s": 1e-10, "threads_per_core": 0.0, "cores": 2}
    slowdown = {"4": 0.7}   # 4 ranks' block time over one rank's alone: impossible below 2 on 2 cores
    monkeypatch.setattr(cal, "_cores", lambda: 2)
    monkeypatch.setattr(cal, "measure_local", lambda model: dict(local))
    monkeypatch.setattr(cal, "measure_process_bytes", lambda: {"process_bytes": 80 * 2**20})
    monkeypatch.setattr(cal, "measure_mpi", lambda ranks: {4: {0: {"block_fb_s": 0.01 * slowdown["4"]}}})
    monkeypatch.setattr(cal, "_own_cpu_s", lambda: 0.0)
    clock = iter([(10.0, 100.0), (10.5, 110.0)] * 3)   # busy, total CPU seconds: others took 5% meanwhile
    monkeypatch.setattr("mpirt.cpu.sysinfo.cpu_seconds", lambda: next(clock))
    monkeypatch.setattr(os, "getloadavg", lambda: (3.1, 2.0, 1.0))
    with pytest.raises(cal.BusyMachine, match=r"1-minute load 3.10 on 2 cores"):
        cal.calibrate([4])
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    with pytest.raises(cal.BusyMachine, match=r"4 ranks on 2 cores each ran at 1.43 of a core, more than the 0.50"):
        cal.calibrate([4])
    slowdown["4"] = 2.1
    assert cal.calibrate([4]).compute_by_ranks[4]["slowdown"] == pytest.approx(2.1)
    clock = iter([(10.0, 100.0), (13.0, 110.0)])   # others: 30% of the machine's CPU time
    with pytest.raises(cal.BusyMachine, match=r"other processes took 30% of the CPU time"):
        cal.calibrate([4])


def test_calibrated_presets_live_in_mpirt_cache(tmp_path, monkeypatch):
    """Calibrated presets go to $MPIRT_CACHE/plan beside the rest of mpirt's cache; the older
    $MPIRT_PLAN_CACHE still wins when set."""
    monkeypatch.delenv("MPIRT_PLAN_CACHE", raising=False)
    monkeypatch.setenv("MPIRT_CACHE", str(tmp_path / "cache"))
    path = hardware.save(cpu(name="here"))
    assert path == tmp_path / "cache" / "plan" / "here.json" and hardware.load("here").cores == 2
    monkeypatch.setenv("MPIRT_PLAN_CACHE", str(tmp_path / "old"))
    assert hardware.save(cpu(name="here")) == tmp_path / "old" / "here.json"


def test_each_axis_message_is_one_function_the_proof_sends_and_the_planner_prices():
    """The pipeline's, the ring's and the experts' message bytes come from the axis's own module
    (``message_bytes``, ``ring_message_bytes``, ``routed_bytes``): the pre-flight proof's
    program sends exactly them, and the planner's traffic is their count times them."""
    from mpirt.parallel.context import ring_message_bytes
    from mpirt.parallel.experts import routed_bytes
    from mpirt.parallel.layout import Layout
    from mpirt.parallel.pipeline.stage import message_bytes
    from mpirt.parallel.preflight import StepPrograms

    c = cpu(cores=2).with_shape(1, 8)
    for dtype in ("float32", "bfloat16"):
        dense, model = cfg(pp=2, cp=2, tp=2, sequence_parallel=True, batch_size=4, seq_len=64, microbatches=2,
                           dtype=dtype), load_model_config("llama-tiny", {})
        layout = Layout.resolve(dense, 8, model)
        act, kv = message_bytes(layout, model, dtype), ring_message_bytes(layout, model, dtype)
        assert act == 2 * 64 // 2 // 2 * model.n_embd * (2 if dtype == "bfloat16" else 4)  # rows x tokens/cp/tp x C
        ops = StepPrograms(layout, model, dtype).program(0)
        assert {n for op in ops if op.comm == "pp" for _, n in op.sends + op.recvs} == {act}
        assert {n for op in ops if op.comm == "cp" for _, n in op.sends + op.recvs} == {kv}
        est = estimate(dense, model, c)
        m, blocks = layout.microbatches, layout.microbatches * model.n_layer / 2
        assert est.comm["pp"]["bytes"] == 2 * m * act and est.comm["cp"]["bytes"] == blocks * (3 * 2 - 2) * kv

    moe = load_model_config("mixtral-tiny", {})
    experts = cfg(dp=2, ep=2, zero=1, batch_size=4, seq_len=64)
    layout = Layout.resolve(experts, 2, moe)
    routed = routed_bytes(layout, moe, "float32")
    ops = StepPrograms(layout, moe, "float32").program(0)
    assert {op.nbytes for op in ops if op.comm == "ep" and op.dtype == "float32"} == {routed}
    assert estimate(experts, moe, cpu(cores=2).with_shape(1, 2)).comm["ep"]["bytes"] == \
        pytest.approx(moe.n_layer * 4 * routed / 2)  # 4 exchanges a block, half of each leaves the rank
