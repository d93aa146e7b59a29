"""Array backend: NumPy on CPU, CuPy on GPU.

Every op is written once against ``backend.xp``. Read it at call time (``B.xp.exp(...)`` after
``import mpirt.core.backend as B``), never bind it at import, so that :func:`select` can switch it.
Only this module touches ``cupy.cuda``.
"""
from __future__ import annotations

import os

import numpy

xp = numpy          # the active array module
name = "numpy"      # "numpy" or "cupy"


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one usable GPU (never raises)."""
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.is_available())


def select(backend: str | None = None) -> str:
    """Choose the array module: ``"numpy"``, ``"cupy"`` or ``"auto"`` (CuPy when usable).

    ``None`` reads ``MPIRT_BACKEND`` (default ``auto``). Returns the chosen name.
    """
    global xp, name
    backend = (backend or os.environ.get("MPIRT_BACKEND", "auto")).lower()
    if backend not in ("auto", "numpy", "cupy"):
        raise ValueError(f"backend: expected auto, numpy or cupy, got {backend!r}")
    if backend == "auto":
        backend = "cupy" if cupy_available() else "numpy"
    if backend == "cupy":
        if not cupy_available():
            raise RuntimeError("backend: cupy was requested but CuPy has no usable GPU here")
        import cupy
        xp, name = cupy, "cupy"
    else:
        xp, name = numpy, "numpy"
    return name


def bind_device(local_rank: int) -> int | None:
    """Bind this process to GPU ``local_rank % device_count`` (CuPy only); returns the device id."""
    if name != "cupy":
        return None
    import cupy
    device = local_rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    return device


def synchronize() -> None:
    """Wait for queued GPU work; call before MPI reads a device buffer. No-op on NumPy."""
    if name == "cupy":
        import cupy
        cupy.cuda.get_current_stream().synchronize()


def to_host(a) -> numpy.ndarray:
    """Return ``a`` as a NumPy array (copies from the GPU when needed)."""
    if isinstance(a, numpy.ndarray):
        return a
    if hasattr(a, "get"):
        return a.get()
    return numpy.asarray(a)


def asarray(a, dtype=None):
    """Move ``a`` onto the active backend (a no-op for arrays already there)."""
    return xp.asarray(a, dtype=dtype)


def writeable(a) -> bool:
    """Whether array ``a`` may be written: NumPy's flag; CuPy arrays have no such flag and are."""
    return getattr(a.flags, "writeable", True)


def is_device_array(a) -> bool:
    """True for a CuPy array (anything exposing ``__cuda_array_interface__``)."""
    return hasattr(a, "__cuda_array_interface__")


def current_stream_ptr() -> int:
    """The raw handle of the current CUDA stream (0 on NumPy); NCCL calls are queued on it."""
    if name != "cupy":
        return 0
    import cupy
    return cupy.cuda.get_current_stream().ptr


def device_info() -> dict | None:
    """Name, PCI bus id and total memory (bytes) of this process's GPU; None on NumPy."""
    if name != "cupy":
        return None
    import cupy
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    label = props["name"]
    return {"name": label.decode() if isinstance(label, bytes) else str(label), "pci_bus_id": dev.pci_bus_id,
            "total_memory": int(dev.mem_info[1])}


def device_memory(local_rank: int) -> int:
    """Total memory (bytes) of the GPU :func:`bind_device` gives local rank ``local_rank``, read
    before any is bound (CuPy must see a GPU)."""
    import cupy
    device = local_rank % cupy.cuda.runtime.getDeviceCount()
    return int(cupy.cuda.runtime.getDeviceProperties(device)["totalGlobalMem"])


def pool_bytes() -> tuple[int, int]:
    """(bytes in use, bytes held) of CuPy's default memory pool; (0, 0) on NumPy."""
    if name != "cupy":
        return 0, 0
    import cupy
    pool = cupy.get_default_memory_pool()
    return int(pool.used_bytes()), int(pool.total_bytes())


def limit_pool(limit: int | None) -> bool:
    """Cap CuPy's default memory pool at ``limit`` bytes (``--memory-budget`` on a GPU: an
    allocation past it raises CuPy's OutOfMemoryError instead of growing the pool); None lifts the
    cap. Returns whether a pool was capped (False on NumPy, where the budget is checked against the
    process's peak resident set instead)."""
    if name != "cupy":
        return False
    import cupy
    cupy.get_default_memory_pool().set_limit(size=int(limit or 0))
    return limit is not None
