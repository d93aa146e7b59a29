"""The GEMM library behind mpirt's matrix products: NumPy's OpenBLAS, BLIS or MKL, the fastest here.

A pip user can have three single-precision GEMMs on a CPU: the OpenBLAS that NumPy bundles
(always there), BLIS (the ``blis`` package, explosion/cython-blis: a Cython ``gemm`` on
C-contiguous arrays) and MKL (the ``mkl`` wheel ships ``libmkl_rt``; its ``cblas_sgemm`` and
``cblas_dgemm`` are called through ctypes, which releases the GIL, with MKL's sequential
threading layer: mpirt's own pool splits the products, see :mod:`mpirt.cpu.threads`). The
``cpu-fast`` extra installs the last two.

:func:`gemm` computes ``out = a @ b`` for 2-D ``a`` and ``b`` without copying them: an operand
may be C-ordered, the transpose of a C-ordered array, or a row- (column-) strided view of one
(MKL reads those through its leading dimension; BLIS takes only whole C-ordered arrays and their
transposes). ``out`` may be C- or F-ordered (``C^T = B^T A^T``). A product the chosen library
cannot take (another dtype, another layout, a read-only array for BLIS, an empty dimension) goes
to NumPy: the result is always ``numpy.matmul``'s within float rounding. ``accumulate=True``
computes ``out += a @ b`` in the GEMM itself (beta = 1: no temporary, no separate add pass; a
weight gradient goes straight into ``.grad``). NumPy's OpenBLAS is called through its own
``cblas_?gemm`` too (ctypes, which releases the GIL) where that symbol is found, else through
``numpy.matmul`` (accumulating then with a temporary and an add). :func:`gemm_call` gives a
product as a call for mpirt's native thread pool.

Which library: ``MPIRT_GEMM=openblas|blis|mkl`` forces one (a missing one degrades to OpenBLAS
with a note). Otherwise the first use times every installed candidate on the products of a GPT
layer (forward and both backward forms, one thread, alternated, best of a few rounds) and takes
the fastest; the verdict is cached per machine (CPU model, cores, library versions) in
``$MPIRT_CACHE/gemm.json`` (default ``~/.cache/mpirt``), so later starts skip the timing.
:func:`describe` is the one-line account a start-up banner prints.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from mpirt.cpu.sysinfo import cache_dir, cpu_model, read_cache, update_cache

NAMES = ("openblas", "blis", "mkl")
ENV = "MPIRT_GEMM"
_INT_MAX = 2**31 - 1       # LP64 BLAS: dimensions and leading dimensions are C ints


@dataclass
class Library:
    """One GEMM library: its name, version and ``run(a, b, out, beta=0.0) -> bool`` (False:
    declined): ``out = a @ b + beta * out``, beta 0 or 1; ``call(a, b, out, beta)``, where the
    library has a ``cblas_?gemm``, gives the same product as a call for mpirt's native pool
    (:func:`mpirt.cpu.kernels.run_calls`), or None where it declines."""

    name: str
    version: str
    run: Callable = field(repr=False)
    call: Callable = field(repr=False, default=lambda a, b, out, beta=0.0: None)


def _blas_form(a):
    """``(transposed, leading dimension)`` under which BLAS reads the 2-D array ``a`` in place,
    or None. Strides of a dimension of extent 1 do not matter and are ignored."""
    item, (rows, cols) = a.itemsize, a.shape
    s0 = a.strides[0] if rows > 1 else cols * item
    s1 = a.strides[1] if cols > 1 else item
    if s1 == item and s0 >= cols * item and s0 % item == 0:
        return False, s0 // item
    s0 = a.strides[0] if rows > 1 else item
    s1 = a.strides[1] if cols > 1 else rows * item
    if s0 == item and s1 >= rows * item and s1 % item == 0:
        return True, s1 // item
    return None


# ---------------------------------------------------------------------------------------------
# the candidates

def _numpy_run(a, b, out, beta=0.0) -> bool:
    if beta:
        out += np.matmul(a, b)
    else:
        np.matmul(a, b, out=out)
    return True


def _cblas_args(fns: dict, int_max: int, a, b, out, beta):
    """``(function, (transa, transb, m, n, k, A, lda, B, ldb, beta, C, ldc))``: the row-major
    ``cblas_?gemm`` call (``fns``: dtype -> ctypes function) computing ``out = a @ b + beta out``
    on the arrays in place (see :func:`_blas_form`), or None where BLAS cannot read them so."""
    fn = fns.get(out.dtype)
    if fn is None or a.dtype != out.dtype or b.dtype != out.dtype:
        return None
    fo = _blas_form(out)
    if fo is None:
        return None
    if fo[0]:                                                # column-major out: C^T = B^T A^T
        return _cblas_args(fns, int_max, b.T, a.T, out.T, beta)
    fa, fb = _blas_form(a), _blas_form(b)
    (m, k), n = a.shape, b.shape[1]
    if fa is None or fb is None or max(m, n, k, fa[1], fb[1], fo[1]) > int_max:
        return None
    return fn, (112 if fa[0] else 111, 112 if fb[0] else 111, m, n, k, a, fa[1], b, fb[1], float(beta), out, fo[1])


def _cblas_library(name: str, version: str, fns: dict, int_max: int, fallback=None) -> Library:
    """A :class:`Library` on ``cblas_sgemm``/``cblas_dgemm`` (``fns``); products BLAS cannot
    read in place go to ``fallback(a, b, out, beta)`` (or are declined)."""
    wide = int_max > _INT_MAX
    address = {dtype: ctypes.cast(fn, ctypes.c_void_p).value for dtype, fn in fns.items()}

    def run(a, b, out, beta=0.0) -> bool:
        found = _cblas_args(fns, int_max, a, b, out, beta)
        if found is None:
            return fallback is not None and fallback(a, b, out, beta)
        fn, (ta, tb, m, n, k, a, lda, b, ldb, beta, out, ldc) = found
        fn(101, ta, tb, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb, beta, out.ctypes.data, ldc)
        return True

    def call(a, b, out, beta=0.0):
        found = _cblas_args(fns, int_max, a, b, out, beta)
        return None if found is None else ("gemm", out.dtype, address[out.dtype], int(wide), *found[1])
    return Library(name, version, run, call)


def _cblas_functions(lib, names: dict, int_type) -> dict:
    """dtype -> ``cblas_?gemm`` of ``lib`` with argument types set (``names``: dtype -> symbol)."""
    fns = {}
    for dtype, name in names.items():
        fn = getattr(lib, name)
        scalar = ctypes.c_float if np.dtype(dtype) == np.float32 else ctypes.c_double
        e, i, p = ctypes.c_int, int_type, ctypes.c_void_p  # the enums stay C ints under ILP64
        fn.argtypes = [e, e, e, i, i, i, scalar, p, i, p, i, scalar, p, i]
        fn.restype = None
        fns[np.dtype(dtype)] = fn
    return fns


def _openblas_cblas() -> tuple[dict, int]:
    """(dtype -> the ``cblas_?gemm`` of the OpenBLAS NumPy loaded, its largest dimension): ILP64
    symbols such as scipy-openblas's ``scipy_cblas_sgemm64_``; ({}, 0) where none is found."""
    from mpirt.cpu.sysinfo import mapped_libraries
    for path in mapped_libraries("openblas"):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix, int_type in (("scipy_", "64_", ctypes.c_int64), ("", "64_", ctypes.c_int64),
                                         ("scipy_", "", ctypes.c_int)):
            names = {np.float32: f"{prefix}cblas_sgemm{suffix}", np.float64: f"{prefix}cblas_dgemm{suffix}"}
            if all(hasattr(lib, n) for n in names.values()):
                return _cblas_functions(lib, names, int_type), 2 ** (8 * ctypes.sizeof(int_type) - 1) - 1
    return {}, 0


