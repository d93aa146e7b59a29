"""Matrix products: batched matmul and the fused linear layer.

Products go through :func:`mpirt.cpu.threads.matmul`, which splits them over mpirt's thread pool.
"""
from __future__ import annotations

import mpirt.core.backend as B
from mpirt.core.ops.basic import unbroadcast
from mpirt.core.tensor import GRAD_ADDED, Function
from mpirt.cpu.threads import (MAX_TASK_MACS, can_accumulate, gemms_side_by_side, matmul as _mm, run_gemms, run_tasks,
                               sum_rows)


def _macs(g, x) -> int:
    """Multiply-adds of the weight-gradient product ``x^T g`` (the size of a backward's GEMMs)."""
    return g.size * x.shape[-1]


def _weight_product(fn: Function, i: int, a, b):
    """The weight gradient ``a @ b`` of input ``i`` of ``fn``: added straight into the leaf's
    ``grad`` (:data:`~mpirt.core.tensor.GRAD_ADDED` returned) when the engine handed that buffer over
    and the GEMM can add into it; else a fresh array."""
    into = fn.grad_into.get(i)
    if into is not None and can_accumulate(into, a, b):
        _mm(a, b, out=into, accumulate=True)
        return GRAD_ADDED
    return _mm(a, b)


def _side_by_side(fn: Function, g, input_product, weight_product):
    """A linear layer's backward products, input gradient ``a @ b`` and weight gradient
    ``wa @ wb`` (added into the leaf's ``grad`` when it can, as :func:`_weight_product`), as one
    run of mpirt's native pool, each whole on its own thread (small products; large ones are split
    instead, see :func:`~mpirt.cpu.threads.run_tasks`). ``(gx, gw)``, or None where the pool cannot
    take them."""
    (a, b), (wa, wb) = input_product, weight_product
    if _macs(g, fn.x) >= MAX_TASK_MACS or not gemms_side_by_side():  # (before allocating their outputs)
        return None
    gx = B.xp.empty((a.shape[0], b.shape[1]), dtype=B.xp.result_type(a, b))
    into = fn.grad_into.get(1)
    if into is not None and can_accumulate(into, wa, wb):
        gw, weight = GRAD_ADDED, (wa, wb, into, True)
    else:
        gw = B.xp.empty((wa.shape[0], wb.shape[1]), dtype=B.xp.result_type(wa, wb))
        weight = (wa, wb, gw, False)
    return (gx, gw) if run_gemms((a, b, gx, False), weight) else None


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


class LinearOp(Function):
    """``y = x @ weight + bias`` with ``weight`` of shape (in, out), as GPT-2's Conv1D.

    Leading dimensions of ``x`` are flattened so each product is one GEMM. The input gradient
    and the weight gradient are separate passes (a zero-bubble schedule defers the latter); the
    weight gradient's GEMM adds straight into ``weight.grad`` when it can (``adds_weight_grads``).
    """

    weight_inputs = (1, 2)
    adds_weight_grads = True
    owns_weight_grads = True  # fresh GEMM outputs and row sums

    def backward(self, g):
        """Both passes at once; small products side by side on two threads (:func:`~mpirt.cpu.threads.run_tasks`)."""
        if self.needs_input_grad[0] and self.needs_input_grad[1]:
            g2, x2 = g.reshape(-1, g.shape[-1]), self.x.reshape(-1, self.x.shape[-1])
            pair = _side_by_side(self, g, (g2, self.weight.T), (x2.T, g2))
            if pair is not None:
                gb = sum_rows(g2) if len(self.needs_input_grad) > 2 and self.needs_input_grad[2] else None
                return pair[0].reshape(self.x.shape), pair[1], gb
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
        gw = _weight_product(self, 1, self.x.reshape(-1, self.x.shape[-1]).T, g2) if self.needs_input_grad[1] else None
        gb = sum_rows(g2) if len(self.needs_input_grad) > 2 and self.needs_input_grad[2] else None
        return None, gw, gb


class TransposedLinear(Function):
    """``y = x @ weight^T`` with ``weight`` of shape (out, in): a tied output head, ``weight`` the
    (V, C) token table. One GEMM over all leading dimensions of ``x``; the weight gradient
    ``g^T x`` (out, in) is a separate pass that adds straight into ``weight.grad`` when it can,
    so a (V, C) table's gradient is neither allocated nor added a second time."""

    weight_inputs = (1,)
    adds_weight_grads = True
    owns_weight_grads = True

    def forward(self, x, weight):
        if weight.ndim != 2:
            raise ValueError(f"linear_transposed: weight must be 2-D (out, in), got shape {weight.shape}")
        self.x, self.weight = x, weight
        return _mm(x.reshape(-1, x.shape[-1]), weight.T).reshape(*x.shape[:-1], weight.shape[0])

    def backward(self, g):
        if self.needs_input_grad[0] and self.needs_input_grad[1]:
            g2, x2 = g.reshape(-1, g.shape[-1]), self.x.reshape(-1, self.x.shape[-1])
            pair = _side_by_side(self, g, (g2, self.weight), (g2.T, x2))
            if pair is not None:
                return pair[0].reshape(self.x.shape), pair[1]
        (gx, _), (_, gw) = run_tasks(lambda: self.backward_input(g), lambda: self.backward_weight(g),
                                     macs=_macs(g, self.x))
        return gx, gw

    def backward_input(self, g):
        gx = None
        if self.needs_input_grad[0]:
            gx = _mm(g.reshape(-1, g.shape[-1]), self.weight).reshape(self.x.shape)
        return gx, None

    def backward_weight(self, g):
        if not self.needs_input_grad[1]:
            return None, None
        g2, x2 = g.reshape(-1, g.shape[-1]), self.x.reshape(-1, self.x.shape[-1])
        return None, _weight_product(self, 1, g2.T, x2)


def matmul(a, b):
    """Batched matrix product ``a @ b``."""
    return MatMul.apply(a, b)


def linear(x, weight, bias=None):
    """Fused affine map ``x @ weight + bias``; ``weight`` is (in_features, out_features)."""
    return LinearOp.apply(x, weight, bias) if bias is not None else LinearOp.apply(x, weight)


def linear_transposed(x, weight):
    """``x @ weight^T`` for ``weight`` (out_features, in_features), no bias (a tied output head)."""
    return TransposedLinear.apply(x, weight)
