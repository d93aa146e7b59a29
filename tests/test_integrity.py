"""No run silently wrong: ``python -m mpirt.train`` refuses bad data, damaged checkpoints, overrides
that cannot apply and ranks that read different files behind one path, in one ``error:`` line
with exit code 2 before training; and a resumed run with dropout equals the uninterrupted one."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_module
from mpirt.core.modeling import build_model
from mpirt.models import GPTConfig
from mpirt.models.hf import save_hf_gpt2
from mpirt.run.config import ConfigError, parse_args
from mpirt.run.distributed import input_fingerprint
from mpirt.run.train import resolve_model

TINY = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.n_positions=32",
        "--seq-len=16", "--batch-size=4", "--eval-batches=2", "--eval-interval=0", "--progress=false",
        "--warmup-steps=2", "--dtype=float64", "--steps=6"]
DROPOUT = ["--model.embd_pdrop=0.1", "--model.resid_pdrop=0.1", "--model.attn_pdrop=0.1"]


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]


def refused(result, *names):
    """The run was refused before training: exit 2, one ``error:`` line naming every one of ``names``."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    for name in names:
        assert name in errors[0], (name, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """A 2-step run's checkpoint root, to be copied (never changed) by the tests."""
    out = tmp_path_factory.mktemp("trained")
    run_module("mpirt.train", *TINY, "--steps=2", f"--data={tiny_data}", f"--out-dir={out}")
    return out / "ckpt"


def copy_data(tiny_data, tmp_path):
    dst = tmp_path / "data"
    shutil.copytree(tiny_data, dst)
    return dst


# --- data ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["train", "val"])
def test_out_of_range_token_id_is_refused_before_training(tiny_data, tmp_path, split):
    data = copy_data(tiny_data, tmp_path)
    tokens = np.memmap(data / f"{split}.bin", dtype=np.uint16, mode="r+")
    tokens[len(tokens) - 3] = 300  # the tiny model's vocabulary is 256: the final evaluation would crash
    tokens.flush()
    del tokens
    out = tmp_path / "out"
    result = run_module("mpirt.train", *TINY, f"--data={data}", f"--out-dir={out}", check=False)
    refused(result, f"{split}.bin holds token id 300 >= the model's vocab_size 256")
    assert not (out / "metrics").exists()


# --- checkpoints --------------------------------------------------------------------------------
def damaged(trained, tmp_path, edit):
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    version = root / (root / "latest").read_text().strip()
    edit(version)
    return root


def set_step(version):
    meta = json.loads((version / "meta.json").read_text())
    meta["step"] = 1
    (version / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


def flip_model_byte(version):
    path = version / "rank-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("edit, names", [
    (set_step, ["meta.json was edited or corrupted"]),
    (flip_model_byte, ["rank-00000.safetensors is corrupted"]),
    (lambda v: (v / "meta.json").unlink(), ["ckpt/latest names step-00000002, but", "meta.json is missing"]),
])
def test_damaged_checkpoint_is_refused_naming_the_file(trained, tiny_data, tmp_path, edit, names):
    root = damaged(trained, tmp_path, edit)
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--init-from={root}",
                        f"--out-dir={tmp_path / 'out'}", check=False)
    refused(result, "init_from: ", *names)


def test_init_from_neither_checkpoint_nor_hf_names_what_was_looked_for(tiny_data, tmp_path):
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--init-from={tmp_path}",
                        f"--out-dir={tmp_path / 'out'}", check=False)
    refused(result, f"{tmp_path / 'latest'}", f"{tmp_path / 'meta.json'}", f"{tmp_path / 'config.json'}")


# --- model overrides with init_from ------------------------------------------------------------
def test_shape_override_with_init_from_is_refused(trained, tiny_data, tmp_path):
    result = run_module("mpirt.train", *TINY, "--model.n_layer=2", f"--data={tiny_data}", f"--init-from={trained}",
                        f"--out-dir={tmp_path / 'out'}", check=False)
    refused(result, "model.n_layer", "n_layer=1", "asks for 2")


def test_dropout_override_with_init_from_applies_and_is_recorded(trained, tiny_data, tmp_path):
    runs = {}
    for name, extra in (("plain", []), ("dropout", DROPOUT)):
        out = tmp_path / name
        run_module("mpirt.train", *TINY, "--steps=3", *extra, f"--data={tiny_data}", f"--init-from={trained}",
                   f"--out-dir={out}")
        version = out / "ckpt" / (out / "ckpt" / "latest").read_text().strip()
        runs[name] = losses(out), json.loads((version / "meta.json").read_text())
    (plain, _), (dropped, meta) = runs["plain"], runs["dropout"]
    assert len(plain) == len(dropped) == 1 and plain != dropped  # step 3 only: the masks changed the loss
    model = meta["extra"]["model_config"]
    assert (model["embd_pdrop"], model["resid_pdrop"], model["attn_pdrop"]) == (0.1, 0.1, 0.1)
    assert meta["config"]["model_overrides"]["attn_pdrop"] == 0.1


