"""`mpiexec -n N python -m mpirt.train` on parallel layouts gives the single-rank loss curve.

Each case is a real MPI launch of the training script on a tiny GPT in float64; the per-step
losses, the final validation loss and the saved weights (every rank's boxes of the sharded
checkpoint, read back whole) must equal the single-rank run's with the same global batch.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import run_module
from mpirt.checkpoint.store import load_state
from runs import read_metrics

TINY = ["--model.n_layer=4", "--model.n_embd=32", "--model.n_head=4", "--model.n_positions=32",
        "--seq-len=16", "--batch-size=8", "--eval-batches=2", "--eval-interval=0", "--progress=false",
        "--steps=5", "--warmup-steps=2", "--dtype=float64"]


def run(tiny_data, out, *layout, ranks=0):
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--out-dir={out}", *layout, ranks=ranks)
    losses = [r["loss"] for r in read_metrics(out)]
    summary = json.loads((out / "summary.json").read_text())
    return losses, summary, load_state(out / "ckpt")[1]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    return run(tiny_data, tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("ranks, layout", [
    (2, ["--dp=2"]),
    (2, ["--dp=2", "--grad-accum=2"]),
    (2, ["--dp=2", "--zero=1"]),
    (2, ["--dp=2", "--zero=2"]),
    (2, ["--dp=2", "--zero=2", "--grad-accum=2"]),
    (2, ["--dp=2", "--zero=3"]),
    (2, ["--tp=2"]),
    (2, ["--tp=2", "--sequence-parallel"]),
    (4, ["--dp=2", "--tp=2"]),
    (2, ["--pp=2"]),
    (2, ["--pp=2", "--schedule=gpipe", "--microbatches=4"]),
    (2, ["--pp=2", "--schedule=interleaved", "--microbatches=4"]),
    (2, ["--pp=2", "--schedule=zb", "--microbatches=4"]),
    (4, ["--pp=4", "--schedule=1f1b", "--microbatches=4"]),
    (4, ["--pp=4", "--schedule=gpipe", "--microbatches=8"]),
    (4, ["--pp=4", "--schedule=zb", "--microbatches=4"]),
    (4, ["--pp=2", "--dp=2"]),
    (4, ["--pp=2", "--tp=2", "--sequence-parallel"]),
    (4, ["--dp=2", "--tp=2", "--zero=1"]),
    (4, ["--dp=2", "--tp=2", "--zero=2", "--sequence-parallel"]),
    (4, ["--dp=2", "--tp=2", "--zero=3", "--sequence-parallel"]),
    (4, ["--dp=2", "--pp=2", "--zero=2"]),
    (4, ["--dp=2", "--pp=2", "--zero=2", "--schedule=zb", "--microbatches=4"]),
    (4, ["--dp=2", "--pp=2", "--zero=2", "--schedule=interleaved", "--microbatches=4"]),
    (8, ["--dp=2", "--pp=2", "--tp=2", "--zero=1", "--recompute=selective"]),
    (4, ["--dp=2", "--pp=2", "--zero=3"]),
    (4, ["--dp=2", "--pp=2", "--zero=3", "--schedule=interleaved", "--microbatches=4"]),
    (4, ["--dp=2", "--pp=2", "--zero=3", "--schedule=zb", "--microbatches=4"]),
    (2, ["--cp=2"]),
    (4, ["--cp=4"]),
    (2, ["--cp=2", "--recompute=full"]),
    (4, ["--dp=2", "--cp=2", "--zero=1"]),
    (4, ["--dp=2", "--cp=2", "--zero=3"]),
    (4, ["--cp=2", "--tp=2", "--sequence-parallel"]),
    (4, ["--cp=2", "--pp=2"]),
    (4, ["--cp=2", "--pp=2", "--schedule=gpipe", "--microbatches=4"]),
    (4, ["--cp=2", "--pp=2", "--schedule=zb", "--microbatches=4", "--zero=3"]),
    (8, ["--dp=2", "--cp=2", "--tp=2", "--zero=2"]),
], ids=lambda v: v if isinstance(v, int) else " ".join(v))
def test_parallel_layout_matches_single_rank(tiny_data, tmp_path, reference, ranks, layout):
    losses, summary, weights = run(tiny_data, tmp_path, *layout, ranks=ranks)
    ref_losses, ref_summary, ref_weights = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    assert summary["val_loss"] == pytest.approx(ref_summary["val_loss"], rel=1e-10)
    assert summary["world_size"] == ranks
    assert summary["layout"]["dp"] * summary["layout"]["cp"] * summary["layout"]["tp"] * summary["layout"]["pp"] == ranks
    assert weights.keys() == ref_weights.keys()
    for name, w in ref_weights.items():
        np.testing.assert_allclose(weights[name], w, rtol=1e-9, atol=1e-12, err_msg=name)


DROPOUT = ["--model.embd_pdrop=0.1", "--model.resid_pdrop=0.1", "--model.attn_pdrop=0.1"]


@pytest.fixture(scope="module")
def dropout_reference(tiny_data, tmp_path_factory):
    return run(tiny_data, tmp_path_factory.mktemp("dropout-single"), *DROPOUT)


@pytest.mark.parametrize("ranks, layout", [
    (2, ["--dp=2", "--grad-accum=2"]),
    (2, ["--tp=2"]),
    (2, ["--tp=2", "--sequence-parallel"]),
    (2, ["--dp=2", "--zero=3"]),
    (2, ["--pp=2", "--schedule=interleaved", "--microbatches=4", "--recompute=full"]),
    (2, ["--pp=2", "--schedule=zb", "--microbatches=4", "--recompute=selective"]),
    (8, ["--dp=2", "--pp=2", "--tp=2", "--sequence-parallel", "--recompute=full"]),
    (4, ["--dp=2", "--pp=2", "--zero=3", "--schedule=zb", "--microbatches=4"]),
    (2, ["--cp=2"]),
    (2, ["--cp=2", "--recompute=selective"]),
    (4, ["--cp=2", "--tp=2", "--sequence-parallel"]),
    (4, ["--cp=2", "--pp=2", "--schedule=interleaved", "--microbatches=4"]),
], ids=lambda v: v if isinstance(v, int) else " ".join(v))
def test_dropout_layout_matches_single_rank(tiny_data, tmp_path, reference, dropout_reference, ranks, layout):
    """With dropout on (embedding, attention probabilities, residuals), every layout gives the
    single-rank run: each mask is a function of the element's place in the global batch, not of
    the rank's shard (rows over dp and micro-batches, heads over tp, tokens under sequence
    parallelism, a context-parallel rank's two chunks and its ring attention's blocks,
    recomputed units replaying theirs)."""
    losses, summary, weights = run(tiny_data, tmp_path, *DROPOUT, *layout, ranks=ranks)
    ref_losses, ref_summary, ref_weights = dropout_reference
    assert not np.allclose(ref_losses, reference[0], rtol=1e-6)  # the masks are on
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    assert summary["val_loss"] == pytest.approx(ref_summary["val_loss"], rel=1e-10)
    for name, w in ref_weights.items():
        np.testing.assert_allclose(weights[name], w, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.fixture(scope="module")
def llama_reference(tiny_data, tmp_path_factory):
    """The single-rank Llama run of a model option tuple, run once per module."""
    runs = {}

    def reference(model: tuple):
        if model not in runs:
            runs[model] = run(tiny_data, tmp_path_factory.mktemp("llama-single"), "--model=llama-tiny", *model)
        return runs[model]
    return reference


GQA = ("--model.n_kv_head=2",)  # grouped-query attention: 2 key/value heads for 4 query heads


@pytest.mark.parametrize("ranks, layout, model", [
    (2, ["--dp=2"], ()),
    (2, ["--dp=2", "--zero=1"], ()),
    (2, ["--dp=2", "--zero=3"], ()),
    (2, ["--tp=2"], ()),
    (2, ["--tp=2", "--sequence-parallel"], ()),
    (2, ["--pp=2", "--schedule=1f1b"], ()),
    (8, ["--dp=2", "--pp=2", "--tp=2"], ()),
    (2, ["--dp=2", "--recompute=selective"], GQA),
    (2, ["--tp=2", "--sequence-parallel"], GQA),
    (2, ["--pp=2", "--schedule=zb", "--microbatches=4"], GQA),
    (2, ["--cp=2"], ()),
    (4, ["--cp=4"], GQA),
    (4, ["--cp=2", "--tp=2", "--sequence-parallel"], GQA),
    (4, ["--cp=2", "--pp=2"], ()),
], ids=lambda v: v if isinstance(v, int) else " ".join(v) or "mha")
def test_llama_layout_matches_single_rank(tiny_data, tmp_path, llama_reference, ranks, layout, model):
    """The second architecture (mpirt.models.llama) on the layouts, with no Llama-specific code in
    mpirt/parallel: the single-rank Llama curve, validation loss and final weights; with
    grouped-query attention too (tp splits the key/value heads), and the rotary tables at a
    context-parallel rank's global positions."""
    losses, summary, weights = run(tiny_data, tmp_path, "--model=llama-tiny", *model, *layout, ranks=ranks)
    ref_losses, ref_summary, ref_weights = llama_reference(model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    assert summary["val_loss"] == pytest.approx(ref_summary["val_loss"], rel=1e-10)
    assert weights.keys() == ref_weights.keys() and "h.3.mlp.gate_proj.weight" in weights
    for name, w in ref_weights.items():
        np.testing.assert_allclose(weights[name], w, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.fixture(scope="module")
def moe_reference(tiny_data, tmp_path_factory):
    """The single-rank mixture-of-experts run of a model option tuple, run once per module."""
    runs = {}

    def reference(model: tuple):
        if model not in runs:
            runs[model] = run(tiny_data, tmp_path_factory.mktemp("moe-single"), "--model=mixtral-tiny", *MOE, *model)
        return runs[model]
    return reference


MOE = ("--model.n_embd=32", "--model.n_inner=48")
CAPACITY = ("--model.capacity_factor=1.0",)  # some assignments dropped


@pytest.mark.parametrize("ranks, layout, model", [
    (2, ["--dp=2"], ()),
    (2, ["--dp=2", "--zero=1"], ()),
    (2, ["--dp=2", "--zero=2", "--grad-accum=2"], ()),
    (2, ["--dp=2", "--zero=3"], ()),
    (2, ["--tp=2"], ()),
    (2, ["--pp=2", "--schedule=1f1b"], ()),
    (2, ["--pp=2", "--schedule=zb", "--microbatches=4", "--recompute=full"], ()),
    (2, ["--dp=2"], CAPACITY),
    (4, ["--dp=2", "--pp=2", "--zero=1"], CAPACITY),
    (2, ["--dp=2", "--ep=2"], ()),
    (4, ["--dp=4", "--ep=4"], ()),
    (4, ["--dp=4", "--ep=2", "--zero=2"], ()),
    (2, ["--dp=2", "--ep=2", "--zero=1"], CAPACITY),
    (2, ["--dp=2", "--ep=2", "--zero=2", "--grad-accum=2"], ()),
    (4, ["--dp=2", "--ep=2", "--tp=2"], ()),
    (4, ["--dp=2", "--ep=2", "--pp=2", "--schedule=zb", "--microbatches=4"], ()),
    (4, ["--dp=2", "--ep=2", "--pp=2", "--zero=1"], CAPACITY),
], ids=lambda v: v if isinstance(v, int) else " ".join(v) or "dropless")
def test_mixture_of_experts_layout_matches_single_rank(tiny_data, tmp_path, moe_reference, ranks, layout, model):
    """The Mixtral-style model (mpirt.models.moe): routing, expert capacity and the load-balancing
    loss are per token and sequence, so every layout gives the single-rank curve, validation loss
    and weights, capacity drops included; the load-balancing loss changes the run; the metrics
    count the tokens per expert and the dropped assignments."""
    losses, summary, weights = run(tiny_data, tmp_path, "--model=mixtral-tiny", *MOE, *model, *layout, ranks=ranks)
    ref_losses, ref_summary, ref_weights = moe_reference(model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    assert summary["val_loss"] == pytest.approx(ref_summary["val_loss"], rel=1e-10)
    assert "h.3.mlp.w_down" in weights
    for name, w in ref_weights.items():
        np.testing.assert_allclose(weights[name], w, rtol=1e-9, atol=1e-12, err_msg=name)
    if layout == ["--dp=2"]:  # the metrics: rank 0's 4 rows x 16 tokens x top-2 in each of the 4 layers
        last = read_metrics(tmp_path)[-1]
        assert sum(last["moe_tokens_per_expert"]) + last["moe_dropped"] == 4 * 16 * 2 * 4
        assert (last["moe_dropped"] > 0) == bool(model) and last["moe_imbalance"] >= 1 and last["moe_aux_loss"] > 0
    if layout == ["--dp=2"] and not model:
        without = moe_reference(("--model.aux_loss_coef=0",))[0]
        assert not np.allclose(without[1:], ref_losses[1:], rtol=1e-9)
    if "--ep=2" in layout:  # the all-to-alls are measured on their own axis
        last = read_metrics(tmp_path)[-1]
        assert last["comm_ep_bytes"] > 0 and last["comm_ep_s"] > 0


def test_mixture_of_experts_checkpoint_saved_at_ep4_resumes_at_ep2(tiny_data, tmp_path, moe_reference):
    """Each ep rank wrote its experts' boxes; at ep 2 each rank reads two of them: the curve goes on
    as the single rank's."""
    out = tmp_path / "run"
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--out-dir={out}", "--model=mixtral-tiny", *MOE,
               "--dp=4", "--ep=4", "--stop-after=3", ranks=4, expect=75)
    losses, _, weights = run(tiny_data, out, "--model=mixtral-tiny", *MOE, "--dp=2", "--ep=2", "--zero=1",
                             f"--init-from={out / 'ckpt'}", ranks=2)
    ref_losses, _, ref_weights = moe_reference(())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    for name, w in ref_weights.items():
        np.testing.assert_allclose(weights[name], w, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("first, then", [
    ((2, ["--tp=2"]), (2, ["--dp=2", "--zero=2"])),
    ((2, ["--pp=2"]), (2, ["--tp=2"])),
    ((4, ["--dp=4"]), (4, ["--tp=2", "--pp=2"])),
    ((2, ["--dp=2", "--zero=1"]), (2, ["--tp=2"])),
    ((2, ["--dp=2", "--zero=3"]), (2, ["--pp=2"])),
    ((2, ["--tp=2"]), (0, [])),
    ((4, ["--dp=2", "--pp=2", "--zero=1"]), (2, ["--tp=2"])),
    ((4, ["--dp=2", "--pp=2", "--zero=3"]), (4, ["--dp=2", "--tp=2", "--zero=3"])),
    ((4, ["--dp=2", "--cp=2"]), (2, ["--tp=2"])),
    ((2, ["--cp=2", "--zero=1"]), (4, ["--cp=4", "--zero=1"])),
], ids=["tp2-then-zero2", "pp2-then-tp2", "dp4-then-tp2xpp2", "zero1-then-tp2", "zero3-then-pp2",
        "tp2-then-1", "zero1xpp2-then-tp2", "zero3xpp2-then-zero3xtp2", "dp2xcp2-then-tp2", "cp2-then-cp4"])
def test_checkpoint_saved_on_one_layout_resumes_on_another(tiny_data, tmp_path, reference, first, then):
    """Stop a run after 3 steps, resume it on another layout: the curve is the single-rank one.
    Each rank wrote only its own boxes (sharded checkpoint) and reads only those it needs."""
    out = tmp_path / "run"
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--out-dir={out}", *first[1], "--stop-after=3",
               ranks=first[0], expect=75)
    losses, _, weights = run(tiny_data, out, *then[1], f"--init-from={out / 'ckpt'}", ranks=then[0])
    np.testing.assert_allclose(losses, reference[0], rtol=1e-10)  # steps 1-3 first run, 4-5 resumed
    for name, w in reference[2].items():
        np.testing.assert_allclose(weights[name], w, rtol=1e-9, atol=1e-12, err_msg=name)


def test_an_error_on_one_rank_stops_every_rank(tiny_data, tmp_path):
    """Rank 1 alone is given a missing dataset: the job ends at once, naming the rank."""
    args = [*TINY, f"--out-dir={tmp_path}"]
    cmd = ["mpiexec", "-n", "1", sys.executable, "-m", "mpirt.train", *args, f"--data={tiny_data}", ":",
           "-n", "1", sys.executable, "-m", "mpirt.train", *args, f"--data={tmp_path / 'missing'}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "error on rank 1" in result.stderr and "missing" in result.stderr


@pytest.mark.parametrize("layout, message", [
    (["--dp=1", "--tp=3"], "dp(1)*pp(1)*tp(3)=3 != world size 2"),
    (["--batch-size=6", "--grad-accum=2"], "batch_size"),
    (["--tp=2", "--model.n_head=1"], "tp"),
    (["--pp=2", "--grad-accum=2"], "grad_accum"),
    (["--pp=2", "--microbatches=3"], "microbatches"),
    (["--pp=2", "--schedule=interleaved", "--model.n_layer=2"], "n_layer=2"),
    (["--cp=2", "--seq-len=14"], "cp: seq_len 14 does not cut into 2 x cp = 4 equal chunks"),
    (["--cp=2", "--dp=2"], "dp(2)*pp(1)*cp(2)*tp(1)=4 != world size 2"),
    (["--ep=4"], "ep: 4 does not divide dp=2"),
    (["--ep=2"], "ep: model_type 'gpt2' has no experts to split"),
    (["--ep=2", "--model=mixtral-tiny", "--model.n_expert=3"], "ep: 2 does not divide the model's n_expert=3"),
])
def test_impossible_layouts_are_refused_before_training(tiny_data, tmp_path, layout, message):
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--out-dir={tmp_path}", *layout, ranks=2,
                        check=False)
    assert result.returncode != 0
    assert message in result.stderr


def test_more_eval_batches_than_the_split_holds_evaluate_on_all_it_holds(tiny_data, tmp_path):
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--out-dir={tmp_path}", "--steps=1",
                        "--eval-batches=100000", ranks=2)
    assert "mpirt: warning: eval_batches 100000: the validation split of" in result.stderr, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["val_loss"] is not None and summary["val_loss"] > 0
