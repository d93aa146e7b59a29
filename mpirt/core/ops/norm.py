"""RMS normalisation (Llama's norm) as one fused Function.

``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dimension. Like layer norm it saves the
normalised input and ``1/rms`` per row, runs on row blocks, and splits its backward into an
input pass and a (deferrable) weight pass.
"""
from __future__ import annotations

import mpirt.core.backend as B
from mpirt.gpu import cuda
from mpirt.core.ops.fused import norm_backward_c, norm_backward_gpu, norm_forward_c, norm_in_c, norm_on_gpu
from mpirt.core.precision import float32_compute
from mpirt.core.tensor import Function
from mpirt.cpu.threads import add_up, for_blocks


@float32_compute
class RMSNormOp(Function):
    weight_inputs = (1,)

    def runs_half(self, x, weight, eps=1e-6):
        return weight is not None and norm_on_gpu(x, weight)

    def forward(self, x, weight, eps=1e-6):
        xp = B.xp
        n = x.shape[-1]
        x2 = x.reshape(-1, n)                                   # (N, C)
        self.x2 = None
        if weight is not None and norm_on_gpu(x, weight):      # keeps x and float32 1/rms per row
            y, self.mean, self.rstd = cuda.norm_forward(x2, weight, None, eps, center=False)
            self.x2, self.weight, self.shape = x2, weight, x.shape
            return y.reshape(x.shape)
        xhat, y = xp.empty(x2.shape, dtype=x.dtype), xp.empty(x2.shape, dtype=x.dtype)
        rstd = xp.empty((x2.shape[0], 1), dtype=x.dtype)

        def block(x, xhat, rstd, y):
            ms = xp.einsum("ij,ij->i", x, x)[:, None]           # (rows, 1)
            ms *= 1.0 / n
            ms += eps
            xp.sqrt(ms, out=ms)
            xp.divide(1.0, ms, out=rstd)
            xp.multiply(x, rstd, out=xhat)
            xp.multiply(xhat, weight, out=y)

        if weight is not None and norm_in_c(x2, weight):       # (no weight: the NumPy form raises)
            norm_forward_c(x2, weight, None, xhat, rstd, y, eps, center=0)
        else:
            for_blocks(block, x2, xhat, rstd, y)
        self.xhat, self.rstd, self.weight, self.shape = xhat, rstd, weight, x.shape
        return y.reshape(x.shape)

    def backward(self, g):
        return self._backward(g, *self.needs_input_grad[:2])

    def backward_input(self, g):
        return self._backward(g, self.needs_input_grad[0], False)

    def backward_weight(self, g):
        return self._backward(g, False, self.needs_input_grad[1])

    def _backward(self, g, want_x, want_w=False):
        """One pass over (g, xhat): ``dx = rstd * (gxhat - xhat * mean(gxhat * xhat))`` with
        ``gxhat = g * weight``; ``dweight = sum_rows(g * xhat)``."""
        if self.x2 is not None:
            return norm_backward_gpu(self, g, want_x, want_w, False, center=False)[:2]
        xp, xhat, weight = B.xp, self.xhat, self.weight
        n = xhat.shape[1]
        g2 = g.reshape(-1, n)
        gx = xp.empty(xhat.shape, dtype=xhat.dtype) if want_x else None

        def block(g, xhat, rstd, gx):
            gw = xp.einsum("ij,ij->j", g, xhat) if want_w else None
            if gx is not None:
                xp.multiply(g, weight, out=gx)
                m = xp.einsum("ij,ij->i", gx, xhat)[:, None]
                m *= 1.0 / n
                gx -= xhat * m
                gx *= rstd
            return gw

        if weight is not None and norm_in_c(g2, weight, None, xhat):
            parts = [gw for gw, _ in norm_backward_c(g2, xhat, self.rstd, weight, gx, want_w, False, center=0)]
        else:
            parts = for_blocks(block, g2, xhat, self.rstd, gx)
        gw = add_up(parts) if want_w else None
        return (None if gx is None else gx.reshape(self.shape)), gw


def rms_norm(x, weight, eps=1e-6):
    """RMS normalisation over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``
    (``weight`` of shape (C,)). The weight gradient is a separate (deferrable) pass."""
    return RMSNormOp.apply(x, weight, eps=eps)
