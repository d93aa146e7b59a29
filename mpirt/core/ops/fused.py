"""Fused neural-network ops: GELU, softmax, log-softmax, layer norm, embedding, cross-entropy.

Each op is one :class:`~mpirt.core.tensor.Function` with a hand-written backward. Conventions:

* Outputs and gradients keep the input dtype. Constants are plain Python floats: NumPy 2
  promotes float32 arrays that meet a NumPy float64 scalar or array.
* Arrays the op allocates itself are updated in place (``out=``, ``*=``); the incoming gradient
  is never written to (it may be a read-only broadcast view).
* Ops with weights (layer norm, embedding) split their backward into an input pass and a weight
  pass, so a zero-bubble pipeline can defer the latter.

Over 400 lines: the fused ops share their kernel-dispatch helpers; each op is short.
"""
from __future__ import annotations

import math

import mpirt.core.backend as B
from mpirt.cpu import kernels
from mpirt.gpu import cuda
from mpirt.core.precision import compute_dtype, float32_compute, upcast
from mpirt.core.tensor import Function, SparseGrad, Tensor, given_up, is_grad_enabled
from mpirt.cpu.threads import LIGHT_BLOCK, add_up, c_blocks, for_blocks

_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def _data(x):
    return x.data if isinstance(x, Tensor) else x


# ------------------------------------------------------------------------------------------
# GELU
# ------------------------------------------------------------------------------------------
def _gelu_block(x, y, d):
    """``y = 0.5 x (1 + t)``, ``t = tanh(k (x + a x^3))``; with ``d``, also ``d = dy/dx``.

    ``dy/dx = h (1 + 2 w (1 - h))`` with ``h = 0.5 (1 + t)`` and ``w = k x (1 + 3 a x^2)``.
    """
    xp, k, a = B.xp, _GELU_K, _GELU_A
    if xp.may_share_memory(x, y):                               # in place: y is written before x is read again
        x = x.copy()
    x2 = x * x                                                  # the one temporary (block-sized)
    xp.multiply(x2, a * k, out=y)
    y += k
    y *= x                                                      # u = k (x + a x^3)
    xp.tanh(y, out=y)
    y += 1.0
    y *= 0.5                                                    # h
    if d is not None:
        x2 *= 6.0 * a * k
        x2 += 2.0 * k
        x2 *= x                                                 # 2 w
        xp.subtract(1.0, y, out=d)
        d *= x2
        d += 1.0
        d *= y
    y *= x


@float32_compute
class Gelu(Function):
    """GPT-2's tanh GELU. While a block of ``x`` is in cache the forward also computes the
    derivative and saves only it (not ``x`` and the tanh): the backward is one multiply.
    With the CUDA kernels the forward saves ``x`` itself (in its dtype: the linear layer before
    holds it anyway) and the backward recomputes the derivative in the same pass. ``into_input``
    (the CPU forms): the result is written into ``x``, C-contiguous and writeable, which the caller gave up."""

    def runs_half(self, x, into_input=False):
        return cuda.takes(x)

    def forward(self, x, into_input=False):
        xp = B.xp
        if cuda.takes(x):
            self.x, self.d = x, None
            return cuda.gelu_forward(x)
        y = x if into_input and x.flags.c_contiguous and B.writeable(x) else xp.empty(x.shape, dtype=x.dtype)
        self.d = xp.empty_like(y) if self.needs_input_grad[0] and is_grad_enabled() else None
        flat = (x.reshape(-1), y.reshape(-1), None if self.d is None else self.d.reshape(-1))
        if kernels.usable(*flat):
            c_blocks("gelu", x.dtype, lambda x, y, d: (x, y, d, x.size), *flat)
        else:
            for_blocks(_gelu_block, *flat)
        return y

    def backward(self, g):
        if self.d is None:
            return (cuda.gelu_backward(self.x, B.xp.ascontiguousarray(g, dtype=self.x.dtype)),)
        gx = B.xp.empty(self.d.shape, dtype=self.d.dtype)
        for_blocks(B.xp.multiply, g.reshape(-1), self.d.reshape(-1), gx.reshape(-1), block=LIGHT_BLOCK)
        return (gx,)