def _openblas() -> Library:
    try:
        version = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        version = f"{version.get('name', 'blas')} {version.get('version', '')}".strip()
    except (TypeError, KeyError):  # NumPy < 1.26 has no dict mode
        version = f"numpy {np.__version__}"
    fns, int_max = _openblas_cblas()
    if not fns:
        return Library("openblas", version, _numpy_run)
    return _cblas_library("openblas", version, fns, int_max, fallback=_numpy_run)


def _blis() -> Library:
    import blis
    import blis.py as bp

    def run(a, b, out, beta=0.0) -> bool:
        if out.dtype != np.float32 or a.dtype != out.dtype or b.dtype != out.dtype:
            return False  # its float64 path ignores the transpose flags
        if not out.flags.c_contiguous:
            return out.T.flags.c_contiguous and run(b.T, a.T, out.T, beta)
        forms = []
        for x in (a, b):  # its typed memoryviews take whole, writable, C-ordered arrays only
            if x.flags.c_contiguous and x.flags.writeable:
                forms.append((x, False))
            elif x.T.flags.c_contiguous and x.flags.writeable:
                forms.append((x.T, True))
            else:
                return False
        (a2, ta), (b2, tb) = forms
        bp.gemm(a2, b2, out=out, trans1=ta, trans2=tb, alpha=1.0, beta=float(beta))
        return True
    return Library("blis", getattr(blis, "__version__", None) or _dist_version("blis"), run)


