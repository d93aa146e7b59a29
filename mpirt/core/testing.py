"""Test helpers: finite-difference gradient checks for Functions and modules, and the table of op
cases that the op tests (tests/test_ops.py) and the GPU check (bench/gpu_check_correct.py) share."""
from __future__ import annotations

import numpy as np

import mpirt.core.backend as B
from mpirt.core.tensor import Tensor


def gradcheck(f, *inputs, eps: float = 1e-6, rtol: float = 1e-5, atol: float = 1e-8, seed: int = 0) -> None:
    """Compare the autograd gradient of ``f`` with central differences, in float64.

    ``f`` takes one Tensor per array in ``inputs`` and returns a Tensor. The scalar checked is
    ``sum(f(*inputs) * R)`` for a fixed random ``R``, so every output element contributes.
    Inputs that are integer arrays are passed as constants. Raises AssertionError naming the
    input and the worst element on mismatch.
    """
    arrays = [B.xp.asarray(a) for a in inputs]
    for i, a in enumerate(arrays):
        if a.dtype.kind == "f" and a.dtype != np.float64:
            raise TypeError(f"gradcheck: input {i} is {a.dtype}; use float64")
    checked = [i for i, a in enumerate(arrays) if a.dtype.kind == "f"]

    def tensors():
        return [Tensor(a.copy(), requires_grad=i in checked) for i, a in enumerate(arrays)]

    ts = tensors()
    out = f(*ts)
    weights = B.xp.asarray(np.random.default_rng(seed).standard_normal(out.shape))
    out.backward(weights)

    def objective():
        return float((f(*tensors()).data * weights).sum())

    for i in checked:
        analytic = ts[i].grad if ts[i].grad is not None else B.xp.zeros_like(arrays[i])
        numeric = np.zeros(arrays[i].shape)
        flat = arrays[i].reshape(-1)
        for j in range(flat.size):
            saved = float(flat[j])
            flat[j] = saved + eps
            plus = objective()
            flat[j] = saved - eps
            minus = objective()
            flat[j] = saved
            numeric.reshape(-1)[j] = (plus - minus) / (2 * eps)
        analytic = B.to_host(analytic)
        err = np.abs(analytic - numeric)
        bad = err > atol + rtol * np.abs(numeric)
        if bad.any():
            worst = np.unravel_index(np.argmax(err), err.shape)
            raise AssertionError(
                f"gradcheck: input {i} shape {arrays[i].shape}: {int(bad.sum())} elements differ; worst at "
                f"{worst}: analytic {analytic[worst]:.8g} vs numeric {numeric[worst]:.8g}")


# --- the op cases --------------------------------------------------------------------------------
def _rng(seed=0):
    return np.random.default_rng(seed)


def normal(*shape, seed=0):
    """Standard normal float64 values (NumPy: the inputs of a case; a checker moves them)."""
    return _rng(seed).standard_normal(shape)


def positive(*shape, seed=0):
    """Values in [0.5, 2): safe for log, pow and division."""
    return _rng(seed).uniform(0.5, 2.0, shape)


def away_from_zero(*shape, seed=0):
    """Values with |x| >= 0.2 (kinks and ties stay out of the finite-difference stencil)."""
    return _rng(seed).uniform(0.2, 1.5, shape) * _rng(seed + 1).choice([-1.0, 1.0], shape)


def ix(*values):
    """An integer index array on the active backend (a constant of the case)."""
    return B.xp.asarray(np.array(values, dtype=np.int64))


def op_cases() -> dict:
    """Every exported op on small inputs: name -> (op name in ``ops.__all__``, a function of
    Tensors calling exactly that op, the input arrays). Integer arrays are constants; index
    constants are made on the active backend when the function runs."""
    from mpirt.core import ops
    return {**_elementwise_cases(ops), **_reduction_and_shape_cases(ops), **_layer_cases(ops)}


