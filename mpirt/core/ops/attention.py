"""Causal multi-head self-attention as one fused Function, and the attention block it is made of.

**One block.** :func:`block_forward` attends a block of queries to a block of keys and values,
causally (a diagonal block) or to every key, and returns the output and each query's log-sum-exp;
:func:`block_backward` gives the block's gradients from the output gradient and the (merged)
output and log-sum-exp. The kernel choice is inside: CUDA's flash attention or the whole C kernel
where they take the arrays, else the chunked xp form below. The whole-sequence op is one causal
block; ring attention (:mod:`mpirt.parallel.context`) runs the same blocks and merges them.

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
no dropout and a head dimension in :data:`mpirt.gpu.cuda.HEAD_DIMS`, both passes are the flash
attention of :mod:`mpirt.gpu.cuda` (tensor cores, float32 accumulation, the same ``lse``, kept in
float32; the backward's dQ gathered over key blocks in float32).

Over 400 lines: the attention block's two passes in their three forms (flash, C, xp), read together.
"""
from __future__ import annotations

import functools
import math

import numpy as np

import mpirt.core.backend as B
from mpirt.cpu import kernels
from mpirt.gpu import cuda
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


def split_qkv(qkv, n_head, n_kv_head=None):
    """``(q, kv)`` views of a fused (B, T, C + 2 Ck) ``qkv``: the queries (B, T, C) and the keys
    and values side by side (B, T, 2 Ck), as :func:`block_forward` takes them apart."""
    c, _, _ = _layout(qkv, n_head, n_kv_head)
    return qkv[..., :c], qkv[..., c:]


def _widths(q, kv, n_head, n_kv_head, causal):
    """``(C, Ck, D)`` of a block's inputs (:func:`block_forward`), checked."""
    if kv is None:
        return _layout(q, n_head, n_kv_head)
    n_kv = n_head if n_kv_head is None else n_kv_head
    d = q.shape[-1] // n_head if q.ndim == 3 and n_head > 0 else 0
    if (not d or kv.ndim != 3 or q.shape[-1] != n_head * d or kv.shape[-1] != 2 * n_kv * d or n_head % n_kv
            or kv.shape[0] != q.shape[0] or (causal and kv.shape[1] != q.shape[1])):
        raise ValueError(f"attention block: queries {q.shape} (B, Tq, n_head D) and keys/values {kv.shape} "
                         f"(B, Tk, 2 n_kv_head D) do not fit n_head={n_head}, n_kv_head={n_kv}"
                         + (" with Tq = Tk (a causal block)" if causal else ""))
    return n_head * d, n_kv * d, d


def _flash(qkv, n_head, n_kv) -> bool:
    """Whether CUDA's flash attention runs a whole causal block (no dropout, as many key/value
    heads as query heads: its kernels read one of each per query head)."""
    return n_kv == n_head and cuda.attention_takes(qkv, n_head)


