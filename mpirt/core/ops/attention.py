"""Causal multi-head self-attention as one fused Function.

The input is the fused ``c_attn`` output, ``qkv`` of shape (B, T, C + 2 Ck): ``q = qkv[..., :C]``,
``k = qkv[..., C:C + Ck]``, ``v = qkv[..., C + Ck:]``; head ``h`` owns columns ``h*D:(h+1)*D`` of
each (``D = C // n_head``, ``Ck = n_kv_head D``; GPT-2: ``Ck = C``). With grouped-query attention
(``n_kv_head < n_head``) the query heads come in ``n_kv_head`` groups, each reading one key and
value head: keys and values broadcast over the group in the forward's products, and the
backward's dK and dV sum the group in one product each. The output (B, T, C) has the heads
merged back in the same order.

Memory: between forward and backward the op keeps no array of the scores' size, (B, H, T, T):
only ``lse`` (B, H, T, 1), each query's log-sum-exp ``rowmax(S) + log(rowsum(exp(S - rowmax)))``.
The backward computes the scores again chunk by chunk and gets the probabilities in one pass,
``P = exp(S - lse)`` (FlashAttention's recomputation: one more ``Q K^T`` product per chunk in
place of writing and reading the largest activation of the model; at T = 128 the two cost the
same time, and the memory they would take grows with T^2). The forward's softmax stays
unnormalised, ``E = exp(S - rowmax)``, and its row scale ``r = 1 / rowsum(E)`` goes onto the
small side of the product, ``O = r (E V)``. The backward's score gradient is
``dS = P * (dP - rowsum(dP * P))`` with ``dP = dO V^T``, where ``rowsum(dP * P) = dO . O`` is taken
on the (B, T, C) output instead of a (B, H, T, T) array. With the C kernels (:mod:`mpirt.cpu.kernels`)
the mask, row max, exponent, row sum and log-sum-exp of a chunk are one pass, and so are the
probabilities and the score gradient in the backward. Heads are never copied out of ``qkv``:
batched matmul on the strided (B, H, T, D) views costs the same as on contiguous copies
(measured, NumPy + OpenBLAS); the forward's products are written straight into the (B, H, T, D)
head view of the merged (B, T, C) output (NumPy 2's matmul takes that strided ``out=`` at full
speed), and the backward's are copied, scaled, into one (B, T, 3C) gradient (see
:func:`_merge_heads`). With dropout the (B, H, T, T) bool mask is kept (a pure function of the
seed, but drawn for the whole shape at once).

Causality skips work: queries go in chunks of ``QUERY_CHUNK``, and a chunk's scores, products and
softmax cover only the keys up to its last query. Both passes run a few batch rows at a time on
mpirt's threads (:func:`~mpirt.cpu.threads.for_blocks`), GEMMs included: a block's scores stay in
cache from the product through the softmax, and each pass holds one chunk's scores at a time.

In float32 without dropout, with the C kernels loaded, the whole forward and the whole backward
are one C call per range of (batch, head) pairs (``attention_forward`` / ``attention_backward``
in ``mpirt/cpu/kernels/kernels_attention.h``): the same formulas and the same saved ``lse``, so either
forward pairs with either backward, on small register-blocked GEMMs that also skip the tiles above
the diagonal; the forward's scores live in a workspace of a few rows. Every pair is computed
alone, so its bits do not depend on the batch split, the heads a rank holds or the thread count.
The NumPy form runs float64, dropout, and CuPy's other cases: on CuPy with bfloat16 or float16,
no dropout and a head dimension in :data:`mpirt.cpu.kernels.cuda.HEAD_DIMS`, both passes are the flash
attention of :mod:`mpirt.cpu.kernels.cuda` (tensor cores, float32 accumulation, the same ``lse``, kept in
float32; the backward's dQ gathered over key blocks in float32).
"""
from __future__ import annotations

import functools
import math

import numpy as np

import mpirt.core.backend as B
from mpirt.cpu import kernels
from mpirt.cpu.kernels import cuda
from mpirt.core.precision import float32_compute
from mpirt.core.ops.dropout import _check_p, dropout_mask
from mpirt.core.tensor import Function
from mpirt.cpu.threads import BLOCK, c_blocks, for_blocks, num_threads

