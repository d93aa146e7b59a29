"""Tensor parallelism (Megatron-LM) and sequence parallelism over one ``tp`` communicator.

Notation: ``t`` ranks in the tp group, this rank ``r``; activations ``X`` of shape (B, T, C).

**Column-parallel linear** ``Y = X A + b`` with ``A = [A_0 | ... | A_{t-1}]`` split by output
columns: rank r computes ``Y_r = X A_r + b_r`` (its slice of the output features) from the full X.
**Row-parallel linear** ``Z = Y W + c`` with ``W = [W_0; ...; W_{t-1}]`` split by input rows and
``Y`` already split by columns: ``Z = sum_r Y_r W_r`` (one allreduce), then ``+ c`` once.
An MLP ``gelu(X A) W`` or an attention layer (heads split over ranks) is column then row: **one
allreduce forward, one backward**. Megatron's two conjugate Functions place them:

- ``f`` (:func:`copy_to_tp`):      forward ``y = x`` (x replicated),  backward ``dx = sum_r dy_r``
  (allreduce: each rank's column slice contributes its part ``dY_r A_r^T`` of ``dX``).
- ``g`` (:func:`reduce_from_tp`):  forward ``y = sum_r x_r`` (allreduce), backward ``dx_r = dy``
  (identity: the sum's derivative by each summand is 1).

**Sequence parallelism** (Korthikanti et al. 2022): outside the column->row pairs (LayerNorm,
dropout, residual adds) activations are split along the sequence, rank r holding tokens
``[r T/t, (r+1) T/t)``. The allreduce ``sum_r x_r`` equals a reduce-scatter (each rank gets its
sequence chunk of the sum) followed by an allgather, so ``g`` becomes a reduce-scatter (into the
sequence-split region) and ``f`` an allgather (out of it), at the same communication volume:

- :func:`gather_seq`:          forward allgather along T, backward reduce-scatter along T
  (``dX_full = sum_r dX_full^(r)``, each rank keeping its chunk).
- :func:`reduce_scatter_seq`:  forward reduce-scatter along T, backward allgather along T.
- :func:`scatter_seq`:         forward keep this rank's chunk, backward allgather.

Parameters outside the sharded matmuls (LayerNorm, the row-parallel bias, the position table)
are replicated; under sequence parallelism each rank sees 1/t of the tokens, so their gradients
are partial sums: :func:`sync_sequence_parallel_grads` allreduces them (one flat allreduce) after
backward.

**Vocabulary parallelism**: the embedding/output table (V, C) is split by rows, rank r holding
``[r V'/t, (r+1) V'/t)`` of the vocabulary padded to ``V' = t * ceil(V / t)`` (padding rows are
zero and masked out of the loss). Lookup: ids outside the rank's range give zero rows, then ``g``.
Cross-entropy on vocabulary-split logits ``z`` never gathers them:
``loss_i = log sum_v exp(z_iv - m_i) + m_i - z_{i,y_i}`` with ``m_i = max_r max_{v in r} z_iv``
(allreduce max), and ``sum_v exp`` and ``z_{i,y_i}`` (only the owner of ``y_i`` contributes) summed
over ranks (one allreduce of a (2, N) array). The gradient ``softmax - onehot`` is local.

A model opts in with a *plan* (``model.tp_plan``; see :data:`KINDS` and ``models/gpt.py``), and
:func:`parallelize` swaps its modules for the parallel ones and gives every parameter its
:class:`~mpirt.nn.ShardSpec` and its slice. The tp Comm is always passed explicitly.
"""
from __future__ import annotations

import fnmatch
import math
import zlib

import numpy as np

import mpirt.backend as B
from mpirt import ops
from mpirt.nn import Dropout, Embedding, Linear, Module, Parameter, ShardSpec
from mpirt.tensor import Function, Tensor

try:  # sparse row gradient (added to the table's grad in place) when the runtime has it
    from mpirt.ops.nn import RowGrad as _RowGrad
except ImportError:  # pragma: no cover
    _RowGrad = None
from mpirt.ops.nn import scatter_add_rows

AXIS = "tp"


# =============================================================================================
# array helpers: collectives along one dimension
# =============================================================================================
def _gather_dim(a, comm, dim: int):
    """Concatenate every rank's ``a`` along ``dim`` (equal sizes): one allgather."""
    if comm.size == 1:
        return a
    xp = B.xp
    front = xp.ascontiguousarray(xp.moveaxis(a, dim, 0))
    full = comm.allgather(front, counts=[front.shape[0]] * comm.size)
    return xp.ascontiguousarray(xp.moveaxis(full, 0, dim))


def _check_split(n: int, comm, dim: int, what: str) -> int:
    if n % comm.size:
        raise ValueError(f"{what}: size {n} of dimension {dim} is not divisible by tp={comm.size}"
                         + (" (sequence parallelism needs seq_len divisible by tp)" if dim == 1 else ""))
    return n // comm.size


def _reduce_scatter_dim(a, comm, dim: int):
    """Sum ``a`` over the ranks and keep this rank's chunk along ``dim``: one reduce-scatter."""
    if comm.size == 1:
        return a
    xp = B.xp
    m = _check_split(a.shape[dim], comm, dim, "reduce_scatter_seq")
    front = xp.ascontiguousarray(xp.moveaxis(a, dim, 0))
    chunk = comm.reduce_scatter(front).reshape((m,) + front.shape[1:])
    return xp.ascontiguousarray(xp.moveaxis(chunk, 0, dim))


