"""The fused C kernels (mpirt.cpu.kernels) against the NumPy forms they replace, and how they are built.

Every op that has a C kernel runs twice on the same inputs, once with the kernels and once with
them switched off, for float32 and float64: outputs and every gradient must agree (float64 to
rounding, float32 to the fast exp's few ulp), and NaN/inf must land where NumPy puts them. The
build tests compile into a fresh cache in subprocesses: built once, then loaded; several processes
building at once; no compiler; MPIRT_KERNELS=numpy.
"""
import contextlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from mpirt.cpu import kernels
from mpirt.core import ops
from mpirt.core.tensor import Tensor


def test_the_kernels_load():
    """CI machines have a C compiler: the fused kernels must be what runs there."""
    assert kernels.library() is not None, kernels.describe()
    assert kernels.describe().startswith("C (")


def kernels_on():
    """The default: the C kernels as loaded (a context, to pair with ``numpy_forms``)."""
    return contextlib.nullcontext()


@pytest.fixture
def numpy_forms():
    """``with numpy_forms(): ...`` runs the NumPy forms."""
    return kernels.numpy_forms


def record_kernel_calls(monkeypatch, called: list) -> None:
    """Append the name of every C kernel called, directly or as a call of the native pool."""
    real_call, real_run = kernels.call, kernels.run_calls
    monkeypatch.setattr(kernels, "call", lambda kernel, *a: (called.append(kernel), real_call(kernel, *a)))
    monkeypatch.setattr(kernels, "run_calls", lambda calls, workers: (called.extend(c[0] for c in calls),
                                                                      real_run(calls, workers)))


def run_op(f, arrays, grad_seed=1):
    """Outputs and input gradients of ``f`` on Tensors of ``arrays`` (ops never write their inputs)."""
    ts = [Tensor(a, requires_grad=True) for a in arrays]
    out = f(*ts)
    g = np.random.default_rng(grad_seed).standard_normal(out.shape).astype(out.data.dtype)
    (out * Tensor(g)).sum().backward()
    return [out.data] + [t.grad for t in ts]


def rng_arrays(dtype, *shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


N, C = 300, 96  # rows not a multiple of anything the kernels vectorise by
CASES = {
    "layer_norm": (lambda x, w, b: ops.layer_norm(x, w, b), [(N, C), (C,), (C,)]),
    "layer_norm_no_affine": (lambda x: ops.layer_norm(x), [(N, C)]),
    "rms_norm": (lambda x, w: ops.rms_norm(x, w), [(N, C), (C,)]),
    "gelu": (lambda x: ops.gelu(x * 3.0), [(N, C)]),
    "attention": (lambda qkv: ops.causal_self_attention(qkv, n_head=3), [(2, 150, 3 * 48)]),
    "attention_dropout": (lambda qkv: ops.causal_self_attention(qkv, n_head=2, dropout_p=0.25, seed=5),
                          [(2, 70, 3 * 16)]),
    "attention_gqa": (lambda qkv: ops.causal_self_attention(qkv, n_head=6, n_kv_head=2), [(2, 150, 10 * 16)]),
    "attention_gqa_dropout": (lambda qkv: ops.causal_self_attention(qkv, n_head=4, n_kv_head=1, dropout_p=0.25,
                                                                    seed=5), [(2, 70, 6 * 8)]),
}


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-11), (np.float32, 2e-5)])
@pytest.mark.parametrize("name", list(CASES))
def test_c_kernels_match_the_numpy_forms(name, dtype, rtol, numpy_forms):
    f, shapes = CASES[name]
    arrays = rng_arrays(dtype, *shapes)
    fused = run_op(f, arrays)
    with numpy_forms():
        plain = run_op(f, arrays)
    for i, (a, b) in enumerate(zip(fused, plain)):
        assert a.dtype == b.dtype == dtype
        scale = np.abs(b).max()
        np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale, err_msg=f"{name}: output/grad {i}")


