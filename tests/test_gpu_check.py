"""bench/gpu_check.sh in its dry run (--cpu: NumPy for CuPy, tiny shapes, PyTorch on the CPU): every
part runs through the same code as on a GPU and the results table is written with every section."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SECTIONS = ("env", "ops", "optim", "gpt-step", "matmul", "attention", "allreduce", "train", "profile", "nvml",
            "parts")
PARTS = ("env", "ops", "optim", "gpt", "matmul", "attention", "allreduce", "train-350m-mpirt", "train-350m-torch",
         "train-1.3b-mpirt", "train-1.3b-torch", "profile")


@pytest.mark.timeout(420)
def test_dry_run_writes_every_section(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_OUT_DIR=str(tmp_path), GPU_CHECK_NAME="gpu-test",
               GPU_CHECK_WORK=str(tmp_path / "work"), GPU_CHECK_LIMIT="360")
    env.pop("OUT", None)
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode in (0, 1), output        # 2: no table
    table = (tmp_path / "gpu-test.md").read_text()
    assert (tmp_path / "gpu-test.json").exists()
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [[c.strip() for c in r] for r in rows[1:]]
    assert {r[0] for r in cells} == set(SECTIONS), table
    assert "DRY RUN" in table
    status = {r[1]: r[3] for r in cells if r[0] == "parts"}
    assert status == {p: "ok" for p in PARTS}, output   # each part ran to its end
    from mpirt.core import ops
    checked = {r[1] for r in cells if r[0] == "ops" and r[3] == "ok"}
    assert set(ops.__all__) <= checked, table          # every exported op passed on NumPy bf16/f32/f64
    assert all(r[3] == "ok" for r in cells if r[0] in ("optim", "gpt-step", "matmul", "train", "profile")), table