def _split_dim(a, comm, dim: int):
    """This rank's chunk of ``a`` along ``dim`` (a contiguous copy); no communication."""
    if comm.size == 1:
        return a
    m = _check_split(a.shape[dim], comm, dim, "scatter_seq")
    index = (slice(None),) * (dim % a.ndim) + (slice(comm.rank * m, (comm.rank + 1) * m),)
    return B.xp.ascontiguousarray(a[index])


def _last_dim_index(n_local: int, comm, blocks: int, rank: int):
    """Positions along the full last dimension held by ``rank`` (``blocks`` blocks each split)."""
    spec = ShardSpec((AXIS,), (blocks,))
    return spec.dim_index(0, n_local * comm.size, {AXIS: comm.size}, {AXIS: rank})


# =============================================================================================
# communication Functions
# =============================================================================================
class CopyToTP(Function):
    """Megatron's ``f``: forward ``y = x``; backward ``dx = allreduce_sum(dy)`` over tp."""

    def forward(self, x, comm=None):
        self.comm = comm
        return x

    def backward(self, g):
        return (self.comm.allreduce(g) if self.comm.size > 1 else g,)


class ReduceFromTP(Function):
    """Megatron's ``g``: forward ``y = allreduce_sum(x)`` over tp; backward ``dx = dy``."""

    def forward(self, x, comm=None):
        return comm.allreduce(x) if comm.size > 1 else x

    def backward(self, g):
        return (g,)


class GatherFromSeq(Function):
    """Forward: allgather along ``dim`` (sequence-split -> full). Backward: reduce-scatter along
    ``dim`` (each rank's consumer computed a partial ``dX_full``; the sum's chunk is ``dX_r``)."""

    def forward(self, x, comm=None, dim=1):
        self.comm, self.dim = comm, dim
        return _gather_dim(x, comm, dim)

    def backward(self, g):
        return (_reduce_scatter_dim(g, self.comm, self.dim),)


class ReduceScatterToSeq(Function):
    """Forward: reduce-scatter along ``dim`` (partial sums -> this rank's chunk of the sum).
    Backward: allgather along ``dim`` (every summand gets the full gradient of the sum)."""

    def forward(self, x, comm=None, dim=1):
        self.comm, self.dim = comm, dim
        return _reduce_scatter_dim(x, comm, dim)

    def backward(self, g):
        return (_gather_dim(g, self.comm, self.dim),)


class ScatterToSeq(Function):
    """Forward: keep this rank's chunk along ``dim`` of a replicated tensor. Backward: allgather."""

    def forward(self, x, comm=None, dim=1):
        self.comm, self.dim = comm, dim
        return _split_dim(x, comm, dim)

    def backward(self, g):
        return (_gather_dim(g, self.comm, self.dim),)


class GatherLastDim(Function):
    """Forward: allgather the column-split last dimension (``blocks`` blocks, each split over
    tp, are put back in global order). Backward: keep this rank's columns (no communication)."""

    def forward(self, x, comm=None, blocks=1):
        self.comm, self.blocks, self.n_local = comm, blocks, x.shape[-1]
        if comm.size == 1:
            return x
        xp, t = B.xp, comm.size
        front = xp.ascontiguousarray(xp.moveaxis(x, -1, 0))                 # (n, ...)
        full = comm.allgather(front, counts=[front.shape[0]] * t)           # (t*n, ...) rank-major
        piece = self.n_local // blocks
        full = full.reshape((t, blocks, piece) + front.shape[1:]).swapaxes(0, 1)  # block-major
        return xp.ascontiguousarray(xp.moveaxis(full.reshape((-1,) + front.shape[1:]), 0, -1))

    def backward(self, g):
        if self.comm.size == 1:
            return (g,)
        idx = _last_dim_index(self.n_local, self.comm, self.blocks, self.comm.rank)
        if not isinstance(idx, slice):
            idx = B.xp.asarray(idx)
        return (B.xp.ascontiguousarray(g[..., idx]),)


def copy_to_tp(x, comm):
    """``f``: identity forward, allreduce of the gradient over tp in backward."""
    return CopyToTP.apply(x, comm=comm)


def reduce_from_tp(x, comm):
    """``g``: allreduce over tp forward, identity backward."""
    return ReduceFromTP.apply(x, comm=comm)


def gather_seq(x, comm, dim=1):
    """Sequence-split -> full along ``dim``: allgather forward, reduce-scatter backward."""
    return GatherFromSeq.apply(x, comm=comm, dim=dim)


def reduce_scatter_seq(x, comm, dim=1):
    """Partial sums -> this rank's sequence chunk of the sum: reduce-scatter forward, allgather
    backward."""
    return ReduceScatterToSeq.apply(x, comm=comm, dim=dim)


def scatter_seq(x, comm, dim=1):
    """Replicated -> this rank's sequence chunk: split forward, allgather backward."""
    return ScatterToSeq.apply(x, comm=comm, dim=dim)


def gather_last_dim(x, comm, blocks=1):
    """Column-split -> full last dimension: allgather forward, split backward."""
    return GatherLastDim.apply(x, comm=comm, blocks=blocks)