NORM = {"norm_forward", "norm_backward"}
SOFTMAX = {"causal_softmax", "causal_probs", "softmax_grad"}  # the attention's chunked NumPy form, fused
KERNELS_OF = {  # (float32, float64)
    "layer_norm": (NORM, NORM), "layer_norm_no_affine": (NORM, NORM), "rms_norm": (NORM, NORM),
    "gelu": ({"gelu"}, {"gelu"}),
    "attention": ({"attention_forward", "attention_backward"}, SOFTMAX),   # whole in C: float32 only
    "attention_dropout": (SOFTMAX, SOFTMAX),
    "attention_gqa": ({"attention_forward", "attention_backward"}, SOFTMAX),
    "attention_gqa_dropout": (SOFTMAX, SOFTMAX)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_each_op_runs_its_c_kernels(name, dtype, monkeypatch):
    """The comparison above compares something: with the kernels on, each op calls its C kernels."""
    called = []
    record_kernel_calls(monkeypatch, called)
    f, shapes = CASES[name]
    run_op(f, rng_arrays(dtype, *shapes))
    assert set(called) == KERNELS_OF[name][dtype == np.float64]


ATTENTION_SHAPES = [  # (B, T, H, D): T and D off every vector and tile width, one key, many chunks
    (2, 150, 3, 48), (1, 7, 2, 8), (3, 130, 2, 20), (1, 1, 1, 4), (1, 300, 1, 16), (2, 64, 8, 64)]


def attention_run(qkv, n_head, g, forward=contextlib.nullcontext, backward=contextlib.nullcontext):
    t = Tensor(qkv, requires_grad=True)
    with forward():
        out = ops.causal_self_attention(t, n_head=n_head)
    with backward():
        out.backward(g)
    return out.data, t.grad


@pytest.mark.parametrize("b, t, h, d", ATTENTION_SHAPES)
def test_c_attention_against_float64(b, t, h, d, numpy_forms):
    """The whole-C float32 attention against the float64 NumPy form, as close as float32's own
    NumPy form is; and either forward pairs with either backward (both keep the same state: the
    log-sum-exp per query)."""
    qkv, g = rng_arrays(np.float32, (b, t, 3 * h * d), (b, t, h * d), seed=t)
    exact = attention_run(qkv.astype(np.float64), h, g.astype(np.float64))
    runs = {"C": attention_run(qkv, h, g), "NumPy": attention_run(qkv, h, g, numpy_forms, numpy_forms),
            "C, NumPy backward": attention_run(qkv, h, g, backward=numpy_forms),
            "NumPy, C backward": attention_run(qkv, h, g, forward=numpy_forms)}
    for name, run in runs.items():
        for what, got, want in zip(("output", "gradient"), run, exact):
            assert got.dtype == np.float32
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err < 2e-6, f"{name} {what}: relative error {err:.1e}"


def test_c_attention_bits_do_not_depend_on_the_split():
    """Each (batch, head) pair is computed alone, the same way wherever it sits: a batch row run
    alone (data parallel), a pair of heads run alone (tensor parallel), and 1, 2 or 3 threads give
    the same bits as the whole run."""
    from mpirt.cpu import threads
    b, t, h, d = 3, 100, 4, 16
    qkv, g = rng_arrays(np.float32, (b, t, 3 * h * d), (b, t, h * d), seed=2)
    saved = threads.num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            threads.set_num_threads(n)
            runs.append(attention_run(qkv, h, g))
    finally:
        threads.set_num_threads(saved)
    for other in runs[1:]:
        for a, want in zip(other, runs[0]):
            np.testing.assert_array_equal(a, want)
    out, grad = runs[0]
    row_out, row_grad = attention_run(qkv[1:2].copy(), h, g[1:2].copy())
    np.testing.assert_array_equal(row_out, out[1:2])
    np.testing.assert_array_equal(row_grad, grad[1:2])
    heads = slice(2 * d, 4 * d)                                 # heads 2 and 3 of q, k and v
    cols = np.concatenate([np.arange(3 * h * d)[i * h * d:(i + 1) * h * d][heads] for i in range(3)])
    part_out, part_grad = attention_run(qkv[..., cols].copy(), 2, g[..., heads].copy())
    np.testing.assert_array_equal(part_out, out[..., heads])
    np.testing.assert_array_equal(part_grad, grad[..., cols])


def test_a_float64_gradient_into_a_float32_attention(numpy_forms):
    """The incoming gradient's dtype decides the backward's score-gradient dtype: the C kernel must
    not read a float32 probability chunk as float64 (it once did: NaN and reads past the end)."""
    qkv = rng_arrays(np.float32, (2, 64, 3 * 16))[0]
    g = rng_arrays(np.float64, (2, 64, 16), seed=4)[0]
    grads = []
    for context in (kernels_on, numpy_forms):
        with context():
            t = Tensor(qkv, requires_grad=True)
            ops.causal_self_attention(t, n_head=2).backward(g)
            grads.append(t.grad)
    assert np.isfinite(grads[0]).all()
    np.testing.assert_allclose(grads[0], grads[1], rtol=0, atol=1e-5 * np.abs(grads[1]).max())


def test_inputs_the_kernels_cannot_take_get_the_numpy_errors():
    """Shapes or arguments the C kernels do not check go to the NumPy forms, which raise."""
    x = rng_arrays(np.float32, (8, 16))[0]
    with pytest.raises(ValueError):                       # a weight of the wrong length
        ops.layer_norm(Tensor(x), Tensor(np.ones(15, np.float32)))
    with pytest.raises(TypeError):                        # no weight (the C form would read NULL)
        ops.rms_norm(Tensor(x), None)


@pytest.mark.mpi(min_size=2)
def test_ranks_agree_on_the_kernels():
    """One rank without the C kernels: every rank runs the NumPy forms (replicated parameters must
    get the same bits everywhere)."""
    from mpirt import comm
    from mpirt.run.distributed import agree_on_kernels
    world = comm.world_comm()
    saved = kernels._loaded
    try:
        agree_on_kernels(world)
        assert kernels.library() is not None                       # all have them: kept
        if world.rank == 1:
            kernels.disable("test: this rank has no compiler")
        agree_on_kernels(world)
        assert kernels.library() is None
        if world.rank != 1:
            assert kernels.describe() == "numpy (rank 1 cannot run the C kernels: every rank runs the NumPy forms)"
    finally:
        kernels._loaded = saved


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adamw_is_bit_equal_to_the_numpy_form(dtype, weight_decay, numpy_forms, monkeypatch):
    """Same operations in the same order, no contraction (-std=c11): the same bits, so switching
    kernels on or off never changes a run's parameters."""
    from mpirt.core.optim import adamw_update
    rng = np.random.default_rng(3)
    start = [rng.standard_normal(70_001).astype(dtype) for _ in range(4)]
    start[3] = np.abs(start[3])
    called = []
    record_kernel_calls(monkeypatch, called)
    runs = []
    for context in (kernels_on, numpy_forms):
        arrays = [a.copy() for a in start]
        with context():
            for step in (1, 2, 3):
                adamw_update(*arrays, step=step, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=weight_decay)
        runs.append(arrays)
    assert called and set(called) == {"adamw"}
    for fused, plain in zip(*runs):
        np.testing.assert_array_equal(fused, plain)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_results_do_not_depend_on_where_the_arrays_sit(dtype):
    """Row sums keep fixed partial sums: the same inputs at another address (shifted by one and
    three elements; the arrays the ops allocate themselves stay aligned) give the same bits."""
    def at_offset(a, k):
        buf = np.empty(a.size + k, dtype=a.dtype)
        view = buf[k:].reshape(a.shape)
        view[...] = a
        return view
    for name, (f, shapes) in CASES.items():
        arrays = rng_arrays(dtype, *shapes)
        runs = [run_op(f, [at_offset(a, k) for a in arrays]) for k in (0, 1, 3)]
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_without_grad_gives_the_same_bits(dtype):
    """The forward with and without the derivative (no_grad, recomputation) must agree exactly."""
    from mpirt.core.tensor import no_grad
    x = rng_arrays(dtype, (N, C))[0] * 4
    with_grad = ops.gelu(Tensor(x, requires_grad=True)).data
    with no_grad():
        without = ops.gelu(Tensor(x)).data
    np.testing.assert_array_equal(with_grad, without)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_non_finite_values_land_where_numpy_puts_them(dtype, numpy_forms):
    x = rng_arrays(dtype, (8, 32))[0]
    x[1, 3], x[4, 0], x[6, 7] = np.nan, np.inf, -np.inf
    qkv = rng_arrays(dtype, (1, 16, 3 * 8))[0]
    qkv[0, 5, 2] = np.nan                              # a query: its row of scores
    for f, a in ((ops.gelu, x), (ops.layer_norm, x), (lambda t: ops.causal_self_attention(t, n_head=2), qkv)):
        fused = f(Tensor(a)).data
        with numpy_forms():
            plain = f(Tensor(a)).data
        # the same elements non-finite (GELU(-inf) is NaN one way and -inf the other: either
        # trips the non-finite checks), and a NaN input stays NaN
        np.testing.assert_array_equal(np.isfinite(fused), np.isfinite(plain))
        if a.shape == fused.shape:
            assert np.isnan(fused[np.isnan(a)]).all()
        ok = np.isfinite(plain)
        np.testing.assert_allclose(fused[ok], plain[ok], rtol=1e-5, atol=1e-6)


def test_gelu_is_accurate_over_the_float32_range():
    """The C GELU (sigmoid form, its own vectorised exp) against float64: within 2e-5 relative
    wherever the value is above 1e-30 (the argument's own float32 rounding costs ~1e-5 in the far
    negative tail, where NumPy's ``1 + tanh`` form cancels to nothing)."""
    x = np.linspace(-20, 20, 200_001, dtype=np.float32)
    fused = ops.gelu(Tensor(x)).data
    xd = x.astype(np.float64)
    exact = xd / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (xd + 0.044715 * xd ** 3)))
    np.testing.assert_allclose(fused, exact, rtol=2e-5, atol=1e-30)


