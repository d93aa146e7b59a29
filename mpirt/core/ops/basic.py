"""Elementwise ops (with NumPy broadcasting) and reductions."""
from __future__ import annotations


import mpirt.core.backend as B
from mpirt.core.precision import compute_dtype, float32_compute
from mpirt.core.tensor import Function, given_up


def unbroadcast(grad, shape):
    """Sum ``grad`` over the axes that broadcasting added or stretched to reach it from ``shape``."""
    if grad.shape == tuple(shape):
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(i + lead for i, n in enumerate(shape) if n == 1 and grad.shape[i + lead] != 1)
    return grad.sum(axis=axes, keepdims=True, dtype=compute_dtype(grad.dtype)).astype(grad.dtype, copy=False).reshape(shape)


def _shape(x):
    return getattr(x, "shape", ())


class Add(Function):
    def forward(self, a, b, into_first=False):
        self.shapes = _shape(a), _shape(b)
        if into_first and _can_take(a, b):
            a += b
            return a
        return a + b

    def backward(self, g):
        return tuple(unbroadcast(g, s) if need else None for s, need in zip(self.shapes, self.needs_input_grad))


class Sub(Function):
    def forward(self, a, b):
        self.shapes = _shape(a), _shape(b)
        return a - b

    def backward(self, g):
        ga = unbroadcast(g, self.shapes[0]) if self.needs_input_grad[0] else None
        gb = -unbroadcast(g, self.shapes[1]) if self.needs_input_grad[1] else None
        return ga, gb