# ------------------------------------------------------------------------------------------
# softmax / log-softmax
# ------------------------------------------------------------------------------------------
@float32_compute
class Softmax(Function):
    def forward(self, x, axis=-1):
        y = x - x.max(axis=axis, keepdims=True)
        B.xp.exp(y, out=y)
        y *= 1.0 / y.sum(axis=axis, keepdims=True)
        self.y, self.axis = y, axis
        return y

    def backward(self, g):
        # dx = y * (g - sum(g * y))
        y = self.y
        gx = g * y
        s = gx.sum(axis=self.axis, keepdims=True)
        B.xp.subtract(g, s, out=gx)
        gx *= y
        return (gx,)


@float32_compute
class LogSoftmax(Function):
    def forward(self, x, axis=-1):
        y = x - x.max(axis=axis, keepdims=True)
        e = B.xp.exp(y)
        y -= B.xp.log(e.sum(axis=axis, keepdims=True))
        self.y, self.axis = y, axis
        return y

    def backward(self, g):
        # dx = g - exp(y) * sum(g)
        gx = B.xp.exp(self.y)
        gx *= -g.sum(axis=self.axis, keepdims=True)
        gx += g
        return (gx,)


# ------------------------------------------------------------------------------------------
# layer norm
# ------------------------------------------------------------------------------------------
def _row_means(a):
    """``a.mean(axis=1, keepdims=True)`` of a 2-D array as a product with a ``1/n`` vector: BLAS's
    GEMV is ~5x faster than NumPy's reduction along a short contiguous last axis (C = 128)."""
    if B.name != "numpy" or a.dtype.kind != "f" or a.dtype.itemsize < 4:
        return a.mean(axis=1, keepdims=True)
    return a @ B.xp.full((a.shape[1], 1), 1.0 / a.shape[1], dtype=a.dtype)


def _column_sums(a):
    """``a.sum(axis=0)`` of a 2-D array as ``ones @ a`` (BLAS GEMV, ~3x faster on NumPy)."""
    if B.name != "numpy" or a.dtype.kind != "f" or a.dtype.itemsize < 4:
        return a.sum(axis=0, dtype=compute_dtype(a.dtype)).astype(a.dtype, copy=False)  # half: float32 sum
    return B.xp.ones(a.shape[0], dtype=a.dtype) @ a


def norm_in_c(x2, weight, bias=None, *others) -> bool:
    """Whether the norms' C kernels take these arrays (:func:`mpirt.cpu.kernels.usable`, and a weight
    and bias, where given, of length C: the C side reads C of each)."""
    n = x2.shape[-1]
    return kernels.usable(x2, weight, bias, *others) and all(a is None or a.shape == (n,) for a in (weight, bias))


def norm_forward_c(x2, weight, bias, xhat, rstd, y, eps, center: int) -> None:
    """Layer norm (``center`` 1) or RMS norm (0) forward of (N, C) ``x2`` in C, on row blocks."""
    n = x2.shape[1]
    c_blocks("norm_forward", x2.dtype, lambda x, h, r, o: (x, weight, bias, h, r, o, x.shape[0], n, eps, center),
             x2, xhat, rstd, y)


def norm_backward_c(g2, xhat, rstd, weight, gx, want_w: bool, want_b: bool, center: int) -> list:
    """The norms' backward in C, on row blocks: ``gx`` written when given; returns each block's
    partial ``(gw, gb)`` column sums (None where not wanted), in block order."""
    n = xhat.shape[1]
    parts = []

    def args(g, h, r, out):
        gw, gb = (B.xp.zeros(n, dtype=xhat.dtype) if want else None for want in (want_w, want_b))
        parts.append((gw, gb))
        return g, h, r, weight, out, gw, gb, h.shape[0], n, center
    c_blocks("norm_backward", xhat.dtype, args, g2, xhat, rstd, gx)
    return parts


