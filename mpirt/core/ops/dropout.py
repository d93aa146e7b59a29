"""Dropout whose masks are a function of each element's place in the global batch, not of the
rank that holds it.

An element is kept when a hash of (mask key, global index) clears ``p``: the key names the
Dropout module and the step (:class:`MaskSource`); the global index is the element's position in
the step's whole activation: its row in the global batch, then the other dimensions at their
full, unsplit extent. A rank holding rows ``[r0, r0 + b)`` of the batch, or the tokens or heads
``[k n, (k + 1) n)`` of dimension 1 split over tp, draws exactly the elements the single rank
draws there: any dp x pp x tp layout, with any micro-batching, gives the single-rank masks.

The hash is SplitMix64 (Steele, Lea and Flood 2014) at position ``index + 1`` of the stream seeded
with the key: ``z = key + (index + 1) * 0x9E3779B97F4A7C15``, then its 64-bit finaliser; the top
24 bits against ``p``. It is counter based (any element is drawn on its own, in any order) and
runs on the active backend's uint64 arithmetic, so NumPy and CuPy draw the same masks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import mpirt.core.backend as B
from mpirt.core.precision import float32_compute
from mpirt.core.tensor import Function

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
UNIFORM_BITS = 24  # a kept element's draw is its hash's top 24 bits over 2**24
MASK_BLOCK = 1 << 18  # elements hashed at a time (two uint64 arrays of this size are the transient)


def _mix(z):
    """SplitMix64's finaliser, on a Python int or in place on a uint64 array (wrapping mod 2**64)."""
    if isinstance(z, int):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


@dataclass(frozen=True)
class MaskSource:
    """Where a dropout mask comes from. ``key``: integers naming the mask stream (a Dropout
    module's seed and the step); ``row0``: the global batch row of the local array's first row;
    ``split``: ``(rank, size)`` when dimension 1 (tokens under sequence parallelism, heads in the
    attention) is split into ``size`` equal parts of which the array holds part ``rank``;
    ``spans``: ``((dim, full, runs), ...)`` where dimension ``dim`` (before ``split``'s part is
    taken) holds the runs ``((start, length), ...)`` of a dimension of extent ``full`` one after
    the other (context parallelism's two chunks of the sequence, a ring attention block's queries
    and keys)."""

    key: tuple
    row0: int = 0
    split: tuple | None = None
    spans: tuple = ()

    def stream(self) -> int:
        """The 64-bit seed of this mask's SplitMix64 stream."""
        z = 0
        for k in self.key:
            z = _mix(((z ^ (int(k) & MASK64)) + GOLDEN) & MASK64)
        return z

    def places(self, shape) -> tuple[list, list]:
        """``(index, full)``: per dimension of a local array of ``shape``, the global index of each
        of its positions (NumPy int64) and the dimension's global extent (None for the rows)."""
        index = [np.arange(n, dtype=np.int64) for n in shape]
        full: list = [None, *shape[1:]]
        index[0] += self.row0
        if self.split is not None:
            rank, size = self.split
            index[1] += rank * shape[1]
            full[1] = size * shape[1]
        for dim, extent, runs in self.spans:
            held = np.concatenate([np.arange(start, start + n, dtype=np.int64) for start, n in runs])
            if len(held) != (full[dim] if dim == 1 else shape[dim]):
                raise ValueError(f"dropout: spans of dimension {dim} hold {len(held)} positions, the array "
                                 f"{full[dim] if dim == 1 else shape[dim]}")
            index[dim], full[dim] = held[index[dim]], extent
        return index, full


def as_mask_source(seed) -> MaskSource:
    """``seed`` as a :class:`MaskSource`: one already, or an int / tuple of ints (the key of an
    array that is the whole batch)."""
    if isinstance(seed, MaskSource):
        return seed
    if seed is None:
        raise ValueError("dropout: a seed is required (masks must be reproducible)")
    return MaskSource(tuple(seed) if isinstance(seed, (tuple, list)) else (int(seed),))


def dropout_mask(shape, p: float, seed):
    """Boolean keep-mask of ``shape`` with ``P(keep) = 1 - p``: element ``i`` is kept when the hash
    of its global index (see the module docstring) clears ``p``. ``seed``: a :class:`MaskSource`,
    or an int / tuple for an array that is the whole batch."""
    src = as_mask_source(seed)
    xp, shape = B.xp, tuple(int(n) for n in shape)
    if len(shape) < 2:
        return dropout_mask((1, *shape), p, src).reshape(shape)
    index, full = src.places(shape)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * full[d + 1]
    # the last two dimensions' global indices as (rows, C) blocks of at most MASK_BLOCK elements,
    # each reused for every leading index (a (T, T) attention mask at T = 4096 would otherwise
    # take two 128 MiB uint64 transients)
    u64 = np.uint64
    threshold = u64(math.ceil(p * (1 << UNIFORM_BITS)))
    stream = u64(src.stream())
    keep = xp.empty(shape, dtype=bool)
    cols = xp.asarray(index[-1].astype(u64))[None, :]
    step = max(1, MASK_BLOCK // max(shape[-1], 1))
    for r0 in range(0, shape[-2], step):
        r1 = min(r0 + step, shape[-2])
        block = xp.asarray(index[-2][r0:r1].astype(u64))[:, None] * u64(strides[-2]) + cols
        z = xp.empty(block.shape, dtype=u64)
        for lead in np.ndindex(*shape[:-2]):
            base = sum(int(index[d][i]) * strides[d] for d, i in enumerate(lead))
            xp.add(block, u64((base + 1) & MASK64), out=z)
            z *= u64(GOLDEN)
            z += stream
            _mix(z)
            z >>= u64(64 - UNIFORM_BITS)
            xp.greater_equal(z, threshold, out=keep[lead][r0:r1])
    return keep


@float32_compute
class DropoutOp(Function):
    def forward(self, x, p=0.5, seed=None):
        self.mask, self.scale = dropout_mask(x.shape, p, seed), 1.0 / (1.0 - p)
        y = x * self.mask
        y *= self.scale
        return y

    def backward(self, g):
        gx = g * self.mask
        gx *= self.scale
        return (gx,)


def _check_p(p, op="dropout", arg="p"):
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{op}: {arg} must satisfy 0 <= {arg} < 1, got {arg}={p}")


def dropout(x, p, seed, training=True):
    """Inverted dropout: zero each element with probability ``p`` and scale the rest by ``1/(1-p)``.

    The mask is :func:`dropout_mask` of ``x.shape`` and ``seed`` (a :class:`MaskSource`, or an int
    / tuple when ``x`` is the whole batch): a run is reproducible, a recomputed forward gives the
    same mask, and a shard of the batch gets the shard of the whole batch's mask. With ``p == 0``
    or ``training=False`` it returns ``x`` itself and records nothing. Requires ``0 <= p < 1``.
    """
    _check_p(p)
    if p == 0 or not training:
        return x
    return DropoutOp.apply(x, p=p, seed=seed)