def block_forward(q, n_head, n_kv_head=None, *, kv=None, causal=True, mask=None, keep_scale=None):
    """One attention block: queries against keys and values, ``(out, lse)``.

    ``kv`` None: ``q`` is a fused (B, T, C + 2 Ck) qkv, queries against their own keys and values
    (the whole-sequence op is this block); else ``q`` holds the queries (B, Tq, C) and ``kv`` the
    keys and values (B, Tk, 2 Ck). ``causal``: query ``i`` sees keys ``<= i`` (Tq = Tk), else
    every key. ``mask`` (B, H, Tq, Tk) bool keeps probabilities (dropout), scaled by
    ``keep_scale``. Returns ``out`` (B, Tq, C) and ``lse`` (B, H, Tq, 1), each query's
    log-sum-exp of its scaled scores (float32 on the flash kernel), what :func:`block_backward`
    and a merge of blocks need. Runs CUDA's flash attention or the whole C kernel where they take
    the arrays (a fused causal block without dropout), else the chunked xp form.
    """
    xp = B.xp
    c, ck, d = _widths(q, kv, n_head, n_kv_head, causal)
    b, tq = q.shape[:2]
    n_kv, scale = ck // d, 1.0 / math.sqrt(d)
    whole = kv is None and causal and mask is None
    if whole and _flash(q, n_head, n_kv):                           # flash attention on tensor cores
        return cuda.attention_forward(q, n_head)
    lse = xp.empty((b, n_head, tq, 1), dtype=q.dtype)
    out = xp.empty((b, tq, c), dtype=q.dtype)
    if whole and _whole_in_c(q, lse, out):
        _over_pairs("attention_forward", (q, lse, out), b * n_head, n_head, n_kv, tq, c, scale)
        return out, lse
    queries, kv = (q[..., :c], q[..., c:]) if kv is None else (q, kv)
    forward = functools.partial(_forward_rows, n_head=n_head, n_kv=n_kv, causal=causal, scale=scale,
                                keep_scale=keep_scale)
    for_blocks(forward, lse, queries, kv, out, mask, blas=True, block=_rows_block(kv.shape[1]))
    return out, lse


def _keys(q0, q1, tk, causal):
    """``(keys, offset)`` of query chunk ``[q0, q1)``: the keys it reads, ``[0, keys)``, and the
    kernels' causal offset (query ``q0 + i`` sees keys ``<= offset + i``; ``tk``: all of them)."""
    return (q1, q0) if causal else (tk, tk)


def _forward_rows(lse, q, kv, out, mask, *, n_head, n_kv, causal, scale, keep_scale):
    """The xp form of :func:`block_forward` on a few batch rows, chunk by chunk; arrays of heads
    are (b, Hk, G, T, D) (:func:`_heads`), keys and values broadcast over a group's G query heads."""
    xp, (b, tq, c), g, tk = B.xp, out.shape, n_head // n_kv, kv.shape[1]
    ck = c // g
    qs = _scaled_queries(_heads(q, n_kv, g), scale)
    k, v = _heads(kv[..., :ck], n_kv), _heads(kv[..., ck:], n_kv)
    o = _heads(out, n_kv, g)                                        # products land with heads merged
    lse = lse.reshape(b, n_kv, g, tq, 1)
    mask = None if mask is None else mask.reshape(b, n_kv, g, tq, tk)
    rinv = xp.empty(lse.shape, dtype=lse.dtype)                     # 1 / rowsum(E) per query
    chunks = _query_chunks(tq)
    for q0, q1 in zip(chunks, chunks[1:]):
        keys, offset = _keys(q0, q1, tk, causal)
        s = xp.matmul(qs[..., q0:q1, :], k[..., :keys, :].swapaxes(-1, -2))  # (b, Hk, G, q1 - q0, keys)
        r = rinv[..., q0:q1, :]
        if kernels.usable(s, rinv, lse):                            # E, 1 / rowsum(E), lse in one pass
            kernels.call("causal_softmax", s.dtype, s, r, lse[..., q0:q1, :], b * n_head, s.shape[-2] * s.shape[-1],
                         q1 - q0, keys, keys, offset, tq)
        else:
            if causal:
                s[..., q0:] += _causal_bias(tq, s.dtype)[q0:q1, q0:q1]  # -inf above the diagonal
            m = _row_max(s)
            s -= m
            xp.exp(s, out=s)                                        # E: unnormalised
            total = _row_sum(s)
            xp.divide(1.0, total, out=r)
            xp.add(m, xp.log(total), out=lse[..., q0:q1, :])
        pv = o[..., q0:q1, :]
        xp.matmul(s if mask is None else s * mask[..., q0:q1, :keys], v[..., :keys, :], out=pv)
        pv *= r if keep_scale is None else r * keep_scale           # O = (E V) / rowsum(E)


