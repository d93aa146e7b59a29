"""Communication over the tp group: Megatron's conjugate ``f``/``g`` Functions and their
sequence-parallel counterparts (allgather / reduce-scatter along one dimension), with the array
helpers they are built on."""
from __future__ import annotations

import numpy as np

import mpirt.core.backend as B
from mpirt.core.injected import injected
from mpirt.core.nn import ShardSpec
from mpirt.core.tensor import Function

from .axis import AXIS


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


def _last_dim_index(n_local: int, comm, blocks, rank: int):
    """Positions along the full last dimension held by ``rank`` (``blocks`` blocks each split: a
    count or a tuple of block weights, as :class:`~mpirt.core.nn.ShardSpec` takes)."""
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
        self.comm = comm
        return comm.allreduce(x) if comm.size > 1 else x

    def backward(self, g):
        if self.comm.size > 1 and injected("tp-row-scale"):  # test-only (mpirt.core.injected)
            return (g * self.comm.size,)
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
        if comm.size > 1 and injected("sp-dropped-reduce-scatter"):  # test-only (mpirt.core.injected)
            return _split_dim(x, comm, dim)
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
        n = t * self.n_local
        where = np.concatenate([np.arange(n)[_last_dim_index(self.n_local, comm, blocks, r)] for r in range(t)])
        out = xp.empty_like(full)
        out[xp.asarray(where)] = full                                       # each gathered row to its column
        return xp.ascontiguousarray(xp.moveaxis(out, 0, -1))

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
