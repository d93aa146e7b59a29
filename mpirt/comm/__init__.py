"""MPI access: the only package that imports mpi4py.

``world()`` says who this process is, ``install_abort_on_error()`` ends the whole job when one
rank fails, and :class:`Comm` moves arrays: collectives and point-to-point on NumPy arrays (and
CuPy arrays) through mpi4py's uppercase buffer methods, never the pickle path.

No hangs. ``start_watchdog(timeout_s)`` (collective) starts a thread per process that ends the
job with exit code 4 (:data:`EXIT_TIMEOUT`) when a call waits longer than ``timeout_s`` (0: no
timeout), after printing the call in the runtime's terms (op, axis, bytes, and the label set with
``with comm.labelled(label):``, e.g. a pipeline action) and the ranks that never arrived, each
rank with its ring of recent calls. It also makes a rank that exits on its own (``sys.exit``, the
end of the program) end the job once another rank waits for it; ``exit_together(code)`` is the way
for all ranks to leave on purpose, with no abort. A SIGKILLed rank is handled by hydra's
``mpiexec``, which then kills the others. The abort hook prints the ring too. The bookkeeping
costs about 0.3 us per call (a list, a ring append, two slot writes; no lock).

Engines (:func:`select_engine`), chosen per call from the array:

- ``"host"``: NumPy arrays go straight to MPI.
- ``"nccl"``: CuPy arrays in collectives when ``cupy.cuda.nccl`` is available (one NCCL
  communicator per :class:`Comm`, made on first use; its unique id travels over MPI). Preferred
  over CUDA-aware MPI for collectives, as it is the faster path on NVLink/InfiniBand GPUs.
  Point-to-point never uses NCCL (it matches no tags and a blocking send pair can deadlock).
- ``"cuda-aware"``: CuPy arrays handed to MPI as device pointers when the MPI library reports
  ``MPIX_Query_cuda_support() == 1`` (PyPI MPI wheels do not: detect, do not assume).
- ``"staged"``: CuPy arrays copied to the host, sent with MPI, copied back.
``MPIRT_COMM_ENGINE=nccl|cuda-aware|staged`` forces the engine for device arrays (NCCL is never
used for point-to-point). The stream is synchronized right before MPI touches a device buffer.

Every call is recorded in the module-level :data:`stats` (one registry for the process; each record
names its communicator's ``axis``, so per-axis views come from ``stats.summary()``).

Dtypes: reductions run on MPI's predefined types (floats, ints, uints, complex); float16 (and any
other 2-byte float such as bfloat16) is reduced in float32 and cast back. Non-reducing operations
(broadcast, allgather, send/recv) move raw bytes, so any dtype works.
Non-contiguous inputs are copied to a C-contiguous buffer first; in-place operations on a
non-contiguous array copy the result back into it.

The package, by concern: :mod:`~mpirt.comm.job` (constants, :class:`World`, the abort hook),
:mod:`~mpirt.comm.registry` (:class:`CommStats`, no mpi4py), :mod:`~mpirt.comm.buffers`
(dtypes, contiguous copies, :func:`chunk_bounds`), :mod:`~mpirt.comm.engines` (engine
selection, CUDA-aware detection, the NCCL engine), :mod:`~mpirt.comm.handles` (non-blocking
handles), :mod:`~mpirt.comm.communicator` (:class:`Comm`, its collectives), :mod:`~mpirt.comm.p2p` (its
point-to-point calls), :mod:`~mpirt.comm.flight` (in-flight slots and the ring of recent calls,
no mpi4py) and :mod:`~mpirt.comm.watchdog` (the watchdog thread, leaving the job).
"""
from mpirt.comm.buffers import chunk_bounds
from mpirt.comm.communicator import Comm, first_error, world_comm
from mpirt.comm.engines import ENGINES, cuda_aware_mpi, describe_engines, nccl_available, select_engine
from mpirt.comm.handles import Handle, test_all, wait_all
from mpirt.comm.job import (ANY_SOURCE, ANY_TAG, PROC_NULL, CommError, World, install_abort_on_error,
                            library_version, world)
from mpirt.comm.registry import CommRecord, CommStats, stats
from mpirt.comm.watchdog import EXIT_TIMEOUT, Watchdog, exit_together, start_watchdog

__all__ = [
    "ANY_SOURCE", "ANY_TAG", "ENGINES", "EXIT_TIMEOUT", "PROC_NULL", "Comm", "CommError", "CommRecord", "CommStats",
    "Handle", "Watchdog", "World", "chunk_bounds", "cuda_aware_mpi", "describe_engines", "exit_together",
    "first_error", "install_abort_on_error", "library_version", "nccl_available", "select_engine", "start_watchdog", "stats", "test_all",
    "wait_all", "world", "world_comm",
]
