"""Causal multi-head self-attention as one fused Function.

The input is GPT-2's ``c_attn`` output, ``qkv`` of shape (B, T, 3C): ``q = qkv[..., :C]``,
``k = qkv[..., C:2C]``, ``v = qkv[..., 2C:]``; head ``h`` owns columns ``h*D:(h+1)*D`` of each
(``D = C // n_head``). The output (B, T, C) has the heads merged back in the same order.

Memory: the forward keeps one (B, H, T, T) array, the probabilities (mask and softmax are done in
place on the score array); the backward allocates one more, ``dP = dO V^T``, and turns it in place
into the score gradient ``dS = P * (dP - rowsum(dP * P))``, where ``rowsum(dP * P) = rowsum(dO * O)``
is taken on the (B, T, C) output instead of the (B, H, T, T) arrays. Heads are never copied out of
``qkv``: batched matmul on the strided (B, H, T, D) views costs the same as on contiguous copies
(measured, NumPy + OpenBLAS); the products are copied into the merged (B, T, C) output and
into one (B, T, 3C) gradient (see :func:`_merge_heads`). The softmax and the score-gradient
passes run a few heads at a time on all threads (:func:`~mpirt.threads.for_blocks`).
"""
from __future__ import annotations

import math

import mpirt.backend as B
from mpirt.ops.nn import _check_p, dropout_mask
from mpirt.tensor import Function
from mpirt.threads import for_blocks


def _heads(a, n_head):
    """View (B, T, n_head*D) as (B, n_head, T, D) without copying."""
    b, t, c = a.shape
    return a.reshape(b, t, n_head, c // n_head).transpose(0, 2, 1, 3)


def _causal_bias(t, dtype):
    """(T, T) array: 0 where key <= query, -inf above the diagonal (adding it is a cheaper pass
    than a masked store)."""
    xp = B.xp
    return xp.where(xp.tri(t, t, 0, dtype=bool), 0.0, -math.inf).astype(dtype, copy=False)


def _merge_heads(src, dst, scale=None) -> None:
    """Write (B, H, T, D) ``src`` (times ``scale``) into (B, T, H*D) ``dst``, heads side by side.

    Products go to a contiguous array first and are copied here: NumPy's matmul with a strided
    ``out=`` takes a slow non-BLAS loop (measured 40x slower at (4, 8, 256, 256) @ (4, 8, 256, 64)).
    """
    b, h, t, d = src.shape
    view = dst.reshape(b, t, h, d).transpose(0, 2, 1, 3)
    if scale is None:
        view[...] = src
    else:
        B.xp.multiply(src, scale, out=view)


class CausalSelfAttention(Function):
    def forward(self, qkv, n_head, dropout_p=0.0, seed=None):
        xp = B.xp
        if qkv.ndim != 3 or qkv.shape[-1] % 3:
            raise ValueError(f"causal_self_attention: qkv must be (B, T, 3C), got shape {qkv.shape}")
        b, t, c3 = qkv.shape
        c = c3 // 3
        if n_head < 1 or c % n_head:
            raise ValueError(f"causal_self_attention: n_head={n_head} does not divide C={c}")
        d = c // n_head
        scale = 1.0 / math.sqrt(d)
        q, k, v = (_heads(qkv[..., i * c:(i + 1) * c], n_head) for i in range(3))

        qs = xp.empty((b, n_head, t, d), dtype=qkv.dtype)           # C-ordered (q * scale would not be)
        xp.multiply(q, scale, out=qs)                               # scale the small operand
        p = xp.matmul(qs, k.swapaxes(-1, -2))                       # (B, H, T, T) scores
        del qs
        bias = _causal_bias(t, p.dtype)

        def softmax_block(p):                                       # in place, a few heads at a time
            p += bias                                               # -inf above the diagonal
            p -= p.max(axis=-1, keepdims=True)
            xp.exp(p, out=p)
            p *= 1.0 / p.sum(axis=-1, keepdims=True)

        for_blocks(softmax_block, p.reshape(b * n_head, t, t))

        self.mask = None
        pv = p
        if dropout_p > 0:
            self.mask, self.keep_scale = dropout_mask(p.shape, dropout_p, seed), 1.0 / (1.0 - dropout_p)
            pv = p * self.mask
            pv *= self.keep_scale
        out = xp.empty((b, t, c), dtype=qkv.dtype)
        _merge_heads(xp.matmul(pv, v), out)
        # out is saved by reference (the next linear layer saves it too); ops never write into it
        self.qkv, self.p, self.out, self.n_head, self.scale = qkv, p, out, n_head, scale
        return out

    def backward(self, g):
        xp = B.xp
        qkv, p, h, scale = self.qkv, self.p, self.n_head, self.scale
        b, t, c3 = qkv.shape
        c = c3 // 3
        q, k, v = (_heads(qkv[..., i * c:(i + 1) * c], h) for i in range(3))
        go = _heads(g, h)                                           # (B, H, T, D)
        dqkv = xp.empty(qkv.shape, dtype=qkv.dtype)
        dq, dk, dv = (dqkv[..., i * c:(i + 1) * c] for i in range(3))

        if self.mask is None:
            _merge_heads(xp.matmul(p.swapaxes(-1, -2), go), dv)    # dV = P^T dO
            buf = xp.matmul(go, v.swapaxes(-1, -2))                 # dP = dO V^T
        else:
            buf = p * self.mask                                     # dropped probabilities
            buf *= self.keep_scale
            _merge_heads(xp.matmul(buf.swapaxes(-1, -2), go), dv)
            xp.matmul(go, v.swapaxes(-1, -2), out=buf)
            buf *= self.mask
            buf *= self.keep_scale
        # rowsum(dP * P) = dO . O per query (FlashAttention's identity; dropout included), a
        # (B, T, C) product instead of a pass over (B, H, T, T)
        rowdot = xp.einsum("bthd,bthd->bht", g.reshape(b, t, h, -1), self.out.reshape(b, t, h, -1))

        def score_grad_block(buf, p, rowdot):                       # dS = P * (dP - rowdot)
            buf -= rowdot[..., None]
            buf *= p                                                # masked entries: P = 0

        for_blocks(score_grad_block, buf.reshape(b * h, t, t), p.reshape(b * h, t, t),
                   xp.ascontiguousarray(rowdot).reshape(b * h, t))
        _merge_heads(xp.matmul(buf, k), dq, scale)
        _merge_heads(xp.matmul(buf.swapaxes(-1, -2), q), dk, scale)
        return (dqkv,)


def causal_self_attention(qkv, n_head, dropout_p=0.0, seed=None):
    """Causal multi-head self-attention on GPT-2's fused ``qkv`` (B, T, 3C) -> (B, T, C).

    Scores are scaled by ``1/sqrt(D)`` and position ``t`` attends to positions ``<= t``. With
    ``dropout_p > 0`` the probabilities are dropped out (inverted scaling) with a mask that is a
    pure function of ``seed`` and the shape; ``seed`` is then required. ``dropout_p == 0`` does
    no mask work at all.
    """
    _check_p(dropout_p, "causal_self_attention", "dropout_p")
    return CausalSelfAttention.apply(qkv, n_head=n_head, dropout_p=dropout_p, seed=seed)