def norm_on_gpu(x, weight, bias=None) -> bool:
    """Whether the norms' CUDA kernels take ``x`` with this weight and bias (each None or of
    length C, in x's dtype)."""
    n = x.shape[-1] if x.ndim else 0
    return cuda.takes(x, weight, bias) and all(a is None or a.shape == (n,) for a in (weight, bias))


def norm_backward_gpu(fn, g, want_x, want_w, want_b, center: bool):
    """A norm Function's backward on its saved input and statistics (the CUDA kernels):
    ``(gx, gw, gb)``, None where not wanted."""
    x2 = fn.x2
    g2 = B.xp.ascontiguousarray(g.reshape(x2.shape), dtype=x2.dtype)
    gx, gw, gb = cuda.norm_backward(g2, x2, fn.weight, fn.mean, fn.rstd, want_x, want_w, want_b, center)
    return (None if gx is None else gx.reshape(fn.shape)), gw, gb


@float32_compute
class LayerNormOp(Function):
    """Layer norm over the last dimension; saves the normalised input and ``1/std`` per row.

    Rows are independent, so both passes run on row blocks (:func:`~mpirt.cpu.threads.for_blocks`);
    the weight and bias gradients are per-block partial column sums, added in block order.
    """

    weight_inputs = (1, 2)

    def runs_half(self, x, weight=None, bias=None, eps=1e-5):
        return norm_on_gpu(x, weight, bias)

    def forward(self, x, weight=None, bias=None, eps=1e-5):
        xp = B.xp
        n = x.shape[-1]
        x2 = x.reshape(-1, n)                                   # (N, C)
        self.x2 = None
        if norm_on_gpu(x, weight, bias):                        # keeps x and float32 row statistics
            y, self.mean, self.rstd = cuda.norm_forward(x2, weight, bias, eps, center=True)
            self.x2, self.weight, self.shape = x2, weight, x.shape
            return y.reshape(x.shape)
        xhat, y = xp.empty(x2.shape, dtype=x.dtype), xp.empty(x2.shape, dtype=x.dtype)
        rstd = xp.empty((x2.shape[0], 1), dtype=x.dtype)

        def block(x, xhat, rstd, y):
            xp.subtract(x, _row_means(x), out=xhat)
            var = xp.einsum("ij,ij->i", xhat, xhat)[:, None]   # (rows, 1), no (rows, C) temporary
            var *= 1.0 / n
            var += eps
            xp.sqrt(var, out=var)
            xp.divide(1.0, var, out=rstd)
            xhat *= rstd
            if weight is None:
                y[...] = xhat if bias is None else xhat + bias
            else:
                xp.multiply(xhat, weight, out=y)
                if bias is not None:
                    y += bias

        if norm_in_c(x2, weight, bias):
            norm_forward_c(x2, weight, bias, xhat, rstd, y, eps, center=1)
        else:
            for_blocks(block, x2, xhat, rstd, y)
        self.xhat, self.rstd, self.weight, self.shape = xhat, rstd, weight, x.shape
        return y.reshape(x.shape)

    def backward(self, g):
        return self._backward(g, *self.needs_input_grad[:3])

    def backward_input(self, g):
        return self._backward(g, self.needs_input_grad[0], False, False)

    def backward_weight(self, g):
        need = self.needs_input_grad
        return self._backward(g, False, len(need) > 1 and need[1], len(need) > 2 and need[2])

    def _backward(self, g, want_x, want_w=False, want_b=False):
        """One pass over (g, xhat) for whichever of the three gradients are wanted."""
        if self.x2 is not None:
            return norm_backward_gpu(self, g, want_x, want_w, want_b, center=True)
        xp, xhat, weight = B.xp, self.xhat, self.weight
        n = xhat.shape[1]
        g2 = g.reshape(-1, n)
        gx = xp.empty(xhat.shape, dtype=xhat.dtype) if want_x else None

        def block(g, xhat, rstd, gx):
            # dx = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat)),  gxhat = g * weight
            gw = xp.einsum("ij,ij->j", g, xhat) if want_w else None
            gb = _column_sums(g) if want_b else None
            if gx is not None:
                gxhat = gx
                if weight is None:
                    gxhat[...] = g
                else:
                    xp.multiply(g, weight, out=gxhat)
                m2 = xp.einsum("ij,ij->i", gxhat, xhat)[:, None]
                m2 *= 1.0 / n
                tmp = xhat * m2
                tmp += _row_means(gxhat)
                gxhat -= tmp
                gxhat *= rstd
            return gw, gb

        if norm_in_c(g2, weight, None, xhat):
            parts = norm_backward_c(g2, xhat, self.rstd, weight, gx, want_w, want_b, center=1)
        else:
            parts = for_blocks(block, g2, xhat, self.rstd, gx)
        gw = add_up([p[0] for p in parts]) if want_w else None
        gb = add_up([p[1] for p in parts]) if want_b else None
        return (None if gx is None else gx.reshape(self.shape)), gw, gb


