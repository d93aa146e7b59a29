"""Fused CPU kernels in C: layer norm, RMS norm, GELU, the causal attention and AdamW, each one
pass over its rows where the NumPy form makes several (the float32 attention: its products,
softmax and gradients per (batch, head) pair in one call, on register-blocked small GEMMs).

The source (``SOURCES``) ships with mpirt and is compiled on first use on the machine that runs
it (``cc -O3 -march=native``: the nodes of a cluster may differ, so nothing is built at install
time), into ``$MPIRT_CACHE`` under a name that hashes the source, the flags, the compiler and the
CPU; later starts load the cached library (a build prunes libraries unused for ``UNUSED_DAYS``).
Ranks that compile at once each write their own temporary file and rename it into place. The
functions are called through ctypes, which releases the GIL; the ops hand row blocks of one call
to the library's own thread pool (``kernels_pool.h``, :func:`run_calls`).

Without a C compiler, or with ``MPIRT_KERNELS=numpy``, :func:`library` is None and every op runs
its NumPy form (the ops test both). :func:`describe` says which, for the start-up banner.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from mpirt.cpu.sysinfo import cache_dir, cpu_model, cpuinfo

SOURCES = ("kernels.c", "kernels_body.h", "kernels_attention.h", "kernels_pool.h")
# -ffp-contract=off and -fno-fast-math spelled out: GCC implies them under -std=c11, clang and icx
# do not, and AdamW's bit-equality and the NaN/inf behaviour depend on them
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
         "-fno-fast-math", "-fPIC", "-shared", "-std=c11", "-pthread")

_lock = threading.Lock()
_loaded: tuple | None = None   # (CDLL or None, how: str)

P, L, D, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_double, ctypes.c_int
SIGNATURES = {
    "norm_forward": (P, P, P, P, P, P, L, L, D, I),    # layer norm (center 1), RMS norm (center 0)
    "norm_backward": (P, P, P, P, P, P, P, L, L, I),
    "gelu": (P, P, P, L),
    "causal_softmax": (P, P, P, L, L, L, L, L, L, L),
    "causal_probs": (P, P, L, L, L, L, L, L, L),
    "softmax_grad": (P, P, P, L, L, L, L, L),
    "adamw": (P, P, P, P, L, D, D, D, D, D),
}
LONG = np.dtype(f"i{ctypes.sizeof(ctypes.c_long)}")  # index arrays the kernels take (idx in C)
FLOAT32_ONLY = {  # return 0, or -1 when their workspace could not be allocated
    "attention_forward": (P, P, P, L, L, L, L, L, L, D),
    "attention_backward": (P, P, P, P, P, L, L, L, L, L, L, D, P, L),
}
# The pool's cblas_?gemm call (kernels_pool.h): function, ILP64?, transa, transb, m, n, k, A, lda,
# B, ldb, beta, C, ldc, bias (or None)
GEMM_CALL = (P, L, I, I, L, L, L, P, L, P, L, D, P, L, P)
POOL_ARGS = 16


def compiler() -> str | None:
    """The C compiler's path (``$CC``, default ``cc``), or None when there is none."""
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def compile_c(cc: str, flags, source: Path, target: Path) -> None:
    """Compile ``source`` with ``flags`` into ``target`` (atomically: a temporary file renamed
    into place, so ranks building at once never load a half-written file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        result = subprocess.run([cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=120)
        if result.returncode:
            raise RuntimeError(f"{cc} exited {result.returncode}: {result.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


UNUSED_DAYS = 30


def _prune(keep: Path) -> None:
    """Delete cached libraries no process has loaded for ``UNUSED_DAYS`` (each load touches its
    file): older mpirt versions' and other compilers'. Nodes of another CPU that share the cache
    keep theirs by using them; a process that has one loaded is not affected (the file stays
    mapped)."""
    cutoff = time.time() - UNUSED_DAYS * 86400
    for old in keep.parent.glob("kernels-*.so"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # another process pruned it first, or it is not ours to delete
            pass


def _load() -> tuple:
    if os.environ.get("MPIRT_KERNELS", "").strip().lower() in ("numpy", "off", "0"):
        return None, "numpy (MPIRT_KERNELS=numpy)"
    try:
        return _build_and_load()
    except Exception as err:  # whatever fails (no home directory, a library without a symbol), NumPy runs
        return None, f"numpy (the C kernels did not load: {type(err).__name__}: {err})"


def _build_and_load() -> tuple:
    cc = compiler()
    if cc is None:
        return None, "numpy (no C compiler: set CC or install cc for the fused kernels)"
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((here / name).read_bytes())
    # -march=native: nodes that share a home directory but not an instruction set (a VM hiding
    # AVX-512 behind the same model name) must not share a library
    info = cpuinfo()
    digest.update(repr((FLAGS, os.path.realpath(cc), cpu_model(), info.get("flags") or info.get("Features", ""),
                        ctypes.sizeof(ctypes.c_long))).encode())
    target = cache_dir() / f"kernels-{digest.hexdigest()[:16]}.so"
    try:
        lib = None
        if target.exists():
            try:
                lib = ctypes.CDLL(str(target))
            except OSError:  # a damaged cache entry: build it again
                lib = None
        built = lib is None
        if built:
            compile_c(cc, FLAGS, here / "kernels.c", target)
            lib = ctypes.CDLL(str(target))
            _prune(target)
        else:
            os.utime(target)                           # in use: _prune keeps it
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        return None, f"numpy (the C kernels did not build: {err})"
    for name, args in SIGNATURES.items():
        for suffix in ("_f32", "_f64"):
            fn = getattr(lib, name + suffix)
            fn.argtypes, fn.restype = args, None
    for name, args in FLOAT32_ONLY.items():
        fn = getattr(lib, name + "_f32")
        fn.argtypes, fn.restype = args, ctypes.c_int
    for name, args, result in (("pool_kernel_index", (ctypes.c_char_p,), L), ("pool_start", (I,), I),
                               ("pool_stop", (), None), ("pool_forget", (), None), ("pool_run", (P, L), I)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib, f"C ({os.path.basename(cc)} {' '.join(FLAGS[:2])}, {'built now' if built else 'cached'})"


def library():
    """The compiled kernels (a ctypes library), or None when the NumPy forms run instead."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load()
    return _loaded[0]