# ---------------------------------------------------------------------------------------------
# building and loading, in fresh processes
# ---------------------------------------------------------------------------------------------
def describe_in(cache, **env):
    code = "from mpirt.cpu import kernels; print(kernels.describe())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                            env={**os.environ, "MPIRT_CACHE": str(cache), **env})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_built_once_then_loaded_from_the_cache(tmp_path):
    import re
    assert re.fullmatch(r"C \(\S+ -O3 -march=native, built now\)", describe_in(tmp_path))
    assert re.fullmatch(r"C \(\S+ -O3 -march=native, cached\)", describe_in(tmp_path))
    assert len(list(tmp_path.glob("kernels-*.so"))) == 1


def test_processes_building_at_once_all_load_one_library(tmp_path):
    code = "from mpirt.cpu import kernels; assert kernels.library() is not None, kernels.describe()"
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "MPIRT_CACHE": str(tmp_path)},
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for p in procs:
        assert p.wait(timeout=180) == 0, p.stderr.read()
    assert [p.name for p in tmp_path.iterdir()] == [next(tmp_path.glob("kernels-*.so")).name]  # no temporaries left


def test_a_cache_that_cannot_be_written_leaves_the_numpy_forms(tmp_path):
    (tmp_path / "file").write_text("a file where the cache directory should be")
    assert describe_in(tmp_path / "file").startswith("numpy (the C kernels did not ")


