"""Rotary position embeddings (RoPE) on the fused qkv, before the attention op
(:func:`rotary_embedding`, with the cached angle tables of :func:`rotary_tables`)."""
from __future__ import annotations

import numpy as np

import mpirt.core.backend as B
from mpirt.core.precision import float32_compute
from mpirt.core.tensor import Function, given_up

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
    if B.xp.may_share_memory(src, dst):                        # in place: the first half is written first
        x1 = x1.copy()
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

    def forward(self, qkv, cos, sin, n_kv_head=None, into_input=False):
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
        return self._apply(qkv, 1.0, in_place=into_input and qkv.flags.c_contiguous and B.writeable(qkv))

    def backward(self, g):
        return (self._apply(g, -1.0),)

    def _apply(self, a, sign: float, in_place: bool = False):
        """``a`` rotated by ``sign``: a new array, or ``a`` itself rotated in place (v is already
        there)."""
        b, t, w = a.shape
        d, n_qk = 2 * self.cos.shape[-1], self.n_qk
        src = a.reshape(b, t, w // d, d)                           # (B, T, H + 2 Hk, D): q, k, v heads
        out = src if in_place else B.xp.empty(src.shape, dtype=a.dtype)
        _rotate(src[:, :, :n_qk], out[:, :, :n_qk], self.cos, self.sin, sign)
        if in_place:
            return a
        out[:, :, n_qk:] = src[:, :, n_qk:]                        # v passes through
        return out.reshape(a.shape)


def rotary_embedding(qkv, cos, sin, n_kv_head=None, into_input=False):
    """Rotary position embeddings on a fused ``qkv`` (B, T, C + 2 Ck): every head of q and k (head
    size ``D = 2 * cos.shape[-1]``) is rotated by its position, v (the last ``n_kv_head`` heads;
    None: a third of them, ``Ck = C``) is unchanged. ``cos``/``sin`` are (T, D/2) arrays
    (:func:`rotary_tables`), constants. Works on a tp rank's local qkv too (``[q_r | k_r | v_r]``,
    whole heads, ``n_kv_head`` the local count). ``into_input=True``: the caller gives ``qkv`` up
    (the projection's output, nothing saved it) and the rotation is written into it, leaving no
    hole in the host heap (docs/memory.md, "the heap's holes")."""
    return RotaryEmbedding.apply(qkv, cos=cos, sin=sin, n_kv_head=n_kv_head, into_input=into_input and given_up(qkv))
