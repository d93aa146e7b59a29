"""This process's place in the job: constants, :class:`World`, :func:`world`, the abort hook."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from mpi4py import MPI

from mpirt.comm import flight

PROC_NULL = MPI.PROC_NULL
ANY_SOURCE = MPI.ANY_SOURCE
ANY_TAG = MPI.ANY_TAG


class CommError(RuntimeError):
    """A communication that cannot complete as asked (e.g. a received message of the wrong size)."""


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int


def library_version() -> str:
    """The MPI library's one-line name and version (e.g. "MPICH Version: 5.0.2", "Open MPI v4.1.6")."""
    lines = MPI.Get_library_version().replace("\0", "").strip().splitlines()
    return " ".join(lines[0].split()) if lines else ""


def world() -> World:
    """Rank and size from MPI_COMM_WORLD; the local rank from a shared-memory split."""
    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    info = World(comm.rank, comm.size, node.rank, node.size)
    node.Free()
    return info


def install_abort_on_error() -> None:
    """Make an uncaught exception on any rank print its traceback, then its ring of recent
    communication calls (:func:`mpirt.comm.flight.dump`), and abort the whole job.

    Without this, the other ranks would wait forever in their next collective.
    """
    previous = sys.excepthook
    if getattr(previous, "mpirt_abort", False):
        return  # already installed: chaining a second hook would print every traceback twice

    def hook(kind, value, tb):
        previous(kind, value, tb)
        alone = MPI.COMM_WORLD.size == 1
        if not alone and flight.ring:
            sys.stderr.write(flight.dump(MPI.COMM_WORLD.rank) + "\n")
        sys.stderr.flush()
        if not alone:
            abort_job(1)

    hook.mpirt_abort = True
    sys.excepthook = hook


ABORT_DRAIN_S = 0.5  # time the launcher gets to forward what a rank printed before its abort


def abort_job(code: int) -> None:
    """``MPI_Abort`` the whole job with ``code`` after flushing this rank's output and giving the
    launcher :data:`ABORT_DRAIN_S` to forward it: the abort kills hydra's I/O forwarding with the
    processes, which otherwise can cut a traceback or a report short (seen once in CI)."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_DRAIN_S)
    MPI.COMM_WORLD.Abort(code)
