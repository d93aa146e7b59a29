"""mpirt's CPU threads: small persistent pools run both the GEMMs and the elementwise passes.

NumPy runs a ufunc or a reduction on one core. NumPy releases the GIL inside ufunc loops,
reductions and BLAS calls, so cutting a pass into row blocks and handing the blocks to a few
threads uses every core for the passes between the GEMMs too (layer norm, GELU, softmax,
cross-entropy, gradient accumulation, AdamW). :func:`for_blocks` does that.

Why the pool also runs the GEMMs: left multithreaded, OpenBLAS keeps its worker threads spinning
for a while after each call (busy-waiting, not yielding), and a pool thread woken right after a
GEMM then finds no free core: measured on 2 cores, a blocked GELU pass ran in 3.5 ms after a GEMM
with single-threaded OpenBLAS and 6.8 ms with 2-thread OpenBLAS (no faster than on one thread).
So :func:`set_num_threads` (or the first use) sets NumPy's OpenBLAS to one thread whenever it
can reach it, and with more than one thread :func:`matmul` splits each product over the pool
(as fast as OpenBLAS's own threading: 5.8 ms against 5.6 ms for (1024, 512) @ (512, 1536)), while
:func:`run_tasks` runs two small independent products side by side. Products computed with plain
``@`` outside mpirt's ops run on one core. 2-D products run on the GEMM library that
:mod:`mpirt.cpu.blas` found fastest here (OpenBLAS, BLIS or MKL, single-threaded). Without access
to NumPy's OpenBLAS (another BLAS, no ``/proc``) it keeps its own threads and products are not
split.

On a shared machine a pool thread may not get a core at once: the calling thread then does the
work itself rather than wait for it (it drains every block of :func:`for_blocks`, and runs a task of
:func:`run_tasks` that no pool thread has started yet), so another process holding one core slows
a pass instead of stalling it.

Blocks are ``BLOCK`` elements: several passes over one block find it in cache, and blocks are
long enough that threads rarely wait for the GIL between ufunc calls. Waking a pool thread costs
about 80 us here, so small work stays on the calling thread.

Work that is all C, the kernels of :mod:`mpirt.cpu.kernels` and the GEMMs on a library with a
``cblas_?gemm`` (OpenBLAS, MKL), goes to the native pool instead (:func:`c_blocks`,
:func:`run_gemms`, the split in :func:`matmul`): C threads that never take the GIL and spin for
2 ms after each run before they sleep, so a block starts in about a microsecond instead of
80-130 (a tiny GPT step hands out ~45 runs: measured 11-20 % faster steps, alternated A/B). The
NumPy passes, BLIS and the products split along K stay on the Python pool.

On CuPy, with one thread and for arrays of one block, kernels run once on the whole arrays: the
calling code is the same for every backend.

The thread count defaults to ``MPIRT_NUM_THREADS``, else ``OPENBLAS_NUM_THREADS`` /
``OMP_NUM_THREADS``, else the usable cores divided by the MPI ranks on this node.

Over 400 lines: the thread pools and the GEMM split are one scheduling policy (which work runs where).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import mpirt.core.backend as B
from mpirt.cpu import blas
from mpirt.core.precision import compute_dtype, is_half, upcast
from mpirt.cpu.sysinfo import mapped_libraries

# Elements per block (1 MiB of float32). Smaller blocks stay in L1/L2 but the threads then spend
# their time handing the GIL back and forth between short ufunc calls: measured on 2 cores, a
# GELU pass over 2M elements took 10.4 ms at 16K-element blocks, 4.0 ms at 256K and 7.5 ms whole.
BLOCK = 1 << 18
# Waking a pool thread takes about 80 us on these machines (an idle virtual CPU), so a kernel that
# makes a single cheap pass (an add, a fill, a scale) goes parallel only from 2 blocks of this size.
LIGHT_BLOCK = 1 << 20
MIN_SPLIT_MACS = 1 << 24  # smaller products are not worth waking a pool thread (~80 us here)
MAX_TASK_MACS = 1 << 28   # larger products are split rather than run side by side (run_tasks)

_num_threads: int | None = None
_split_gemms = False      # True while this pool runs the GEMMs and OpenBLAS is single-threaded
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
    """Threads the pool uses (the calling thread included)."""
    if _num_threads is None:
        set_num_threads(default_num_threads())
    return _num_threads


def set_num_threads(n: int) -> None:
    """Use ``n`` threads (the calling thread included) for mpirt's GEMMs and passes; 1 turns the
    pool off. The one owner of the process's CPU thread counts: NumPy's OpenBLAS, where it is
    found, runs one thread (the pool splits the GEMMs; see the module docstring);
    :func:`blas_threads` reads back the count in force."""
    global _num_threads, _pool, _split_gemms
    if n < 1:
        raise ValueError(f"set_num_threads: need n >= 1, got {n}")
    if _pool is not None and n != _num_threads:
        _pool.shutdown(wait=True)
        _pool = None
    _num_threads = int(n)
    _split_gemms = _openblas() is not None and n > 1
    if _openblas() is not None:
        set_blas_threads(1)


@functools.lru_cache(maxsize=None)
def _openblas():
    """(set, get) ctypes functions of the OpenBLAS NumPy loaded (found in ``/proc/self/maps``; the
    scipy-openblas build names them ``scipy_openblas_*_num_threads64_``), or None."""
    for path in mapped_libraries("openblas"):
        lib = ctypes.CDLL(path)
        for suffix in ("64_", "", "_64"):
            for prefix in ("scipy_openblas", "openblas"):
                try:
                    set_fn = getattr(lib, f"{prefix}_set_num_threads{suffix}")
                    get_fn = getattr(lib, f"{prefix}_get_num_threads{suffix}")
                except AttributeError:
                    continue
                set_fn.argtypes, set_fn.restype = [ctypes.c_int], None
                get_fn.argtypes, get_fn.restype = [], ctypes.c_int
                return set_fn, get_fn
    return None


def blas_threads() -> int | None:
    """OpenBLAS's current thread count, or None when no OpenBLAS is loaded."""
    fns = _openblas()
    return fns[1]() if fns else None