# =============================================================================================
# compute Functions
# =============================================================================================
class SeqParallelLinear(Function):
    """Column-parallel ``y = gather_seq(x) @ weight + bias`` in one Function (sequence parallel).

    Saves only the sequence-split input ``x`` (B, T/t, C) and allgathers it again in the weight
    pass (``regather=True``, as Megatron-LM), so sequence parallelism divides this activation by
    t too; ``regather=False`` saves the gathered input instead (one allgather less in backward).
    Input gradient: ``dx = reduce_scatter_seq(dy @ weight^T)``.
    """

    weight_inputs = (1, 2)

    def forward(self, x, weight, bias=None, comm=None, dim=1, regather=True):
        full = _gather_dim(x, comm, dim)
        self.comm, self.dim, self.weight, self.full_shape = comm, dim, weight, full.shape
        self.x = x if regather else full
        self.gathered = not regather
        y = full.reshape(-1, full.shape[-1]) @ weight
        if bias is not None:
            y += bias
        return y.reshape(*full.shape[:-1], weight.shape[1])

    def backward_input(self, g):
        gx = None
        if self.needs_input_grad[0]:
            gx = (g.reshape(-1, g.shape[-1]) @ self.weight.T).reshape(self.full_shape)
            gx = _reduce_scatter_dim(gx, self.comm, self.dim)
        return gx, None, None

    def backward_weight(self, g):
        need = self.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])
        gw = gb = None
        if need[1]:
            full = self.x if self.gathered else _gather_dim(self.x, self.comm, self.dim)
            gw = full.reshape(-1, full.shape[-1]).T @ g2
        if len(need) > 2 and need[2]:
            gb = g2.sum(axis=0)
        return None, gw, gb


class VocabEmbedding(Function):
    """Lookup in this rank's rows ``[start, start + V_local)`` of a vocabulary-split table: ids
    outside the range give zero rows (another rank supplies them); their gradient goes nowhere."""

    weight_inputs = (1,)

    def forward(self, ids, weight, start=0, vocab_size=None):
        xp = B.xp
        ids = xp.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"embedding: ids must be integers, got dtype {ids.dtype}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise IndexError(f"embedding: ids must be in [0, {vocab_size})")
        local = ids.reshape(-1).astype(xp.int64) - start
        mask = (local >= 0) & (local < weight.shape[0])
        self.ids, self.rows = local[mask], weight.shape[0]
        out = xp.zeros((local.size, weight.shape[1]), dtype=weight.dtype)
        out[mask] = xp.take(weight, self.ids, axis=0)
        self.mask = mask
        return out.reshape(*ids.shape, weight.shape[1])

    def backward_input(self, g):
        return None, None

    def backward_weight(self, g):
        if not self.needs_input_grad[1]:
            return None, None
        rows = g.reshape(self.mask.size, -1)[self.mask]
        if _RowGrad is not None:
            return None, _RowGrad(self.ids, rows, self.rows)
        return None, scatter_add_rows(self.ids, rows, self.rows)


