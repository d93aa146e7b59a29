"""Unit tests of mpirt.run.startup: the checkpoint version rank 0 pins for every rank, and the
pre-flight's own timeout. (The launches that prove the start-up cannot hang are in
test_resilience.py.)"""
import hashlib

import numpy as np
import pytest

from mpirt.checkpoint.store import save_state
from mpirt.run.config import ConfigError, parse_args
from mpirt.run.startup import PREFLIGHT_S, follow_pin, pin_checkpoint, preflight_timeout


def save(root, step):
    return save_state(root, {"w": np.full(3, float(step))}, None, step=step, config={}, keep=3)


def test_every_rank_follows_the_version_rank_0_resolved_even_after_a_newer_save(tmp_path):
    root = tmp_path / "ckpt"
    save(root, 2)
    pinned = save(root, 4)
    pin = pin_checkpoint(str(root))          # rank 0 reads `latest` once
    assert pin["version"] == str(pinned.resolve()) and pin["bytes"] > 0
    assert pin["sha256"] == hashlib.sha256((pinned / "meta.json").read_bytes()).hexdigest()
    save(root, 6)                            # the run being read saves again before rank 1 looks
    cfg = follow_pin(parse_args([f"--init-from={root}"]), pin)
    assert cfg.init_from == pin["version"]
    # --resume auto: rank 0 decides whether the run resumes (this rank found no checkpoint)
    assert follow_pin(parse_args(["--resume=auto"]), pin).init_from == pin["version"]
    # a rank that names another checkpoint keeps it: the config agreement refuses it by name
    assert follow_pin(parse_args([f"--init-from={tmp_path}/other"]), pin).init_from == f"{tmp_path}/other"
    # nothing pinned (a Hugging Face directory, a fresh start): init_from as given
    assert follow_pin(parse_args(["--init-from=hf"]), pin_checkpoint("hf")).init_from == "hf"


def test_a_rank_reading_another_meta_json_than_rank_0_is_refused_naming_it(tmp_path):
    root = tmp_path / "ckpt"
    version = save(root, 2)
    pin = dict(pin_checkpoint(str(root)), sha256="0" * 64)  # what rank 0 read there
    with pytest.raises(ConfigError, match=f"init_from: {version.resolve()}/meta.json reads differently here than "
                                          f"on rank 0"):
        follow_pin(parse_args([f"--init-from={root}"]), pin)
    with pytest.raises(ConfigError, match="init_from: .* is missing"):  # `latest` names a version that is gone
        (root / "latest").write_text("step-00000009\n")
        pin_checkpoint(str(root))


def test_the_pre_flight_has_its_own_short_timeout():
    assert preflight_timeout() == PREFLIGHT_S == preflight_timeout(parse_args([]))
    assert preflight_timeout(parse_args([]), {"bytes": 50e6 * 30}) == PREFLIGHT_S + 30  # checksums at 50 MB/s
    assert preflight_timeout(parse_args(["--comm-timeout=7"]), {"bytes": 1e12}) == 7