# ------------------------------------------------------------------------------------------
# embedding
# ------------------------------------------------------------------------------------------
def scatter_add_rows(ids, rows, num_rows: int | None = None, out=None):
    """``out[ids[i]] += rows[i]`` (ids 1-D, rows (N, C)); ``out`` defaults to a fresh zero
    ``(num_rows, C)`` array. Returns ``out``.

    NumPy's ``add.at`` is slow, so ids are sorted, the rows of each distinct id summed with
    ``add.reduceat`` and the sums added with one fancy-index ``+=`` (ids unique there): only the
    touched rows of ``out`` are read and written. On CuPy ``add.at`` is an atomic scatter-add
    kernel and is used directly; half rows (CuPy's ``add.at`` takes no bfloat16) are summed per
    distinct id in float32 and added to ``out`` with one rounding, as on NumPy.
    """
    xp = B.xp
    if out is None:
        out = xp.zeros((num_rows, rows.shape[1]), dtype=rows.dtype)
    if ids.size == 0:
        return out
    if B.name == "cupy":
        if compute_dtype(rows.dtype) == rows.dtype:
            xp.add.at(out, ids, rows)
            return out
        uniq, where = xp.unique(ids, return_inverse=True)
        sums = xp.zeros((uniq.size, rows.shape[1]), dtype=compute_dtype(rows.dtype))
        xp.add.at(sums, where.reshape(-1), upcast(rows))
        out[uniq] = (upcast(out[uniq]) + sums).astype(out.dtype)
        return out
    order = xp.argsort(ids, kind="stable")
    s = ids[order]
    starts = xp.flatnonzero(xp.concatenate(([True], s[1:] != s[:-1])))
    out[s[starts]] += xp.add.reduceat(upcast(rows[order]), starts, axis=0)  # half rows: summed in float32
    return out


class RowGrad(SparseGrad):
    """An embedding table's gradient: zero except the rows ``ids``, which get ``rows`` (repeats
    add up). The engine adds it straight into the table's gradient buffer, touching N rows
    instead of materialising and adding a (V, C) array."""

    def __init__(self, ids, rows, num_rows: int):
        self.ids, self.rows = ids, rows
        self.shape, self.dtype = (num_rows, rows.shape[1]), rows.dtype

    def add_to(self, out) -> None:
        scatter_add_rows(self.ids, self.rows.astype(out.dtype, copy=False), out=out)

    def dense(self):
        return scatter_add_rows(self.ids, self.rows, self.shape[0])