def _dist_version(dist: str) -> str:
    from importlib import metadata
    return metadata.version(dist)


def _mkl_path() -> str:
    """libmkl_rt of the ``mkl`` wheel (installed under the environment's lib/), else the system's."""
    from importlib import metadata
    try:
        for f in metadata.files("mkl") or ():
            if f.name.startswith("libmkl_rt.so"):
                return str(f.locate())
    except metadata.PackageNotFoundError:
        pass
    found = ctypes.util.find_library("mkl_rt")
    if found is None:
        raise ImportError("MKL not found: neither the mkl wheel nor a system libmkl_rt")
    return found


def _mkl() -> Library:
    lib = ctypes.CDLL(_mkl_path())
    lib.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
    lib.MKL_Set_Interface_Layer.argtypes = [ctypes.c_int]
    lib.MKL_Set_Threading_Layer(1)    # MKL_THREADING_SEQUENTIAL: mpirt's pool does the threading
    lib.MKL_Set_Interface_Layer(0)    # MKL_INTERFACE_LP64: 32-bit integers, as declared below
    text = ctypes.create_string_buffer(256)
    lib.MKL_Get_Version_String(text, len(text))
    version = text.value.decode(errors="replace").split(" for ")[0].replace("Intel(R) oneAPI Math Kernel Library ", "")
    fns = _cblas_functions(lib, {np.float32: "cblas_sgemm", np.float64: "cblas_dgemm"}, ctypes.c_int)
    return _cblas_library("mkl", version, fns, _INT_MAX)


_LOADERS = {"openblas": _openblas, "blis": _blis, "mkl": _mkl}


@functools.lru_cache(maxsize=None)
def available() -> tuple[dict[str, Library], dict[str, str]]:
    """(the libraries that load here by name, why each other candidate does not); loaded once."""
    found, missing = {}, {}
    for name, load in _LOADERS.items():
        try:
            found[name] = load()
        except (ImportError, OSError, AttributeError) as err:
            missing[name] = f"{type(err).__name__}: {err}"
    return found, missing


# ---------------------------------------------------------------------------------------------
# calibration

