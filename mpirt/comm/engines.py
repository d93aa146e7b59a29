"""Engine selection for device arrays (NCCL, CUDA-aware MPI, host staging), CUDA-aware MPI
detection, and the NCCL engine.
"""
from __future__ import annotations

import ctypes
import functools
import os
import warnings

import numpy as np
from mpi4py import MPI

import mpirt.core.backend as B
from mpirt.comm.buffers import _contig, _divide, _mpi_op, chunk_bounds
from mpirt.core.precision import compute_dtype
from mpirt.cpu.sysinfo import mapped_libraries

ENGINES = ("host", "nccl", "cuda-aware", "staged")


@functools.lru_cache(maxsize=None)
def cuda_aware_mpi() -> bool:
    """True when the loaded MPI library says it can read device pointers (``MPIX_Query_cuda_support``).

    mpi4py has no wrapper for it, so the symbol is looked up with ctypes in the process, then in
    the ``libmpi*`` mapped into it; any failure (symbol missing, not Linux) answers False.
    """
    candidates = [None, *mapped_libraries(lambda name: name.startswith(("libmpi.so", "libmpi_")))]
    for path in candidates:
        try:
            fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
            fn.restype = ctypes.c_int
            return bool(fn())
        except (OSError, AttributeError):
            continue
    return False