def block_backward(q, lse, out, grad, n_head, n_kv_head=None, *, kv=None, causal=True, mask=None,
                   keep_scale=None):
    """The gradients of one attention block (:func:`block_forward`'s arguments) from the output
    gradient ``grad`` (B, Tq, C), with ``out`` and ``lse`` the block's output and log-sum-exp, or
    where blocks were merged (ring attention) the merged ones for these queries. Returns the
    gradient of ``q`` (B, T, C + 2 Ck) when ``kv`` is None, else ``(dq, dkv)`` (B, Tq, C) and
    (B, Tk, 2 Ck)."""
    xp = B.xp
    c, ck, d = _widths(q, kv, n_head, n_kv_head, causal)
    n_kv, scale = ck // d, 1.0 / math.sqrt(d)
    whole = kv is None and causal and mask is None
    if whole and _flash(q, n_head, n_kv):
        return cuda.attention_backward(q, out, lse, xp.ascontiguousarray(grad, dtype=q.dtype), n_head)
    b, tq = grad.shape[:2]
    fused = kv is None
    if fused:
        dqkv = xp.empty(q.shape, dtype=q.dtype)
        if whole and _whole_in_c(q, lse, out, grad, dqkv):
            bounds = _bounds(_query_chunks(tq))
            _over_pairs("attention_backward", (q, lse, out, grad, dqkv), b * n_kv, n_head, n_kv, tq, c, scale, bounds,
                        len(bounds))
            return dqkv
        (q, kv), (dq, dkv) = (q[..., :c], q[..., c:]), (dqkv[..., :c], dqkv[..., c:])
    else:
        dq, dkv = xp.empty(q.shape, dtype=q.dtype), xp.empty(kv.shape, dtype=q.dtype)
    backward = functools.partial(_backward_rows, n_head=n_head, n_kv=n_kv, causal=causal, scale=scale,
                                 keep_scale=keep_scale)
    for_blocks(backward, lse, q, kv, grad, out, mask, dq, dkv, blas=True, block=_rows_block(kv.shape[1]))
    return dqkv if fused else (dq, dkv)


