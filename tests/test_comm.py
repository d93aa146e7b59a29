"""Process identity and failure handling under a real MPI launch."""
import subprocess
import sys
import time

import pytest
from mpi4py import MPI

from conftest import run_module
from mpirt import comm


@pytest.mark.mpi(min_size=2)
def test_world_matches_mpi():
    info = comm.world()
    assert (info.rank, info.size) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
    # every rank of this single-node job shares one node
    assert (info.local_rank, info.local_size) == (info.rank, info.size)
    assert MPI.COMM_WORLD.allgather(info.local_rank) == list(range(info.size))


def test_one_rank_failing_ends_the_whole_job_quickly(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "from mpi4py import MPI\n"
        "from mpirt import comm\n"
        "comm.install_abort_on_error()\n"
        "if MPI.COMM_WORLD.rank == 1:\n"
        "    raise RuntimeError('rank 1 broke')\n"
        "MPI.COMM_WORLD.Barrier()\n")
    start = time.monotonic()
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(script)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "rank 1 broke" in result.stderr
    assert time.monotonic() - start < 60


def test_train_refuses_several_ranks_until_parallelism_exists(tiny_data, tmp_path):
    result = run_module("mpirt.train", f"--data={tiny_data}", f"--out-dir={tmp_path}", ranks=2, check=False)
    assert result.returncode != 0
    assert "world size 2" in result.stderr