class VocabParallelCrossEntropy(Function):
    """Cross-entropy of vocabulary-split logits (N, V_local) without gathering them (see the
    module docstring). Columns at global index ``>= vocab_size`` (padding) are excluded: they
    never win the max and add nothing to the sum. Two allreduces: the row max, then the row sum of
    exponentials together with the target logit. Saves the local softmax (N, V_local); the
    backward turns it in place into ``(softmax - onehot) * g / count`` (local, no communication)."""

    def forward(self, logits, targets, comm=None, start=0, vocab_size=None, ignore_index=-100,
                reduction="mean"):
        xp = B.xp
        if reduction not in ("mean", "sum"):
            raise ValueError(f"cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
        targets = xp.asarray(targets)
        if targets.dtype.kind not in "iu":
            raise TypeError(f"cross_entropy: targets must be integers, got dtype {targets.dtype}")
        vl = logits.shape[-1]
        if tuple(targets.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"cross_entropy: targets shape {targets.shape} != logits shape "
                             f"{logits.shape} without its last (class) dimension")
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
        nll *= valid
        count = valid.sum(dtype=x.dtype)
        loss = nll.sum()
        if reduction == "mean":
            loss = loss / xp.maximum(count, 1.0)
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


# =============================================================================================
# layout
# =============================================================================================
def pad_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary padded to a multiple of ``tp`` (``tp * ceil(V / tp)``)."""
    return -(-vocab_size // tp) * tp


def check_tp_layout(tp: int, *, n_head: int, n_embd: int, hidden: int, vocab_size: int | None = None,
                    seq_len: int | None = None, sequence_parallel: bool = False) -> None:
    """Refuse a tensor-parallel size that does not divide the model, naming the numbers.

    tp must divide the attention heads, the embedding width and the MLP hidden size; the
    vocabulary is padded to a multiple of tp (so it always fits); with sequence parallelism tp must
    divide the sequence length. Pure: call it before any communication (config validation).
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: must be a positive integer, got {tp!r}")
    bad = [f"n_head={n_head}" if n_head % tp else "", f"n_embd={n_embd}" if n_embd % tp else "",
           f"MLP hidden size={hidden}" if hidden % tp else ""]
    if sequence_parallel and seq_len is not None and seq_len % tp:
        bad.append(f"seq_len={seq_len} (sequence parallelism)")
    bad = [b for b in bad if b]
    if bad:
        raise ValueError(f"tensor parallelism: tp={tp} must divide {', '.join(bad)}")
    if vocab_size is not None and pad_vocab(vocab_size, tp) % tp:  # pragma: no cover (always divides)
        raise ValueError(f"tensor parallelism: padded vocabulary {pad_vocab(vocab_size, tp)} not divisible by tp={tp}")


def _local_param(global_shape, spec: ShardSpec, comm, init="normal", std=0.02, dtype="float32", cls=Parameter,
                 **extra):
    p = cls(global_shape, init=init, std=std, spec=spec, dtype=dtype, **extra)
    p.data = B.xp.zeros(spec.local_shape(global_shape, {AXIS: comm.size}), dtype=dtype)
    return p


class PaddedParameter(Parameter):
    """A parameter whose first dimension is padded (vocabulary to a multiple of tp): the full
    initial value is the unpadded ``logical_shape`` tensor of the same name and seed (hence equal
    to the tp=1 one) followed by zero rows."""

    def __init__(self, shape, logical_shape, **kw):
        super().__init__(shape, **kw)
        self.logical_shape = tuple(logical_shape)

    def full_init(self, seed: int) -> np.ndarray:
        padded, self.global_shape = self.global_shape, self.logical_shape
        try:
            core = super().full_init(seed)
        finally:
            self.global_shape = padded
        return pad_rows(core, padded[0])


def pad_rows(a, rows: int):
    """``a`` with zero rows appended up to ``rows`` (NumPy)."""
    a = np.asarray(a)
    if a.shape[0] == rows:
        return a
    out = np.zeros((rows,) + a.shape[1:], dtype=a.dtype)
    out[:a.shape[0]] = a
    return out


# =============================================================================================
# parallel modules
# =============================================================================================
class ColumnParallelLinear(Module):
    """``y = x @ weight + bias`` with the output features split over tp: weight (in, out) held as
    (in, out/t), ``ShardSpec((None, "tp"), blocks=(1, blocks))``; bias (out/t,).

    ``blocks > 1`` splits each of ``blocks`` equal column blocks (fused q|k|v: ``blocks=3``).
    Input: replicated (B, T, in), or sequence-split (B, T/t, in) with ``sequence_parallel``.
    Output: (B, T, out/t), or the full (B, T, out) with ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, comm, bias: bool = True, *, gather_output=False,
                 sequence_parallel=False, blocks: int = 1, std: float = 0.02, dtype="float32", regather=True):
        super().__init__()
        self.comm, self.gather_output, self.sequence_parallel = comm, gather_output, sequence_parallel
        self.blocks, self.regather = blocks, regather
        self.weight = _local_param((in_features, out_features), ShardSpec((None, AXIS), (1, blocks)), comm,
                                   std=std, dtype=dtype)
        self.bias = _local_param((out_features,), ShardSpec((AXIS,), (blocks,)), comm, init="zeros",
                                 dtype=dtype) if bias else None

    def forward(self, x):
        if self.sequence_parallel:
            args = (x, self.weight) if self.bias is None else (x, self.weight, self.bias)
            y = SeqParallelLinear.apply(*args, comm=self.comm, dim=1, regather=self.regather)
        else:
            y = ops.linear(copy_to_tp(x, self.comm), self.weight, self.bias)
        return gather_last_dim(y, self.comm, self.blocks) if self.gather_output else y


class RowParallelLinear(Module):
    """``y = x @ weight + bias`` with the input features split over tp: weight (in, out) held as
    (in/t, out), ``ShardSpec(("tp", None))``; the bias is replicated and added once, after the
    reduction. Input: (B, T, in/t), already split (e.g. a column-parallel output). Output:
    replicated (B, T, out) after an allreduce, or with ``sequence_parallel`` the sequence chunk
    (B, T/t, out) after a reduce-scatter."""

    def __init__(self, in_features: int, out_features: int, comm, bias: bool = True, *, sequence_parallel=False,
                 std: float = 0.02, dtype="float32"):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _local_param((in_features, out_features), ShardSpec((AXIS, None)), comm, std=std,
                                   dtype=dtype)
        self.bias = _local_param((out_features,), ShardSpec((None,)), comm, init="zeros",
                                 dtype=dtype) if bias else None
        if self.bias is not None:  # added to the sequence chunk: its gradient is partial under SP
            self.bias.tp_partial_grad = sequence_parallel

    def forward(self, x):
        y = ops.linear(x, self.weight)                                     # partial sum over tp
        y = reduce_scatter_seq(y, self.comm, 1) if self.sequence_parallel else reduce_from_tp(y, self.comm)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(Module):
    """Embedding table (V, C) split by rows over tp, the vocabulary padded to ``t * ceil(V/t)``
    (zero rows). Each rank looks up the ids in its range (zero elsewhere); the partial outputs are
    summed by an allreduce, or with ``sequence_parallel`` a reduce-scatter along the sequence
    (ids (B, T) -> (B, T/t, C))."""

    def __init__(self, num_embeddings: int, dim: int, comm, *, sequence_parallel=False, std: float = 0.02,
                 dtype="float32"):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.vocab_size, self.padded_vocab_size = num_embeddings, pad_vocab(num_embeddings, comm.size)
        self.rows = self.padded_vocab_size // comm.size
        self.vocab_start = comm.rank * self.rows
        self.weight = _local_param((self.padded_vocab_size, dim), ShardSpec((AXIS, None)), comm, std=std,
                                   dtype=dtype, cls=PaddedParameter, logical_shape=(num_embeddings, dim))

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else ids
        y = VocabEmbedding.apply(ids, self.weight, start=self.vocab_start, vocab_size=self.vocab_size)
        return reduce_scatter_seq(y, self.comm, 1) if self.sequence_parallel else reduce_from_tp(y, self.comm)


class SequenceParallelEmbedding(Module):
    """A replicated table looked up only for this rank's chunk of the sequence (the last axis of
    ``ids``): position embeddings under sequence parallelism. No communication forward; its
    gradient is partial (see :func:`sync_sequence_parallel_grads`)."""

    def __init__(self, num_embeddings: int, dim: int, comm, std: float = 0.02, dtype="float32"):
        super().__init__()
        self.comm = comm
        self.weight = _local_param((num_embeddings, dim), ShardSpec((None, None)), comm, std=std, dtype=dtype)
        self.weight.tp_partial_grad = True

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else B.xp.asarray(ids)
        return ops.embedding(_split_dim(ids, self.comm, ids.ndim - 1), self.weight)


class VocabParallelHead:
    """The tied output projection on a vocabulary-split table: ``logits_r = x @ W_r^T``
    (B, T, V'/t). ``x`` is replicated (``f`` before the matmul) or, with sequence parallelism,
    sequence-split (allgathered, as a column-parallel linear). Call as ``head(x, table)``."""

    def __init__(self, comm, sequence_parallel=False, regather=True):
        self.comm, self.sequence_parallel, self.regather = comm, sequence_parallel, regather

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

    def __call__(self, logits, targets):
        t = targets.data if isinstance(targets, Tensor) else B.xp.asarray(targets)
        if tuple(t.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"targets: shape {tuple(t.shape)} does not match logits {tuple(logits.shape[:-1])}")
        vl = logits.shape[-1]
        return vocab_parallel_cross_entropy(ops.reshape(logits, (-1, vl)), t.reshape(-1), self.comm,
                                            self.vocab_size, self.ignore_index)


class ParallelMLP(Module):
    """``c_proj(gelu(c_fc(x)))``, column then row parallel: one allreduce forward and one backward
    (or, sequence parallel, allgather + reduce-scatter). Names as GPT-2's MLP."""

    def __init__(self, n_embd: int, hidden: int, comm, *, sequence_parallel=False, std=0.02, proj_std=0.02,
                 dropout: float = 0.0, dtype="float32"):
        super().__init__()
        self.c_fc = ColumnParallelLinear(n_embd, hidden, comm, sequence_parallel=sequence_parallel, std=std,
                                         dtype=dtype)
        self.c_proj = RowParallelLinear(hidden, n_embd, comm, sequence_parallel=sequence_parallel, std=proj_std,
                                        dtype=dtype)
        self.dropout = Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(ops.gelu(self.c_fc(x))))