def _elementwise_cases(ops) -> dict:
    return {
        "add_broadcast": ("add", lambda a, b: a + b, [normal(2, 3, 4), normal(3, 1, seed=1)]),
        "add_scalar": ("add", lambda a: 2.5 + a, [normal(3, 4)]),
        "add_0d": ("add", lambda a, b: ops.add(a, b), [normal(2, 3), normal(seed=1)]),
        "sub_broadcast": ("sub", lambda a, b: a - b, [normal(4, 1), normal(2, 1, 3, seed=1)]),
        "sub_scalar_left": ("sub", lambda a: 1.5 - a, [normal(3, 2)]),
        "mul_broadcast": ("mul", lambda a, b: a * b, [normal(2, 3, 4), normal(4, seed=1)]),
        "mul_scalar": ("mul", lambda a: a * 3.0, [normal(5)]),
        "div_broadcast": ("div", lambda a, b: a / b, [normal(2, 3), away_from_zero(2, 1, seed=1)]),
        "div_scalar_left": ("div", lambda a: 2.0 / a, [away_from_zero(3, 2)]),
        "neg": ("neg", lambda a: -a, [normal(2, 3)]),
        "pow_int": ("pow", lambda a: a ** 3, [normal(2, 3)]),
        "pow_float": ("pow", lambda a: a ** 0.5, [positive(2, 3)]),
        "pow_tensor_broadcast": ("pow", lambda a, p: ops.pow(a, p), [positive(2, 3), normal(3, seed=1)]),
        "pow_scalar_base": ("pow", lambda p: ops.pow(2.0, p), [normal(2, 3)]),
        "exp": ("exp", lambda a: a.exp(), [normal(2, 3)]),
        "log": ("log", lambda a: a.log(), [positive(2, 3)]),
        "tanh": ("tanh", lambda a: a.tanh(), [normal(2, 3)]),
        "relu": ("relu", lambda a: a.relu(), [away_from_zero(3, 4)]),
        "swiglu": ("swiglu", lambda a, b: ops.swiglu(a, b), [2 * normal(2, 3, 4), normal(2, 3, 4, seed=1)]),
    }


def _reduction_and_shape_cases(ops) -> dict:
    return {
        "sum_all": ("sum", lambda a: a.sum(), [normal(2, 3, 4)]),
        "sum_axis": ("sum", lambda a: a.sum(axis=1), [normal(2, 3, 4)]),
        "sum_tuple_keepdims": ("sum", lambda a: a.sum(axis=(0, 2), keepdims=True), [normal(2, 3, 4)]),
        "mean_all": ("mean", lambda a: a.mean(), [normal(2, 3, 4)]),
        "mean_neg_axis_keepdims": ("mean", lambda a: a.mean(axis=-1, keepdims=True), [normal(2, 3, 4)]),
        "mean_tuple": ("mean", lambda a: a.mean(axis=(0, 1)), [normal(2, 3, 4)]),
        "max_all": ("max", lambda a: a.max(), [normal(2, 3, 4)]),
        "max_axis": ("max", lambda a: a.max(axis=1), [normal(2, 3, 4)]),
        "max_tuple_keepdims": ("max", lambda a: a.max(axis=(0, 2), keepdims=True), [normal(2, 3, 4)]),
        "reshape": ("reshape", lambda a: a.reshape(4, -1), [normal(2, 3, 4)]),
        "transpose_reverse": ("transpose", lambda a: a.T, [normal(2, 3, 4)]),
        "transpose_axes": ("transpose", lambda a: a.transpose(1, 2, 0), [normal(2, 3, 4)]),
        "getitem_slices": ("getitem", lambda a: a[1:, ::2], [normal(3, 5)]),
        "getitem_int_array_repeats": ("getitem", lambda a: a[ix(0, 2, 0, 0)], [normal(3, 4)]),
        "getitem_mixed": ("getitem", lambda a: a[:, ix(1, 1, 3), 1:], [normal(2, 4, 3)]),
        "getitem_tensor_index": ("getitem", lambda a: a[Tensor(ix([1, 1], [0, 2]))], [normal(3, 2)]),
        "concat_axis0": ("concat", lambda a, b: ops.concat([a, b], axis=0), [normal(2, 3), normal(1, 3, seed=1)]),
        "concat_last_with_const": ("concat", lambda a: ops.concat([a, B.xp.ones((2, 2), a.dtype), a], axis=-1),
                                   [normal(2, 3)]),
        "split_int": ("split", lambda a: ops.split(a, 3, axis=-1), [normal(2, 6)]),
        "split_sizes_axis0": ("split", lambda a: ops.split(a, [1, 3], axis=0), [normal(4, 2)]),
        "matmul_2d": ("matmul", lambda a, b: a @ b, [normal(3, 4), normal(4, 2, seed=1)]),
        "matmul_batched_2d_weight": ("matmul", lambda a, b: a @ b, [normal(2, 3, 4), normal(4, 5, seed=1)]),
        "matmul_batched": ("matmul", lambda a, b: ops.matmul(a, b), [normal(2, 3, 4), normal(2, 4, 2, seed=1)]),
        "matmul_batch_broadcast": ("matmul", lambda a, b: a @ b, [normal(3, 4), normal(2, 4, 2, seed=1)]),
    }