@functools.lru_cache(maxsize=None)
def nccl_available() -> bool:
    """True when CuPy imports with its NCCL bindings usable (``cupy.cuda.nccl.available``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
        return bool(nccl.available)
    except Exception:
        return False


def select_engine(x, p2p: bool = False) -> str:
    """``"host"`` for host arrays; for device arrays ``"nccl"`` (collectives only), then
    ``"cuda-aware"``, then ``"staged"``, or what ``MPIRT_COMM_ENGINE`` forces."""
    if not B.is_device_array(x):
        return "host"
    forced = os.environ.get("MPIRT_COMM_ENGINE", "auto")
    if forced not in ("auto", *ENGINES[1:]):
        raise ValueError(f"MPIRT_COMM_ENGINE: expected auto or one of {', '.join(ENGINES[1:])}, got {forced!r}")
    if forced == "nccl" and not nccl_available():
        raise RuntimeError("MPIRT_COMM_ENGINE=nccl but cupy.cuda.nccl is not available "
                           "(pip install nvidia-nccl-cu12)")
    if forced != "auto" and not (p2p and forced == "nccl"):
        return forced
    if not p2p and nccl_available():
        return "nccl"
    return "cuda-aware" if cuda_aware_mpi() else "staged"


def describe_engines(x) -> str:
    """The engines that calls on arrays like ``x`` take, for the start-up banner: ``host MPI`` for
    host arrays; for device arrays the collectives' engine, and the point-to-point one where it
    differs (NCCL never does p2p): e.g. ``nccl (p2p staged)``."""
    collective, p2p = select_engine(x), select_engine(x, p2p=True)
    if collective == "host":
        return "host MPI"
    return collective if p2p == collective else f"{collective} (p2p {p2p})"


class _NcclEngine:
    """NCCL collectives on CuPy arrays for one :class:`Comm`, on the current stream (launch only:
    results are stream-ordered; the stream is synchronized before any MPI call reads them).

    The unique id is made on rank 0 and broadcast over MPI as 128 bytes. NCCL needs equal chunks,
    so the unequal :func:`chunk_bounds` chunks are padded to ``ceil(n / size)`` and compacted.
    """

    def __init__(self, comm):
        import cupy
        from cupy.cuda import nccl
        self.cp, self.nccl, self.size, self.rank = cupy, nccl, comm.size, comm.rank
        self._row_counts = comm._row_counts
        # 128 id bytes and a last byte saying the id's Python form: bytes (CuPy >= 14) or a tuple
        # of signed chars (earlier CuPy); NcclCommunicator takes back the form get_unique_id gave
        uid = np.zeros(129, np.uint8)
        if comm.rank == 0:
            made = nccl.get_unique_id()
            uid[128] = isinstance(made, (bytes, bytearray))
            uid[:128] = np.frombuffer(bytes(made), np.uint8) if uid[128] else np.array(made, np.int64).astype(np.uint8)
        comm.mpi.Bcast([uid, MPI.BYTE], root=0)
        raw = uid[:128]
        self.nc = nccl.NcclCommunicator(comm.size, raw.tobytes() if uid[128] else tuple(raw.view(np.int8).tolist()),
                                        comm.rank)
        self.types = {np.dtype(k): getattr(nccl, v) for k, v in [
            (np.float16, "NCCL_FLOAT16"), (np.float32, "NCCL_FLOAT32"), (np.float64, "NCCL_FLOAT64"),
            (np.int8, "NCCL_INT8"), (np.uint8, "NCCL_UINT8"), (np.int32, "NCCL_INT32"),
            (np.uint32, "NCCL_UINT32"), (np.int64, "NCCL_INT64"), (np.uint64, "NCCL_UINT64")]}
        self.ops = {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}

    def _type(self, dtype, what):
        if np.dtype(dtype) not in self.types:
            raise TypeError(f"{what}: NCCL cannot reduce dtype {dtype}")
        return self.types[np.dtype(dtype)]

    def _op(self, op, what):
        _mpi_op(op, what)
        return self.ops[op]

    def allreduce(self, x, op, out):
        rdtype = compute_dtype(x.dtype)  # 2-byte floats are reduced in float32, as on the host
        buf = _contig(x, rdtype)
        direct = out is x or out is not None and out.flags.c_contiguous and out.dtype == rdtype
        res = buf if out is x else out if direct else self.cp.empty_like(buf)
        self.nc.allReduce(buf.data.ptr, res.data.ptr, buf.size, self._type(rdtype, "allreduce"),
                          self._op(op, "allreduce"), B.current_stream_ptr())
        if op == "avg":
            _divide(res, self.size)
        target = x if out is x else out
        if target is not None and res is not target:
            target[...] = res
        return res.astype(x.dtype, copy=False) if target is None else target

    def reduce_scatter(self, x, op, out):
        flat = _contig(x, compute_dtype(x.dtype)).reshape(-1)  # 2-byte floats reduced in float32
        bounds = chunk_bounds(flat.size, self.size)
        c = bounds[0][1] - bounds[0][0]
        if flat.size != c * self.size:
            padded = self.cp.zeros(c * self.size, flat.dtype)
            for r, (a, b) in enumerate(bounds):
                padded[r * c:r * c + b - a] = flat[a:b]
            flat = padded
        res = self.cp.empty(c, flat.dtype)
        self.nc.reduceScatter(flat.data.ptr, res.data.ptr, c, self._type(flat.dtype, "reduce_scatter"),
                              self._op(op, "reduce_scatter"), B.current_stream_ptr())
        a, b = bounds[self.rank]
        res = res[:b - a]
        if op == "avg":
            _divide(res, self.size)
        if out is None:
            return res.astype(x.dtype, copy=False)
        out[...] = res
        return out

    def _gather(self, send, rows: int, counts, out):
        """Allgather of ``send`` (``rows`` padded rows per rank), compacted to ``counts`` rows."""
        full = self.cp.empty((self.size * rows, *send.shape[1:]), send.dtype)
        self.nc.allGather(send.data.ptr, full.data.ptr, send.nbytes, self.nccl.NCCL_UINT8,
                          B.current_stream_ptr())
        if len(set(counts)) != 1:
            full = self.cp.concatenate([full[r * rows:r * rows + c] for r, c in enumerate(counts)])
        if out is None:
            return full
        out[...] = full.reshape(out.shape)
        return out

    def allgather(self, x, counts, out):
        x2 = _contig(x.reshape(1) if x.ndim == 0 else x)
        counts = self._row_counts(x2, counts)
        rows = max(counts)
        if x2.shape[0] != rows:
            padded = self.cp.zeros((rows, *x2.shape[1:]), x2.dtype)
            padded[:x2.shape[0]] = x2
            x2 = padded
        return self._gather(x2, rows, counts, out)

    def allgather_flat(self, chunk, n, out):
        counts = [b - a for a, b in chunk_bounds(n, self.size)]
        if chunk.size != counts[self.rank]:
            raise ValueError(f"allgather_flat: rank {self.rank} holds {chunk.size} elements, chunk "
                             f"{self.rank} of {n} over {self.size} ranks has {counts[self.rank]}")
        send = self.cp.zeros(counts[0], chunk.dtype)
        send[:chunk.size] = chunk.reshape(-1)
        return self._gather(send, counts[0], counts, out)

    def broadcast(self, x, root):
        buf = _contig(x)
        self.nc.bcast(buf.data.ptr, buf.nbytes, self.nccl.NCCL_UINT8, root, B.current_stream_ptr())
        if buf is not x:
            x[...] = buf
