"""Tests of mpirt.checkpoint: round trip, resume == uninterrupted, validation, crash safety."""
import json
import pickle
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

import mpirt.checkpoint.store as ckpt
from mpirt.core import nn
from mpirt.checkpoint.store import (CheckpointError, is_checkpoint, load_checkpoint, looks_like_checkpoint,
                                    read_checkpoint_meta, save_checkpoint, verify_checkpoint)
from mpirt.core.optim import AdamW, SGD, clip_grad_norm, cosine_lr
from mpirt.core.tensor import Tensor

CONFIG = {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "steps": 5, "model": {"d": 4, "hidden": 8}}


class MLP(nn.Module):
    def __init__(self, d=4, hidden=8, out=3):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def fresh(seed=0, lr=CONFIG["lr"]):
    model = MLP().initialize(seed)
    return model, AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def train(model, opt, steps):
    for t in steps:
        rng = np.random.default_rng(t)
        x = Tensor(rng.standard_normal((6, 4)).astype(np.float32))
        target = rng.standard_normal((6, 3)).astype(np.float32)
        opt.zero_grad()
        d = model(x) - target
        (d * d).mean().backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.lr = cosine_lr(t, lr=CONFIG["lr"], min_lr=CONFIG["min_lr"], warmup_steps=2, total_steps=5)
        opt.step()


def weights(model):
    return {n: p.data.copy() for n, p in model.named_parameters()}


def saved(tmp_path, steps=3, **kw):
    model, opt = fresh()
    train(model, opt, range(steps))
    root = tmp_path / "ckpt"
    save_checkpoint(root, model, opt, step=steps, config=CONFIG, **kw)
    return root, model, opt


def test_resume_equals_uninterrupted(tmp_path):
    root, model, opt = saved(tmp_path, extra={"tokens_seen": 1234, "data_position": [3, 7]})
    train(model, opt, range(3, 5))
    model2, opt2 = fresh(seed=99, lr=0.5)  # different weights and lr: everything must come from the file
    meta = load_checkpoint(root, model2, opt2)
    assert meta["step"] == 3 and meta["config"] == CONFIG and meta["extra"]["data_position"] == [3, 7]
    assert opt2.step_count == 3
    train(model2, opt2, range(3, 5))
    for (n, a), b in zip(weights(model).items(), weights(model2).values()):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(a, b, err_msg=n)
    for s1, s2 in zip(opt.state, opt2.state):
        for k in s1:
            np.testing.assert_array_equal(s1[k], s2[k])


def test_round_trip_and_format(tmp_path, monkeypatch):
    def no_pickle(*a, **k):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "dump", no_pickle)
    monkeypatch.setattr(pickle, "dumps", no_pickle)
    root, model, opt = saved(tmp_path)
    vdir = root / "step-00000003"
    assert (root / "latest").read_text().strip() == "step-00000003"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000003"]
    assert sorted(p.name for p in vdir.iterdir()) == ["meta.json", "meta.sha256", "model.safetensors",
                                                      "optimizer.safetensors"]
    assert (vdir / "meta.sha256").read_text() == f"{ckpt._sha256(vdir / 'meta.json')}  meta.json\n"
    meta = json.loads((vdir / "meta.json").read_text())
    assert meta["format"] == "mpirt-checkpoint" and meta["version"] == 3 and meta["step"] == 3
    assert meta["params"]["fc1.weight"]["shape"] == [4, 8] and meta["params"]["fc1.weight"]["dtype"] == "float32"
    assert meta["params"]["fc2.bias"]["spec"] == [None]
    assert meta["optimizer"]["type"] == "AdamW" and meta["optimizer"]["scalars"]["step"] == 3
    assert meta["optimizer"]["scalars"]["weight_decay"] == 0.1
    assert set(meta["files"]) == {"model.safetensors", "optimizer.safetensors"}
    assert all(len(f["sha256"]) == 64 for f in meta["files"].values())
    w = load_file(str(vdir / "model.safetensors"))
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(w[n], p.data)
    o = load_file(str(vdir / "optimizer.safetensors"))
    np.testing.assert_array_equal(o["fc1.weight.exp_avg_sq"], opt.state[0]["exp_avg_sq"])
    assert is_checkpoint(root) and is_checkpoint(vdir) and not is_checkpoint(tmp_path)
    assert read_checkpoint_meta(root)["path"] == str(vdir)
    # a version directory loads directly; weights-only load needs no optimizer
    model2, _ = fresh(seed=5)
    load_checkpoint(vdir, model2)
    for a, b in zip(weights(model).values(), weights(model2).values()):
        np.testing.assert_array_equal(a, b)