def describe() -> str:
    """Which kernels run, for the start-up banner: ``C (cc -O3 -march=native, cached)`` or
    ``numpy (why)``."""
    library()
    return _loaded[1]


@contextlib.contextmanager
def numpy_forms():
    """Context: inside, every op runs its NumPy form (for side-by-side benchmarks and tests)."""
    global _loaded
    library()
    saved, _loaded = _loaded, (None, "numpy (numpy_forms)")
    try:
        yield
    finally:
        _loaded = saved


def disable(reason: str) -> None:
    """Run the NumPy forms from now on in this process (e.g. because another rank cannot run the
    C kernels); ``reason`` shows in :func:`describe`."""
    global _loaded
    library()
    _loaded = (None, f"numpy ({reason})")


def usable(*arrays) -> bool:
    """Whether the C kernels can take these arrays: the kernels are loaded and every array is a
    C-contiguous NumPy float32 or float64 array of one dtype (None entries are skipped: optional
    inputs; callers check the shapes the kernel assumes)."""
    if library() is None:
        return False
    dtype = None
    for a in arrays:
        if a is None:
            continue
        if type(a) is not np.ndarray or not a.flags.c_contiguous or a.dtype.char not in "fd":
            return False
        if dtype is not None and a.dtype != dtype:
            return False
        dtype = a.dtype
    return True


_pool_workers = 0
_indices: dict = {}


def _forget_pool_in_child() -> None:
    global _pool_workers
    if _loaded is not None and _loaded[0] is not None:
        _loaded[0].pool_forget()
    _pool_workers = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def _signature(name: str):
    if name == "gemm":
        return GEMM_CALL
    return SIGNATURES.get(name) or FLOAT32_ONLY[name]


_AS_DOUBLE, _AS_INT64 = struct.Struct("d"), struct.Struct("q")  # a double's bits as a C long


def _pack(name: str, dtype, args) -> list:
    """One call row of the native pool: the kernel's index, then its arguments as C longs (arrays
    by their data pointer, None as NULL, doubles by their bits), padded to ``POOL_ARGS``."""
    full = name + ("_f32" if dtype == np.float32 else "_f64")
    index = _indices.get(full)
    if index is None:
        index = _indices[full] = library().pool_kernel_index(full.encode())
        if index < 0:
            raise ValueError(f"kernels: no pool entry for {full}")
    kinds = _signature(name)
    if len(args) != len(kinds):
        raise TypeError(f"kernels: {name} takes {len(kinds)} arguments, got {len(args)}")
    row = [index]
    for kind, a in zip(kinds, args):
        if isinstance(a, np.ndarray):
            row.append(a.__array_interface__["data"][0])
        elif a is None:
            row.append(0)
        elif kind is D:
            row.append(_AS_INT64.unpack(_AS_DOUBLE.pack(a))[0])
        else:
            row.append(int(a))
    return row + [0] * (POOL_ARGS - len(row))


def run_calls(calls, workers: int) -> None:
    """Run kernel calls, each ``(name, dtype, *args)`` as for :func:`call` (``name`` may also be
    ``"gemm"``: a ``cblas_?gemm`` call, see ``GEMM_CALL``), on the calling thread and ``workers``
    threads of the native pool (``kernels_pool.h``): threads that never hold the GIL and spin a
    while between runs, so a run starts in microseconds where a Python pool thread needs ~100.
    Returns when every call is done; calls must not overlap in what they write."""
    global _pool_workers
    lib = library()
    if workers != _pool_workers:
        with _lock:                    # one start at a time (the C side serialises them too)
            if workers != _pool_workers:
                lib.pool_start(workers)  # may start fewer (no threads left): then those run
                _pool_workers = workers
    rows = np.array([_pack(name, dtype, args) for name, dtype, *args in calls], dtype=np.int64)
    status = lib.pool_run(rows.ctypes.data, len(calls))
    if status == -2:
        raise ValueError("kernels: a pool call row names no kernel")
    if status:
        raise MemoryError("kernels: a pool call could not allocate its workspace")


def call(name: str, dtype, *args) -> None:
    """Call kernel ``name`` for ``dtype`` (float32 or float64); array arguments are passed by their
    data pointer, None as NULL, numbers as they are."""
    fn = getattr(library(), name + ("_f32" if dtype == np.float32 else "_f64"))
    if fn(*(a.ctypes.data if isinstance(a, np.ndarray) else a for a in args)):
        raise MemoryError(f"kernel {name}: its workspace could not be allocated")
