"""Weight gradients added by the GEMM straight into ``.grad`` (beta = 1, ``adds_weight_grads``):
the same numbers as a fresh product plus an add, the buffers never rebound, hooks once per
backward with the final value, deferred weight passes, half dtypes, both thread counts."""
import numpy as np
import pytest

from mpirt.cpu import blas, threads
from mpirt.core import ops
from mpirt.core.tensor import Tensor


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def nthreads(request):
    before = threads.num_threads()
    threads.set_num_threads(request.param)
    yield request.param
    threads.set_num_threads(before)


def _leaf(a):
    return Tensor(a, requires_grad=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (8, 128, 128, 384)], ids=["small", "split"])
@pytest.mark.parametrize("kind", ["linear", "transposed"])
def test_weight_grad_added_in_place(nthreads, dtype, shape, kind):
    b, t, cin, cout = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, t, cin)).astype(dtype)
    g = rng.standard_normal((b, t, cout)).astype(dtype)
    w_shape = (cin, cout) if kind == "linear" else (cout, cin)
    w = _leaf(rng.standard_normal(w_shape).astype(dtype))
    start = rng.standard_normal(w_shape).astype(dtype)
    w.grad = start.copy()
    buffer = w.grad
    fired = []
    w.register_hook(lambda p: fired.append(p.grad.copy()))
    op = (lambda x: ops.linear(x, w)) if kind == "linear" else (lambda x: ops.linear_transposed(x, w))
    op(_leaf(x)).backward(g)
    x2, g2 = x.reshape(-1, cin), g.reshape(-1, cout)
    expected = start + (x2.T @ g2 if kind == "linear" else g2.T @ x2)
    assert w.grad is buffer                                 # accumulated in place, never rebound
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(w.grad, expected, rtol=tol, atol=tol * np.abs(expected).max())
    assert len(fired) == 1
    np.testing.assert_array_equal(fired[0], w.grad)


@pytest.mark.parametrize("kind", ["linear", "transposed"])
def test_deferred_weight_grad_added_in_place(kind):
    rng = np.random.default_rng(1)
    x, g = rng.standard_normal((3, 4)), rng.standard_normal((3, 5))
    w = _leaf(rng.standard_normal((4, 5) if kind == "linear" else (5, 4)))
    w.grad = np.ones(w.shape)
    buffer = w.grad
    fired = []
    w.register_hook(lambda p: fired.append(True))
    xt = _leaf(x)
    y = ops.linear(xt, w) if kind == "linear" else ops.linear_transposed(xt, w)
    wpass = y.backward(g, defer_weight_grad=True)
    np.testing.assert_array_equal(w.grad, np.ones(w.shape))  # nothing added before the W pass
    assert not fired and xt.grad is not None
    wpass.run()
    expected = 1 + (x.T @ g if kind == "linear" else g.T @ x)
    assert w.grad is buffer and fired == [True]
    np.testing.assert_allclose(w.grad, expected, rtol=1e-12)


def test_two_uses_of_one_weight_add_up():
    """A weight used by two Functions (a tied table: lookup and head) gets both gradients."""
    rng = np.random.default_rng(2)
    w = _leaf(rng.standard_normal((6, 4)))
    h = _leaf(rng.standard_normal((3, 4)))
    g = rng.standard_normal((3, 6))
    w.grad = np.zeros(w.shape)
    ids = np.array([1, 1, 5])
    y = ops.linear_transposed(ops.embedding(ids, w) + h, w)
    y.backward(g)
    e = w.data[ids] + h.data
    expected = g.T @ e
    np.add.at(expected, ids, g @ w.data)
    np.testing.assert_allclose(w.grad, expected, rtol=1e-12)


def test_half_weight_grad_falls_back():
    """bfloat16 gradients are not added by the GEMM (it runs in float32): same numbers as before."""
    bf16 = np.dtype("bfloat16")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 8)).astype(bf16)
    g = rng.standard_normal((4, 3)).astype(bf16)
    w = _leaf(rng.standard_normal((8, 3)).astype(bf16))
    w.grad = np.zeros(w.shape, dtype=bf16)
    buffer = w.grad
    ops.linear(_leaf(x), w).backward(g)
    expected = (x.astype(np.float32).T @ g.astype(np.float32)).astype(bf16)
    assert w.grad is buffer and w.grad.dtype == bf16
    np.testing.assert_array_equal(w.grad, expected)


@pytest.mark.parametrize("name", list(blas.available()[0]))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_accumulate(name, dtype):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((37, 20)).astype(dtype), rng.standard_normal((20, 11)).astype(dtype)
    previous = blas.current().library.name
    blas.choose(name)
    try:
        for out in (rng.standard_normal((37, 11)).astype(dtype),
                    np.asfortranarray(rng.standard_normal((37, 11)).astype(dtype))):
            for left, right in ((a, b), (np.asfortranarray(a), b), (a, np.asfortranarray(b))):
                start = out.copy()
                blas.gemm(left, right, out, accumulate=True)
                np.testing.assert_allclose(out, start + a @ b, rtol=1e-5, atol=1e-5)
    finally:
        blas.choose(previous)
