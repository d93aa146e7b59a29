"""Blocked elementwise passes, spread over a small persistent thread pool (NumPy on CPU).

BLAS runs every GEMM on all cores, but a NumPy ufunc or reduction runs on one. In a training step
the passes between the GEMMs (layer norm, GELU, softmax, cross-entropy, gradient accumulation,
AdamW) then leave the other cores idle. NumPy releases the GIL inside ufunc loops and reductions,
so cutting such a pass into row blocks and handing the blocks to a few threads uses those cores.

:func:`for_blocks` is the one entry point. Its blocks are also cache-sized (``BLOCK`` elements), so
a kernel that makes several passes over a block (max, subtract, exp, sum ...) reads it from memory
once instead of once per pass. On CuPy, for small arrays and with one thread, the kernel runs once
on the whole arrays: the code that calls it is the same for both backends.

The thread count defaults to ``MPIRT_NUM_THREADS``, else ``OPENBLAS_NUM_THREADS`` /
``OMP_NUM_THREADS``, else the usable cores divided by the MPI ranks on this node; set it with
:func:`set_num_threads` (use the BLAS thread count).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import mpirt.backend as B

BLOCK = 1 << 16       # elements per block: 256 KiB of float32, several arrays fit in L2
MIN_PARALLEL = 1 << 17  # below this many elements a dispatch to the pool costs more than it saves

_num_threads: int | None = None
_pool: ThreadPoolExecutor | None = None
_in_worker = threading.local()


def default_num_threads() -> int:
    """Thread count from the environment (see the module docstring)."""
    for var in ("MPIRT_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var, "").strip().isdigit():
            return max(1, int(os.environ[var]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or "1"
    return max(1, cores // max(1, int(local)))


def num_threads() -> int:
    """Threads :func:`for_blocks` uses (the calling thread included)."""
    global _num_threads
    if _num_threads is None:
        _num_threads = default_num_threads()
    return _num_threads


def set_num_threads(n: int) -> None:
    """Use ``n`` threads (the calling thread included) from now on; 1 turns the pool off."""
    global _num_threads, _pool
    if n < 1:
        raise ValueError(f"set_num_threads: need n >= 1, got {n}")
    if _pool is not None and n != _num_threads:
        _pool.shutdown(wait=True)
        _pool = None
    _num_threads = int(n)


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=num_threads() - 1, thread_name_prefix="mpirt-blocks")
    return _pool


def _drain(kernel, arrays, bounds, next_block, results, worker: bool) -> None:
    """Run blocks until none are left (each thread pulls the next free block)."""
    if worker:
        _in_worker.active = True  # a kernel that calls for_blocks from a worker runs serially
    while True:
        i = next_block()
        if i is None:
            return
        lo, hi = bounds[i], bounds[i + 1]
        results[i] = kernel(*(None if a is None else a[lo:hi] for a in arrays))


def for_blocks(kernel, *arrays, block: int | None = None) -> list:
    """Call ``kernel(*parts)`` on row blocks of ``arrays``; return the kernel's results in block order.

    ``arrays`` share their leading dimension (their "rows"); each call gets the same row range
    ``a[lo:hi]`` of every array (None stays None), about ``block`` elements of the first one. A kernel writes its
    output into one of the parts (or returns a small per-block result, e.g. a partial sum) and
    must not touch rows outside its parts. Blocks run in any order on any thread; the returned
    list is in block order, so reductions over it are deterministic.
    """
    first = arrays[0]
    rows = first.shape[0] if first.ndim else 1
    threads = num_threads()
    if (B.name != "numpy" or first.ndim == 0 or rows < 2 or first.size < MIN_PARALLEL
            or getattr(_in_worker, "active", False)):
        return [kernel(*arrays)]
    per_row = max(1, first.size // rows)
    step = max(1, (block or BLOCK) // per_row)
    bounds = list(range(0, rows, step)) + [rows]
    count = len(bounds) - 1
    results = [None] * count
    lock, cursor = threading.Lock(), iter(range(count))

    def next_block():
        with lock:
            return next(cursor, None)

    helpers = min(threads, count) - 1
    futures = [_executor().submit(_drain, kernel, arrays, bounds, next_block, results, True)
               for _ in range(helpers)]
    try:
        _drain(kernel, arrays, bounds, next_block, results, False)
    finally:
        for f in futures:  # the arrays stay in use until every helper is done
            f.exception()
    for f in futures:
        f.result()
    return results


def fill_zero(a) -> None:
    """``a.fill(0)``, on all threads when ``a`` is a large contiguous NumPy array."""
    if a.flags.c_contiguous:
        for_blocks(lambda part: part.fill(0), a.reshape(-1))
    else:
        a.fill(0)