def calibration_products(rows: int = 512, width: int = 256, dtype=np.float32) -> list:
    """``(label, a, b)`` products of one GPT layer of width ``width`` on ``rows`` tokens, in the
    three forms a linear layer runs (forward, input gradient ``g w^T``, weight gradient ``x^T g``)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, width), dtype=dtype)
    w = rng.standard_normal((width, 4 * width), dtype=dtype)
    g = rng.standard_normal((rows, 4 * width), dtype=dtype)
    return [("x w", x, w), ("g w^T", g, w.T), ("x^T g", x.T, g)]


def calibrate(libraries: dict[str, Library], rounds: int = 5) -> dict[str, float]:
    """Seconds per library for the :func:`calibration_products` (one thread, each product's best of
    ``rounds``; libraries alternate call by call so background load hits them alike)."""
    products = calibration_products()
    outs = [np.empty((a.shape[0], b.shape[1]), dtype=a.dtype) for _, a, b in products]
    best = {name: [float("inf")] * len(products) for name in libraries}
    for r in range(rounds + 1):                              # round 0 warms up
        for i, (_, a, b) in enumerate(products):
            for name, lib in libraries.items():
                t0 = time.perf_counter()
                if not lib.run(a, b, outs[i]):
                    _numpy_run(a, b, outs[i])
                if r:
                    best[name][i] = min(best[name][i], time.perf_counter() - t0)
    return {name: sum(ts) for name, ts in best.items()}


def machine_key(libraries: dict[str, Library]) -> str:
    """What a cached verdict depends on: CPU model, usable cores, the libraries and versions."""
    cpu = cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = json.dumps([cpu, cores, sorted((n, lib.version) for n, lib in libraries.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path() -> Path:
    """``$MPIRT_CACHE/gemm.json`` (default ``~/.cache/mpirt/gemm.json``)."""
    return cache_dir() / "gemm.json"



# ---------------------------------------------------------------------------------------------
# the choice

@dataclass
class Choice:
    """The library in use and how it was chosen."""

    library: Library
    how: str                                   # "MPIRT_GEMM", "calibrated", "cached", "set"
    seconds: dict[str, float] = field(default_factory=dict)   # calibration times, when timed
    notes: list[str] = field(default_factory=list)            # candidates missing, degradations


_choice: Choice | None = None
_lock = threading.Lock()


def choose(name: str | None = None, use_cache: bool = True) -> Choice:
    """Pick the library (see the module docstring) and make it current. ``name`` (or
    ``MPIRT_GEMM``) forces one; a name not installed here degrades to OpenBLAS with a note."""
    global _choice
    found, missing = available()
    notes = [f"{n} not available ({why})" for n, why in missing.items()]
    forced = name or os.environ.get(ENV, "").strip().lower() or None
    if forced is not None:
        if forced not in NAMES:
            raise ValueError(f"{ENV}: expected one of {', '.join(NAMES)}, got {forced!r}")
        how = "set" if name else ENV
        if forced not in found:
            notes.append(f"{forced} requested but not available: using openblas")
            forced = "openblas"
        choice = Choice(found[forced], how, notes=notes)
    else:
        key, path = machine_key(found), cache_path()
        entry = read_cache(path).get(key) if use_cache else None
        if entry and entry.get("choice") in found:
            choice = Choice(found[entry["choice"]], "cached", entry.get("seconds", {}), notes)
        else:
            seconds = calibrate(found) if len(found) > 1 else {}
            best = min(seconds, key=seconds.get) if seconds else "openblas"
            choice = Choice(found[best], "calibrated", seconds, notes)
            if use_cache and seconds:
                update_cache(path, key, {"choice": best, "seconds": seconds,
                                         "versions": {n: lib.version for n, lib in found.items()}})
    _choice = choice
    return choice


def current() -> Choice:
    """The current choice; the first call makes it (:func:`choose`)."""
    if _choice is None:
        with _lock:
            if _choice is None:
                choose()
    return _choice


def describe() -> str:
    """One line for a start-up banner: the library in use, its version, how it was chosen and
    the calibration times (ms) of the candidates, plus what is missing."""
    c = current()
    text = f"{c.library.name} ({c.library.version}; {c.how}"
    if c.seconds:
        text += ": " + ", ".join(f"{n} {1e3 * s:.1f} ms" for n, s in sorted(c.seconds.items(), key=lambda kv: kv[1]))
    text += ")"
    missing = [n.split(" ")[0] for n in c.notes if " not available " in n]
    if missing:
        text += f"; not installed: {', '.join(missing)}"
    degraded = [n for n in c.notes if "requested but" in n]
    return text + (f"; {degraded[0]}" if degraded else "")


def gemm_call(a, b, out, accumulate: bool = False, bias=None):
    """``out = a @ b`` (``accumulate``: ``+=``; then ``+ bias`` per row) as a call for
    :func:`mpirt.cpu.kernels.run_calls` on the current library, or None where it has no
    ``cblas_?gemm`` or cannot read the arrays in place (or would read ``out`` transposed, with a
    bias)."""
    if 0 in a.shape or 0 in b.shape:
        return None
    if bias is not None:
        form = _blas_form(out)                  # the C side adds the bias to rows, not columns
        if (form is None or form[0] or bias.dtype != out.dtype or not bias.flags.c_contiguous
                or bias.shape != out.shape[1:]):
            return None
    call = current().library.call(a, b, out, 1.0 if accumulate else 0.0)
    return None if call is None else (*call, bias)


def gemm(a, b, out=None, accumulate: bool = False):
    """``out = a @ b`` (``accumulate``: ``out += a @ b``) for 2-D NumPy arrays on the current
    library (NumPy where it declines); returns ``out`` (a new C-ordered array when None)."""
    if out is None:
        if accumulate:
            raise ValueError("gemm: accumulate=True needs out")
        out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    beta = 1.0 if accumulate else 0.0
    if 0 in a.shape or 0 in b.shape:
        if not accumulate:
            out[...] = 0
        return out
    if not current().library.run(a, b, out, beta):
        _numpy_run(a, b, out, beta)
    return out