def test_overrides_on_a_hf_directory(tmp_path):
    hf = save_hf_gpt2(build_model(GPTConfig(n_layer=1, n_head=2, n_embd=32, n_positions=32), seed=0),
                      GPTConfig(n_layer=1, n_head=2, n_embd=32, n_positions=32), tmp_path / "hf")
    cfg = parse_args([f"--init-from={hf}", "--model.resid_pdrop=0.2", "--model.layer_norm_epsilon=1e-6",
                      "--model.n_inner=128"])  # n_inner 128 == 4 * n_embd: the same shapes
    model_cfg, weights, resume = resolve_model(cfg)
    assert (model_cfg.resid_pdrop, model_cfg.layer_norm_epsilon, resume) == (0.2, 1e-6, False)
    assert weights.entry("params", "wte.weight", (256, 32))  # a reader of boxes: nothing read yet
    for arg, key in (("--model.n_head=4", "model.n_head: "), ("--model.initializer_range=0.5",
                                                              "model.initializer_range: ")):
        with pytest.raises(ConfigError, match=key):
            resolve_model(parse_args([f"--init-from={hf}", arg]))


# --- dropout masks across a resume ---------------------------------------------------------
@pytest.mark.parametrize("ranks, layout", [(0, []), (2, ["--dp=2"]), (2, ["--pp=2", "--model.n_layer=2"])])
def test_resume_with_dropout_equals_uninterrupted_run(tiny_data, tmp_path, ranks, layout):
    common = [*TINY, *DROPOUT, *layout, f"--data={tiny_data}"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_module("mpirt.train", *common, f"--out-dir={full}", ranks=ranks)
    run_module("mpirt.train", *common, f"--out-dir={part}", "--stop-after=3", ranks=ranks, expect=75)
    run_module("mpirt.train", *common, f"--out-dir={part}", f"--init-from={part / 'ckpt'}", ranks=ranks)
    assert losses(part) == losses(full)  # bitwise: the resumed masks continue where the first run stopped
    assert len(set(losses(full))) == 6


# --- every rank reads the same files -----------------------------------------------------------
def test_input_fingerprint(tiny_data, tmp_path):
    toml = tmp_path / "m.toml"
    toml.write_text("n_layer = 1\n")
    cfg = parse_args([f"--model={toml}", f"--data={tiny_data}"])
    first = input_fingerprint(cfg)
    assert first["model file"].startswith(f"{toml} sha256 ")
    assert first["dataset train.bin size"] == (tiny_data / "train.bin").stat().st_size
    toml.write_text("n_layer = 2\n")
    assert input_fingerprint(cfg)["model file"] != first["model file"]


def mpmd(tmp_path, tiny_data, differ: str):
    """A 2-rank MPMD launch whose ranks run the same command line in their own directory holding
    ``m.toml`` and ``data``: identical contents except ``differ`` ("model" or "data") on rank 1."""
    for rank in (0, 1):
        d = tmp_path / f"rank{rank}"
        shutil.copytree(tiny_data, d / "data")
        heads = 4 if rank and differ == "model" else 2
        (d / "m.toml").write_text(f"n_layer = 1\nn_embd = 32\nn_head = {heads}\nn_positions = 32\n")
        if rank and differ == "data":  # one token fewer: a consistent dataset, but another one
            meta = json.loads((d / "data" / "meta.json").read_text())
            meta["train_tokens"] -= 1
            (d / "data" / "meta.json").write_text(json.dumps(meta))
            os.truncate(d / "data" / "train.bin", 2 * meta["train_tokens"])
    args = ["--model=m.toml", "--data=data", *TINY[4:], f"--out-dir={tmp_path / 'out'}"]
    cmd = ["mpiexec"]
    for rank in (0, 1):
        cmd += [":"] * bool(rank) + ["-n", "1", "-wdir", str(tmp_path / f"rank{rank}"),
                                     sys.executable, "-m", "mpirt.train", *args]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


@pytest.mark.parametrize("differ, names", [
    ("model", ["rank 1 differs from rank 0 in inputs.model file", "m.toml sha256"]),
    ("data", ["rank 1 differs from rank 0 in inputs.dataset meta.json", "inputs.dataset train.bin size"]),
])
def test_ranks_reading_different_files_are_refused(tiny_data, tmp_path, differ, names):
    result = mpmd(tmp_path, tiny_data, differ)
    refused(result, "config differs across ranks", *names)
    assert not (tmp_path / "out" / "metrics").exists()