class ParallelSelfAttention(Module):
    """Causal self-attention with the heads split over tp: the fused qkv projection is column
    parallel with 3 blocks (each rank holds whole heads of q, k and v), attention runs on the
    local ``n_head/t`` heads, the output projection is row parallel. Names as GPT-2's."""

    def __init__(self, n_embd: int, n_head: int, comm, *, sequence_parallel=False, std=0.02, proj_std=0.02,
                 attn_dropout: float = 0.0, resid_dropout: float = 0.0, dtype="float32"):
        super().__init__()
        check_tp_layout(comm.size, n_head=n_head, n_embd=n_embd, hidden=n_embd)
        self.n_head = n_head // comm.size
        self.c_attn = ColumnParallelLinear(n_embd, 3 * n_embd, comm, sequence_parallel=sequence_parallel, blocks=3,
                                           std=std, dtype=dtype)
        self.c_proj = RowParallelLinear(n_embd, n_embd, comm, sequence_parallel=sequence_parallel, std=proj_std,
                                        dtype=dtype)
        self.attn_dropout, self.resid_dropout = Dropout(attn_dropout), Dropout(resid_dropout)
        self.attn_dropout.tp_distinct = True

    def forward(self, x):
        qkv = self.c_attn(x)                                               # (B, T, 3C/t): q_r | k_r | v_r
        d = self.attn_dropout
        if self.training and d.p > 0.0:
            d.calls += 1
            y = ops.causal_self_attention(qkv, self.n_head, dropout_p=d.p, seed=(d.seed, d.calls))
        else:
            y = ops.causal_self_attention(qkv, self.n_head)                # (B, T, C/t)
        return self.resid_dropout(self.c_proj(y))


# =============================================================================================
# the plan: turning a model's modules into their parallel versions
# =============================================================================================
KINDS = {
    "column": "Linear -> ColumnParallelLinear (weight (None, tp), bias (tp,); blocks from the spec)",
    "row": "Linear -> RowParallelLinear (weight (tp, None), bias replicated)",
    "vocab": "Embedding -> VocabParallelEmbedding (rows split, vocabulary padded to a multiple of tp)",
    "positions": "Embedding of sequence positions: replicated; sliced to the sequence chunk under SP",
    "heads": "a module attribute n_head divided by tp",
    "sharded_dropout": "a Dropout acting on tp-split data: distinct masks per tp rank",
    "vocab_head": "a model attribute (callable (x, table) -> logits) -> VocabParallelHead",
    "vocab_loss": "a model attribute (callable (logits, targets) -> loss) -> VocabParallelLoss",
    "replicated": "unchanged, replicated over tp",
}


def _matches(pattern: str, name: str) -> bool:
    """Dotted-name match where ``*`` stands for one path segment (``h.*.attn`` -> ``h.3.attn``)."""
    ps, ns = pattern.split("."), name.split(".")
    return len(ps) == len(ns) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(ps, ns))


def _owner(model: Module, name: str):
    parent = model
    *path, last = name.split(".")
    for part in path:
        parent = parent._modules[part]
    return parent, last


