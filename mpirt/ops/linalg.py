"""Matrix products: batched matmul and the fused linear layer.

Products go through :func:`mpirt.threads.matmul`, which splits them over mpirt's thread pool.
"""
from __future__ import annotations

from mpirt.ops.basic import unbroadcast
from mpirt.tensor import Function
from mpirt.threads import matmul as _mm, run_tasks, sum_rows


def _macs(g, x) -> int:
    """Multiply-adds of the weight-gradient product ``x^T g`` (the size of a backward's GEMMs)."""
    return g.size * x.shape[-1]


def _transposed(a) -> bool:
    """True for a 2-D array laid out column-major (the transpose of a C-ordered one)."""
    return a.ndim == 2 and a.flags.f_contiguous and not a.flags.c_contiguous


class MatMul(Function):
    """``a @ b`` with NumPy's batching rules; both operands at least 2-D."""

    def forward(self, a, b):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul: operands must be at least 2-D, got shapes {a.shape} and {b.shape}")
        self.a, self.b = a, b
        return _mm(a, b)

    def backward(self, g):
        need_a, need_b = self.needs_input_grad[:2]
        ga, gb = run_tasks(lambda: self._grad_a(g) if need_a else None,
                           lambda: self._grad_b(g) if need_b else None, macs=_macs(g, self.a))
        return ga, gb

    def _grad_a(self, g):
        return unbroadcast(_mm(g, self.b.swapaxes(-1, -2)), self.a.shape)

    def _grad_b(self, g):
        a, b = self.a, self.b
        if b.ndim != 2:
            return unbroadcast(_mm(a.swapaxes(-1, -2), g), b.shape)
        a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])  # one GEMM, no batched sum
        # Give gb the memory order of b: when b is a transposed view (a tied output head,
        # x @ wte^T), gb = (g^T a)^T is the transpose of a C-ordered array, so the gradient
        # reaching wte through the transpose is contiguous (adding a transposed (V, C) array into
        # wte.grad is about 4x slower than adding a contiguous one).
        return _mm(g2.T, a2).T if _transposed(b) else _mm(a2.T, g2)


class Linear(Function):
    """``y = x @ weight + bias`` with ``weight`` of shape (in, out), as GPT-2's Conv1D.

    Leading dimensions of ``x`` are flattened so each product is one GEMM. The input gradient
    and the weight gradient are separate passes (a zero-bubble schedule defers the latter).
    """

    weight_inputs = (1, 2)

    def backward(self, g):
        """Both passes at once; small products side by side on two threads (:func:`~mpirt.threads.run_tasks`)."""
        (gx, _, _), (_, gw, gb) = run_tasks(lambda: self.backward_input(g), lambda: self.backward_weight(g),
                                            macs=_macs(g, self.x))
        return gx, gw, gb

    def forward(self, x, weight, bias=None):
        self.x, self.weight = x, weight
        y = _mm(x.reshape(-1, x.shape[-1]), weight, bias)  # (N, out)
        return y.reshape(*x.shape[:-1], weight.shape[1])

    def backward_input(self, g):
        gx = None
        if self.needs_input_grad[0]:
            gx = _mm(g.reshape(-1, g.shape[-1]), self.weight.T).reshape(self.x.shape)
        return gx, None, None

    def backward_weight(self, g):
        g2 = g.reshape(-1, g.shape[-1])  # (N, out)
        gw = _mm(self.x.reshape(-1, self.x.shape[-1]).T, g2) if self.needs_input_grad[1] else None
        gb = sum_rows(g2) if len(self.needs_input_grad) > 2 and self.needs_input_grad[2] else None
        return None, gw, gb


def matmul(a, b):
    """Batched matrix product ``a @ b``."""
    return MatMul.apply(a, b)


def linear(x, weight, bias=None):
    """Fused affine map ``x @ weight + bias``; ``weight`` is (in_features, out_features)."""
    return Linear.apply(x, weight, bias) if bias is not None else Linear.apply(x, weight)