# Queries per chunk. Chunk [q0, q1) needs keys [0, q1) only, so n chunks compute (n + 1) / 2n of
# the (T, T) scores, products and softmax: 5/8 at T = 256. Smaller chunks skip more but make
# thinner GEMMs and more calls.
QUERY_CHUNK = 64


def _heads(a, n_kv, group=1):
    """View (B, T, n_kv*group*D) as (B, n_kv, group, T, D) without copying: query heads grouped by
    the key/value head they read (grouped-query attention), keys and values with ``group`` 1."""
    b, t, c = a.shape
    return a.reshape(b, t, n_kv, group, c // (n_kv * group)).transpose(0, 2, 3, 1, 4)


def _fold(a):
    """(B, Hk, G, T, X) -> (B, Hk, 1, G*T, X): a group's query heads as one run of rows, so that a
    product over them sums the group (dK, dV); a copy only when G > 1 and ``a`` is strided."""
    b, hk, g, t, x = a.shape
    return a.reshape(b, hk, 1, g * t, x)


def _layout(qkv, n_head, n_kv_head):
    """``(C, Ck, D)`` of a fused (B, T, C + 2 Ck) ``qkv``: query, key (= value) widths, head size."""
    kv = n_head if n_kv_head is None else n_kv_head
    if qkv.ndim != 3:
        raise ValueError(f"causal_self_attention: qkv must be (B, T, C + 2 Ck), got shape {qkv.shape}")
    w = qkv.shape[-1]
    if n_head < 1 or kv < 1 or n_head % kv or w % (n_head + 2 * kv):
        raise ValueError(f"causal_self_attention: qkv width {w} does not hold n_head={n_head} query heads and "
                         f"n_kv_head={kv} key and value heads of one size (n_kv_head must divide n_head)")
    d = w // (n_head + 2 * kv)
    return n_head * d, kv * d, d


_BIAS_CACHE: dict = {}


def _causal_bias(t, dtype):
    """(T, T) array: 0 where key <= query, -inf above the diagonal (adding it is a cheaper pass
    than a masked store). Cached per size, dtype and backend (building it took ~115 us, a tenth
    of a tiny layer's attention); read-only."""
    xp = B.xp
    key = (t, str(dtype), xp.__name__)
    bias = _BIAS_CACHE.get(key)
    if bias is None:
        bias = xp.where(xp.tri(t, t, 0, dtype=bool), 0.0, -math.inf).astype(dtype, copy=False)
        if B.name == "numpy":
            bias.flags.writeable = False
        _BIAS_CACHE[key] = bias
    return bias


def _query_chunks(t):
    """Bounds of the query chunks: chunk ``[q0, q1)`` attends to keys ``[0, q1)`` only."""
    n = max(1, t // QUERY_CHUNK)
    return [t * i // n for i in range(n + 1)]


def _merge_heads(src, dst, scale=None) -> None:
    """Write (B, H, T, D) ``src`` (times ``scale``) into (B, T, H*D) ``dst``, heads side by side.

    The backward's gradients are summed over query chunks in contiguous arrays and copied here,
    scaled, in one pass each.
    """
    b, h, t, d = src.shape
    view = dst.reshape(b, t, h, d).transpose(0, 2, 1, 3)
    if scale is None:
        view[...] = src
    else:
        B.xp.multiply(src, scale, out=view)


def _row_max(s):
    """Per-row maximum over the last axis, keepdims (``fmax``: NumPy's ``max`` reduction checks
    for NaN per element and is ~20 % slower; a NaN score still reaches the output through exp)."""
    return B.xp.fmax.reduce(s, axis=-1, keepdims=True) if B.name == "numpy" else s.max(axis=-1, keepdims=True)


def _row_sum(e):
    """Per-row sum over the last axis, keepdims, as a product with a ones vector (BLAS, ~4x faster
    than NumPy's sum reduction along a short last axis)."""
    return B.xp.matmul(e, B.xp.ones((e.shape[-1], 1), dtype=e.dtype))


def _scaled_queries(q, scale):
    """``q * scale`` as a C-ordered copy (the scale goes on the small operand of the score product)."""
    qs = B.xp.empty(q.shape, dtype=q.dtype)
    B.xp.multiply(q, scale, out=qs)
    return qs


def _rows_block(t):
    """The NumPy form's block size in elements of its first array, the (B, H, T, 1) lse: a block
    holds about ``BLOCK`` elements of scores, so it splits batch rows by the (H, T, T) work."""
    return max(1, BLOCK // max(t, 1))


def _whole_in_c(*arrays) -> bool:
    """Whether the C kernels run the whole attention (float32, contiguous arrays, no dropout)."""
    return arrays[0].dtype == np.float32 and kernels.usable(*arrays)


def _bounds(chunks):
    """The query chunks' bounds as the C kernels take them (C longs)."""
    return np.asarray(chunks, dtype=kernels.LONG)


def _over_pairs(name, arrays, pairs, *rest) -> None:
    """Run C kernel ``name`` on ``arrays`` for all (batch, head) pairs, split over mpirt's threads
    (each call gets a range ``[bh0, bh1)`` of pairs; the pairs do equal work)."""
    c_blocks(name, np.float32, lambda part: (*arrays, int(part[0]), int(part[-1]) + 1, *rest), np.arange(pairs),
             block=-(-pairs // num_threads()))


@float32_compute
class CausalSelfAttentionOp(Function):
    def runs_half(self, qkv, n_head, dropout_p=0.0, seed=None, n_kv_head=None):
        return self._flash(qkv, n_head, dropout_p, n_kv_head)

    @staticmethod
    def _flash(qkv, n_head, dropout_p, n_kv_head) -> bool:
        """Whether CUDA's flash attention runs both passes (no dropout, as many key/value heads as
        query heads: its kernels read one of each per query head)."""
        return dropout_p == 0 and n_kv_head in (None, n_head) and cuda.attention_takes(qkv, n_head)

    def forward(self, qkv, n_head, dropout_p=0.0, seed=None, n_kv_head=None):
        xp = B.xp
        c, ck, d = _layout(qkv, n_head, n_kv_head)
        b, t = qkv.shape[:2]
        kv = ck // d
        self.on_gpu = self._flash(qkv, n_head, dropout_p, n_kv_head)
        if self.on_gpu:                                             # flash attention on tensor cores
            out, lse = cuda.attention_forward(qkv, n_head)
            self.qkv, self.lse, self.out, self.n_head = qkv, lse, out, n_head
            return out
        scale = 1.0 / math.sqrt(d)
        lse = xp.empty((b, n_head, t, 1), dtype=qkv.dtype)          # log-sum-exp of each query's scores
        out = xp.empty((b, t, c), dtype=qkv.dtype)
        chunks = _query_chunks(t)
        mask = keep_scale = None
        if dropout_p > 0:
            mask, keep_scale = dropout_mask((b, n_head, t, t), dropout_p, seed), 1.0 / (1.0 - dropout_p)
        if mask is None and _whole_in_c(qkv, lse, out):
            _over_pairs("attention_forward", (qkv, lse, out), b * n_head, n_head, kv, t, c, scale)
        else:
            forward = functools.partial(self._forward_block, n_head=n_head, n_kv=kv, scale=scale, chunks=chunks,
                                        keep_scale=keep_scale)
            for_blocks(forward, lse, qkv, out, mask, blas=True, block=_rows_block(t))
        # out is saved by reference (the next linear layer saves it too); ops never write into it
        self.qkv, self.lse, self.out, self.mask, self.keep_scale = qkv, lse, out, mask, keep_scale
        self.n_head, self.n_kv, self.scale, self.chunks = n_head, kv, scale, chunks
        return out

    @staticmethod
    def _forward_block(lse, qkv, out, mask, *, n_head, n_kv, scale, chunks, keep_scale):
        """The NumPy form of the forward on a few batch rows, chunk by chunk; arrays of heads are
        (b, Hk, G, T, D) (:func:`_heads`), keys and values broadcast over a group's G query heads."""
        xp, (b, t, c), g = B.xp, out.shape, n_head // n_kv
        ck = c // g
        q = _heads(qkv[..., :c], n_kv, g)
        k, v = _heads(qkv[..., c:c + ck], n_kv), _heads(qkv[..., c + ck:], n_kv)
        qs = _scaled_queries(q, scale)
        o = _heads(out, n_kv, g)                                    # products land with heads merged
        lse = lse.reshape(b, n_kv, g, t, 1)
        mask = None if mask is None else mask.reshape(b, n_kv, g, t, t)
        rinv = xp.empty(lse.shape, dtype=lse.dtype)                 # 1 / rowsum(E) per query
        for q0, q1 in zip(chunks, chunks[1:]):                      # keys [0, q1) only
            s = xp.matmul(qs[..., q0:q1, :], k[..., :q1, :].swapaxes(-1, -2))  # (b, Hk, G, q1 - q0, q1)
            r = rinv[..., q0:q1, :]
            if kernels.usable(s, rinv, lse):                        # E, 1 / rowsum(E), lse in one pass
                kernels.call("causal_softmax", s.dtype, s, r, lse[..., q0:q1, :], b * n_head, s.shape[-2] * s.shape[-1],
                             q1 - q0, q1, q1, q0, t)
            else:
                s[..., q0:] += _causal_bias(t, s.dtype)[q0:q1, q0:q1]  # -inf above the diagonal
                m = _row_max(s)
                s -= m
                xp.exp(s, out=s)                                    # E: unnormalised
                total = _row_sum(s)
                xp.divide(1.0, total, out=r)
                xp.add(m, xp.log(total), out=lse[..., q0:q1, :])
            pv = o[..., q0:q1, :]
            xp.matmul(s if mask is None else s * mask[..., q0:q1, :q1], v[..., :q1, :], out=pv)
            pv *= r if keep_scale is None else r * keep_scale       # O = (E V) / rowsum(E)

    def backward(self, g):
        xp = B.xp
        if self.on_gpu:
            g = xp.ascontiguousarray(g, dtype=self.qkv.dtype)
            return (cuda.attention_backward(self.qkv, self.out, self.lse, g, self.n_head),)
        h, kv, scale, keep_scale, chunks = self.n_head, self.n_kv, self.scale, self.keep_scale, self.chunks
        c = g.shape[-1]
        ck, grp = c // h * kv, h // kv
        dqkv = xp.empty(self.qkv.shape, dtype=self.qkv.dtype)
        t = g.shape[1]
        if self.mask is None and _whole_in_c(self.qkv, self.lse, self.out, g, dqkv):
            bounds = _bounds(chunks)
            _over_pairs("attention_backward", (self.qkv, self.lse, self.out, g, dqkv), g.shape[0] * kv, h, kv, t, c,
                        scale, bounds, len(bounds))
            return (dqkv,)

        def block(lse, qkv, g, out, mask, dqkv):                    # a few batch rows
            b = g.shape[0]
            q = _heads(qkv[..., :c], kv, grp)                       # (b, Hk, G, T, D)
            k, v = _heads(qkv[..., c:c + ck], kv), _heads(qkv[..., c + ck:], kv)  # (b, Hk, 1, T, D)
            qs = _scaled_queries(q, scale)
            go = _heads(g, kv, grp)
            lse = lse.reshape(b, kv, grp, t, 1)
            mask = None if mask is None else mask.reshape(b, kv, grp, t, t)
            # rowsum(dP * P) = dO . O per query (FlashAttention's identity; dropout included), a
            # (B, T, C) product instead of a pass over (B, H, T, T)
            rowdot = xp.einsum("bthd,bthd->bht", g.reshape(b, t, h, -1), out.reshape(b, t, h, -1))
            rowdot = rowdot.reshape(b, kv, grp, t, 1)
            dq, dk, dv = xp.empty(q.shape, dtype=q.dtype), xp.empty(k.shape, dtype=q.dtype), xp.empty(v.shape, dtype=q.dtype)
            # The last chunk sees every key: it runs first and writes dk and dv (no zero fill),
            # the others add into their keys' rows. Every chunk writes its own rows of dq. dK and
            # dV sum over a group's query heads: its heads and queries fold into one product.
            for q0, q1 in reversed(list(zip(chunks, chunks[1:]))):  # keys [0, q1) only
                pj = xp.matmul(qs[..., q0:q1, :], k[..., :q1, :].swapaxes(-1, -2))  # the scores again
                lj = lse[..., q0:q1, :]
                if kernels.usable(pj, lse):                         # P = exp(S - lse), one pass
                    kernels.call("causal_probs", pj.dtype, pj, lj, b * h, pj.shape[-2] * pj.shape[-1],
                                 q1 - q0, q1, q1, q0, t)
                else:
                    pj[..., q0:] += _causal_bias(t, pj.dtype)[q0:q1, q0:q1]
                    pj -= lj
                    xp.exp(pj, out=pj)
                # dropout: P as applied is P * mask * keep_scale; the scale goes on the small dO side
                # and the bool mask multiplies without promoting float32
                gj = go[..., q0:q1, :] if mask is None else go[..., q0:q1, :] * keep_scale
                pd = pj if mask is None else pj * mask[..., q0:q1, :q1]
                if q1 == t:
                    xp.matmul(_fold(pd).swapaxes(-1, -2), _fold(gj), out=dv)           # dV = P^T dO
                else:
                    dv[..., :q1, :] += xp.matmul(_fold(pd).swapaxes(-1, -2), _fold(gj))
                ds = xp.matmul(gj, v[..., :q1, :].swapaxes(-1, -2))                    # dP = dO V^T
                if mask is not None:
                    ds *= mask[..., q0:q1, :q1]
                rd = xp.ascontiguousarray(rowdot[..., q0:q1, :])
                if kernels.usable(ds, pj, rd):                      # dS = P (dP - rowdot), one pass
                    # (checked here: the incoming gradient's dtype decides ds's)
                    kernels.call("softmax_grad", ds.dtype, ds, pj, rd, b * h, ds.shape[-2] * ds.shape[-1],
                                 q1 - q0, q1, q1)
                else:
                    ds -= rd
                    ds *= pj                                        # dS (masked entries: P = 0)
                xp.matmul(ds, k[..., :q1, :], out=dq[..., q0:q1, :])
                if q1 == t:
                    xp.matmul(_fold(ds).swapaxes(-1, -2), _fold(q[..., q0:q1, :]), out=dk)
                else:
                    dk[..., :q1, :] += xp.matmul(_fold(ds).swapaxes(-1, -2), _fold(q[..., q0:q1, :]))
            for grad, cols, factor in ((dq, slice(0, c), scale), (dk, slice(c, c + ck), scale),
                                       (dv, slice(c + ck, None), None)):
                _merge_heads(grad.reshape(b, -1, t, grad.shape[-1]), dqkv[..., cols], factor)

        for_blocks(block, self.lse, self.qkv, g, self.out, self.mask, dqkv, blas=True, block=_rows_block(t))
        return (dqkv,)


def causal_self_attention(qkv, n_head, dropout_p=0.0, seed=None, n_kv_head=None):
    """Causal multi-head self-attention on a fused ``qkv`` (B, T, C + 2 Ck) -> (B, T, C).

    ``C = n_head D`` query columns, then ``Ck = n_kv_head D`` key and ``Ck`` value columns
    (``n_kv_head`` None: ``n_head``, GPT-2's (B, T, 3C)); with fewer key/value heads than query
    heads (grouped-query attention) query head ``h`` reads key/value head ``h // (n_head /
    n_kv_head)``. Scores are scaled by ``1/sqrt(D)`` and position ``t`` attends to positions ``<= t``. With
    ``dropout_p > 0`` the probabilities are dropped out (inverted scaling) with a mask that is a
    pure function of ``seed`` and the shape; ``seed`` is then required. ``dropout_p == 0`` does
    no mask work at all.
    """
    _check_p(dropout_p, "causal_self_attention", "dropout_p")
    return CausalSelfAttentionOp.apply(qkv, n_head=n_head, dropout_p=dropout_p, seed=seed, n_kv_head=n_kv_head)


# ------------------------------------------------------------------------------------------
# rotary position embeddings (RoPE) on the fused qkv, before the attention op
# ------------------------------------------------------------------------------------------
_ROTARY_CACHE: dict = {}


def rotary_tables(t: int, head_dim: int, theta: float, dtype):
    """``(cos, sin)``, each (T, D/2): ``angle[p, i] = p * theta^(-2i/D)`` for positions ``p < T``.
    Computed in float64 on the host, cast to ``dtype`` on the current backend, cached per shape."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings: head dimension {head_dim} must be even")
    key = (t, head_dim, float(theta), str(dtype), B.xp.__name__)
    if key not in _ROTARY_CACHE:
        inv_freq = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (D/2,)
        angle = np.outer(np.arange(t, dtype=np.float64), inv_freq)                             # (T, D/2)
        _ROTARY_CACHE[key] = tuple(B.xp.asarray(f(angle), dtype=dtype) for f in (np.cos, np.sin))
    return _ROTARY_CACHE[key]


def _rotate(src, dst, cos, sin, sign: float) -> None:
    """``dst = rotate(src)`` per head, halves ``(x1, x2)`` of each (…, D) head vector:
    ``(x1 cos - s x2 sin, x2 cos + s x1 sin)`` with ``s = sign`` (-1: the inverse rotation)."""
    h = src.shape[-1] // 2
    x1, x2 = src[..., :h], src[..., h:]
    B.xp.multiply(x1, cos, out=dst[..., :h])
    dst[..., :h] -= sign * (x2 * sin)
    B.xp.multiply(x2, cos, out=dst[..., h:])
    dst[..., h:] += sign * (x1 * sin)


@float32_compute
class RotaryEmbedding(Function):
    """q and k of a fused qkv rotated by position (GPT-NeoX / Llama "rotate half" form); v copied.

    The rotation is orthogonal, so the backward is the inverse rotation of the incoming gradient;
    nothing but the tables is saved.
    """

    def forward(self, qkv, cos, sin, n_kv_head=None):
        t, w = qkv.shape[1:]
        d = 2 * cos.shape[-1]
        heads = w // d if d and w % d == 0 else 0                  # q, k and v heads together
        kv = heads // 3 if n_kv_head is None else n_kv_head
        if not heads or heads <= 2 * kv or (n_kv_head is None and heads % 3) or cos.shape != (t, d // 2) \
                or sin.shape != cos.shape:
            raise ValueError(f"rotary_embedding: qkv (B, T, C + 2 Ck) {qkv.shape} does not fit tables of shape "
                             f"{cos.shape} (T, D/2) with D dividing C" + (f" and n_kv_head={n_kv_head}" if n_kv_head else ""))
        self.cos, self.sin = cos[:, None, :], sin[:, None, :]     # (T, 1, D/2): broadcast over heads
        self.n_qk = heads - kv                                    # heads of q and k together
        return self._apply(qkv, 1.0)

    def backward(self, g):
        return (self._apply(g, -1.0),)

    def _apply(self, a, sign: float):
        b, t, w = a.shape
        d, n_qk = 2 * self.cos.shape[-1], self.n_qk
        src = a.reshape(b, t, w // d, d)                           # (B, T, H + 2 Hk, D): q, k, v heads
        out = B.xp.empty(src.shape, dtype=a.dtype)
        _rotate(src[:, :, :n_qk], out[:, :, :n_qk], self.cos, self.sin, sign)
        out[:, :, n_qk:] = src[:, :, n_qk:]                        # v passes through
        return out.reshape(a.shape)


def rotary_embedding(qkv, cos, sin, n_kv_head=None):
    """Rotary position embeddings on a fused ``qkv`` (B, T, C + 2 Ck): every head of q and k (head
    size ``D = 2 * cos.shape[-1]``) is rotated by its position, v (the last ``n_kv_head`` heads;
    None: a third of them, ``Ck = C``) is unchanged. ``cos``/``sin`` are (T, D/2) arrays
    (:func:`rotary_tables`), constants. Works on a tp rank's local qkv too (``[q_r | k_r | v_r]``,
    whole heads, ``n_kv_head`` the local count)."""
    return RotaryEmbedding.apply(qkv, cos=cos, sin=sin, n_kv_head=n_kv_head)
