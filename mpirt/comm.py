"""MPI access: the only module that imports mpi4py.

For now it answers who this process is (rank, world size, local rank on the node) and stops the
whole job when one rank fails; collectives and point-to-point arrive with data parallelism.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from mpi4py import MPI


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int


def world() -> World:
    """Rank and size from MPI_COMM_WORLD; the local rank from a shared-memory split."""
    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    info = World(comm.rank, comm.size, node.rank, node.size)
    node.Free()
    return info


def install_abort_on_error() -> None:
    """Make an uncaught exception on any rank print its traceback and abort the whole job.

    Without this, the other ranks would wait forever in their next collective.
    """
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        if MPI.COMM_WORLD.size > 1:
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
