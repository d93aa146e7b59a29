"""Shared test helpers: a tiny prepared dataset, the command line to run mpirt's entry points, and
for the multi-rank tests the verdict every rank agrees on (:func:`agree`) and this rank's group of
consecutive world ranks (the :func:`group` fixture, freed after the test).

The ``launch`` marker goes on every test that starts processes (it runs an entry point through
:func:`run_module`, calls ``subprocess``, or trains on the :func:`tiny_data` set), so that
``pytest -m "not launch and not mpi" tests`` runs the single-process unit tests alone, in a few
minutes."""
import compileall
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpirt.data.tokens import prepare

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = ("run_module(", "subprocess.", "Popen(", "mpiexec")


def pytest_configure(config):
    config.addinivalue_line("markers", "launch: starts processes (an entry point, mpiexec, a subprocess); "
                                       "-m 'not launch and not mpi' runs the unit tests alone")
    # the bytecode of this tree, written once: every process the tests launch then reads it, also
    # under PYTHONDONTWRITEBYTECODE=1, instead of compiling ~100 modules again (~0.2 s of CPU a rank)
    for package in ("mpirt", "models"):
        compileall.compile_dir(ROOT / package, quiet=2)


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        try:
            source = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            source = ""
        if "tiny_data" in getattr(item, "fixturenames", ()) or any(word in source for word in LAUNCHES):
            item.add_marker(pytest.mark.launch)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A byte-level dataset prepared from this repository's Python sources."""
    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare(ROOT / "mpirt", out, pattern="*.py", val_fraction=0.2)
    return out


def run_module(module: str, *args, ranks: int = 0, timeout: float = 240, check: bool = True, cwd=ROOT,
               expect: int = 0, env: dict | None = None):
    """Run ``python -m module args`` (under ``mpiexec -n ranks`` when ranks > 0) in ``cwd``, with
    ``env`` added to the environment; returns the result. With ``check``, an exit code other than
    ``expect`` raises (75: a run stopped with work left)."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    if ranks:
        cmd = ["mpiexec", "-n", str(ranks), *cmd]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", **(env or {}))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check and result.returncode != expect:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


# --- multi-rank helpers ---------------------------------------------------------------------------
def agree(ok: bool, detail="") -> None:
    """Assert on every rank that ``ok`` holds on every rank: the per-rank verdicts are gathered
    over MPI_COMM_WORLD, so one rank failing fails all of them (naming the ranks and their
    ``detail``) instead of leaving the others waiting. A list of failures reads
    ``agree(not fails, fails)``."""
    from mpi4py import MPI

    results = MPI.COMM_WORLD.allgather((bool(ok), str(detail)))
    bad = {r: d for r, (o, d) in enumerate(results) if not o}
    assert not bad, f"failed on ranks {sorted(bad)}: {bad}"


@pytest.fixture
def group():
    """``group(size, axis="world")``: this rank's group of ``size`` consecutive world ranks as a
    :class:`mpirt.comm.Comm` labelled ``axis``, or None on the ranks left over when ``size`` does
    not divide the world size. Collective over MPI_COMM_WORLD; every communicator it made is freed
    when the test ends."""
    from mpi4py import MPI

    from mpirt.comm import Comm

    made = []

    def make(size: int, axis: str = "world"):
        world = MPI.COMM_WORLD
        full = world.size // size * size
        sub = world.Split(world.rank // size if world.rank < full else MPI.UNDEFINED, world.rank)
        if sub == MPI.COMM_NULL:
            return None
        comm = Comm(sub, axis)
        made.append(comm)
        return comm

    yield make
    for comm in made:
        comm.free()
