"""The installed layout: mpirt's models live in ``mpirt.models``, so a project with its own
``models/`` package can run ``python -m mpirt.train`` (which failed with an ImportError while
mpirt installed a top-level ``models``).

Each case installs mpirt into a fresh, plain venv (``--without-pip``; the dependencies and pip
itself come from the test's own site-packages through a ``.pth`` line, so nothing is downloaded),
editable or from a built wheel, and trains two steps from a directory that holds a ``models``
package of its own (the old layout fails there with ``ImportError: cannot import name
'build_model' from 'models'``). Measured here: 1 s to build the wheel, 1-2 s for a venv and its
install, 1-2 s to train; 8 s for the file.
"""
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

TRAIN = ["--steps=2", "--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.n_positions=16",
         "--seq-len=16", "--batch-size=2", "--eval-batches=1", "--progress=false"]


def sh(*cmd, cwd=None, env=None, timeout=300):
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def fresh_venv(path: Path) -> Path:
    """A plain venv (no system site-packages, no pip) that sees this interpreter's site-packages
    through a .pth line (appended to sys.path after its own, so what it installs comes first)."""
    sh(Path(sys.base_prefix) / "bin" / "python3", "-m", "venv", "--without-pip", path)
    python = path / "bin" / "python"
    purelib = sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    Path(purelib, "shared.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def build_wheel(out: Path) -> Path:
    """A wheel of the working tree, built from a copy (pip builds in place, leaving build/ behind)."""
    src = out / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("mpirt", "models"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out / "dist", src)
    return next((out / "dist").glob("mpirt-*.whl"))


def test_wheel_holds_mpirt_models_and_presets_and_no_top_level_models(tmp_path):
    names = zipfile.ZipFile(build_wheel(tmp_path)).namelist()
    presets = {Path(n).name for n in names if n.startswith("mpirt/models/presets/") and n.endswith(".toml")}
    assert {"tiny.toml", "gpt2.toml", "mlp.toml", "llama-tiny.toml"} <= presets
    assert {"mpirt/models/__init__.py", "mpirt/models/gpt.py", "mpirt/models/llama.py", "mpirt/core/modeling.py",
            "mpirt/cpu/kernels/kernels.c", "mpirt/cpu/kernels/kernels_body.h",  # the C and CUDA kernels' sources,
            "mpirt/gpu/cuda_kernels.cu", "mpirt/cpu/kernels/fma_peak.c"} <= set(names)  # the FMA loop's
    assert not [n for n in names if n.split("/")[0] in ("models", "models.py")]


@pytest.mark.parametrize("install", ["editable", "wheel"])
def test_a_project_with_its_own_models_package_trains(tmp_path, tiny_data, install):
    python = fresh_venv(tmp_path / "venv")
    target = ["-e", ROOT] if install == "editable" else [build_wheel(tmp_path)]
    sh(python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *target)
    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "__init__.py").write_text('OWNER = "the project"\n')
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",  # libmpi of the mpich wheel:
               LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(Path(sys.prefix) / "lib"),
                                                              os.environ.get("LD_LIBRARY_PATH")])))
    seen = sh(python, "-c", "import models, mpirt.models; print(models.OWNER); print(mpirt.models.__file__)",
              cwd=project, env=env).stdout.splitlines()
    assert seen[0] == "the project"
    installed = sysconfig.get_paths(vars={"base": str(tmp_path / "venv"), "platbase": str(tmp_path / "venv")})
    expected = ROOT / "models" if install == "editable" else Path(installed["purelib"]) / "mpirt" / "models"
    assert Path(seen[1]).parent.resolve() == expected.resolve()
    sh(python, "-m", "mpirt.train", *TRAIN, f"--data={tiny_data}", f"--out-dir={tmp_path / 'out'}", cwd=project, env=env)
    assert (tmp_path / "out" / "summary.json").is_file()


def test_every_package_folder_is_listed_in_pyproject():
    """A subpackage missing from pyproject's explicit list works in the editable install and is
    absent from a wheel (mpirt.plan once was): every folder of mpirt/ and models/ with an
    __init__.py must be listed."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mpirt").rglob("__init__.py")}
    found |= {".".join(("mpirt",) + p.parent.relative_to(ROOT).parts) for p in (ROOT / "models").rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
