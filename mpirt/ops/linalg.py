"""Matrix products: batched matmul and the fused linear layer."""
from __future__ import annotations

from mpirt.ops.basic import unbroadcast
from mpirt.tensor import Function


def _transposed(a) -> bool:
    """True for a 2-D array laid out column-major (the transpose of a C-ordered one)."""
    return a.ndim == 2 and a.flags.f_contiguous and not a.flags.c_contiguous


class MatMul(Function):
    """``a @ b`` with NumPy's batching rules; both operands at least 2-D."""

    def forward(self, a, b):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul: operands must be at least 2-D, got shapes {a.shape} and {b.shape}")
        self.a, self.b = a, b
        return a @ b

    def backward(self, g):
        a, b = self.a, self.b
        ga = gb = None
        if self.needs_input_grad[0]:
            ga = unbroadcast(g @ b.swapaxes(-1, -2), a.shape)
        if self.needs_input_grad[1]:
            if b.ndim == 2:  # one GEMM over all leading dimensions instead of a batched sum
                a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
                # Give gb the memory order of b: when b is a transposed view (a tied output head,
                # x @ wte^T), gb = (g^T a)^T is the transpose of a C-ordered array, so the
                # gradient reaching wte through the transpose is contiguous (adding a transposed
                # (V, C) array into wte.grad is about 4x slower than adding a contiguous one).
                gb = (g2.T @ a2).T if _transposed(b) else a2.T @ g2
            else:
                gb = unbroadcast(a.swapaxes(-1, -2) @ g, b.shape)
        return ga, gb


class Linear(Function):
    """``y = x @ weight + bias`` with ``weight`` of shape (in, out), as GPT-2's Conv1D.

    Leading dimensions of ``x`` are flattened so each product is one GEMM. The input gradient
    and the weight gradient are separate passes (a zero-bubble schedule defers the latter).
    """

    weight_inputs = (1, 2)

    def forward(self, x, weight, bias=None):
        self.x, self.weight = x, weight
        y = x.reshape(-1, x.shape[-1]) @ weight  # (N, out)
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], weight.shape[1])

    def backward_input(self, g):
        gx = None
        if self.needs_input_grad[0]:
            gx = (g.reshape(-1, g.shape[-1]) @ self.weight.T).reshape(self.x.shape)
        return gx, None, None

    def backward_weight(self, g):
        g2 = g.reshape(-1, g.shape[-1])  # (N, out)
        gw = self.x.reshape(-1, self.x.shape[-1]).T @ g2 if self.needs_input_grad[1] else None
        gb = g2.sum(axis=0) if len(self.needs_input_grad) > 2 and self.needs_input_grad[2] else None
        return None, gw, gb


def matmul(a, b):
    """Batched matrix product ``a @ b``."""
    return MatMul.apply(a, b)


def linear(x, weight, bias=None):
    """Fused affine map ``x @ weight + bias``; ``weight`` is (in_features, out_features)."""
    return Linear.apply(x, weight, bias) if bias is not None else Linear.apply(x, weight)
