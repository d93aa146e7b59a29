"""Shared fixtures: a tiny prepared dataset and the command line to run mpirt's entry points."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpirt.data import prepare

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A byte-level dataset prepared from this repository's Python sources."""
    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare(ROOT / "mpirt", out, pattern="*.py", val_fraction=0.2)
    return out


def run_module(module: str, *args, ranks: int = 0, timeout: float = 240, check: bool = True):
    """Run ``python -m module args`` (under ``mpiexec -n ranks`` when ranks > 0); returns the result."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    if ranks:
        cmd = ["mpiexec", "-n", str(ranks), *cmd]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result