def set_blas_threads(n: int) -> int:
    """Set OpenBLAS's own thread count; returns the count read back. RuntimeError when not
    possible. (:func:`set_num_threads` sets it for training; this alone is for measurements of
    OpenBLAS itself.)"""
    fns = _openblas()
    if fns is None:
        raise RuntimeError("no OpenBLAS with openblas_set_num_threads is loaded in this process")
    fns[0](int(n))
    return fns[1]()


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=num_threads() - 1, thread_name_prefix="mpirt")
    return _pool


def _forget_pool_in_child() -> None:
    """A forked child has none of the parent's threads: it starts its own pool when it needs one."""
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def _drain(kernel, arrays, bounds, next_block, results, worker: bool) -> None:
    """Run blocks until none are left (each thread pulls the next free block)."""
    if worker:
        _in_worker.active = True  # a kernel that calls for_blocks from a worker runs serially
    while True:
        i = next_block()
        if i is None:
            return
        lo, hi = bounds[i], bounds[i + 1]
        results[i] = kernel(*_rows(arrays, lo, hi))


def _rows(arrays, lo: int, hi: int) -> tuple:
    """Rows ``[lo, hi)`` of each array (None stays None): one block's parts."""
    return tuple(None if a is None else a[lo:hi] for a in arrays)


