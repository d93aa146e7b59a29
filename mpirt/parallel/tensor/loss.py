"""Vocabulary-parallel output: the tied head on a vocabulary-split table and the cross-entropy
of vocabulary-split logits, computed without gathering them (two allreduces)."""
from __future__ import annotations

import math

import numpy as np

import mpirt.core.backend as B
from mpirt.core import ops
from mpirt.core.ops.fused import check_targets, reduce_nll
from mpirt.core.precision import compute_dtype, float32_compute
from mpirt.core.tensor import Function, Tensor

from .mappings import copy_to_tp
from .layers import SeqParallelLinear, linear_input_calls


@float32_compute(keep_output=True)
class VocabParallelCrossEntropy(Function):
    """Cross-entropy of vocabulary-split logits (N, V_local) without gathering them (see the
    package docstring). Columns at global index ``>= vocab_size`` (padding) are excluded: they
    never win the max and add nothing to the sum. Two allreduces: the row max, then the row sum of
    exponentials together with the target logit. Saves the local softmax (N, V_local); the
    backward turns it in place into ``(softmax - onehot) * g / count`` (local, no communication)."""

    def forward(self, logits, targets, comm=None, start=0, vocab_size=None, ignore_index=-100,
                reduction="mean"):
        xp = B.xp
        targets = check_targets(logits, targets, reduction)
        vl = logits.shape[-1]
        x = logits.reshape(-1, vl)
        n = x.shape[0]
        t = targets.reshape(-1).astype(xp.int64)
        valid = t != ignore_index
        if bool((((t < 0) | (t >= vocab_size)) & valid).any()):
            raise IndexError(f"cross_entropy: targets must be in [0, {vocab_size}) or ignore_index={ignore_index}")
        real = max(0, min(vl, vocab_size - start))                 # columns that are not padding
        m = x[:, :real].max(axis=1) if real else xp.full(n, -math.inf, dtype=x.dtype)
        comm.allreduce(m, "max", out=m)
        p = xp.zeros_like(x)
        xp.subtract(x[:, :real], m[:, None], out=p[:, :real])
        xp.exp(p[:, :real], out=p[:, :real])
        local_t = t - start
        owned = valid & (local_t >= 0) & (local_t < real)
        local_t = xp.where(owned, local_t, 0)
        sums = xp.empty((2, n), dtype=x.dtype)
        p.sum(axis=1, out=sums[0])
        sums[1] = x[xp.arange(n), local_t]
        sums[1] *= owned
        comm.allreduce(sums, "sum", out=sums)
        s, zt = sums[0], sums[1]
        p *= (1.0 / s)[:, None]                                     # local softmax
        nll = xp.log(s)
        nll += m
        nll -= zt
        loss, count = reduce_nll(nll, valid, reduction)
        self.p, self.t, self.owned, self.valid, self.count = p, local_t, owned, valid, count
        self.reduction, self.shape = reduction, logits.shape
        return xp.asarray(loss, dtype=x.dtype)

    def backward(self, g):
        if getattr(self, "p", None) is None:
            raise RuntimeError("vocab_parallel_cross_entropy: backward ran twice (its buffer is consumed)")
        xp, p = B.xp, self.p
        self.p = None
        scale = xp.asarray(g, dtype=p.dtype)
        if self.reduction == "mean":
            scale = scale / xp.maximum(self.count, 1.0)
        rowscale = self.valid.astype(p.dtype)
        rowscale *= scale
        p *= rowscale[:, None]
        rows = xp.flatnonzero(self.owned)
        p[rows, self.t[rows]] -= rowscale[rows]
        return p.reshape(self.shape), None


def vocab_parallel_cross_entropy(logits, targets, comm, vocab_size=None, ignore_index=-100, reduction="mean"):
    """Mean (or summed) cross-entropy of logits split over tp along the last dimension.

    ``logits`` (..., V_local) holds columns ``[rank V_local, (rank+1) V_local)`` of the (padded)
    vocabulary; ``vocab_size`` is the real vocabulary (default ``t * V_local``: no padding), and
    columns beyond it are ignored. ``targets`` (...) are global ids; ``ignore_index`` ones count
    for nothing. Equal to ``ops.cross_entropy`` on the gathered, unpadded logits.
    """
    vl = logits.shape[-1]
    vocab_size = vl * comm.size if vocab_size is None else vocab_size
    t = targets.data if isinstance(targets, Tensor) else targets
    return VocabParallelCrossEntropy.apply(logits, t, comm=comm, start=comm.rank * vl, vocab_size=vocab_size,
                                           ignore_index=ignore_index, reduction=reduction)


class VocabParallelHead:
    """The tied output projection on a vocabulary-split table: ``logits_r = x @ W_r^T``
    (B, T, V'/t). ``x`` is replicated (``f`` before the matmul) or, with sequence parallelism,
    sequence-split (allgathered, as a column-parallel linear). Call as ``head(x, table)``."""

    def __init__(self, comm, sequence_parallel=False, regather=True):
        self.comm, self.sequence_parallel, self.regather = comm, sequence_parallel, regather

    def tp_calls(self, tokens: int, width: int, dtype) -> tuple[list, list]:
        """``(kind, bytes, dtype)`` of the tp calls of one forward and one backward over ``tokens``
        tokens of ``width`` features in ``dtype``: a column-parallel product's input
        (:func:`~mpirt.parallel.tensor.layers.linear_input_calls`)."""
        return linear_input_calls(self.comm, self.sequence_parallel, self.regather, tokens * width, dtype)

    def __call__(self, x, weight):
        wt = ops.transpose(weight, (1, 0))                                 # (C, V'/t)
        if self.sequence_parallel:
            return SeqParallelLinear.apply(x, wt, comm=self.comm, dim=1, regather=self.regather)
        b, t, c = x.shape
        logits = ops.matmul(ops.reshape(copy_to_tp(x, self.comm), (b * t, c)), wt)
        return ops.reshape(logits, (b, t, weight.shape[0]))


class VocabParallelLoss:
    """Mean cross-entropy of vocabulary-split logits (B, T, V'/t) against (B, T) targets; -100
    entries are ignored, padded columns masked. Call as ``loss(logits, targets)``."""

    def __init__(self, comm, vocab_size: int, ignore_index: int = -100):
        self.comm, self.vocab_size, self.ignore_index = comm, vocab_size, ignore_index

    def tp_calls(self, tokens: int, dtype) -> tuple[list, list]:
        """``(kind, bytes, dtype)`` of the tp calls of one forward and one backward over ``tokens``
        tokens of logits in ``dtype``: the row max, then the row sums with the target logits
        (float32 for half logits); nothing backward."""
        if self.comm.size == 1:
            return [], []
        rows = np.dtype(compute_dtype(dtype))
        return [("allreduce", tokens * rows.itemsize, rows.name), ("allreduce", 2 * tokens * rows.itemsize, rows.name)], []

    def __call__(self, logits, targets):
        t = targets.data if isinstance(targets, Tensor) else B.xp.asarray(targets)
        if tuple(t.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"targets: shape {tuple(t.shape)} does not match logits {tuple(logits.shape[:-1])}")
        vl = logits.shape[-1]
        return vocab_parallel_cross_entropy(ops.reshape(logits, (-1, vl)), t.reshape(-1), self.comm,
                                            self.vocab_size, self.ignore_index)