def _new_module(kind, old, spec: dict, comm, sp, regather):
    w = old.weight
    dtype = str(w.dtype)
    if kind in ("column", "row"):
        if not isinstance(old, Linear):
            raise TypeError(f"tp plan: {kind} needs a Linear, got {type(old).__name__}")
        n_in, n_out = w.global_shape
        has_bias = old.bias is not None
        if kind == "column":
            want = spec.get("weight", ShardSpec((None, AXIS)))
            if want.dims != (None, AXIS):
                raise ValueError(f"tp plan: column weight spec must be (None, 'tp'), got {want.dims}")
            blocks = want.blocks[1] if want.blocks else 1
            return ColumnParallelLinear(n_in, n_out, comm, has_bias, sequence_parallel=sp, blocks=blocks,
                                        std=w.std, dtype=dtype, regather=regather)
        want = spec.get("weight", ShardSpec((AXIS, None)))
        if want.dims != (AXIS, None) or want.is_blocked:
            raise ValueError(f"tp plan: row weight spec must be ('tp', None), got {want}")
        return RowParallelLinear(n_in, n_out, comm, has_bias, sequence_parallel=sp, std=w.std, dtype=dtype)
    if not isinstance(old, Embedding):
        raise TypeError(f"tp plan: {kind} needs an Embedding, got {type(old).__name__}")
    v, c = w.global_shape
    if kind == "vocab":
        return VocabParallelEmbedding(v, c, comm, sequence_parallel=sp, std=w.std, dtype=dtype)
    return SequenceParallelEmbedding(v, c, comm, std=w.std, dtype=dtype)