class Mul(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return a * b

    def backward(self, g):
        ga = unbroadcast(g * self.b, _shape(self.a)) if self.needs_input_grad[0] else None
        gb = unbroadcast(g * self.a, _shape(self.b)) if self.needs_input_grad[1] else None
        return ga, gb


class Div(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return a / b

    def backward(self, g):
        ga = unbroadcast(g / self.b, _shape(self.a)) if self.needs_input_grad[0] else None
        gb = unbroadcast(-g * self.a / (self.b * self.b), _shape(self.b)) if self.needs_input_grad[1] else None
        return ga, gb


class Neg(Function):
    def forward(self, a):
        return -a

    def backward(self, g):
        return (-g,)


class Pow(Function):
    def forward(self, a, p):
        self.a, self.p = a, p
        self.out = a ** p
        return self.out

    def backward(self, g):
        a, p = self.a, self.p
        ga = unbroadcast(g * p * a ** (p - 1), _shape(a)) if self.needs_input_grad[0] else None
        gp = None
        if self.needs_input_grad[1]:
            gp = g * self.out
            gp *= B.xp.log(a)  # in place: a float64 log of a Python-scalar base must not promote
            gp = unbroadcast(gp, _shape(p))
        return ga, gp


class Exp(Function):
    def forward(self, a):
        self.out = B.xp.exp(a)
        return self.out

    def backward(self, g):
        return (g * self.out,)


class Log(Function):
    def forward(self, a):
        self.a = a
        return B.xp.log(a)

    def backward(self, g):
        return (g / self.a,)


class Tanh(Function):
    def forward(self, a):
        self.out = B.xp.tanh(a)
        return self.out

    def backward(self, g):
        return (g * (1 - self.out * self.out),)


class Relu(Function):
    def forward(self, a):
        self.mask = a > 0
        return a * self.mask

    def backward(self, g):
        return (g * self.mask,)


@float32_compute
class SwiGLU(Function):
    """``silu(a) * b`` (SwiGLU's gate times its linear unit), one pass each way; saves a and b."""

    def forward(self, a, b):
        self.a, self.b = a, b
        out = _silu(a)
        out *= b
        return out

    def backward(self, g):
        a, b = self.a, self.b
        sig = _sigmoid(a)
        ga = gb = None
        if self.needs_input_grad[0]:        # d silu / da = sig * (1 + a (1 - sig))
            ga = a * (1.0 - sig)
            ga += 1.0
            ga *= sig
            ga *= b
            ga *= g
        if self.needs_input_grad[1]:
            gb = a * sig
            gb *= g
        return ga, gb


def _can_take(a, b) -> bool:
    """Whether ``a op= b`` leaves ``a`` the result's shape and dtype: ``a`` a writeable array."""
    return (isinstance(a, B.xp.ndarray) and B.writeable(a) and _shape(b) in ((), a.shape)
            and B.xp.result_type(a, b) == a.dtype)


def _sigmoid(a):
    """``1 / (1 + exp(-a))`` as ``(1 + tanh(a / 2)) / 2``: no overflow for large ``|a|``. In place
    in its one output: a temporary freed between the activations a forward keeps leaves a hole in
    the host heap that larger later arrays cannot use (docs/memory.md, "the heap's holes")."""
    out = B.xp.multiply(a, 0.5, out=B.xp.empty_like(a))  # an array even for a 0-d ``a``
    B.xp.tanh(out, out=out)
    out += 1.0
    out *= 0.5
    return out


def _silu(a):
    out = _sigmoid(a)
    out *= a
    return out


def _normalize_axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = axis if isinstance(axis, tuple) else (axis,)
    return tuple(a % ndim for a in axes)


def _expand_reduced(g, axes, keepdims):
    """Re-insert the reduced axes of ``g`` (size 1) so it broadcasts against the input."""
    if keepdims:
        return g
    for a in sorted(axes):
        g = B.xp.expand_dims(g, a)
    return g


class Sum(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.shape, self.axes, self.keepdims = a.shape, _normalize_axes(axis, a.ndim), keepdims
        return a.sum(axis=self.axes, keepdims=keepdims, dtype=compute_dtype(a.dtype)).astype(a.dtype, copy=False)

    def backward(self, g):
        return (B.xp.broadcast_to(_expand_reduced(g, self.axes, self.keepdims), self.shape),)


class Mean(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.shape, self.axes, self.keepdims = a.shape, _normalize_axes(axis, a.ndim), keepdims
        self.count = 1
        for ax in self.axes:
            self.count *= a.shape[ax]
        return a.mean(axis=self.axes, keepdims=keepdims)

    def backward(self, g):
        g = _expand_reduced(g, self.axes, self.keepdims) / self.count
        return (B.xp.broadcast_to(g, self.shape),)


class Max(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.a, self.axes, self.keepdims = a, _normalize_axes(axis, a.ndim), keepdims
        self.out = a.max(axis=self.axes, keepdims=True)
        return self.out if keepdims else self.out.reshape([n for i, n in enumerate(a.shape) if i not in self.axes])

    def backward(self, g):
        # Ties share the gradient equally (as amax does), so the result is a valid subgradient.
        share = (self.a == self.out).astype(self.a.dtype)  # keep the dtype (bool / int -> float64)
        share /= share.sum(axis=self.axes, keepdims=True)
        return (_expand_reduced(g, self.axes, self.keepdims) * share,)


def add(a, b, into_first=False):
    """``a + b``. ``into_first=True``: the caller gives ``a`` up (an op's output that nothing
    saved, such as a residual branch's) and the sum is written into its buffer where shape and
    dtype allow: no array is freed between the activations a forward keeps, so no hole is left in
    the host heap (docs/memory.md, "the heap's holes"). Only an op's output recorded for backward
    is written into, never a leaf (a parameter, the data) nor anything under no_grad."""
    return Add.apply(a, b, into_first=into_first and given_up(a))


def sub(a, b): return Sub.apply(a, b)
def mul(a, b): return Mul.apply(a, b)
def div(a, b): return Div.apply(a, b)
def neg(a): return Neg.apply(a)
def pow(a, p): return Pow.apply(a, p)  # noqa: A001  (the op's name)
def exp(a): return Exp.apply(a)
def log(a): return Log.apply(a)
def tanh(a): return Tanh.apply(a)
def relu(a): return Relu.apply(a)


def swiglu(a, b):
    """``silu(a) * b`` with ``silu(a) = a * sigmoid(a)``: Llama's gated MLP unit, ``a`` the gate
    projection and ``b`` the up projection (same shape)."""
    return SwiGLU.apply(a, b)


def sum(a, axis=None, keepdims=False):  # noqa: A001
    """Sum over ``axis`` (int, tuple or None for all)."""
    return Sum.apply(a, axis=axis, keepdims=keepdims)


def mean(a, axis=None, keepdims=False):
    """Mean over ``axis`` (int, tuple or None for all)."""
    return Mean.apply(a, axis=axis, keepdims=keepdims)


def max(a, axis=None, keepdims=False):  # noqa: A001
    """Maximum over ``axis``; tied maxima share the gradient equally."""
    return Max.apply(a, axis=axis, keepdims=keepdims)


