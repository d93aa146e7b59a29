"""The communicator: :class:`Comm` (collectives, point-to-point, small objects, splits) and
:func:`world_comm`.

Over 400 lines: every collective of Comm, each short, around one shared call-tracking path.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import mpirt.core.backend as B
from mpirt.core.injected import injected
from mpirt.comm import buffers, flight
from mpirt.comm.buffers import (_OPS, _REDUCE_TYPES, _byte_layout, _contig, _counts, _divide, _mpi_op, _put_back,
                                _reduce_dtype, _sync)
from mpirt.comm.engines import _NcclEngine, select_engine
from mpirt.comm.flight import DONE, DTYPE, NBYTES, OP, T0, new_call
from mpirt.comm.handles import Handle, _done_handle
from mpirt.comm.p2p import PointToPoint
from mpirt.comm.registry import _clock, stats


def world_comm() -> "Comm":
    """A :class:`Comm` over MPI_COMM_WORLD with axis ``"world"``."""
    return Comm(MPI.COMM_WORLD, axis="world")


def first_error(message: str | None) -> tuple[int, str] | None:
    """Collective over the world: ``(rank, message)`` of the lowest rank that passed a message
    (an error found before training), or None when no rank did. Every rank must call it, so a
    start-up error on some ranks stops all of them instead of leaving the others waiting."""
    # a few short strings: the pickle path is fine; through world_comm, so the watchdog (when
    # started) names a rank that never arrives
    messages = world_comm().allgather_object(message)
    return next(((rank, m) for rank, m in enumerate(messages) if m is not None), None)


class Comm(PointToPoint):
    """One MPI communicator for arrays: ``Comm(mpi_comm, axis="world")``.

    ``rank``, ``size``, ``axis`` (the grid axis it spans, used in the registry) and ``mpi`` (the
    raw mpi4py communicator). Every call is tracked for the watchdog (:mod:`mpirt.comm.flight`):
    it sits in the communicator's in-flight slot while it runs and in the ring of recent calls.
    """

    def __init__(self, mpi_comm, axis: str = "world"):
        self.mpi = mpi_comm
        self.axis = axis
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self._nccl_engine = None
        self._ch = flight.Channel(axis, _world_ranks(mpi_comm))

    def __repr__(self) -> str:
        return f"Comm(axis={self.axis!r}, rank={self.rank}, size={self.size})"

    def labelled(self, label) -> flight.labelled:
        """``with comm.labelled(label):`` calls started on this communicator inside the block
        (blocking, or posted and waited on later) carry ``label`` in watchdog reports, e.g. a
        pipeline action. ``label`` is any object; it is formatted only when a report is written."""
        return flight.labelled(self._ch, label)

    def _record(self, call, engine="host", nbytes=None) -> None:
        """Mark ``call`` complete and add it to :data:`stats` (``nbytes`` when the recorded size
        differs from the size the call started with)."""
        t1 = _clock()
        call[DONE] = t1
        stats.add(call[OP], self.axis, call[NBYTES] if nbytes is None else nbytes, t1 - call[T0], engine,
                  dtype=call[DTYPE])

    def _engine(self, x, p2p=False) -> str:
        return select_engine(x, p2p)

    def _nccl(self):
        if self._nccl_engine is None:
            self._nccl_engine = _NcclEngine(self)
        return self._nccl_engine

    # -- collectives ---------------------------------------------------------------------------

    def allreduce(self, x, op: str = "sum", out=None):
        """Reduce ``x`` over the ranks (``op`` = sum | avg | max | min; avg = sum / size in x's
        dtype, floor division for integers). Returns a new array, or ``out`` (any layout, cast to
        its dtype); ``out=x`` works in place (MPI_IN_PLACE)."""
        call = new_call(self._ch, "allreduce", x.nbytes, -1, _clock(), x.dtype)
        try:
            engine = "host" if not hasattr(x, "__cuda_array_interface__") else self._engine(x)
            if engine == "host":
                mtype = _REDUCE_TYPES.get(x.dtype)
                if out is x and mtype is not None and op in _OPS and x.flags.c_contiguous:  # the hot path
                    self.mpi.Allreduce(MPI.IN_PLACE, [x, mtype], _OPS[op])
                    if op == "avg":
                        _divide(x, self.size)
                    result = x
                else:
                    result = self._allreduce(x, op, out)
            elif engine == "nccl":
                result = self._nccl().allreduce(x, op, out)
            elif engine == "staged":
                result = _put_back(self._allreduce(B.to_host(x), op, None), x, out)
            else:
                result = self._allreduce(x, op, out)
        finally:
            self._ch.cur = None
        self._record(call, engine)
        return result

    def _allreduce(self, x, op, out):
        mop = _mpi_op(op, "allreduce")
        rdtype, mtype = _reduce_dtype(x.dtype, "allreduce")
        buf = _contig(x, rdtype)
        _sync(buf)
        if out is x:
            self.mpi.Allreduce(MPI.IN_PLACE, [buf, mtype], mop)
            result = buf
        else:
            if out is not None and out.shape != x.shape:
                raise ValueError(f"allreduce: out has shape {out.shape}, x has {x.shape}")
            direct = out is not None and out.dtype == rdtype and out.flags.c_contiguous
            result = out if direct else buffers._xp(x).empty(x.shape, rdtype)
            self.mpi.Allreduce([buf, mtype], [result, mtype], mop)
        if op == "avg":
            _divide(result, self.size)
        target = x if out is x else out
        if target is None:
            return result if result.dtype == x.dtype else result.astype(x.dtype)
        if result is not target:
            target[...] = result
        return target

    def iallreduce(self, x, op: str = "sum") -> Handle:
        """Start an in-place allreduce of ``x``; ``Handle.wait()`` completes it (dividing for avg)
        and returns ``x``. ``x`` should be C-contiguous: otherwise (or for float16) a contiguous
        copy is reduced and copied back into ``x`` at completion. Do not touch ``x`` meanwhile."""
        engine = self._engine(x)
        call = new_call(self._ch, "iallreduce", x.nbytes, -1, _clock(), x.dtype)
        try:
            if engine == "nccl":
                return Handle(None, lambda _: B.synchronize(), engine, self._nccl().allreduce(x, op, x), call)
            mop = _mpi_op(op, "iallreduce")
            rdtype, mtype = _reduce_dtype(x.dtype, "iallreduce")
            buf = _contig(B.to_host(x) if engine == "staged" else x, rdtype)
            _sync(buf)
            req = self.mpi.Iallreduce(MPI.IN_PLACE, [buf, mtype], mop)
        finally:
            self._ch.cur = None

        def finish(_status):
            if op == "avg":
                _divide(buf, self.size)
            if buf is not x:
                x[...] = buffers._xp(x).asarray(buf)
        return Handle(req, finish, engine, x, call)

    def reduce_scatter(self, x, op: str = "sum", out=None, counts=None):
        """Reduce ``x`` (flattened) over the ranks and return this rank's chunk of the flat
        result, chunks following :func:`chunk_bounds` ``(x.size, size)``, or ``counts`` (elements
        per rank, in rank order, summing to ``x.size``; zeros allowed). ``out``: a preallocated
        1-D array of the chunk's length."""
        call = new_call(self._ch, "reduce_scatter", x.nbytes, -1, _clock(), x.dtype)
        try:
            engine = "host" if not hasattr(x, "__cuda_array_interface__") else self._engine(x)
            mtype = _REDUCE_TYPES.get(x.dtype)
            if (engine == "host" and counts is None and out is not None and mtype is not None and op in _OPS and
                    x.size % self.size == 0 and out.size * self.size == x.size and out.ndim == 1 and  # the hot path
                    out.dtype == x.dtype and x.flags.c_contiguous and out.flags.c_contiguous):
                self.mpi.Reduce_scatter_block([x, mtype], [out, mtype], _OPS[op])
                if op == "avg":
                    _divide(out, self.size)
                result = out
            elif engine == "nccl" and counts is None:
                result = self._nccl().reduce_scatter(x, op, out)
            elif engine == "nccl":  # NCCL has no uneven reduce-scatter: the whole sum, then this rank's part
                start = sum(counts[:self.rank])
                part = self._nccl().allreduce(x.reshape(-1), op, None)[start:start + counts[self.rank]]
                result = part.astype(x.dtype, copy=False) if out is None else _put_back(part, part, out)
            elif engine == "staged":
                result = _put_back(self._reduce_scatter(B.to_host(x), op, None, counts), x, out)
            else:
                result = self._reduce_scatter(x, op, out, counts)
        finally:
            self._ch.cur = None
        self._record(call, engine)
        return result

    def _reduce_scatter(self, x, op, out, counts=None):
        mop = _mpi_op(op, "reduce_scatter")
        rdtype, mtype = _reduce_dtype(x.dtype, "reduce_scatter")
        flat = _contig(x, rdtype).reshape(-1)
        if counts is not None and (len(counts) != self.size or sum(counts) != flat.size or min(counts) < 0):
            raise ValueError(f"reduce_scatter: counts {list(counts)} must be {self.size} non-negative numbers "
                             f"summing to {flat.size}")
        even = counts is None and flat.size % self.size == 0
        counts = None if even else (list(counts) if counts is not None else _counts(flat.size, self.size))
        mine = flat.size // self.size if even else counts[self.rank]
        if out is not None and (out.ndim != 1 or out.size != mine):
            raise ValueError(f"reduce_scatter: out must be 1-D of {mine} elements, got shape {out.shape}")
        direct = out is not None and out.dtype == rdtype and out.flags.c_contiguous
        result = out if direct else buffers._xp(x).empty(mine, rdtype)
        _sync(flat)
        if even:
            self.mpi.Reduce_scatter_block([flat, mtype], [result, mtype], mop)
        else:
            self.mpi.Reduce_scatter([flat, mtype], [result, mtype], counts, mop)
        if op == "avg":
            _divide(result, self.size)
        if out is None:
            return result if result.dtype == x.dtype else result.astype(x.dtype)
        if result is not out:
            out[...] = result
        return out

    def allgather(self, x, counts=None, out=None):
        """Concatenate every rank's ``x`` along axis 0 (leading sizes may differ; trailing shapes
        and dtypes must agree). Without ``counts`` (each rank's leading size, the same list on
        every rank) one small Allgather exchanges them first. ``out``: preallocated result."""
        call = new_call(self._ch, "allgather", x.nbytes, -1, _clock(), x.dtype)
        try:
            engine = self._engine(x)
            if engine == "nccl":
                result = self._nccl().allgather(x, counts, out)
            elif engine == "staged":
                result = _put_back(self._allgather(B.to_host(x), counts, None), x, out)
            else:
                result = self._allgather(x, counts, out)
        finally:
            self._ch.cur = None
        self._record(call, engine, result.nbytes)
        return result

    def _row_counts(self, x, counts) -> list[int]:
        """Each rank's leading size, exchanged when not given; checks the trailing shapes agree."""
        x2 = x.reshape(1) if x.ndim == 0 else x
        if counts is not None:
            counts = [int(c) for c in counts]
            if len(counts) != self.size or counts[self.rank] != x2.shape[0]:
                raise ValueError(f"allgather: counts {counts} do not fit {self.size} ranks with this "
                                 f"rank ({self.rank}) holding {x2.shape[0]} rows")
            return counts
        row = int(np.prod(x2.shape[1:], dtype=np.int64)) * x2.itemsize
        table = np.empty((self.size, 2), np.int64)
        self.mpi.Allgather([np.array([x2.shape[0], row], np.int64), MPI.INT64_T], [table, MPI.INT64_T])
        if len(set(table[:, 1].tolist())) != 1:
            raise ValueError("allgather: ranks hold rows of different byte sizes "
                             f"{dict(enumerate(table[:, 1].tolist()))} (trailing shape or dtype differ)")
        return table[:, 0].tolist()

    def _allgather(self, x, counts, out):
        x2 = x.reshape(1) if x.ndim == 0 else x
        counts = self._row_counts(x2, counts)
        shape = (sum(counts), *x2.shape[1:])
        if out is not None and (tuple(out.shape) != shape or out.dtype != x.dtype):
            raise ValueError(f"allgather: out must be {shape} {x.dtype}, got {out.shape} {out.dtype}")
        direct = out is not None and out.flags.c_contiguous
        result = out if direct else buffers._xp(x).empty(shape, x.dtype)
        self._gather_bytes(_contig(x2), result, counts, int(np.prod(shape[1:], dtype=np.int64)) * x.itemsize,
                           len(set(counts)) == 1)
        if out is not None and result is not out:
            out[...] = result
            return out
        return result

    def _gather_bytes(self, send, result, counts, unit: int, equal: bool) -> None:
        """Allgather(v) of raw bytes: rank r contributes ``counts[r] * unit`` bytes."""
        _sync(send)
        if equal:
            self.mpi.Allgather([send, MPI.BYTE], [result, MPI.BYTE])
        else:
            self.mpi.Allgatherv([send, MPI.BYTE], [result, _byte_layout(counts, unit), MPI.BYTE])

    def alltoallv(self, x, send_counts) -> tuple:
        """Rows of ``x`` to every rank: the first ``send_counts[0]`` rows to rank 0, the next
        ``send_counts[1]`` to rank 1, ...; returns ``(rows received, in rank order; the counts
        received from each rank)``. The counts go first (one MPI_Alltoall of integers), then the
        rows' bytes (MPI_Alltoallv); a rank may send or receive no rows at all, and still takes
        part. Trailing shapes and dtypes must agree over the ranks. A device array goes through
        the host. Recorded as ``alltoall`` with the bytes sent."""
        counts = np.asarray([int(c) for c in send_counts], dtype=np.int64)
        if len(counts) != self.size or (counts < 0).any() or counts.sum() != (x.shape[0] if x.ndim else 1):
            raise ValueError(f"alltoallv: send counts {counts.tolist()} do not split the {x.shape[0] if x.ndim else 1} "
                             f"rows of rank {self.rank} over {self.size} ranks")
        call = new_call(self._ch, "alltoall", x.nbytes, -1, _clock(), x.dtype)
        try:
            host = _contig(B.to_host(x))
            row = int(np.prod(host.shape[1:], dtype=np.int64)) * host.itemsize
            received = np.empty(self.size, dtype=np.int64)
            self.mpi.Alltoall([counts, MPI.INT64_T], [received, MPI.INT64_T])
            result = np.empty((int(received.sum()), *host.shape[1:]), dtype=host.dtype)
            self.mpi.Alltoallv([host, _byte_layout(counts, row), MPI.BYTE],
                               [result, _byte_layout(received, row), MPI.BYTE])
        finally:
            self._ch.cur = None
        self._record(call, "host" if host is x else "staged", x.nbytes)
        return (result if host is x else B.asarray(result)), received.tolist()

    def allgather_flat(self, chunk, n: int, out=None):
        """The inverse of :meth:`reduce_scatter`: rank r holds chunk r of a flat array of ``n``
        elements (:func:`chunk_bounds`); returns the whole flat array (or fills ``out``).
        ``chunk`` may be a view of ``out``: when it is exactly this rank's chunk of ``out`` the
        gather runs in place (MPI_IN_PLACE), any other overlap is gathered from a copy.
        Recorded in :data:`stats` as ``allgather``."""
        call = new_call(self._ch, "allgather", chunk.nbytes, -1, _clock(), chunk.dtype)
        try:
            engine = "host" if not hasattr(chunk, "__cuda_array_interface__") else self._engine(chunk)
            shared = engine == "host" and out is not None and np.may_share_memory(chunk, out)
            if shared and self._is_own_chunk(chunk, n, out):
                result = self._allgather_flat_in_place(n, out)
            else:
                if shared:
                    chunk = chunk.copy()
                if (engine == "host" and out is not None and n % self.size == 0 and  # the hot path
                        chunk.size * self.size == n and out.size == n and out.dtype == chunk.dtype and
                        chunk.flags.c_contiguous and out.flags.c_contiguous):
                    self.mpi.Allgather([chunk, MPI.BYTE], [out, MPI.BYTE])
                    result = out
                elif engine == "nccl":
                    result = self._nccl().allgather_flat(chunk, n, out)
                elif engine == "staged":
                    result = _put_back(self._allgather_flat(B.to_host(chunk), n, None), chunk, out)
                else:
                    result = self._allgather_flat(chunk, n, out)
        finally:
            self._ch.cur = None
        self._record(call, engine, result.nbytes)
        return result

    def iallgather_flat(self, chunk, n: int) -> Handle:
        """Start :meth:`allgather_flat` of ``chunk`` (this rank's chunk of a flat array of ``n``
        elements); ``Handle.wait()`` returns the whole array. Keep ``chunk`` unchanged meanwhile.
        NumPy arrays gather non-blocking (MPI_Iallgather(v)); a device array gathers at once (its
        NCCL or staged path) and the handle is already complete. Recorded as ``iallgather``."""
        if hasattr(chunk, "__cuda_array_interface__"):
            return _done_handle(self.allgather_flat(chunk, n))
        counts = self._chunk_counts("iallgather_flat", chunk, n)
        call = new_call(self._ch, "iallgather", chunk.nbytes, -1, _clock(), chunk.dtype)
        try:
            send = _contig(chunk)
            result = np.empty(n, dtype=chunk.dtype)
            if n % self.size == 0:
                req = self.mpi.Iallgather([send, MPI.BYTE], [result, MPI.BYTE])
            else:
                req = self.mpi.Iallgatherv([send, MPI.BYTE], [result, _byte_layout(counts, chunk.itemsize), MPI.BYTE])
        finally:
            self._ch.cur = None
        return Handle(req, None, "host", result, call, keep=send)

    def _is_own_chunk(self, chunk, n, out) -> bool:
        """Whether ``chunk`` is exactly elements ``chunk_bounds(n, size)[rank]`` of ``out`` (both
        C-contiguous, same dtype): the layout MPI_IN_PLACE expects."""
        if out.size != n or out.dtype != chunk.dtype or not (out.flags.c_contiguous and chunk.flags.c_contiguous):
            return False
        counts = _counts(n, self.size)
        lo = sum(counts[:self.rank])
        addr = out.__array_interface__["data"][0] + lo * out.itemsize
        return chunk.size == counts[self.rank] and (chunk.size == 0 or chunk.__array_interface__["data"][0] == addr)

    def _allgather_flat_in_place(self, n, out):
        counts = _counts(n, self.size)
        flat = out.reshape(-1)
        if n % self.size == 0:
            self.mpi.Allgather(MPI.IN_PLACE, [flat, MPI.BYTE])
        else:
            self.mpi.Allgatherv(MPI.IN_PLACE, [flat, _byte_layout(counts, out.itemsize), MPI.BYTE])
        return out

    def _chunk_counts(self, op: str, chunk, n: int) -> tuple:
        """The chunk sizes of a flat array of ``n`` over the ranks; ValueError when this rank's
        ``chunk`` is not its chunk's size."""
        counts = _counts(n, self.size)
        if chunk.size != counts[self.rank]:
            raise ValueError(f"{op}: rank {self.rank} holds {chunk.size} elements, but chunk "
                             f"{self.rank} of {n} over {self.size} ranks has {counts[self.rank]}")
        return counts

    def _allgather_flat(self, chunk, n, out):
        counts = self._chunk_counts("allgather_flat", chunk, n)
        if out is not None and (out.size != n or out.dtype != chunk.dtype):
            raise ValueError(f"allgather_flat: out must hold {n} {chunk.dtype}, got {out.size} {out.dtype}")
        direct = out is not None and out.flags.c_contiguous
        result = out.reshape(-1) if direct else buffers._xp(chunk).empty(n, chunk.dtype)
        self._gather_bytes(_contig(chunk), result, counts, chunk.itemsize, n % self.size == 0)
        if out is not None and not direct:
            out[...] = result.reshape(out.shape)
        return out if out is not None else result

    def broadcast(self, x, root: int = 0):
        """Copy ``x`` of rank ``root`` into ``x`` on every rank, in place; returns ``x``."""
        call = new_call(self._ch, "broadcast", x.nbytes, -1, _clock(), x.dtype)
        try:
            engine = self._engine(x)
            if engine == "nccl":
                self._nccl().broadcast(x, root)
            else:
                buf = _contig(B.to_host(x) if engine == "staged" else x)
                _sync(buf)
                self.mpi.Bcast([buf, MPI.BYTE], root)
                if buf is not x:
                    x[...] = buffers._xp(x).asarray(buf)
        finally:
            self._ch.cur = None
        self._record(call, engine)
        return x

    def barrier(self) -> None:
        call = new_call(self._ch, "barrier", 0, -1, _clock())
        try:
            self.mpi.Barrier()
        finally:
            self._ch.cur = None
        self._record(call)

    def ibarrier(self) -> Handle:
        """Start a barrier; the handle completes once every rank has started it. Waiting on it
        by polling ``test()`` (with sleeps) keeps a rank that arrives early off the CPU."""
        call = new_call(self._ch, "ibarrier", 0, -1, _clock())
        try:
            req = self.mpi.Ibarrier()
        finally:
            self._ch.cur = None
        return Handle(req, None, "host", None, call)

    # -- small Python objects (pickle path; never for arrays) ----------------------------------

    def allgather_object(self, obj) -> list:
        call = new_call(self._ch, "allgather_object", 0, -1, _clock())
        try:
            result = self.mpi.allgather(obj)
        finally:
            self._ch.cur = None
        self._record(call)
        return result

    def broadcast_object(self, obj, root: int = 0):
        call = new_call(self._ch, "broadcast_object", 0, -1, _clock())
        try:
            result = self.mpi.bcast(obj, root=root)
        finally:
            self._ch.cur = None
        self._record(call)
        return result

    def allreduce_scalar(self, value, op: str = "sum") -> float:
        """Reduce one number (a loss, a squared gradient norm) as float64 on every rank. The dtype
        is fixed here, never taken from ``value``: a rank whose part is the integer 0 (a ZeRO shard
        holding nothing counted) must still send the float64 its peers send and read."""
        a = np.array([value], None if injected("scalar-dtype-from-value") else np.float64)  # test-only
        return float(self.allreduce(a, op, out=a)[0])

    # -- communicators -------------------------------------------------------------------------

    def split(self, color: int, key: int = 0, axis: str | None = None) -> "Comm":
        """``MPI_Comm_split`` wrapped: ranks with the same color form a new Comm ordered by key."""
        return Comm(self.mpi.Split(color, key), axis or self.axis)

    def free(self) -> None:
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            self.mpi.Free()


def _world_ranks(mpi_comm) -> tuple[int, ...]:
    """The world rank of each member of ``mpi_comm``, in its rank order."""
    world = MPI.COMM_WORLD
    if mpi_comm == world:
        return tuple(range(world.Get_size()))
    group, world_group = mpi_comm.Get_group(), world.Get_group()
    try:
        return tuple(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world_group))
    finally:
        group.Free()
        world_group.Free()
