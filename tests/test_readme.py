"""The README's commands, as written, so that it cannot drift from the code: every indented command
line is classified; the ones this machine can run are run (tiny where they train), the training
launches (mpiexec, sbatch) have their arguments and layout checked for their world size as the run's
pre-flight would, and the rest (installs, cluster submissions' shells, benchmarks, calibration)
are named here. A command of a new kind fails the test until it is classified."""
import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

README = ROOT / "README.md"
# lines that are not mpirt commands, or that cannot run here (installs, a cluster, minutes of timing)
NOT_RUN = ("python3 -m venv", "pip install", "MPICC=", "bash tests/run.sh", "python -m pytest", "python bench/",
           "bash bench/", "module load", "sbatch gpt2m.sbatch", "grep ", "mpirt: ", "python -c ",
           "python -m mpirt.plan --calibrate")
SYNOPSIS = "python -m mpirt.train [CONFIG.toml]"            # the usage line, not a command


STARTS = ("python ", "python3 ", "mpiexec ", "sbatch ", "pip ", "bash ", "module ", "grep ", "MPICC=", "mpirt: ")


def commands() -> list[str]:
    """Every command line of the README's indented code blocks (a line that starts with a command
    word; the layout's file list is not one), continuation lines joined, comments dropped."""
    out = []
    for line in README.read_text().splitlines():
        text = line.strip()
        if out and out[-1].endswith("\\") and line.startswith("    "):
            out[-1] = out[-1][:-1].rstrip() + " " + text
        elif line.startswith("    ") and not line.startswith("     ") and text.startswith(STARTS):
            out.append(text)
    return [" ".join(shlex.split(c, comments=True)) if "#" in c and not c.startswith("mpirt: ") else c for c in out]


def train_args(cmd: str) -> tuple[int, list[str]] | None:
    """(world size, mpirt.train arguments) of a training launch: ``[mpiexec -n N] python -m
    mpirt.train ARGS`` or ``sbatch [--nodes K] slurm/T.sbatch RUN_DIR ARGS``; None otherwise."""
    from mpirt.run.slurm import TEMPLATES
    words = shlex.split(cmd)
    if words[:1] == ["mpiexec"] and words[3:6] == ["python", "-m", "mpirt.train"]:
        return int(words[2]), words[6:]
    if words[:3] == ["python", "-m", "mpirt.train"]:
        return 1, words[3:]
    if words[:1] == ["sbatch"]:
        script = next(i for i, w in enumerate(words) if w.startswith("slurm/") and w.endswith(".sbatch"))
        spec = TEMPLATES[Path(words[script]).stem][1]
        flags = dict(zip(words[1:script:2], words[2:script:2]))
        return int(flags.get("--nodes", spec.nodes)) * spec.ntasks_per_node, words[script + 2:]
    return None


def verify_args(cmd: str) -> tuple[int, list[str]] | None:
    """(world size, arguments) of ``mpiexec -n N python -m mpirt.verify ARGS``; None otherwise."""
    words = shlex.split(cmd)
    if words[:1] == ["mpiexec"] and words[3:6] == ["python", "-m", "mpirt.verify"]:
        return int(words[2]), words[6:]
    return None


def check_verify(world: int, args: list[str]) -> None:
    """What verify refuses before it starts (its plan: flags, both layouts, the reduced model); a
    --replay's checkpoint is not here, so only its flags and --against layout are read."""
    from mpirt.run.config import TrainConfig
    from mpirt.verify.cli import make_plan, split_args
    from mpirt.verify.sides import layout_config
    own, _, _ = split_args(args)
    if "replay" in own:
        layout_config(TrainConfig(), own.get("against", "dp=1"), "against")
    else:
        make_plan(args, world)


def check_training(world: int, args: list[str]) -> None:
    """What the run's pre-flight checks before anything starts: keys and values, the layout for
    ``world`` ranks, the model's tp, the sequence length."""
    from mpirt.run.config import parse_args
    from mpirt.core.modeling import load_model_config
    from mpirt.parallel.tensor.axis import check_model_tp
    from mpirt.run.train import plan_layout
    cfg = parse_args(args)
    layout = plan_layout(cfg, world)
    model = load_model_config(cfg.model, cfg.model_overrides)
    check_model_tp(model, layout["tp"], seq_len=cfg.seq_len, sequence_parallel=cfg.sequence_parallel)
    assert cfg.seq_len <= model.n_positions, (cfg.seq_len, model.n_positions)


def test_every_readme_command_is_classified_and_the_launches_check():
    seen = {"train": 0, "run": 0, "verify": 0}
    for cmd in commands():
        if cmd.startswith(NOT_RUN) or cmd.startswith(SYNOPSIS):
            continue
        launch = train_args(cmd)
        if verify_args(cmd) is not None:
            try:
                check_verify(*verify_args(cmd))
            except Exception as err:  # noqa: BLE001 - the README line is what fails
                pytest.fail(f"README: {cmd}\n  refused: {err}")
            seen["verify"] += 1
        elif launch is not None and "--help" not in cmd:
            try:
                check_training(*launch)
            except Exception as err:  # noqa: BLE001 - the README line is what fails
                pytest.fail(f"README: {cmd}\n  refused: {err}")
            seen["train"] += 1
        elif cmd.startswith("python -m mpirt."):
            seen["run"] += 1
        else:
            pytest.fail(f"README: a command of no known kind (classify it in tests/test_readme.py): {cmd}")
    assert seen["train"] >= 9 and seen["run"] >= 6 and seen["verify"] >= 2, seen


def test_the_readme_tools_run_as_written(tmp_path, tiny_data):
    """The non-training commands, run in a scratch folder: the planner (with a 'local' preset made
    from the cpu one, as --calibrate would save), the grid and schedule views, the job script
    writer, the dataset preparation (its placeholders filled) and sampling from a short run."""
    from mpirt.plan import hardware
    hardware.save(dataclasses.replace(hardware.load("cpu"), name="local"), tmp_path / "plan" / "local.json")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("def f(x):\n    return x\n" * 200)
    env = dict(os.environ, MPIRT_PLAN_CACHE=str(tmp_path / "plan"), OPENBLAS_NUM_THREADS="1")
    train = [sys.executable, "-m", "mpirt.train", "--steps=2", "--out-dir=out", f"--data={tiny_data}",
             "--model.n_layer=1", "--eval-batches=1", "--progress=false"]
    subprocess.run(train, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=240)   # out/ckpt for sample
    ran = []
    for cmd in commands():
        if not cmd.startswith("python -m mpirt.") or cmd.startswith(NOT_RUN) or cmd.startswith(SYNOPSIS) \
                or train_args(cmd) is not None and "--help" not in cmd:
            continue
        words = shlex.split(cmd.replace("SRC_DIR", "src").replace("OUT_DIR", "prepared"))
        words = [w for w in words if not (w.startswith("[") or w.endswith("]"))]   # optional parts
        result = subprocess.run([sys.executable, *words[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=240)
        assert result.returncode == 0, f"README: {cmd}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        ran.append(words[2])
    assert {"mpirt.plan", "mpirt.grid", "mpirt.schedule", "mpirt.slurm", "mpirt.data", "mpirt.sample",
            "mpirt.train", "mpirt.verify"} <= set(ran), ran
