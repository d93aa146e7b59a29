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
are partial sums: the parameter store sums them over tp (one allreduce of their runs,
:meth:`mpirt.parallel.flat.FlatParams.sync_partial_grads`) after backward.

**Vocabulary parallelism**: the embedding/output table (V, C) is split by rows, rank r holding
``[r V'/t, (r+1) V'/t)`` of the vocabulary padded to ``V' = t * ceil(V / t)`` (padding rows are
zero and masked out of the loss). Lookup: ids outside the rank's range give zero rows, then ``g``.
Cross-entropy on vocabulary-split logits ``z`` never gathers them:
``loss_i = log sum_v exp(z_iv - m_i) + m_i - z_{i,y_i}`` with ``m_i = max_r max_{v in r} z_iv``
(allreduce max), and ``sum_v exp`` and ``z_{i,y_i}`` (only the owner of ``y_i`` contributes) summed
over ranks (one allreduce of a (2, N) array). The gradient ``softmax - onehot`` is local.

A model opts in with a *plan* (``model.tp_plan``; see :data:`KINDS` and ``mpirt.models.gpt``), and
:func:`parallelize` swaps its modules for the parallel ones and gives every parameter its
:class:`~mpirt.core.nn.ShardSpec` and its slice. The tp Comm is always passed explicitly.

The package, one module per concern: :mod:`.axis` (the tp axis, divisibility, vocabulary
padding), :mod:`.mappings` (``f``/``g`` and the sequence Functions), :mod:`.layers` (parallel modules
and their fused Functions), :mod:`.loss` (vocabulary-parallel head and cross-entropy),
:mod:`.parallelize` (:func:`parallelize`, :func:`reseed_dropouts`), :mod:`.slices` (shards and state dicts). Activation bytes: the model's formula
(:func:`mpirt.core.modeling.activation_bytes`) and :func:`mpirt.core.nn.kept_bytes`.
"""
from __future__ import annotations

from .mappings import (CopyToTP, GatherFromSeq, GatherLastDim, ReduceFromTP, ReduceScatterToSeq, ScatterToSeq,
                       copy_to_tp, gather_last_dim, gather_seq, reduce_from_tp, reduce_scatter_seq, scatter_seq)
from .layers import (ColumnParallelLinear, RowParallelLinear, SeqParallelLinear, SequenceParallelEmbedding,
                     VocabEmbedding, VocabParallelEmbedding)
from .axis import AXIS, PaddedParameter, check_model_tp, check_tp_layout, pad_rows, pad_vocab
from .loss import VocabParallelCrossEntropy, VocabParallelHead, VocabParallelLoss, vocab_parallel_cross_entropy
from .parallelize import KINDS, parallelize, reseed_dropouts
from .slices import gather_param, shard_param, shard_state_dict

__all__ = [
    "AXIS", "KINDS",
    # layout
    "PaddedParameter", "check_model_tp", "check_tp_layout", "pad_rows", "pad_vocab",
    # communication
    "CopyToTP", "ReduceFromTP", "GatherFromSeq", "ReduceScatterToSeq", "ScatterToSeq", "GatherLastDim",
    "copy_to_tp", "reduce_from_tp", "gather_seq", "reduce_scatter_seq", "scatter_seq", "gather_last_dim",
    # layers
    "SeqParallelLinear", "VocabEmbedding", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "SequenceParallelEmbedding",
    # loss
    "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy", "VocabParallelHead", "VocabParallelLoss",
    # plan
    "parallelize", "reseed_dropouts",
    # state
    "shard_param", "gather_param", "shard_state_dict",
]
