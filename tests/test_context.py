"""Context parallelism (mpirt.parallel.context): the load-balanced split of a sequence, dropout
masks at the global places a rank holds, and ring attention over real MPI ranks against the
one-rank attention op (float64, forward and backward, grouped-query attention, dropout).

The end-to-end runs (every layout with --cp, dropout, Llama, resume across cp sizes) are launches
of the training script in test_train_parallel.py.
"""
import dataclasses
import itertools

import numpy as np
import pytest

from conftest import agree
from mpirt.core.ops.attention import causal_self_attention
from mpirt.core.ops.dropout import MaskSource, dropout_mask
from mpirt.core.tensor import Tensor
from mpirt.parallel.context import DIAGONAL, FULL, NONE, ContextShard, pair, ring_attention


class _Ring:
    """A cp communicator's rank and size, for the pure parts of :class:`ContextShard`."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_each_rank_holds_one_chunk_from_each_end_and_the_ranks_cover_the_sequence(cp):
    t = 4 * cp
    a = np.arange(3 * t).reshape(3, t)
    held = [ContextShard(_Ring(r, cp)) for r in range(cp)]
    parts = [s.shard(a) for s in held]
    assert all(p.shape == (3, t // cp) for p in parts)
    assert sorted(np.concatenate([p[0] for p in parts]).tolist()) == list(range(t))
    for s, p in zip(held, parts):
        np.testing.assert_array_equal(p[0], s.positions(t // cp))
        assert s.chunks() == (s.rank, 2 * cp - 1 - s.rank)
    # the causal work of each rank: blocks over the whole ring are equal in number
    work = [sum(pair(q, k) != NONE for q in s.chunks() for k in range(2 * cp)) for s in held]
    assert len(set(work)) == 1 and work[0] == 2 * cp + 1
    assert (pair(3, 1), pair(2, 2), pair(1, 3)) == (FULL, DIAGONAL, NONE)
    with pytest.raises(ValueError, match=f"seq_len {t + 1} does not cut into 2 x cp = {2 * cp} equal chunks"):
        held[0].shard(np.zeros((1, t + 1)))


def test_a_mask_drawn_for_the_runs_a_rank_holds_is_that_part_of_the_whole_mask():
    """Spans (context parallelism's chunks, a ring block's queries and keys) and tp's split of
    dimension 1 draw exactly the whole batch's mask at those places."""
    key = (7, 3)
    whole = dropout_mask((4, 6, 16, 16), 0.3, MaskSource(key))          # (B, H, T, T)
    rows = whole[2:4]
    src = MaskSource(key, row0=2, split=(1, 2), spans=((2, 16, ((4, 4),)), (3, 16, ((12, 4),))))
    np.testing.assert_array_equal(dropout_mask((2, 3, 4, 4), 0.3, src), rows[:, 3:, 4:8, 12:16])
    # the residual stream under cp 2 x tp 2 with sequence parallelism: tp rank 1 of cp rank 0's
    # tokens [0, 4) + [12, 16) holds local tokens 4..7, global 12..15
    tokens = dropout_mask((4, 16, 5), 0.3, MaskSource(key))
    src = MaskSource(key, split=(1, 2), spans=((1, 16, ((0, 4), (12, 4))),))
    np.testing.assert_array_equal(dropout_mask((4, 4, 5), 0.3, src), tokens[:, 12:16])
    with pytest.raises(ValueError, match="spans of dimension 1 hold 8 positions, the array 6"):
        dropout_mask((4, 6, 5), 0.3, dataclasses.replace(src, split=None))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n_head, n_kv_head, p", [(4, 4, 0.0), (4, 2, 0.0), (4, 4, 0.3), (6, 2, 0.2)])
def test_ring_attention_equals_the_whole_sequence_op(group, n_head, n_kv_head, p):
    """Every rank's rows of the output and of dqkv equal the one-rank op's (float64, 1e-12), at
    cp 2 and (with four ranks) 4; grouped-query attention and attention dropout included; chunks of
    2 tokens, and of 128 (two query chunks per block)."""
    from mpi4py import MPI

    fails = []
    for cp, chunk in itertools.product((2, 4), (2, 128)):
        comm = group(cp, "cp") if cp <= MPI.COMM_WORLD.size else None
        if comm is None:
            continue
        shard = ContextShard(comm)
        rng = np.random.default_rng(0)
        b, t, d = 2, 2 * cp * chunk, 4
        qkv = rng.standard_normal((b, t, (n_head + 2 * n_kv_head) * d))
        grad_out = rng.standard_normal((b, t, n_head * d))
        kw = dict(dropout_p=p, seed=MaskSource((5, 1))) if p else {}
        whole = Tensor(qkv, requires_grad=True)
        causal_self_attention(whole, n_head, n_kv_head=n_kv_head, **kw).backward(grad_out)
        held = Tensor(shard.shard(qkv), requires_grad=True)
        out = ring_attention(held, n_head, shard, n_kv_head=n_kv_head, **kw)
        out.backward(shard.shard(grad_out))
        ref = causal_self_attention(Tensor(qkv), n_head, n_kv_head=n_kv_head, **kw).data
        errs = (np.abs(out.data - shard.shard(ref)).max(), np.abs(held.grad - shard.shard(whole.grad)).max())
        if max(errs) > 1e-12:
            fails.append(f"cp {cp} chunk {chunk} rank {shard.rank}: output, dqkv errors {errs}")
    agree(not fails, fails)
