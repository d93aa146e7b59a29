"""Test helpers: finite-difference gradient checks for Functions and modules."""
from __future__ import annotations

import numpy as np

import mpirt.backend as B
from mpirt.tensor import Tensor


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
