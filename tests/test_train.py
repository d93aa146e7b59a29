"""End-to-end tests of ``python -m mpirt.train`` and ``python -m mpirt.sample`` on a tiny model."""
import json
import math

import pytest

from conftest import run_module
from mpirt.core.settings import format_size
from runs import TINY, read_metrics


def test_train_writes_summary_checkpoint_and_samples(tiny_data, tmp_path):
    out = tmp_path / "run"
    # lr 1e-2: six steps lower the loss by ~1 (at 1e-3 by ~0.1, within the batches' spread: the
    # data are this repository's sources, so each commit's are other batches)
    log = run_module("mpirt.train", *TINY, "--steps=6", "--lr=1e-2", f"--data={tiny_data}", f"--out-dir={out}").stderr
    summary = json.loads((out / "summary.json").read_text())
    for key in ("steps", "first_loss", "last_loss", "val_loss", "tokens_per_s", "step_time_s", "mfu",
                "world_size", "layout"):
        assert key in summary, key
    assert summary["steps"] == 6 and summary["world_size"] == 1
    assert summary["layout"] == {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "sequence_parallel": False,
                                 "schedule": None, "microbatches": None, "recompute": "none"}
    assert summary["last_loss"] < summary["first_loss"]
    assert 0 < summary["mfu"] < 1 and summary["tokens_per_s"] > 0
    # the performance model's self-check: predicted beside measured, with the error in percent
    pred = summary["prediction"]
    assert "error" not in pred, pred
    assert pred["step_time_s"]["measured"] == summary["step_time_s"] and pred["step_time_s"]["predicted"] > 0
    assert pred["peak_memory_bytes"]["measured"] == summary["peak_memory_bytes"]
    assert pred["peak_memory_bytes"]["error_pct"] is not None
    # one predicted peak in the run's output: the banner's, the summary's and the model check's
    predicted = format_size(summary["predicted_peak_bytes"])
    assert pred["peak_memory_bytes"]["predicted"] == summary["predicted_peak_bytes"]
    assert f"predicted peak {predicted} on the largest rank" in log, log
    assert f"peak memory {summary['predicted_peak_bytes'] / 2**20:.3g} MiB predicted" in log, log
    assert len(read_metrics(out)) == 6

    text = run_module("mpirt.sample", f"--ckpt={out / 'ckpt'}", "--tokens=20", "--prompt=def ").stdout
    assert text.startswith("def ") and len(text) > 4


def test_sample_help_shows_the_defaults(capsys):
    from mpirt.run import sample

    with pytest.raises(SystemExit):
        sample.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: out/ckpt)", "(default: 300)", "(default: 0.8)", "(default: 40)", "(default: 0)"):
        assert default in text, text


def test_resume_equals_uninterrupted_run(tiny_data, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = [*TINY, f"--data={tiny_data}", "--dtype=float64", "--steps=6"]
    run_module("mpirt.train", *common, f"--out-dir={full}")
    run_module("mpirt.train", *common, f"--out-dir={part}", "--stop-after=3", expect=75)
    run_module("mpirt.train", *common, f"--out-dir={part}", f"--init-from={part / 'ckpt'}")
    expected, resumed = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in expected]
    assert json.loads((part / "summary.json").read_text())["val_loss"] == \
        json.loads((full / "summary.json").read_text())["val_loss"]


def test_eval_only_is_independent_of_seed(tiny_data, tmp_path):
    ckpt = tmp_path / "run" / "ckpt"
    run_module("mpirt.train", *TINY, "--steps=2", f"--data={tiny_data}", f"--out-dir={tmp_path / 'run'}")
    losses = []
    for seed in (1, 2):
        out = run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--init-from={ckpt}", "--eval-only",
                         f"--seed={seed}", f"--out-dir={tmp_path / str(seed)}").stdout
        losses.append(json.loads(out.strip().splitlines()[-1])["val_loss"])
    assert losses[0] == losses[1] > 0


@pytest.mark.parametrize("args, message", [
    (["--steps=abc"], "steps"),
    (["--bogus-key=1"], "bogus_key"),
    (["--seq-len=64"], "n_positions"),
])
def test_bad_configuration_is_refused_naming_the_key(tiny_data, tmp_path, args, message):
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--out-dir={tmp_path}", *args, check=False)
    assert result.returncode == 2
    assert message in result.stderr


def test_a_non_finite_gradient_norm_skips_the_update(tiny_data, tmp_path):
    """An absurd learning rate overflows the weights; from then on steps are skipped, not applied."""
    run_module("mpirt.train", *TINY, "--steps=4", "--lr=1e30", "--grad-clip=1", f"--data={tiny_data}",
               f"--out-dir={tmp_path}", check=False)
    records = read_metrics(tmp_path)
    assert records[0]["skipped"] is False
    assert any(r["skipped"] for r in records[1:])
    assert all(r["skipped"] == (not math.isfinite(r["grad_norm"])) for r in records)
