"""Mixed precision: bfloat16/float16 parameters, gradients and activations with float32 masters,
moments and reductions; dynamic loss scaling for float16; bytes per parameter.

Tolerances. With u the unit roundoff (2^-8 for bfloat16, 2^-11 for float16), each stored value
carries a relative error up to u. Over 25 steps of the default model (batch 4 x 64) a half run's
losses must stay within 2u (relative) of the float32 run's at every step, and its final float32
masters within 2u in relative L2 norm. Measured: bfloat16 1.0e-3 (losses) and 1.4e-3 (weights)
against 2u = 7.8e-3; float16 1.5e-4 and 2.8e-4 against 2u = 9.8e-4. Layouts of one half dtype
round at other points (each dp rank rounds its partial gradient to half before the float32
reduction), so dp2, tp2, ZeRO-1/3 and pp2 bfloat16 runs match the single-rank bfloat16 run to u/4
in the loss (measured at most 1.2e-4) and 2u in the weights (measured at most 1.1e-3).
"""
import json

import ml_dtypes
import numpy as np
import pytest

from conftest import run_module
from mpirt import comm
from mpirt.core import ops
from mpirt.checkpoint.store import load_state
from mpirt.core.modeling import build_model, load_model_config
from mpirt.core.optim import AdamW
from mpirt.core.precision import LossScaler, bytes_per_parameter, compute_dtype, is_half, upcast
from mpirt.core.tensor import Tensor

BF16 = np.dtype(ml_dtypes.bfloat16)
U = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
RUN = ["--steps=25", "--batch-size=4", "--seq-len=64", "--eval-batches=1", "--progress=false", "--monitor=false"]


def rng_array(shape, dtype, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


# --- dtypes and ops -----------------------------------------------------------------------------
def test_half_dtypes_and_their_compute_dtype():
    assert is_half("bfloat16") and is_half(np.float16) and is_half(BF16)
    assert not any(is_half(d) for d in ("float32", "float64", "int16", None))
    assert compute_dtype("bfloat16") == compute_dtype("float16") == np.float32
    assert compute_dtype("float64") == np.float64
    a = rng_array(3, np.float32)
    assert upcast(a) is a and upcast(a.astype(BF16)).dtype == np.float32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_matmul_and_fused_ops_compute_in_float32_and_round_once(dtype):
    """Products, layer norm and GELU on half inputs equal the float32 computation on the upcast
    inputs, rounded once to half (bitwise); cross-entropy returns a float32 loss; every gradient
    keeps its input's half dtype."""
    x, w = rng_array((8, 16), dtype, 1), rng_array((16, 24), dtype, 2, 0.2)
    b = rng_array(24, dtype, 3)
    y = ops.linear(Tensor(x), Tensor(w), Tensor(b)).data
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y, (x.astype(np.float32) @ w.astype(np.float32) + b.astype(np.float32)).astype(dtype))
    g, beta = rng_array(24, dtype, 4), rng_array(24, dtype, 5)
    ln = ops.layer_norm(Tensor(y), Tensor(g), Tensor(beta)).data
    ref = ops.layer_norm(Tensor(y.astype(np.float32)), Tensor(g.astype(np.float32)),
                         Tensor(beta.astype(np.float32))).data.astype(dtype)
    np.testing.assert_array_equal(ln, ref)
    np.testing.assert_array_equal(ops.gelu(Tensor(y)).data, ops.gelu(Tensor(y.astype(np.float32))).data.astype(dtype))

    params = [Tensor(a, requires_grad=True) for a in (x, w, b, g, beta)]
    h = ops.layer_norm(ops.linear(*params[:3]), params[3], params[4])
    loss = ops.cross_entropy(h, np.arange(8) % 24)
    assert loss.dtype == np.float32
    loss.backward()
    assert all(p.grad.dtype == np.dtype(dtype) and np.isfinite(upcast(p.grad)).all() for p in params)


# --- optimizer ------------------------------------------------------------------------------------
def _params(dtype, seed=0):
    from mpirt.core.nn import Parameter
    ps = []
    for i, shape in enumerate([(6, 4), (4,)]):
        p = Parameter(shape, dtype=dtype)
        p.data = rng_array(shape, dtype, seed + i, 0.5)
        p.name = f"p{i}"
        ps.append(p)
    return ps


