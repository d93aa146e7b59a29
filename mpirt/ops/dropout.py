"""Dropout with reproducible masks (a pure function of a seed and the shape)."""
from __future__ import annotations

import mpirt.backend as B
from mpirt.precision import float32_compute
from mpirt.tensor import Function


def dropout_mask(shape, p: float, seed):
    """Boolean keep-mask with ``P(keep) = 1 - p``: a pure function of ``(seed, shape)`` on one backend.

    Drawn from ``xp.random.default_rng(seed)`` (NumPy's PCG64; CuPy's own generator on the GPU,
    so the two backends give different but each reproducible masks).
    """
    if seed is None:
        raise ValueError("dropout: a seed is required (masks must be reproducible)")
    u = B.xp.random.default_rng(seed).random(shape, dtype="float32")
    return u >= p


@float32_compute
class Dropout(Function):
    def forward(self, x, p=0.5, seed=None):
        self.mask, self.scale = dropout_mask(x.shape, p, seed), 1.0 / (1.0 - p)
        y = x * self.mask
        y *= self.scale
        return y

    def backward(self, g):
        gx = g * self.mask
        gx *= self.scale
        return (gx,)


def _check_p(p, op="dropout", arg="p"):
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{op}: {arg} must satisfy 0 <= {arg} < 1, got {arg}={p}")


def dropout(x, p, seed, training=True):
    """Inverted dropout: zero each element with probability ``p`` and scale the rest by ``1/(1-p)``.

    The mask is a pure function of ``seed`` and ``x.shape`` (``xp.random.default_rng(seed)``), so
    a run is reproducible and a recomputed forward gives the same mask. With ``p == 0`` or
    ``training=False`` it returns ``x`` itself and records nothing. Requires ``0 <= p < 1``.
    """
    _check_p(p)
    if p == 0 or not training:
        return x
    return Dropout.apply(x, p=p, seed=seed)