def _backward_rows(lse, q, kv, g, out, mask, dq_out, dkv_out, *, n_head, n_kv, causal, scale, keep_scale):
    """The xp form of :func:`block_backward` on a few batch rows, chunk by chunk (last first)."""
    xp, (b, tq, c), grp, tk = B.xp, g.shape, n_head // n_kv, kv.shape[1]
    ck = c // grp
    qh = _heads(q, n_kv, grp)                                       # (b, Hk, G, Tq, D)
    k, v = _heads(kv[..., :ck], n_kv), _heads(kv[..., ck:], n_kv)   # (b, Hk, 1, Tk, D)
    qs = _scaled_queries(qh, scale)
    go = _heads(g, n_kv, grp)
    lse = lse.reshape(b, n_kv, grp, tq, 1)
    mask = None if mask is None else mask.reshape(b, n_kv, grp, tq, tk)
    # rowsum(dP * P) = dO . O per query (FlashAttention's identity; dropout included), a
    # (B, T, C) product instead of a pass over (B, H, T, T)
    rowdot = xp.einsum("bthd,bthd->bht", g.reshape(b, tq, n_head, -1), out.reshape(b, tq, n_head, -1))
    rowdot = rowdot.reshape(b, n_kv, grp, tq, 1)
    dq, dk, dv = (xp.empty(a.shape, dtype=qh.dtype) for a in (qh, k, v))
    # The last chunk sees every key: it runs first and writes dk and dv (no zero fill), the others
    # add into their keys' rows. Every chunk writes its own rows of dq. dK and dV sum over a
    # group's query heads: its heads and queries fold into one product.
    chunks = _query_chunks(tq)
    for n, (q0, q1) in enumerate(reversed(list(zip(chunks, chunks[1:])))):
        keys, offset = _keys(q0, q1, tk, causal)
        pj = xp.matmul(qs[..., q0:q1, :], k[..., :keys, :].swapaxes(-1, -2))  # the scores again
        lj = lse[..., q0:q1, :]
        if kernels.usable(pj, lse):                                 # P = exp(S - lse), one pass
            kernels.call("causal_probs", pj.dtype, pj, lj, b * n_head, pj.shape[-2] * pj.shape[-1], q1 - q0, keys,
                         keys, offset, tq)
        else:
            if causal:
                pj[..., q0:] += _causal_bias(tq, pj.dtype)[q0:q1, q0:q1]
            pj -= lj
            xp.exp(pj, out=pj)
        # dropout: P as applied is P * mask * keep_scale; the scale goes on the small dO side and
        # the bool mask multiplies without promoting float32
        gj = go[..., q0:q1, :] if mask is None else go[..., q0:q1, :] * keep_scale
        pd = pj if mask is None else pj * mask[..., q0:q1, :keys]
        if n == 0:
            xp.matmul(_fold(pd).swapaxes(-1, -2), _fold(gj), out=dv)               # dV = P^T dO
        else:
            dv[..., :keys, :] += xp.matmul(_fold(pd).swapaxes(-1, -2), _fold(gj))
        ds = xp.matmul(gj, v[..., :keys, :].swapaxes(-1, -2))                        # dP = dO V^T
        if mask is not None:
            ds *= mask[..., q0:q1, :keys]
        rd = xp.ascontiguousarray(rowdot[..., q0:q1, :])
        if kernels.usable(ds, pj, rd):                              # dS = P (dP - rowdot), one pass
            # (checked here: the incoming gradient's dtype decides ds's)
            kernels.call("softmax_grad", ds.dtype, ds, pj, rd, b * n_head, ds.shape[-2] * ds.shape[-1], q1 - q0, keys,
                         keys)
        else:
            ds -= rd
            ds *= pj                                                # dS (masked entries: P = 0)
        xp.matmul(ds, k[..., :keys, :], out=dq[..., q0:q1, :])
        if n == 0:
            xp.matmul(_fold(ds).swapaxes(-1, -2), _fold(qh[..., q0:q1, :]), out=dk)
        else:
            dk[..., :keys, :] += xp.matmul(_fold(ds).swapaxes(-1, -2), _fold(qh[..., q0:q1, :]))
    for grad, dst, factor, t in ((dq, dq_out, scale, tq), (dk, dkv_out[..., :ck], scale, tk),
                                 (dv, dkv_out[..., ck:], None, tk)):
        _merge_heads(grad.reshape(b, -1, t, grad.shape[-1]), dst, factor)


@float32_compute
class CausalSelfAttentionOp(Function):
    """The whole sequence's causal attention: one :func:`block_forward` / :func:`block_backward`."""

    def runs_half(self, qkv, n_head, dropout_p=0.0, seed=None, n_kv_head=None):
        return dropout_p == 0 and _flash(qkv, n_head, n_head if n_kv_head is None else n_kv_head)

    def forward(self, qkv, n_head, dropout_p=0.0, seed=None, n_kv_head=None):
        b, t = qkv.shape[:2]
        mask = keep_scale = None
        if dropout_p > 0:
            mask, keep_scale = dropout_mask((b, n_head, t, t), dropout_p, seed), 1.0 / (1.0 - dropout_p)
        self.on_gpu = self.runs_half(qkv, n_head, dropout_p, seed, n_kv_head)  # the block runs flash attention
        out, lse = block_forward(qkv, n_head, n_kv_head, mask=mask, keep_scale=keep_scale)
        # out is saved by reference (the next linear layer saves it too); ops never write into it
        self.qkv, self.lse, self.out, self.mask, self.keep_scale = qkv, lse, out, mask, keep_scale
        self.n_head, self.n_kv_head = n_head, n_kv_head
        return out

    def backward(self, g):
        return (block_backward(self.qkv, self.lse, self.out, g, self.n_head, self.n_kv_head, mask=self.mask,
                               keep_scale=self.keep_scale),)


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
