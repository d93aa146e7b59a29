"""Mixture-of-experts ops: the experts' SwiGLU MLPs over tokens grouped by expert, as one Function.

``grouped_swiglu(x, w_gate, w_up, w_down, counts)``: ``x`` (M, C) holds the tokens routed to
expert 0 first (``counts[0]`` rows), then expert 1's, and so on; expert ``e``'s rows become
``silu(x_e @ w_gate[e]) * (x_e @ w_up[e]) @ w_down[e]`` with ``w_gate``, ``w_up`` (E, C, F) and
``w_down`` (E, F, C) (mpirt's (in, out) layout per expert). One GEMM per expert and matrix, no
token copies beyond the grouped input; an expert without tokens does no work and gets a zero
weight gradient. The forward saves the grouped input and each expert's two hidden arrays. The
backward runs expert by expert (one expert's intermediate gradients alive at a time) and adds
each expert's weight products into the weights' gradients in place (no full-size transient); a
zero-bubble schedule's deferred weight pass keeps every expert's intermediates from B to W.
"""
from __future__ import annotations

import numpy as np

import mpirt.core.backend as B
from mpirt.core.ops.basic import _sigmoid, _silu
from mpirt.core.precision import float32_compute, upcast
from mpirt.core.tensor import GRAD_ADDED, Function


def _segments(counts):
    """``(expert, start, stop)`` of the experts with rows."""
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [(e, int(bounds[e]), int(bounds[e + 1])) for e in range(len(counts)) if counts[e]]


@float32_compute
class GroupedSwiGLU(Function):
    # the weights' gradients are a separate pass (a zero-bubble schedule defers it) that adds each
    # expert's product straight into the weight's .grad where it can: no (E, C, F) transient
    weight_inputs = (1, 2, 3)
    adds_weight_grads = True
    owns_weight_grads = True

    def forward(self, x, w_gate, w_up, w_down, counts=(), weight_grad_scale=1.0):
        xp = B.xp
        if x.ndim != 2 or sum(counts) != x.shape[0] or len(counts) != w_gate.shape[0]:
            raise ValueError(f"grouped_swiglu: x {x.shape} must hold the rows of {len(counts)} experts "
                             f"({w_gate.shape[0]} in the weights), {sum(counts)} in all")
        y = xp.empty((x.shape[0], w_down.shape[-1]), dtype=x.dtype)
        self.hidden = {}
        for e, lo, hi in _segments(counts):
            g, u = x[lo:hi] @ w_gate[e], x[lo:hi] @ w_up[e]        # (M_e, F)
            h = _silu(g)
            h *= u
            y[lo:hi] = h @ w_down[e]
            self.hidden[e] = (g, u)
        self.x, self.w_gate, self.w_up, self.w_down, self.counts = x, w_gate, w_up, w_down, tuple(counts)
        self.scale, self.pre = weight_grad_scale, {}
        return y

    def backward(self, g):
        """Both passes, expert by expert: only one expert's intermediate gradients at a time."""
        dx = B.xp.zeros(self.x.shape, dtype=self.x.dtype)
        dws = self._weight_grads()
        for e, lo, hi in _segments(self.counts):
            dx[lo:hi] = self._input_pass(e, lo, hi, g)
            self._weight_pass(e, lo, hi, g, dws)
        return (dx, *self._handed_back(dws))

    def backward_input(self, g):
        """dx, keeping each expert's intermediate gradients for :meth:`backward_weight` (deferred)."""
        dx = B.xp.zeros(self.x.shape, dtype=self.x.dtype)
        half = getattr(self, "_half", None)  # float32_compute's: kept half until W, as the activations
        for e, lo, hi in _segments(self.counts):
            dx[lo:hi] = self._input_pass(e, lo, hi, g)
            if half is not None:
                self.pre[e] = tuple(a.astype(half) for a in self.pre[e])
        return dx, None, None, None

    def backward_weight(self, g):
        dws = self._weight_grads()
        for e, lo, hi in _segments(self.counts):
            self._weight_pass(e, lo, hi, g, dws)
        return (None, *self._handed_back(dws))

    def _input_pass(self, e: int, lo: int, hi: int, grad):
        """Expert ``e``'s rows' dx; its gradients of the gate and up products (and the down
        projection's input) kept in ``self.pre[e]`` for its weight pass."""
        g, u = self.hidden.pop(e)
        sig = _sigmoid(g)
        silu = g * sig
        da = grad[lo:hi] @ self.w_down[e].T                         # (M_e, F)
        du = da * silu
        dg = da * u * sig * (1.0 + g * (1.0 - sig))                 # d silu / dg
        self.pre[e] = (dg, du, silu * u)
        return dg @ self.w_gate[e].T + du @ self.w_up[e].T

    def _weight_grads(self) -> list:
        """The three weight gradients' arrays to add into: the ``grad`` the engine handed
        (``grad_into``, when of the weight's dtype), else a new zeroed one (an expert without rows
        keeps zero)."""
        dws = []
        for i, w in enumerate((self.w_gate, self.w_up, self.w_down), start=1):
            into = self.grad_into.get(i)
            dws.append(into if into is not None and into.dtype == w.dtype else B.xp.zeros(w.shape, dtype=w.dtype))
        return dws

    def _handed_back(self, dws) -> tuple:
        """What the backward returns for the weights: GRAD_ADDED where it added into the weight's grad."""
        return tuple(GRAD_ADDED if dw is self.grad_into.get(i) else dw for i, dw in enumerate(dws, start=1))

    def _weight_pass(self, e: int, lo: int, hi: int, grad, dws) -> None:
        """Add expert ``e``'s weight gradients (``dW = input^T dy``, times ``weight_grad_scale``)."""
        dg, du, a = (upcast(v) for v in self.pre.pop(e))
        x = self.x[lo:hi]
        for dw, part in zip(dws, (x.T @ dg, x.T @ du, a.T @ grad[lo:hi])):
            if self.scale != 1.0:
                part *= self.scale
            dw[e] += part


def grouped_swiglu(x, w_gate, w_up, w_down, counts, weight_grad_scale: float = 1.0):
    """The experts' SwiGLU MLPs over ``x`` grouped by expert (see the module docstring); the
    weights' gradients times ``weight_grad_scale``."""
    return GroupedSwiGLU.apply(x, w_gate, w_up, w_down, counts=tuple(int(c) for c in counts),
                               weight_grad_scale=weight_grad_scale)
