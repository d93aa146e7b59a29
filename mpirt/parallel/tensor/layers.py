"""Tensor-parallel modules (column/row-parallel linear, vocabulary-split and sequence-split
embeddings) and the fused Functions with weights they run on. A model's MLP and attention become
tensor parallel through its plan (:func:`mpirt.parallel.tensor.parallelize`), which swaps these in."""
from __future__ import annotations

import numpy as np

import mpirt.core.backend as B
from mpirt.core import ops
from mpirt.core.nn import Module, ShardSpec
from mpirt.core.tensor import Function, Tensor
from mpirt.cpu.threads import matmul

try:  # sparse row gradient (added to the table's grad in place) when the runtime has it
    from mpirt.core.ops.fused import RowGrad as _RowGrad
except ImportError:  # pragma: no cover
    _RowGrad = None
from mpirt.core.ops.fused import scatter_add_rows

from .mappings import (_gather_dim, _reduce_scatter_dim, _split_dim, copy_to_tp, gather_last_dim, reduce_from_tp,
                       reduce_scatter_seq)
from .axis import AXIS, PaddedParameter, _local_param, pad_vocab


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
        # threads.matmul as the Linear layers: the pool's GEMMs, and half products in float32
        # rounded once (NumPy's own bfloat16 matmul returns float32)
        y = matmul(full.reshape(-1, full.shape[-1]), weight, bias=bias)
        return y.reshape(*full.shape[:-1], weight.shape[1])

    def backward_input(self, g):
        gx = None
        if self.needs_input_grad[0]:
            gx = matmul(g.reshape(-1, g.shape[-1]), self.weight.T).reshape(self.full_shape)
            gx = _reduce_scatter_dim(gx, self.comm, self.dim)
        return gx, None, None

    def backward_weight(self, g):
        need = self.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])
        gw = gb = None
        if need[1]:
            full = self.x if self.gathered else _gather_dim(self.x, self.comm, self.dim)
            gw = matmul(full.reshape(-1, full.shape[-1]).T, g2)
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


# =============================================================================================
# parallel modules
# =============================================================================================
def _reduced_output_calls(comm, sequence_parallel: bool, elements: int, dtype) -> tuple[list, list]:
    """The tp calls of an output summed over tp (``elements`` of it over whole sequences): a
    reduce-scatter forward and an allgather of its gradient backward (SP), else one allreduce."""
    if comm.size == 1:
        return [], []
    one = elements * dtype.itemsize, dtype.name
    return ([("reduce_scatter", *one)], [("allgather", *one)]) if sequence_parallel else ([("allreduce", *one)], [])


def linear_input_calls(comm, sequence_parallel: bool, regather: bool, elements: int, dtype) -> tuple[list, list]:
    """The tp calls of a column-parallel product's input (``elements`` of it over whole sequences,
    in ``dtype``): gathered forward and its gradient reduce-scattered backward, gathered again for
    the weight gradient with ``regather`` (SP); else its gradient allreduced (``f``)."""
    if comm.size == 1:
        return [], []
    one = elements * np.dtype(dtype).itemsize, np.dtype(dtype).name
    if sequence_parallel:
        return [("allgather", *one)], [("reduce_scatter", *one)] + [("allgather", *one)] * regather
    return [], [("allreduce", *one)]


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

    def tp_calls(self, tokens: int) -> tuple[list, list]:
        """``(kind, bytes, dtype)`` of the tp calls of one forward and one backward over ``tokens``
        tokens (the whole sequences of a micro-batch): as :func:`linear_input_calls`, and the
        output gathered with ``gather_output``."""
        n_in, n_out = self.weight.global_shape   # (ZeRO-3 empties the local weight outside its unit)
        forward, backward = linear_input_calls(self.comm, self.sequence_parallel, self.regather, tokens * n_in,
                                               self.weight.dtype)
        if self.gather_output and self.comm.size > 1:
            forward = forward + [("allgather", tokens * n_out * self.weight.dtype.itemsize, self.weight.dtype.name)]
        return forward, backward

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

    def tp_calls(self, tokens: int) -> tuple[list, list]:
        """``(kind, bytes, dtype)`` of the tp calls of one forward and one backward over ``tokens``
        tokens: the partial outputs reduce-scattered (SP; the gradient gathered back) or allreduced."""
        return _reduced_output_calls(self.comm, self.sequence_parallel, tokens * self.weight.global_shape[1],
                                     self.weight.dtype)

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

    def tp_calls(self, tokens: int) -> tuple[list, list]:
        """``(kind, bytes, dtype)`` of the tp calls of one forward and one backward over ``tokens``
        tokens: the partial lookups reduce-scattered (SP; the gradient gathered back) or allreduced."""
        return _reduced_output_calls(self.comm, self.sequence_parallel, tokens * self.weight.global_shape[1],
                                     self.weight.dtype)

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else ids
        y = VocabEmbedding.apply(ids, self.weight, start=self.vocab_start, vocab_size=self.vocab_size)
        return reduce_scatter_seq(y, self.comm, 1) if self.sequence_parallel else reduce_from_tp(y, self.comm)


class SequenceParallelEmbedding(Module):
    """A replicated table looked up only for this rank's chunk of the sequence (the last axis of
    ``ids``): position embeddings under sequence parallelism. No communication forward; its
    gradient is partial (summed over tp by :meth:`mpirt.parallel.flat.FlatParams.sync_partial_grads`)."""

    def __init__(self, num_embeddings: int, dim: int, comm, std: float = 0.02, dtype="float32"):
        super().__init__()
        self.comm = comm
        self.weight = _local_param((num_embeddings, dim), ShardSpec((None, None)), comm, std=std, dtype=dtype)
        self.weight.tp_partial_grad = True

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else B.xp.asarray(ids)
        return ops.embedding(_split_dim(ids, self.comm, ids.ndim - 1), self.weight)