def parallelize(model: Module, comm, sequence_parallel: bool = False, seed: int | None = None, plan=None,
                regather: bool = True) -> Module:
    """Make ``model`` tensor parallel over ``comm`` (the tp Comm) in place, following its plan.

    ``plan`` (default ``model.tp_plan``) is a sequence of ``(pattern, kind, specs)``: ``pattern`` a
    dotted module name (``*`` = one segment) or, for ``vocab_head``/``vocab_loss``, a model
    attribute; ``kind`` one of :data:`KINDS`; ``specs`` the ShardSpec of each parameter of the
    module (``{"weight": ShardSpec((None, "tp"), blocks=(1, 3))}``). The first matching entry wins.
    Every parameter keeps its name and global shape (the vocabulary table is padded) and gets its
    ShardSpec; its value is this rank's slice of the current full value, or with ``seed`` of the
    seeded full initial tensor (so any tp starts from the tp=1 model). Build the optimizer (and
    DataParallel) afterwards. ``regather`` (sequence parallelism): column-parallel layers save the
    sequence-split input and allgather it again for the weight gradient (True, less memory) or
    save the gathered input (False, one allgather less per layer in backward). Returns ``model``.
    """
    plan = getattr(model, "tp_plan", None) if plan is None else plan
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no tp_plan: pass plan=")
    t, r = comm.size, comm.rank
    sizes, ranks = {AXIS: t}, {AXIS: r}
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "n_head"):
        check_tp_layout(t, n_head=cfg.n_head, n_embd=cfg.n_embd, hidden=cfg.hidden, vocab_size=cfg.vocab_size,
                        sequence_parallel=sequence_parallel)
    for name, p in model.named_parameters():  # names and full values, before anything changes
        p.name = name
    modules = dict(model.named_modules())
    changes = []
    for name, module in modules.items():
        entry = next((e for e in plan if e[1] not in ("vocab_head", "vocab_loss") and _matches(e[0], name)), None)
        if entry is not None:
            changes.append((name, module, entry[1], entry[2] if len(entry) > 2 else {}))
    # validate everything (with the numbers) before changing anything
    for name, module, kind, specs in changes:
        if kind not in KINDS:
            raise ValueError(f"tp plan: {name}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        if kind == "heads" and module.n_head % t:
            raise ValueError(f"tensor parallelism: tp={t} must divide {name}.n_head={module.n_head}")
        for pname, spec in specs.items():
            p = module._parameters.get(pname)
            if p is not None:
                shape = p.global_shape
                if kind == "vocab":
                    shape = (pad_vocab(shape[0], t),) + tuple(shape[1:])
                try:
                    spec.local_shape(shape, sizes)
                except ValueError as err:
                    raise ValueError(f"tensor parallelism: {name}.{pname} {shape} with tp={t}: {err}") from None
    for name, module, kind, specs in changes:
        if kind in ("column", "row", "vocab") or (kind == "positions" and sequence_parallel):
            new = _new_module(kind, module, specs, comm, sequence_parallel, regather)
            for pname, p in new._parameters.items():
                old = module._parameters[pname]
                p.name = old.name
                if seed is None:
                    full = B.to_host(old.data)
                    if isinstance(p, PaddedParameter):
                        full = pad_rows(full, p.global_shape[0])
                    p.data = B.asarray(p.spec.shard(full, sizes, ranks), dtype=p.dtype)
            parent, attr = _owner(model, name)
            setattr(parent, attr, new)
        elif kind == "heads":
            module.n_head //= t
        elif kind == "sharded_dropout":
            module.tp_distinct = True
    for pattern, kind, *_ in plan:
        if kind == "vocab_head":
            setattr(model, pattern, VocabParallelHead(comm, sequence_parallel, regather))
        elif kind == "vocab_loss":
            vocab = next((m.vocab_size for _, m in model.named_modules() if isinstance(m, VocabParallelEmbedding)), None)
            if vocab is None:
                raise ValueError("tp plan: vocab_loss needs a 'vocab' module (the vocabulary-split table)")
            setattr(model, pattern, VocabParallelLoss(comm, vocab))
    for _, p in model.named_parameters():  # replicated parameters see 1/t of the tokens under SP
        p.tp_partial_grad = bool(sequence_parallel and AXIS not in p.spec.dims)
    object.__setattr__(model, "tp_info", {"size": t, "rank": r, "sequence_parallel": sequence_parallel})
    reseed_dropouts(model, None, r, sequence_parallel)
    if seed is not None:
        model.initialize(seed, sizes, ranks)
    return model


def reseed_dropouts(model: Module, seed: int | None, tp_rank: int, sequence_parallel: bool = False) -> None:
    """Seed every Dropout of a tensor-parallel model. Dropouts on replicated activations must draw
    the *same* mask on every tp rank (else the replicas diverge): their seed comes from ``seed``
    and the module name only, so ``seed`` must be equal over the tp group. Dropouts on tp-split data
    (attention probabilities of the local heads; every dropout under sequence parallelism) mix in
    the tp rank. ``seed=None`` keeps the current seeds and only mixes the rank in."""
    for name, m in model.named_modules():
        if not isinstance(m, Dropout):
            continue
        if seed is not None:
            m.seed, m.calls = zlib.crc32(f"{seed}:{name}".encode()), 0
        if sequence_parallel or getattr(m, "tp_distinct", False):
            m.seed = zlib.crc32(f"{m.seed}:tp{tp_rank}".encode())


# =============================================================================================
# state dicts, gradients, norms
# =============================================================================================
def shard_param(p: Parameter, full, tp: int, rank: int):
    """This tp rank's slice of ``full``, a full (unpadded or padded) array shaped like ``p``."""
    a = np.asarray(B.to_host(full))
    if isinstance(p, PaddedParameter) and tuple(a.shape) == p.logical_shape:
        a = pad_rows(a, p.global_shape[0])
    if tuple(a.shape) != tuple(p.global_shape):
        raise ValueError(f"{p.name}: has shape {tuple(a.shape)}, expected {p.global_shape}")
    return np.ascontiguousarray(p.spec.shard(a, {AXIS: tp}, {AXIS: rank}))


def gather_param(p: Parameter, local, comm):
    """The full, unpadded array (NumPy) of which ``local`` is this rank's shard over the tp
    ``comm``, placed by ``p``'s ShardSpec: the inverse of :func:`shard_param`. Collective."""
    t = comm.size
    if AXIS not in p.spec.dims or t == 1:
        full = np.array(B.to_host(local))
    else:
        parts = B.to_host(comm.allgather(B.xp.ascontiguousarray(local)[None], counts=[1] * t))
        full = np.empty(p.global_shape, dtype=parts.dtype)
        for rank in range(t):
            p.spec.place(full, parts[rank], {AXIS: t}, {AXIS: rank})
    return full[:p.logical_shape[0]] if isinstance(p, PaddedParameter) else full


def shard_state_dict(model: Module, full_state: dict, axis_sizes: dict, axis_ranks: dict) -> dict:
    """This rank's slices of a full (unsharded, unpadded) state dict, e.g. a Hugging Face GPT-2
    file: ``model.load_state_dict(shard_state_dict(model, hf, {"tp": t}, {"tp": r}))``. Padded
    tables are padded with zero rows first; shapes are checked against each global shape."""
    out = {}
    for name, p in model.named_parameters():
        if name not in full_state:
            raise KeyError(f"shard_state_dict: {name} missing from the full state dict")
        out[name] = shard_param(p, full_state[name], axis_sizes.get(AXIS, 1), axis_ranks.get(AXIS, 0))
    return out


def full_state_dict(model: Module, comm) -> dict:
    """The full, unpadded parameters (NumPy) on every rank, allgathered over the tp ``comm``:
    the inverse of :func:`shard_state_dict` (for export, e.g. ``save_hf_gpt2``, and tests)."""
    return {name: gather_param(p, p.data, comm) for name, p in model.named_parameters()}


def sync_sequence_parallel_grads(model: Module, comm) -> None:
    """Sum over tp the gradients of replicated parameters that saw only this rank's sequence
    chunk (``p.tp_partial_grad``, set by :func:`parallelize` under sequence parallelism): one flat
    allreduce, results written into ``p.grad`` in place (views such as DataParallel buckets stay
    valid). Call once per optimizer step after the last backward, before clipping. No-op without
    sequence parallelism."""
    params = [p for p in model.parameters() if getattr(p, "tp_partial_grad", False) and p.grad is not None]
    if not params or comm.size == 1:
        return
    xp = B.xp
    by_dtype: dict = {}
    for p in params:
        by_dtype.setdefault(str(p.grad.dtype), []).append(p)
    for group in by_dtype.values():
        flat = xp.concatenate([p.grad.reshape(-1) for p in group])
        comm.allreduce(flat, out=flat)
        offset = 0
        for p in group:
            p.grad[...] = flat[offset:offset + p.grad.size].reshape(p.grad.shape)
            offset += p.grad.size


def grad_norm(params, comms: dict) -> float:
    """Global L2 norm of the gradients of a model sharded over the axes of ``comms`` (axis name ->
    Comm, e.g. ``{"tp": grid.comm["tp"], "pp": grid.comm["pp"]}``; leave out axes over which
    gradients are identical, such as dp after averaging). Each element counts once: a parameter
    split over an axis contributes its shard on every rank of that axis; one replicated over it
    only on that axis's rank 0. Padded vocabulary rows have zero gradient."""
    xp = B.xp
    sq = 0.0
    for p in params:
        if p.grad is None:
            continue
        if any(axis not in p.spec.dims and c.rank != 0 for axis, c in comms.items()):
            continue
        g = p.grad.reshape(-1)
        sq += float(xp.vdot(g, g))
    for c in comms.values():
        sq = c.allreduce_scalar(sq) if c.size > 1 else sq
    return math.sqrt(sq)


def clip_grad_norm(params, max_norm: float, comms: dict) -> float:
    """Scale every gradient by ``max_norm / (norm + 1e-6)`` when the global norm (:func:`grad_norm`)
    exceeds ``max_norm``; returns the norm before clipping (non-finite: nothing is scaled)."""
    params = list(params)
    norm = grad_norm(params, comms)
    if norm > max_norm:
        coef = float(max_norm) / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad *= coef
    return norm


def gather_logits(logits, comm, vocab_size: int):
    """Full (B, T, V) logits (an array, no graph) from vocabulary-split ones, padding removed: for
    sampling and evaluation, never for the loss."""
    data = logits.data if isinstance(logits, Tensor) else logits
    full = GatherLastDim().forward(data, comm=comm, blocks=1)
    return full[..., :vocab_size]


# =============================================================================================
# activation memory: measured and predicted
# =============================================================================================
def _root(a):
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def _arrays(value):
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _arrays(v)
    elif isinstance(value, np.ndarray) or B.is_device_array(value):
        yield value


def saved_activation_bytes(root: Tensor) -> int:
    """Bytes of the arrays that the Functions of ``root``'s graph hold for backward.

    Walks the graph from ``root`` (call before ``backward``), collects every array attribute of
    every Function (not its inputs), and sums ``nbytes`` once per underlying buffer (views are
    resolved to their base, so an array saved by two Functions counts once). Parameter data (a
    leaf input's array, e.g. a weight saved by a linear layer) is not an activation and is left out.
    """
    seen_fn, stack, fns = set(), [root._ctx] if root._ctx is not None else [], []
    params = set()
    while stack:
        fn = stack.pop()
        if id(fn) in seen_fn:
            continue
        seen_fn.add(id(fn))
        fns.append(fn)
        for x in getattr(fn, "inputs", ()):
            if isinstance(x, Tensor):
                if x._ctx is None:
                    params.add(id(_root(x.data)))
                elif id(x._ctx) not in seen_fn:
                    stack.append(x._ctx)
    total, counted = 0, set()
    for fn in fns:
        for key, value in vars(fn).items():
            if key in ("inputs", "needs_input_grad"):
                continue
            for a in _arrays(value):
                base = _root(a)
                if id(base) in params or id(base) in counted:
                    continue
                counted.add(id(base))
                total += int(base.nbytes)
    return total


def activation_bytes(*, n_layer, n_embd, n_head, hidden, vocab_size, batch, seq_len, tp=1,
                     sequence_parallel=False, itemsize=4) -> int:
    """Predicted :func:`saved_activation_bytes` of one GPT forward with loss (no dropout), per rank.

    With ``b`` the batch, ``s`` the sequence, ``h`` the width, ``a`` the heads, ``f`` the MLP hidden
    size, ``t`` = tp, ``p = t`` with sequence parallelism (else 1) and ``V'`` the vocabulary padded
    to a multiple of t, one transformer layer saves (elements, as mpirt's fused ops do):

    ===============================================  ===================
    saved by                                         elements
    ===============================================  ===================
    ln_1, ln_2: normalised input and 1/std per row   2 (bsh + bs) / p
    c_attn, c_fc inputs (the LayerNorm outputs)      2 bsh / p
    qkv (c_attn output, kept by attention)           3 bsh / t
    attention probabilities                          a b s^2 / t
    attention output = c_proj input                  bsh / t
    GELU derivative, GELU output = c_proj input      2 b s f / t
    ===============================================  ===================

    ``layer = itemsize * [(4 bsh + 2 bs) / p + (4 bsh + 2 bsf + a b s^2) / t]``: without sequence
    parallelism the LayerNorm region (4bsh + 2bs) is replicated on every tp rank, with it (and
    the column-parallel input re-gathered in backward) everything is divided by t. (For f = 4h
    this is Korthikanti et al.'s ``sbh (10 + 24/t + 5as/(ht))`` with fp32 instead of 16-bit
    activations and no dropout masks.)

    Outside the layers: ln_f (bsh + bs) / p, the head input bsh / p, the loss softmax b s V' / t;
    int64 index arrays: targets bs and token ids (bs at t = 1, else ~bs/t: only the ids in this
    rank's vocabulary range), position ids s / p; bool masks: 1 (t = 1) or 3 (t > 1) of bs bytes.
    The ~bs/t term assumes ids spread evenly over the vocabulary (the only data-dependent term).
    """
    b, s, h, a, f, t = batch, seq_len, n_embd, n_head, hidden, tp
    v = pad_vocab(vocab_size, t)
    p = t if sequence_parallel else 1
    layer = (4 * b * s * h + 2 * b * s) / p + (4 * b * s * h + 2 * b * s * f + a * b * s * s) / t
    outside = (2 * b * s * h + b * s) / p + b * s * v / t
    index = 8 * (b * s + b * s / t + s / p) + (3 * b * s if t > 1 else b * s)
    return int(round(itemsize * (n_layer * layer + outside) + index))