def _block_bounds(first, block: int | None) -> list | None:
    """Row bounds of the blocks :func:`for_blocks` makes of ``first``, or None: one block, or not
    to be split here (CuPy, or inside a pool thread)."""
    rows = first.shape[0] if first.ndim else 1
    count = min(rows, -(-first.size // (block or BLOCK)))  # blocks of about `block` elements
    if B.name != "numpy" or count < 2 or getattr(_in_worker, "active", False):
        return None
    return [rows * i // count for i in range(count + 1)]


def c_blocks(name: str, dtype, args_of, *arrays, block: int | None = None) -> None:
    """:func:`for_blocks` for one C kernel of :mod:`mpirt.cpu.kernels`: ``args_of(*parts)`` gives
    kernel ``name``'s arguments for the row block ``parts``; the blocks run on the native pool
    (:func:`mpirt.cpu.kernels.run_calls`), whose threads start a block in microseconds. Inside
    :func:`one_run` the calls are collected instead, to run at its end."""
    bounds = _block_bounds(arrays[0], block)
    if bounds is None:
        calls = [(name, dtype, *args_of(*arrays))]
    else:  # the same blocks at any thread count: per-block partial sums keep their bits
        calls = [(name, dtype, *args_of(*_rows(arrays, lo, hi))) for lo, hi in zip(bounds, bounds[1:])]
    collecting = getattr(_collecting, "run", None)
    if collecting is not None and name in collecting[0]:
        collecting[1].extend(calls)
    else:
        _run_c_calls(calls)


def _run_c_calls(calls: list) -> None:
    """Kernel calls on the native pool; one call, or one thread, on this thread."""
    from mpirt.cpu import kernels
    if len(calls) == 1 or num_threads() < 2:
        for c in calls:
            kernels.call(*c)
    elif calls:
        kernels.run_calls(calls, workers=num_threads() - 1)


_collecting = threading.local()


@contextlib.contextmanager
def one_run(*names: str):
    """Context: the blocks of kernels ``names`` that :func:`c_blocks` is given inside are
    collected, and run at the end as one run of the native pool, spread over its threads (other
    kernels run at once). For calls independent of each other and of what the body reads (every
    parameter's AdamW update: one run instead of one per parameter, most of them too small to
    split). Nothing collected runs if the body raises."""
    if getattr(_collecting, "run", None) is not None:     # nested: the outer run decides
        yield
        return
    calls: list = []
    _collecting.run = (frozenset(names), calls)
    try:
        yield
    finally:
        _collecting.run = None
    _run_c_calls(calls)


def for_blocks(kernel, *arrays, block: int | None = None, blas: bool = False) -> list:
    """Call ``kernel(*parts)`` on row blocks of ``arrays``; return the kernel's results in block order.

    ``arrays`` share their leading dimension (their "rows"); each call gets the same row range
    ``a[lo:hi]`` of every array (None stays None), about ``block`` (default ``BLOCK``) elements
    of the first one; arrays of at most one block go to the kernel whole, in one call. A kernel
    writes its output into one of the parts (or returns a small per-block result, e.g. a partial
    sum) and must not touch rows outside its parts. Blocks run in any order on any thread; the
    returned list is in block order, so reductions over it are deterministic. A kernel that calls
    BLAS passes ``blas=True``: it then runs whole unless this pool is running the GEMMs.
    """
    bounds = _block_bounds(arrays[0], block)
    if bounds is None or (blas and not (num_threads() > 1 and _split_gemms)):
        return [kernel(*arrays)]
    count = len(bounds) - 1
    results = [None] * count
    lock, cursor = threading.Lock(), iter(range(count))

    def next_block():
        with lock:
            return next(cursor, None)

    helpers = min(num_threads(), count) - 1
    futures = [_executor().submit(_drain, kernel, arrays, bounds, next_block, results, True)
               for _ in range(helpers)]
    try:
        _drain(kernel, arrays, bounds, next_block, results, False)
    finally:
        for f in futures:  # the arrays stay in use until every helper is done; one that has
            if not f.cancel():  # not started yet (its core busy elsewhere) has nothing left to do
                f.exception()
    for f in futures:
        if not f.cancelled():
            f.result()
    return results


def run_tasks(*tasks, macs: int = 0) -> list:
    """Run independent zero-argument functions concurrently, one per thread, each on one core
    (GEMMs and passes inside them are not split); return their results in order.

    Two small products of a backward pass (input and weight gradient) run faster side by side,
    each whole on its own core, than one after the other, each split: one wake-up instead of two,
    and a small GEMM runs better whole than in halves (tiny GPT: 21 ms against 28 ms per step).
    Large ones (``macs``, the multiply-adds of the largest task, from ``MAX_TASK_MACS``) run one
    after the other, each split: side by side they compete for memory bandwidth (the 50257-token
    head's backward took 466 ms against 391 ms). Sequential with one thread, or when the BLAS
    keeps its own threads.
    """
    if (B.name != "numpy" or len(tasks) < 2 or num_threads() < 2 or not _split_gemms
            or macs >= MAX_TASK_MACS or getattr(_in_worker, "active", False)):
        return [t() for t in tasks]
    futures = [_executor().submit(_serial, t) for t in tasks[1:]]
    try:
        first = _serial(tasks[0], caller=True)
    except BaseException:
        for f in futures:  # the arrays stay in use until every started helper is done
            if not f.cancel():
                f.exception()
        raise
    # A task whose pool thread has not started it yet (another process holds that core) runs
    # here instead of keeping this thread waiting for the pool thread to be scheduled.
    results = [first]
    try:
        for t, f in zip(tasks[1:], futures):
            results.append(_serial(t, caller=True) if f.cancel() else f.result())
    finally:
        for f in futures:
            if not f.cancel():
                f.exception()
    return results


def _serial(task, caller: bool = False):
    """Run ``task`` with this thread's blocked passes and products kept on this thread."""
    _in_worker.active = True
    try:
        return task()
    finally:
        if caller:
            _in_worker.active = False


def _gemm(a, b, out=None, accumulate: bool = False):
    """A 2-D product (``accumulate``: added into ``out``) on the GEMM library :mod:`mpirt.cpu.blas`
    chose (``xp.matmul`` on CuPy)."""
    if B.name != "numpy":
        if accumulate:
            out += B.xp.matmul(a, b)
            return out
        return B.xp.matmul(a, b, out=out)
    return blas.gemm(a, b, out, accumulate)


def can_accumulate(out, a, b) -> bool:
    """True when :func:`matmul` can add ``a @ b`` into ``out`` inside the GEMM (beta = 1): NumPy,
    2-D, one float32/float64 dtype for all three, ``out`` C- or F-contiguous and writable."""
    return (B.name == "numpy" and out.ndim == 2 and a.ndim == 2 and b.ndim == 2
            and out.dtype == a.dtype == b.dtype and out.dtype.kind == "f" and out.dtype.itemsize >= 4
            and (out.flags.c_contiguous or out.flags.f_contiguous) and out.flags.writeable)


def matmul(a, b, bias=None, out=None, accumulate: bool = False):
    """``a @ b (+ bias)`` for ``a`` (..., M, K) and a 2-D ``b`` (K, N), or both batched with one
    batch shape, split over the pool: by rows of ``a``, by columns of ``b`` when ``b`` is the
    larger operand (each thread then packs only its part of it), or along K when K is much the
    longest dimension (partial products added). A ``bias`` (N,) (2-D ``b`` only) is added to each
    block of the result while it is in cache. 2-D products run on the GEMM library that
    :mod:`mpirt.cpu.blas` chose; batched ones on ``xp.matmul``. CuPy and small products run whole.
    Half operands on NumPy (which has no half GEMM) are multiplied in float32 and the result is
    rounded once to their dtype, as a GPU GEMM accumulating in float32 would.

    ``accumulate=True`` adds the product into ``out`` (2-D ``a``, ``b``, ``out`` where
    :func:`can_accumulate` holds, no bias): each thread's GEMM adds into its own block of
    ``out`` (beta = 1), with no temporary and no separate pass; returns ``out``."""
    xp = B.xp
    if accumulate:
        if bias is not None or out is None or out.shape != (a.shape[0], b.shape[1]):
            raise ValueError("matmul: accumulate=True needs 2-D operands, an out of their product's shape, no bias")
        if not can_accumulate(out, a, b):
            out += matmul(a, b)
            return out
    half = a.dtype if is_half(a.dtype) else b.dtype if is_half(b.dtype) else None
    if half is not None and (B.name == "numpy" or b.ndim > 2):
        # NumPy has no half GEMM, CuPy no batched bfloat16 one: float32 products, rounded once
        return matmul(upcast(a), upcast(b), upcast(bias)).astype(half)
    if B.name != "numpy" or num_threads() < 2 or not _split_gemms or a.ndim < 2 or b.ndim < 2 \
            or a.shape[-1] * b.shape[-1] * (a.size // a.shape[-1]) < MIN_SPLIT_MACS \
            or (b.ndim > 2 and a.shape[:-2] != b.shape[:-2]):
        if accumulate:
            return _gemm(a, b, out, accumulate=True)
        if b.ndim == 2 and a.ndim >= 2:
            out = _gemm(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[1])
        else:
            out = xp.matmul(a, b)
        if bias is not None:
            out += bias
        return out
    out_dtype = xp.result_type(a, b)
    if b.ndim > 2:
        out = xp.empty((*a.shape[:-1], b.shape[-1]), dtype=out_dtype)
        for_blocks(lambda ap, bp, op: xp.matmul(ap, bp, out=op), a, b, out,
                   block=-(-a.size // num_threads()), blas=True)
        return out
    a2 = a.reshape(-1, a.shape[-1])
    (m, k), n = a2.shape, b.shape[1]
    if k >= 16 * max(m, n):  # a long inner dimension (a vocabulary): split it, add the partials
        parts = for_blocks(lambda bk, at: _gemm(at.T, bk), b, a2.T,
                           block=-(-b.size // num_threads()), blas=True)
        if accumulate:
            for part in parts:
                out += part
            return out
        out = parts[0]                                      # fresh products: add in place
        for part in parts[1:]:
            out += part
        if bias is not None:
            out += bias
        return out.reshape(*a.shape[:-1], n)
    if not accumulate:
        out = xp.empty((m, n), dtype=out_dtype)
    if _pooled_gemm(a2, b, out, bias, accumulate):
        return out.reshape(*a.shape[:-1], b.shape[1])
    if b.size > a2.size:
        def columns(bt, ot, bias_part):
            _gemm(a2, bt.T, ot.T, accumulate)
            if bias_part is not None:
                ot += bias_part[:, None]
        for_blocks(columns, b.T, out.T, bias, block=-(-b.size // num_threads()), blas=True)
    else:
        def rows(ap, op):
            _gemm(ap, b, op, accumulate)
            if bias is not None:
                op += bias
        for_blocks(rows, a2, out, block=-(-a2.size // num_threads()), blas=True)
    return out.reshape(*a.shape[:-1], b.shape[1])


def _pooled_gemm(a2, b, out, bias, accumulate: bool) -> bool:
    """:func:`matmul`'s split 2-D product on the native pool, blocks as :func:`matmul` makes them,
    one ``cblas_?gemm`` call each, which adds the bias to its block after the product. False,
    with nothing done, where the kernels or the library's cblas cannot take it."""
    from mpirt.cpu import kernels
    if kernels.library() is None:
        return False
    by_columns = b.size > a2.size
    whole, cut = (b.T, out.T) if by_columns else (a2, out)
    bounds = _block_bounds(whole, -(-whole.size // num_threads()))
    if bounds is None:
        return False
    calls = []
    for lo, hi in zip(bounds, bounds[1:]):
        if by_columns:
            calls.append(blas.gemm_call(a2, whole[lo:hi].T, cut[lo:hi].T, accumulate,
                                        None if bias is None else bias[lo:hi]))
        else:
            calls.append(blas.gemm_call(whole[lo:hi], b, cut[lo:hi], accumulate, bias))
    if None in calls:
        return False
    kernels.run_calls(calls, workers=num_threads() - 1)
    return True


def gemms_side_by_side() -> bool:
    """Whether :func:`run_gemms` can run products side by side here (NumPy, two threads or more,
    the native pool and its GEMM library; not inside a pool worker): ask before allocating their
    outputs."""
    from mpirt.cpu import kernels
    return (B.name == "numpy" and num_threads() >= 2 and _split_gemms and not getattr(_in_worker, "active", False)
            and kernels.library() is not None)


def run_gemms(*products) -> bool:
    """Run 2-D products ``(a, b, out, accumulate)`` side by side, each whole on one thread of the
    native pool (as :func:`run_tasks` runs small ones); False, with nothing done, where the pool,
    the library's cblas or the layouts cannot take them all."""
    from mpirt.cpu import kernels
    if not gemms_side_by_side():
        return False
    calls = [blas.gemm_call(a, b, out, accumulate) for a, b, out, accumulate in products]  # no bias
    if None in calls:
        return False
    kernels.run_calls(calls, workers=num_threads() - 1)
    return True


def add_up(parts):
    """The sum of per-block partial results, added in block order (deterministic)."""
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return total


def sum_rows(a):
    """``a.sum(axis=0)`` of a 2-D array, on all threads. On NumPy float32/float64 each block's
    sum is ``ones @ block`` (a GEMV: ~3x faster than NumPy's column-sum reduction)."""
    if B.name == "numpy" and a.dtype.kind == "f" and a.dtype.itemsize >= 4:
        ones = B.xp.ones(a.shape[0], dtype=a.dtype)
        return add_up(for_blocks(lambda part: ones[:part.shape[0]] @ part, a, block=LIGHT_BLOCK))
    acc = compute_dtype(a.dtype)  # half sums accumulate in float32, rounded once at the end
    return add_up(for_blocks(lambda part: part.sum(axis=0, dtype=acc), a, block=LIGHT_BLOCK)).astype(a.dtype, copy=False)


def fill_zero(a) -> None:
    """``a.fill(0)``, on all threads when ``a`` is a large contiguous NumPy array."""
    if a.flags.c_contiguous:
        for_blocks(lambda part: part.fill(0), a.reshape(-1), block=LIGHT_BLOCK)
    else:
        a.fill(0)