def test_a_damaged_cache_entry_is_built_again(tmp_path):
    assert describe_in(tmp_path).endswith("built now)")
    (so,) = tmp_path.glob("kernels-*.so")
    so.write_bytes(b"not a shared library")
    assert describe_in(tmp_path).endswith("built now)")
    assert describe_in(tmp_path).endswith("cached)")


def test_without_a_compiler_or_when_switched_off_the_numpy_forms_run(tmp_path):
    text = describe_in(tmp_path, CC="/nonexistent/cc")
    assert text.startswith("numpy (no C compiler")
    assert describe_in(tmp_path, MPIRT_KERNELS="numpy") == "numpy (MPIRT_KERNELS=numpy)"
    assert not list(tmp_path.glob("kernels-*"))


def test_a_failing_build_is_reported_and_the_numpy_forms_run(tmp_path):
    fake = tmp_path / "badcc"
    fake.write_text("#!/bin/sh\necho 'badcc: internal error' >&2\nexit 3\n")
    fake.chmod(0o755)
    text = describe_in(tmp_path / "cache", CC=str(fake))
    assert text.startswith("numpy (the C kernels did not build: ") and "badcc: internal error" in text


def test_a_new_build_prunes_libraries_unused_for_a_month(tmp_path):
    """Each load touches its library; a build deletes others not loaded for 30 days (an old
    mpirt's) and keeps recently used ones (another CPU's sharing the cache)."""
    stale, recent = tmp_path / "kernels-0000000000000000.so", tmp_path / "kernels-1111111111111111.so"
    for f in (stale, recent):
        f.write_bytes(b"not a library")
    month = time.time() - 31 * 86400
    os.utime(stale, (month, month))
    assert describe_in(tmp_path).endswith("built now)")
    assert not stale.exists() and recent.exists()
    built = next(f for f in tmp_path.glob("kernels-*.so") if f not in (stale, recent))
    os.utime(built, (month, month))
    assert describe_in(tmp_path).endswith("cached)")
    assert built.stat().st_mtime > time.time() - 3600
