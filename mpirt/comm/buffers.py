"""Buffers and dtypes for MPI calls: chunk bounds, reduction dtypes and ops, contiguous copies,
the array module of an array, and the stream synchronization before MPI touches a device buffer.
"""
from __future__ import annotations

import itertools

import functools

import numpy as np
from mpi4py import MPI

import mpirt.core.backend as B


def chunk_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``size`` contiguous chunks: rank r owns ``[start_r, stop_r)``.

    The first ``n % size`` ranks hold one element more; e.g. ``chunk_bounds(10, 4)`` is
    ``[(0, 3), (3, 6), (6, 8), (8, 10)]``.
    """
    if size < 1 or n < 0:
        raise ValueError(f"chunk_bounds: need n >= 0 and size >= 1, got n={n}, size={size}")
    q, r = divmod(n, size)
    bounds, start = [], 0
    for i in range(size):
        stop = start + q + (i < r)
        bounds.append((start, stop))
        start = stop
    return bounds


@functools.lru_cache(maxsize=256)
def _counts(n: int, size: int) -> tuple[int, ...]:
    return tuple(b - a for a, b in chunk_bounds(n, size))


def _byte_layout(counts, unit: int) -> tuple[list, list]:
    """``(sizes, displacements)`` in bytes of ``counts`` items of ``unit`` bytes laid back to back:
    the buffer description of MPI's v-collectives."""
    sizes = [int(c) * unit for c in counts]
    return sizes, [0, *itertools.accumulate(sizes)][:-1]

_REDUCE_TYPES = {np.dtype(k): v for k, v in [
    (np.float32, MPI.FLOAT), (np.float64, MPI.DOUBLE), (np.int8, MPI.INT8_T), (np.int16, MPI.INT16_T),
    (np.int32, MPI.INT32_T), (np.int64, MPI.INT64_T), (np.uint8, MPI.UINT8_T), (np.uint16, MPI.UINT16_T),
    (np.uint32, MPI.UINT32_T), (np.uint64, MPI.UINT64_T), (np.complex64, MPI.C_FLOAT_COMPLEX),
    (np.complex128, MPI.C_DOUBLE_COMPLEX)]}
_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def _reduce_dtype(dtype, what: str):
    """(dtype the reduction runs in, its MPI datatype); 2-byte floats are reduced in float32."""
    mtype = _REDUCE_TYPES.get(dtype)
    if mtype is not None:
        return dtype, mtype
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize == 2 or dtype.name == "bfloat16":
        return np.dtype(np.float32), MPI.FLOAT
    raise TypeError(f"{what}: dtype {dtype} cannot be reduced (supported: "
                    f"{', '.join(sorted(str(d) for d in _REDUCE_TYPES))}, float16)")


def _mpi_op(op: str, what: str):
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"{what}: op must be one of {', '.join(_OPS)}, got {op!r}") from None


def _divide(a, size: int) -> None:
    """In place ``a /= size`` in ``a``'s dtype (floor division for integers)."""
    if a.dtype.kind in "iu":
        a //= size
    else:
        a /= size


def _xp(a):
    if B.is_device_array(a):
        import cupy
        return cupy
    return np


def _sync(buf) -> None:
    """Before MPI reads or writes a device buffer, finish the kernels queued on the stream
    (including the copy that may have just made ``buf``)."""
    if hasattr(buf, "__cuda_array_interface__"):
        B.synchronize()


def _contig(a, dtype=None):
    """``a`` itself when C-contiguous (and of ``dtype``), else a C-contiguous copy."""
    if (dtype is None or a.dtype == dtype) and a.flags.c_contiguous:
        return a
    return _xp(a).ascontiguousarray(a, dtype=dtype)


def _put_back(host_result, like, out):
    """Copy a host result of the staged engine onto the device of ``like`` (into ``out`` if given)."""
    xp = _xp(like)
    if out is None:
        return xp.asarray(host_result)
    out[...] = xp.asarray(host_result).reshape(out.shape)
    return out