@pytest.mark.parametrize("rows", [3, 8])  # 8: as many rows as the weight has elements
def test_half_ops_keep_half_activations_and_float32_row_statistics(rows):
    """A half layer norm keeps its normalised input in half and 1/std per row in float32, also
    when the rows number the weight's elements; GELU keeps its derivative in half; a forward
    without a graph rounds nothing it will not need."""
    from mpirt.core.tensor import no_grad

    x = Tensor(np.random.default_rng(0).standard_normal((2, rows, 8)).astype("float16"), requires_grad=True)
    w = Tensor(np.ones(8, "float16"), requires_grad=True)
    y = ops.layer_norm(x, w)
    fn = y._ctx
    assert fn.xhat.dtype == np.float16 and fn.rstd.dtype == np.float32 and "rstd" not in fn._kept_half
    assert fn.weight is w.data  # its float32 copy is not kept: the argument itself is
    assert ops.gelu(x)._ctx.d.dtype == np.float16
    y.sum().backward()
    assert x.grad.dtype == np.float16 and np.isfinite(x.grad.astype(np.float32)).all()
    with no_grad():
        assert ops.layer_norm(x, w).dtype == np.float16


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_adamw_keeps_float32_masters_and_unscales_in_float32(dtype):
    """The update runs on float32 masters with float32 moments, exactly as a float32 AdamW fed the
    upcast gradients; the half weights are the masters rounded to nearest even. Gradients of
    about 1e-6 scaled by 2^16 (float16 would flush them) and unscaled by grad_scale = 2^-16 are
    unscaled in float32: bit for bit the float32 AdamW fed the exact quotients."""
    runs = {}
    for case in ("plain", "scaled"):
        half, ref = _params(dtype), _params("float32")
        for p, r in zip(half, ref):
            r.data = p.data.astype(np.float32)
        opt, ref_opt = AdamW(half, lr=0.01, weight_decay=0.1), AdamW(ref, lr=0.01, weight_decay=0.1)
        opt.grad_scale = 2.0 ** -16 if case == "scaled" else 1.0
        for step in range(3):
            for i, (p, r) in enumerate(zip(half, ref)):
                if case == "plain":
                    p.grad = rng_array(p.shape, dtype, 10 * step + i, 1e-2)
                    r.grad = p.grad.astype(np.float32)
                else:
                    p.grad = (rng_array(p.shape, np.float32, 10 * step + i, 1e-6) * 2.0 ** 16).astype(dtype)
                    r.grad = p.grad.astype(np.float32) * np.float32(2.0 ** -16)
            opt.step()
            ref_opt.step()
        for i, (p, r) in enumerate(zip(half, ref)):
            assert opt.master[i].dtype == np.float32 and opt.state[i]["exp_avg"].dtype == np.float32
            np.testing.assert_array_equal(opt.master[i], r.data, err_msg=case)
            np.testing.assert_array_equal(p.data, r.data.astype(dtype), err_msg=case)
        runs[case] = half, opt
    half, opt = runs["plain"]
    with opt.full_parameters():  # a checkpoint sees the float32 masters
        assert all(p.data.dtype == np.float32 for p in half)
        half[0].data[...] = 0.25
    assert half[0].data.dtype == np.dtype(dtype) and (opt.master[0] == 0.25).all() and (half[0].data == 0.25).all()


