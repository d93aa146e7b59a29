"""Activation recomputation: gradients equal the run without it, and the activations it keeps
match the formula (``activation_bytes_of``), per block and per mode; the training script gives the
same losses with and without it on dp2, tp2 and pp2 zb-h1.
"""
import json

import numpy as np
import pytest

from conftest import run_module
from mpirt.core import recompute
from mpirt.core.nn import kept_bytes
from mpirt.core.modeling import activation_bytes, attention_core, build_model, load_model_config
from mpirt.core.tensor import Tensor
from mpirt.parallel.layout import Layout

DROPOUT = {"attn_pdrop": 0.1, "resid_pdrop": 0.1}


def _model(name, mode, layers="", dtype="float64", **over):
    cfg = load_model_config(name, {"n_layer": 3, "n_embd": 32, **({"n_head": 4} if name != "mlp" else {}), **over})
    model = build_model(cfg, dtype=dtype, seed=5)
    done = recompute.apply(dict(enumerate(model.h)), mode, layers, attention_core(cfg))
    return cfg, model, done


def _grads(name, mode, defer, layers=""):
    """Two steps' losses and the second step's gradients (dropout on: masks must replay)."""
    cfg, model, _ = _model(name, mode, layers, **DROPOUT)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(2):
        x, y = rng.integers(0, cfg.vocab_size, (2, 16)), rng.integers(0, cfg.vocab_size, (2, 16))
        for p in model.parameters():
            p.grad = None
        _, loss = model(x, y)
        wp = loss.backward(defer_weight_grad=defer)
        if wp:
            wp.run()
        losses.append(loss.item())
    return losses, {n: p.grad.copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("mode, layers", [("full", ""), ("selective", ""), ("full", "0,2"), ("selective", "1")])
@pytest.mark.parametrize("defer", [False, True], ids=["B", "B+W"])
def test_gradients_equal_without_recomputation(name, mode, layers, defer):
    ref_losses, ref = _grads(name, "none", defer)
    losses, grads = _grads(name, mode, defer, layers)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    assert grads.keys() == ref.keys()
    for k in ref:
        scale = np.abs(ref[k]).max()
        assert np.abs(grads[k] - ref[k]).max() <= 1e-12 * scale, k


@pytest.mark.parametrize("name, over, mode, layers", [
    (name, over, mode, layers) for name, over in (("tiny", {}), ("tiny", DROPOUT), ("llama-tiny", {}),
                                                  ("llama-tiny", DROPOUT), ("llama-tiny", {"n_kv_head": 2, **DROPOUT}))
    for mode, layers in (("none", ""), ("selective", ""), ("full", ""), ("full", "1-2"))]
    + [("mlp", over, mode, "") for over in ({}, {"resid_pdrop": 0.1}) for mode in ("none", "full")], ids=str)
def test_kept_activations_match_the_formula(name, over, mode, layers):
    """Measured: every array the graph of a float32 forward keeps alive (kept_bytes); predicted:
    embed + head + per block ``block`` / ``block - core`` / ``input`` (within 10%; exact here)."""
    b, t = 4, 32
    cfg, model, done = _model(name, mode, layers, dtype="float32", n_positions=64, **over)
    x = np.random.default_rng(1).integers(0, cfg.vocab_size, (b, t))
    _, loss = model(x, x)
    a = activation_bytes(cfg, Layout.micro_batch(b, t))
    per = {"none": a["block"], "selective": a["block"] - a["core"], "full": a["input"]}
    predicted = a["embed"] + a["head"] + sum(per[mode] if i in done else a["block"] for i in range(cfg.n_layer))
    assert kept_bytes(loss) == pytest.approx(predicted, rel=0.1)
    saved = {"none": 0, "selective": a["core"], "full": a["block"] - a["input"]}[mode] * len(done)
    _, ref_model, _ = _model(name, "none", dtype="float32", n_positions=64, **over)
    _, ref_loss = ref_model(x, x)
    assert kept_bytes(ref_loss) - kept_bytes(loss) == pytest.approx(saved, rel=0.1, abs=1)


def test_recompute_runs_again_in_backward():
    """The checkpointed unit runs once forward (without a graph) and once more in backward."""
    calls = []

    def unit(x):
        calls.append(x.requires_grad)
        return (x * x).sum()

    x = Tensor(np.arange(3.0), requires_grad=True)
    recompute.checkpoint(unit, x).backward()
    assert calls == [False, True]
    np.testing.assert_array_equal(x.grad, 2 * np.arange(3.0))


def test_parse_layers():
    assert recompute.parse_layers("") is None
    assert recompute.parse_layers("0-2, 5") == {0, 1, 2, 5}
    assert recompute.chosen(4, "full", "1,3") == [1, 3]
    assert recompute.chosen(4, "none", "") == []
    for bad in ("x", "3-1", "-1"):
        with pytest.raises(ValueError):
            recompute.parse_layers(bad)


TINY = ["--model.n_layer=4", "--model.n_embd=32", "--model.n_head=4", "--model.n_positions=32",
        "--model.attn_pdrop=0.1", "--model.resid_pdrop=0.1", "--seq-len=16", "--batch-size=8",
        "--eval-batches=1", "--eval-interval=0", "--progress=false", "--steps=4", "--dtype=float64"]


def _losses(tiny_data, out, *args, ranks):
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--out-dir={out}", *args, ranks=ranks)
    return [json.loads(line)["loss"] for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]


LAYOUTS = [["--dp=2"], ["--tp=2"], ["--pp=2", "--schedule=zb-h1", "--microbatches=4"]]
MORE = [["--dp=2", "--zero=1"], ["--dp=2", "--zero=2"], ["--dp=2", "--zero=3"], ["--tp=2", "--sequence-parallel"],
        ["--pp=2"], ["--pp=2", "--schedule=gpipe", "--microbatches=4"],
        ["--pp=2", "--schedule=interleaved", "--microbatches=4"], ["--pp=2", "--recompute-layers=0-1"],
        ["--model=llama-tiny", "--tp=2", "--sequence-parallel"], ["--model=llama-tiny", "--pp=2", "--schedule=zb-h1"]]


@pytest.fixture(scope="module")
def without_recomputation(tiny_data, tmp_path_factory):
    """The losses of a layout's run without recomputation, run once per layout for the module (the
    layouts are tested with both modes)."""
    runs = {}

    def losses(layout: list[str]) -> list[float]:
        if tuple(layout) not in runs:
            runs[tuple(layout)] = _losses(tiny_data, tmp_path_factory.mktemp("ref"), *layout, ranks=2)
        return runs[tuple(layout)]
    return losses


@pytest.mark.parametrize("layout, mode", [(lay, m) for lay in LAYOUTS for m in ("full", "selective")]
                         + [(lay, "full") for lay in MORE] + [(MORE[-2], "selective")], ids=str)
def test_train_losses_equal_with_recomputation(tiny_data, tmp_path, without_recomputation, layout, mode):
    ref = without_recomputation(layout)
    # every block named: recompute runs on every stage, also where it would not lower the peak
    got = _losses(tiny_data, tmp_path / "rc", "--recompute-layers=0-3", *layout, f"--recompute={mode}", ranks=2)
    assert len(got) == 4
    np.testing.assert_allclose(got, ref, rtol=1e-12)
