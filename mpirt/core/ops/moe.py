"""Mixture-of-experts ops: the experts' SwiGLU MLPs over tokens grouped by expert, as one Function.

``grouped_swiglu(x, counts, w_gate, w_up, w_down)``: ``x`` (M, C) holds the tokens routed to
expert 0 first (``counts[0]`` rows), then expert 1's, and so on; expert ``e``'s rows become
``silu(x_e @ w_gate[e]) * (x_e @ w_up[e]) @ w_down[e]`` with ``w_gate``, ``w_up`` (E, C, F) and
``w_down`` (E, F, C) (mpirt's (in, out) layout per expert). One GEMM per expert and matrix, no
token copies beyond the grouped input; an expert without tokens does no work and gets a zero
weight gradient. The backward saves the grouped input and each expert's two hidden arrays.
"""
from __future__ import annotations

import numpy as np

import mpirt.core.backend as B
from mpirt.core.ops.basic import _sigmoid
from mpirt.core.precision import float32_compute
from mpirt.core.tensor import Function


def _segments(counts):
    """``(expert, start, stop)`` of the experts with rows."""
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [(e, int(bounds[e]), int(bounds[e + 1])) for e in range(len(counts)) if counts[e]]


@float32_compute
class GroupedSwiGLU(Function):
    def forward(self, x, w_gate, w_up, w_down, counts=()):
        xp = B.xp
        if x.ndim != 2 or sum(counts) != x.shape[0] or len(counts) != w_gate.shape[0]:
            raise ValueError(f"grouped_swiglu: x {x.shape} must hold the rows of {len(counts)} experts "
                             f"({w_gate.shape[0]} in the weights), {sum(counts)} in all")
        y = xp.empty((x.shape[0], w_down.shape[-1]), dtype=x.dtype)
        self.hidden = {}
        for e, lo, hi in _segments(counts):
            g, u = x[lo:hi] @ w_gate[e], x[lo:hi] @ w_up[e]        # (M_e, F)
            y[lo:hi] = (g * _sigmoid(g) * u) @ w_down[e]
            self.hidden[e] = (g, u)
        self.x, self.w_gate, self.w_up, self.w_down, self.counts = x, w_gate, w_up, w_down, tuple(counts)
        return y

    def backward(self, grad):
        xp = B.xp
        dx = xp.zeros(self.x.shape, dtype=self.x.dtype)
        dws = [xp.zeros(w.shape, dtype=w.dtype) for w in (self.w_gate, self.w_up, self.w_down)]
        for e, lo, hi in _segments(self.counts):
            g, u = self.hidden[e]
            sig = _sigmoid(g)
            silu = g * sig
            ge = grad[lo:hi]                                        # (M_e, C)
            dws[2][e] = (silu * u).T @ ge                          # dW_down = a^T dy
            da = ge @ self.w_down[e].T                              # (M_e, F)
            du = da * silu
            dg = da * u * sig * (1.0 + g * (1.0 - sig))             # d silu / dg
            dws[0][e] = self.x[lo:hi].T @ dg
            dws[1][e] = self.x[lo:hi].T @ du
            dx[lo:hi] = dg @ self.w_gate[e].T + du @ self.w_up[e].T
        self.hidden = {}
        return (dx, *dws)


def grouped_swiglu(x, w_gate, w_up, w_down, counts):
    """The experts' SwiGLU MLPs over ``x`` grouped by expert (see the module docstring)."""
    return GroupedSwiGLU.apply(x, w_gate, w_up, w_down, counts=tuple(int(c) for c in counts))