class EmbeddingOp(Function):
    """``weight[ids]``; the weight gradient is a :class:`RowGrad` (a scatter-add of the output gradient)."""

    weight_inputs = (1,)

    def forward(self, ids, weight):
        xp = B.xp
        ids = xp.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"embedding: ids must be integers, got dtype {ids.dtype}")
        if weight.ndim != 2:
            raise ValueError(f"embedding: weight must be 2-D (V, C), got shape {weight.shape}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
            raise IndexError(f"embedding: ids must be in [0, {weight.shape[0]})")
        self.ids, self.vocab = ids.reshape(-1), weight.shape[0]
        return xp.take(weight, self.ids, axis=0).reshape(*ids.shape, weight.shape[1])

    def backward_input(self, g):
        return None, None

    def backward_weight(self, g):
        if not self.needs_input_grad[1]:
            return None, None
        return None, RowGrad(self.ids, g.reshape(self.ids.size, -1), self.vocab)


# ------------------------------------------------------------------------------------------
# cross-entropy
# ------------------------------------------------------------------------------------------
def check_targets(logits, targets, reduction: str):
    """``targets`` as an integer ``xp`` array shaped like ``logits`` without its class dimension;
    raises naming what is wrong (shared by the plain and the vocab-parallel cross-entropy)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    targets = B.xp.asarray(targets)
    if targets.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: targets must be integers, got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"cross_entropy: targets shape {targets.shape} != logits shape "
                         f"{logits.shape} without its last (class) dimension")
    return targets


def reduce_nll(nll, valid, reduction: str):
    """``(loss, count)`` of per-row negative log-likelihoods ``nll`` (zeroed in place where
    ``valid`` is 0): their sum, or for ``"mean"`` the sum over the ``count`` rows that count (at
    least 1; shared by the plain and the vocab-parallel cross-entropy)."""
    nll *= valid
    count = valid.sum(dtype=nll.dtype)
    loss = nll.sum()
    if reduction == "mean":
        loss = loss / B.xp.maximum(count, 1.0)
    return loss, count


@float32_compute(keep_output=True)
class CrossEntropy(Function):
    """Log-softmax + negative log-likelihood in one op.

    The forward writes ``E = exp(x - rowmax)`` into the one (N, V) array it allocates, a block
    of rows at a time (:func:`~mpirt.cpu.threads.for_blocks`): max, subtract, exp and the row sum run
    in cache, the array is written to memory once, and blocks run on all threads. The softmax's
    ``1 / rowsum(E)`` is kept per row, not applied: the backward turns E *in place* into the
    gradient ``(softmax - onehot) * g / count`` with one row scale ``g / (count * rowsum)``
    (one pass over (N, V) fewer). One backward per forward; a second one (``retain_graph``)
    raises instead of returning wrong numbers.
    """

    def runs_half(self, logits, targets, ignore_index=-100, reduction="mean"):
        return cuda.takes(logits)

    def forward(self, logits, targets, ignore_index=-100, reduction="mean"):
        xp = B.xp
        targets = check_targets(logits, targets, reduction)
        v = logits.shape[-1]
        x = logits.reshape(-1, v)                                   # (N, V)
        n = x.shape[0]
        t = targets.reshape(-1)
        valid = t != ignore_index
        if bool((((t < 0) | (t >= v)) & valid).any()):
            raise IndexError(f"cross_entropy: targets must be in [0, {v}) or ignore_index={ignore_index}")
        self.reduction, self.shape = reduction, logits.shape
        if cuda.takes(x):                                           # keeps the logits and a lse per row
            self.x, self.t = x, xp.where(valid, t, -1).astype(xp.int64)
            rows, self.lse = cuda.cross_entropy_forward(x, self.t)
            self.count = valid.sum(dtype=xp.float32)
            loss = rows.sum()
            self.p = None
            return loss / xp.maximum(self.count, 1.0) if reduction == "mean" else loss
        self.x = None
        t = xp.where(valid, t, 0)
        p = xp.empty_like(x)                                        # the one (N, V) array: E
        lse, rsum = xp.empty((n, 1), dtype=x.dtype), xp.empty((n, 1), dtype=x.dtype)

        def block(x, p, lse, rsum):
            m = x.max(axis=1, keepdims=True)
            xp.subtract(x, m, out=p)
            xp.exp(p, out=p)
            s = p.sum(axis=1, keepdims=True)
            xp.divide(1.0, s, out=rsum)                             # softmax = E / rowsum: applied in backward
            xp.log(s, out=lse)
            lse += m                                                # logsumexp per row

        for_blocks(block, x, p, lse, rsum)
        loss, count = reduce_nll(lse[:, 0] - x[xp.arange(n), t], valid, reduction)
        self.p, self.rsum, self.t, self.valid, self.count = p, rsum, t, valid, count
        return xp.asarray(loss, dtype=x.dtype)

    def backward(self, g):
        xp = B.xp
        if self.x is not None:
            scale = xp.asarray(g, dtype=xp.float32).reshape(1)
            if self.reduction == "mean":
                scale = scale / xp.maximum(self.count, 1.0)
            return cuda.cross_entropy_backward(self.x, self.t, self.lse, scale).reshape(self.shape), None
        if getattr(self, "p", None) is None:
            raise RuntimeError("cross_entropy: backward ran twice; its saved buffer was consumed "
                               "by the first backward (retain_graph is not supported here)")
        p, valid = self.p, self.valid
        self.p = None
        scale = xp.asarray(g, dtype=p.dtype)
        if self.reduction == "mean":
            scale = scale / xp.maximum(self.count, 1.0)
        rowscale = valid.astype(p.dtype)                            # ignored rows -> 0
        rowscale *= scale
        pscale = self.rsum * rowscale[:, None]                      # E / rowsum * g / count
        for_blocks(lambda p, r: xp.multiply(p, r, out=p), p, pscale, block=LIGHT_BLOCK)  # softmax * g / count
        p[xp.arange(self.t.size), self.t] -= rowscale               # - onehot * g / count
        return p.reshape(self.shape), None


# ------------------------------------------------------------------------------------------
# functional API
# ------------------------------------------------------------------------------------------
def gelu(x, into_input=False):
    """GELU, tanh approximation as in GPT-2 (HF ``gelu_new``):
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``. ``into_input=True``: the caller gives
    ``x`` up (a projection's output nothing saved) and, on the CPU, the result is written into its
    buffer: no array is freed between the kept activations (docs/memory.md, "the heap's holes");
    only an op's output recorded for backward (:func:`mpirt.core.tensor.given_up`)."""
    return Gelu.apply(x, into_input=into_input and given_up(x))


def softmax(x, axis=-1):
    """Numerically stable softmax along ``axis``."""
    return Softmax.apply(x, axis=axis)


def log_softmax(x, axis=-1):
    """Numerically stable log-softmax along ``axis``."""
    return LogSoftmax.apply(x, axis=axis)


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """Layer normalisation over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    ``weight`` and ``bias`` have shape ``(C,)`` and may be None. The variance is the biased one,
    as in PyTorch. Weight and bias gradients form a separate (deferrable) pass.
    """
    return LayerNormOp.apply(x, weight, bias, eps=eps)


def embedding(ids, weight):
    """Rows of ``weight`` (V, C) picked by the integer array ``ids`` (any shape): (*ids.shape, C).

    ``ids`` may be an array or a Tensor of integers; repeated ids add up in the weight gradient,
    which is a separate (deferrable) pass.
    """
    return EmbeddingOp.apply(_data(ids), weight)


def cross_entropy(logits, targets, ignore_index=-100, reduction="mean"):
    """Cross-entropy of ``logits`` (..., V) against integer ``targets`` (...), log-softmax fused in.

    Targets equal to ``ignore_index`` contribute nothing. ``reduction="mean"`` divides the summed
    negative log-likelihood by the number of counted targets (0 when all are ignored, with zero
    gradient); ``"sum"`` does not divide. Returns a 0-d Tensor in the logits dtype.
    """
    return CrossEntropy.apply(logits, _data(targets), ignore_index=ignore_index, reduction=reduction)