def _layer_cases(ops) -> dict:
    from mpirt.core.ops.rotary import rotary_tables

    def rot(qkv, t, d):
        return ops.rotary_embedding(qkv, *rotary_tables(t, d, 10.0, B.xp.dtype(qkv.dtype)))

    return {
        "linear_bias": ("linear", lambda x, w, b: ops.linear(x, w, b),
                        [normal(2, 3, 4), normal(4, 5, seed=1), normal(5, seed=2)]),
        "linear_no_bias": ("linear", lambda x, w: ops.linear(x, w), [normal(3, 4), normal(4, 2, seed=1)]),
        "linear_transposed": ("linear_transposed", lambda x, w: ops.linear_transposed(x, w),
                              [normal(2, 3, 4), normal(5, 4, seed=1)]),
        "gelu": ("gelu", lambda x: ops.gelu(x), [2 * normal(3, 4)]),
        "softmax": ("softmax", lambda x: ops.softmax(x), [normal(2, 3, 5)]),
        "softmax_axis0": ("softmax", lambda x: ops.softmax(x, axis=0), [normal(4, 3)]),
        "log_softmax": ("log_softmax", lambda x: ops.log_softmax(x), [normal(2, 3, 5)]),
        "log_softmax_axis1": ("log_softmax", lambda x: ops.log_softmax(x, axis=1), [normal(2, 4, 3)]),
        "layer_norm": ("layer_norm", lambda x, w, b: ops.layer_norm(x, w, b),
                       [normal(2, 3, 6), 1 + 0.5 * normal(6, seed=1), normal(6, seed=2)]),
        "layer_norm_no_affine": ("layer_norm", lambda x: ops.layer_norm(x, None, None, eps=1e-3), [normal(4, 5)]),
        "rms_norm": ("rms_norm", lambda x, w: ops.rms_norm(x, w, eps=1e-5), [normal(2, 3, 6), 1 + 0.5 * normal(6, seed=1)]),
        "embedding_repeats": ("embedding", lambda w: ops.embedding(ix([1, 3, 1], [0, 1, 3]), w), [normal(5, 4)]),
        "embedding_tensor_ids": ("embedding", lambda w: ops.embedding(Tensor(ix(2, 2, 2, 0)), w), [normal(3, 2)]),
        "cross_entropy": ("cross_entropy", lambda x, t: ops.cross_entropy(x, t), [normal(6, 5), np.array([0, 4, 2, 2, 1, 3])]),
        "cross_entropy_ignore_3d": ("cross_entropy", lambda x, t: ops.cross_entropy(x, t, ignore_index=-100),
                                    [normal(2, 3, 4), np.array([[1, -100, 3], [0, 0, -100]])]),
        "cross_entropy_custom_ignore_sum": ("cross_entropy",
                                            lambda x, t: ops.cross_entropy(x, t, ignore_index=2, reduction="sum"),
                                            [normal(4, 3), np.array([2, 0, 2, 1])]),
        "cross_entropy_all_ignored": ("cross_entropy", lambda x, t: ops.cross_entropy(x, t), [normal(3, 4), np.full(3, -100)]),
        "dropout": ("dropout", lambda x: ops.dropout(x, 0.4, seed=7), [normal(4, 5)]),
        "attention": ("causal_self_attention", lambda qkv: ops.causal_self_attention(qkv, n_head=2), [normal(2, 5, 24)]),
        "attention_T1": ("causal_self_attention", lambda qkv: ops.causal_self_attention(qkv, n_head=2), [normal(2, 1, 24)]),
        "attention_dropout": ("causal_self_attention", lambda qkv: ops.causal_self_attention(qkv, 2, dropout_p=0.3, seed=3),
                              [normal(1, 4, 12)]),
        "rotary": ("rotary_embedding", lambda qkv: rot(qkv, 5, 4), [normal(2, 5, 24)]),
    }