def test_new_save_replaces_previous_and_keep(tmp_path):
    root, model, opt = saved(tmp_path)
    save_checkpoint(root, model, opt, step=4, config=CONFIG)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000004"]
    save_checkpoint(root, model, opt, step=5, config=CONFIG, keep=2)
    save_checkpoint(root, model, opt, step=5, config=CONFIG, keep=2)  # same step again: a new name
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000005", "step-00000005-1"]
    assert read_checkpoint_meta(root)["path"].endswith("step-00000005-1")


def test_corrupted_file_is_named(tmp_path):
    root, _, _ = saved(tmp_path)
    f = root / "step-00000003" / "optimizer.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    model, opt = fresh(seed=7)
    before = weights(model)
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors is corrupted"):
        load_checkpoint(root, model, opt)
    for a, b in zip(before.values(), weights(model).values()):
        np.testing.assert_array_equal(a, b)  # nothing was loaded
    (root / "step-00000003" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors is missing"):
        load_checkpoint(root, model)


def test_edited_meta_json_is_refused(tmp_path):
    root, _, _ = saved(tmp_path)
    meta_path = root / "step-00000003" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["step"] = 300  # still valid JSON, still a plausible checkpoint
    meta_path.write_text(json.dumps(meta, indent=1, sort_keys=True))
    with pytest.raises(CheckpointError, match=r"step-00000003/meta\.json was edited or corrupted"):
        read_checkpoint_meta(root)
    (root / "step-00000003" / "meta.sha256").unlink()
    with pytest.raises(CheckpointError, match=r"meta\.sha256 is missing: .*meta\.json cannot be verified"):
        read_checkpoint_meta(root)


FILES = ["meta.json", "meta.sha256", "model.safetensors", "optimizer.safetensors", "latest"]


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_any_damaged_file_is_named(tmp_path, name, damage):
    """A flipped byte anywhere (a few positions each) or a truncated file is refused, naming it."""
    path = tmp_path / "ckpt" / ("latest" if name == "latest" else f"step-00000003/{name}")
    positions = [0, 1, -2] if damage == "flip" else [None]
    for pos in positions:
        shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
        root, _, _ = saved(tmp_path)
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[pos] ^= 0x01
        else:
            del data[len(data) // 2:]
        path.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=re.escape(name)):
            verify_checkpoint(root)


def test_missing_pieces_name_what_was_looked_for(tmp_path):
    root, _, _ = saved(tmp_path)
    (root / "step-00000003" / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=r"ckpt/latest names step-00000003, but .*ckpt/step-00000003/meta\.json "
                                              r"is missing"):
        verify_checkpoint(root)
    assert looks_like_checkpoint(root) and not is_checkpoint(root)
    root, _, _ = saved(tmp_path / "b")
    (root / "latest").unlink()     # killed between the first save's rename and its pointer: still loads
    assert verify_checkpoint(root)["step"] == 3
    (root / "step-00000003" / "meta.json").write_text("{not json")
    (root / "step-00000003" / "meta.sha256").write_text(f"{ckpt._sha256(root / 'step-00000003' / 'meta.json')}"
                                                        "  meta.json\n")
    with pytest.raises(CheckpointError, match=r"step-00000003/meta\.json: not valid JSON"):
        verify_checkpoint(root / "step-00000003")
    with pytest.raises(CheckpointError, match=r"ckpt/latest is missing and no version there verifies "
                                              r"\(step-00000003: .*not valid JSON"):
        verify_checkpoint(root)
    assert not looks_like_checkpoint(tmp_path / "nothing") and not looks_like_checkpoint(tmp_path)


def test_wrong_shape_and_names_are_reported(tmp_path):
    root, _, _ = saved(tmp_path)
    other = MLP(hidden=16).initialize(0)
    with pytest.raises(CheckpointError, match=r"fc1\.weight has shape \(4, 8\) in the checkpoint, \(4, 16\) in the model"):
        load_checkpoint(root, other)
    renamed = MLP().initialize(0)
    renamed._modules["proj"] = renamed._modules.pop("fc2")
    with pytest.raises(CheckpointError, match=r"missing keys \['proj\.bias', 'proj\.weight'\]"):
        load_checkpoint(root, renamed)
    model = MLP().initialize(0)
    with pytest.raises(ValueError, match="state of a AdamW optimizer, this is a SGD"):
        load_checkpoint(root, model, SGD(model.parameters(), lr=0.1))
    save_checkpoint(root, model, None, step=9, config={})
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(root, model, AdamW(model.parameters(), lr=0.1))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nothing", MLP().initialize(0))
    (tmp_path / "latest").write_text("../etc\n")
    with pytest.raises(CheckpointError, match="does not name"):
        read_checkpoint_meta(tmp_path)
    model, opt = fresh()
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(tmp_path / "c", model, opt, step=1, config={"f": object()})
    assert not (tmp_path / "c").exists()  # rejected before anything was written


@pytest.mark.parametrize("crash_at", ["optimizer_file", "meta", "rename", "pointer"])
def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch, crash_at):
    root, model, opt = saved(tmp_path)
    expected = weights(model)
    train(model, opt, range(3, 4))

    class Crash(Exception):
        pass

    real_save, real_write, real_rename = ckpt.save_file, ckpt._write_bytes, ckpt.os.rename

    def save_file(tensors, path, metadata=None):
        if path.endswith("optimizer.safetensors"):  # half a file, then the process dies
            real_save(tensors, path, metadata)
            with open(path, "r+b") as f:
                f.truncate(f.seek(0, 2) // 2)
            raise Crash
        real_save(tensors, path, metadata)

    def write_bytes(path, data):
        if path.name == "meta.json":
            path.write_bytes(data[: len(data) // 2])
            raise Crash
        real_write(path, data)

    def rename(src, dst):
        raise Crash

    def write_pointer(root_, name):
        raise Crash

    patch = {"optimizer_file": ("save_file", save_file), "meta": ("_write_bytes", write_bytes),
             "pointer": ("_write_pointer", write_pointer)}
    if crash_at == "rename":
        monkeypatch.setattr(ckpt.os, "rename", rename)
    else:
        monkeypatch.setattr(ckpt, *patch[crash_at])
    with pytest.raises(Crash):
        save_checkpoint(root, model, opt, step=4, config=CONFIG)
    monkeypatch.undo()

    # the previous checkpoint is still the one that loads, intact
    model2, opt2 = fresh(seed=3)
    meta = load_checkpoint(root, model2, opt2)
    assert meta["step"] == 3 and opt2.step_count == 3
    for n, a in expected.items():
        np.testing.assert_array_equal(dict(model2.named_parameters())[n].data, a)
    # whatever the crash left behind does not pass for a checkpoint
    leftovers = [p for p in root.iterdir() if p.name not in ("latest", "step-00000003")]
    for p in leftovers:
        if crash_at == "pointer":  # complete and checksummed, just never made current
            assert p.name == "step-00000004" and load_checkpoint(p, fresh()[0])["step"] == 4
        else:
            assert p.name.startswith(".tmp-") and not is_checkpoint(p) and not is_checkpoint(root / p.name[5:])
    # the next save cleans up and commits normally
    save_checkpoint(root, model, opt, step=4, config=CONFIG)
    assert sorted(p.name for p in root.iterdir())[-1].startswith("step-00000004")
    assert len([p for p in root.iterdir() if p.name != "latest"]) == 1
    assert load_checkpoint(root, model2, opt2)["step"] == 4


def test_a_version_1_checkpoint_without_meta_sha256_still_loads(tmp_path):
    """Checkpoints written before meta.sha256 existed (format version 1) load; version 2 needs it."""
    model, _ = fresh()
    vdir = save_checkpoint(tmp_path / "ckpt", model, None, step=3, config={})
    meta = json.loads((vdir / "meta.json").read_text())
    (vdir / "meta.sha256").unlink()
    with pytest.raises(CheckpointError, match="meta.sha256 is missing"):
        load_checkpoint(tmp_path / "ckpt", model)
    meta["version"] = 1
    (vdir / "meta.json").write_text(json.dumps(meta))
    assert load_checkpoint(tmp_path / "ckpt", model)["step"] == 3