def test_loss_scaler_backs_off_grows_and_round_trips():
    s = LossScaler(scale=8.0, window=3, min_scale=2.0)
    s.update(True)
    assert (s.scale, s.good_steps, s.overflows) == (4.0, 0, 1)
    s.update(True)
    s.update(True)
    assert s.scale == 2.0  # not below min_scale
    for _ in range(2):
        s.update(False)
    assert s.scale == 2.0
    s.update(False)
    assert (s.scale, s.good_steps) == (4.0, 0)
    s.update(False)
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.good_steps, t.overflows) == (4.0, 1, 3)
    with pytest.raises(ValueError, match="LossScaler"):
        LossScaler(growth=1.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_memory_per_parameter_matches_the_formula(dtype):
    """Persistent bytes per parameter of AdamW: bf16/fp16 2 (weights) + 2 (grads) + 12 (float32
    master and two moments); float32 4 + 4 + 8; ZeRO shards by the formula."""
    model = build_model(load_model_config("tiny", {}), dtype=dtype, seed=0)
    opt = AdamW(model.parameters(), lr=1e-3)
    opt.zero_grad()
    n = model.num_parameters()
    per = {k: v / n for k, v in opt.memory_bytes().items()}
    assert per == bytes_per_parameter(dtype)
    assert per == ({"params": 2, "grads": 2, "optimizer": 12} if dtype != "float32"
                   else {"params": 4, "grads": 4, "optimizer": 8})
    assert bytes_per_parameter("bfloat16", dp=4, zero=1) == {"params": 2, "grads": 2, "optimizer": 3}
    assert bytes_per_parameter("bfloat16", dp=4, zero=3) == {"params": 0.5, "grads": 0.5, "optimizer": 3}


# --- the comm engine in the banner --------------------------------------------------------------
def test_describe_engines_names_collective_and_p2p_engines(monkeypatch):
    class FakeDevice:
        __cuda_array_interface__ = {}
    assert comm.describe_engines(np.ones(1)) == "host MPI"
    monkeypatch.setattr(comm.engines, "nccl_available", lambda: True)
    monkeypatch.setattr(comm.engines, "cuda_aware_mpi", lambda: False)
    assert comm.describe_engines(FakeDevice()) == "nccl (p2p staged)"
    monkeypatch.setattr(comm.engines, "cuda_aware_mpi", lambda: True)
    assert comm.describe_engines(FakeDevice()) == "nccl (p2p cuda-aware)"
    monkeypatch.setattr(comm.engines, "nccl_available", lambda: False)
    assert comm.describe_engines(FakeDevice()) == "cuda-aware"
    monkeypatch.setenv("MPIRT_COMM_ENGINE", "staged")
    assert comm.describe_engines(FakeDevice()) == "staged"


# --- training runs (python -m mpirt.train) ------------------------------------------------------
def train(out, *args, ranks=0, expect=0):
    run_module("mpirt.train", *RUN, f"--out-dir={out}", *args, ranks=ranks, timeout=280, expect=expect)


def records(out, rank=0):
    return [json.loads(line) for line in (out / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]


def weights(out):
    """The latest checkpoint's full weights (its shards assembled)."""
    return load_state(out / "ckpt")[1]


def rel_norm(a: dict, b: dict) -> float:
    num = sum(float(np.sum((a[k].astype(np.float64) - b[k].astype(np.float64)) ** 2)) for k in b)
    return (num / sum(float(np.sum(b[k].astype(np.float64) ** 2)) for k in b)) ** 0.5


@pytest.fixture(scope="module")
def float32_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp32")
    train(out, "--dtype=float32")
    return out


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16")
    train(out, "--dtype=bfloat16")
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_training_matches_float32_within_2u(dtype, float32_run, bf16_run, tmp_path):
    out = bf16_run if dtype == "bfloat16" else tmp_path
    if dtype == "float16":
        train(out, "--dtype=float16")
    ref, got = records(float32_run), records(out)
    assert len(got) == len(ref) == 25
    losses, ref_losses = np.array([r["loss"] for r in got]), np.array([r["loss"] for r in ref])
    np.testing.assert_allclose(losses, ref_losses, rtol=2 * U[dtype])
    assert not np.allclose(losses, ref_losses, rtol=1e-6)  # it did run in half precision
    w, w_ref = weights(out), weights(float32_run)
    assert all(a.dtype == np.float32 for a in w.values())  # the checkpoint holds the float32 masters
    assert rel_norm(w, w_ref) < 2 * U[dtype]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 0 and summary["overflow_steps"] == 0
    assert summary["loss_scale"] == (65536.0 if dtype == "float16" else None)


@pytest.mark.parametrize("layout", [["--dp=2"], ["--tp=2"], ["--dp=2", "--zero=1"], ["--dp=2", "--zero=3"],
                                    ["--pp=2"]], ids=" ".join)
def test_bf16_layouts_match_the_single_rank_bf16_run(layout, bf16_run, tmp_path):
    train(tmp_path, "--dtype=bfloat16", *layout, ranks=2)
    losses = np.array([r["loss"] for r in records(tmp_path)])
    ref = np.array([r["loss"] for r in records(bf16_run)])
    np.testing.assert_allclose(losses, ref, rtol=U["bfloat16"] / 4)
    assert rel_norm(weights(tmp_path), weights(bf16_run)) < 2 * U["bfloat16"]


def test_injected_overflow_skips_on_every_rank_halves_the_scale_then_grows(tmp_path, monkeypatch):
    """An infinite gradient on dp rank 1 at step 3: both ranks skip step 3 (an overflow, not a
    non-finite failure, so --max-skips=1 does not stop the run) and the scale halves; after 4
    clean steps (--loss-scale-window=4) it doubles again."""
    monkeypatch.setenv("MPIRT_FAULT", "overflow@1:3")
    train(tmp_path, "--dtype=float16", "--dp=2", "--steps=10", "--loss-scale-window=4", "--max-skips=1",
          "--nan-policy=stop", ranks=2)
    for rank in (0, 1):
        recs = records(tmp_path, rank)
        assert [r["overflow"] for r in recs] == [r["step"] == 3 for r in recs]
        assert not any(r["skipped"] for r in recs)
        assert [r["loss_scale"] for r in recs] == [65536.0] * 3 + [32768.0] * 4 + [65536.0] * 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["overflow_steps"], summary["skipped_steps"], summary["exit_code"]) == (1, 0, 0)
    # the skipped step left the weights alone on both ranks: the same as one rank skipping step 3
    single = tmp_path / "single"
    monkeypatch.setenv("MPIRT_FAULT", "overflow@0:3")
    train(single, "--dtype=float16", "--steps=10", "--loss-scale-window=4")
    np.testing.assert_allclose([r["loss"] for r in records(tmp_path)], [r["loss"] for r in records(single)],
                               rtol=U["float16"])


def test_a_too_large_loss_scale_backs_off_until_the_gradients_fit(tmp_path):
    """Started at 2^40 the float16 gradients overflow: each such step is skipped and halves the
    scale until they fit; the overflows do not count towards --max-skips."""
    train(tmp_path, "--dtype=float16", "--steps=30", "--initial-loss-scale=1099511627776", "--max-skips=2")
    recs = records(tmp_path)
    k = next(i for i, r in enumerate(recs) if not r["overflow"])
    assert k > 2 and all(r["overflow"] for r in recs[:k]) and not any(r["overflow"] for r in recs[k:])
    assert [r["loss_scale"] for r in recs[:k + 1]] == [2.0 ** (40 - i) for i in range(k + 1)]
    assert all(np.isfinite(r["loss"]) and not r["skipped"] for r in recs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_resume_from_float32_masters_is_bitwise(dtype, tmp_path):
    """Stopped at step 3 and resumed, a half run (masters, moments, loss-scaler state) ends bit for
    bit where the uninterrupted run does."""
    args = ["--steps=6", f"--dtype={dtype}", "--loss-scale-window=2"]
    train(tmp_path / "whole", *args)
    train(tmp_path / "split", *args, "--stop-after=3", expect=75)
    train(tmp_path / "split", *args, "--resume=auto")
    for name, w in weights(tmp_path / "whole").items():
        np.testing.assert_array_equal(weights(tmp_path / "split")[name], w, err_msg=name)
    assert [r["loss"] for r in records(tmp_path / "split")] == [r["loss"] for r in records(tmp_path / "whole")]


# --- ZeRO (multi-rank tier) -----------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_bf16_shards_float32_masters_by_the_formula(stage):
    """bf16 ZeRO at dp N: 2 + 2 + 12/N bytes per parameter (stage 2: 2 + 14/N, stage 3: 16/N),
    the master shard float32, the bf16 shard its rounding; full_parameters shows the float32
    masters, the same on every rank."""
    from mpi4py import MPI

    from conftest import agree
    from mpirt.models import GPTConfig
    from mpirt.parallel.zero import ZeroOptimizer
    from parity import batch, dp_comm, make_model

    c = dp_comm()
    model = make_model("bfloat16", GPTConfig(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=256))
    opt = ZeroOptimizer(model, c, stage=stage, lr=1e-3)
    opt.zero_grad()
    x, y = batch(0, c.rank, c.size)
    model(x, y)[1].backward()
    opt.step()
    n = model.num_parameters()
    per = {k: v / n for k, v in opt.memory_bytes().items()}
    want = bytes_per_parameter("bfloat16", dp=c.size, zero=stage)
    fails = [f"{k}: {per[k]:.4f} != {want[k]:.4f}" for k in want if abs(per[k] / want[k] - 1) > 0.02]
    if opt.master_shard.dtype != np.float32 or opt.exp_avg.dtype != np.float32:
        fails.append(f"state dtypes {opt.master_shard.dtype}, {opt.exp_avg.dtype}")
    if not np.array_equal(opt.param_shard, opt.master_shard.astype(BF16)):
        fails.append("the bf16 shard is not the rounded master")
    with opt.full_parameters():
        full = {p.name: p.data.copy() for p in model.parameters()}
    if {a.dtype for a in full.values()} != {np.dtype(np.float32)}:
        fails.append(f"full parameters {({str(a.dtype) for a in full.values()})}")
    digest = float(sum(np.sum(a.astype(np.float64) * (i + 1)) for i, a in enumerate(full.values())))
    if len(set(MPI.COMM_WORLD.allgather(digest))) != 1:
        fails.append("ranks see different masters")
    agree(not fails, fails)


def test_half_sums_accumulate_in_float32():
    """A column sum of 1024 bf16 rows (ops.sum, and the bias gradient's sum_rows) adds in float32
    and rounds once: its error is one bf16 rounding, not one per addition."""
    from mpirt.cpu.threads import sum_rows
    a = np.random.default_rng(0).standard_normal((1024, 64)).astype(np.dtype("bfloat16"))
    exact = a.astype(np.float64).sum(axis=0)
    for got in (ops.sum(Tensor(a), axis=0).data, sum_rows(a)):
        assert got.dtype == a.dtype
        assert np.abs(got.astype(np.float64) - exact).max() <= 2 ** -8 * np.abs(exact).max()
