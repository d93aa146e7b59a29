"""bench/fit.py's tiny twin: a GPT whose single-rank training memory is > 4x the per-rank budget
trains on 8 ranks within it (dp2 x tp4, ZeRO-1, selective recomputation), resumes its sharded
checkpoint on tp8 under the same budget, and exports to a Hugging Face directory. Every rank's
measured peak stays within the budget (the runs enforce it: exit 5 otherwise), checked again here
from the summaries; the export is read back and compared with the checkpoint."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from mpirt.core.settings import parse_size

# 118M parameters, most of them in the token table: little compute for the memory it needs. Its
# single rank needs 2.12 GiB (predicted), 4.17x the budget; measured on 8 ranks: 465-474 MiB owned
# per rank (rank 0 writes the checkpoint's metadata), 3-5 MiB above the prediction
TWIN = ["--model=tiny", "--model-args=--model.n_layer=4 --model.n_embd=1024 --model.n_head=8 "
        "--model.vocab_size=65536 --model.n_positions=32", "--seq-len=32", "--batch-size=4", "--steps=2",
        "--budget=520MiB", "--layout=--dp=2 --tp=4 --zero=1 --recompute=selective", "--then=--tp=8"]


@pytest.mark.timeout(900)
def test_model_four_times_the_budget_trains_on_8_ranks_within_it(tmp_path, tiny_data):
    out = tmp_path / "fit"
    result = subprocess.run([sys.executable, "bench/fit.py", *TWIN, f"--data={tiny_data}", f"--out={out}",
                             f"--results={tmp_path / 'results'}"],
                            capture_output=True, text=True, timeout=880, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "results" / "fit.json").read_text())
    budget = report["budget"]
    assert report["ratio"] >= 4 and report["within_budget"]
    assert all(row["measured_peak"] <= budget and row["predicted_peak"] <= budget for row in report["rows"])
    assert report["resumed"]["peak_memory_bytes"] <= budget and report["resumed"]["steps"] == 4
    grid = {k: report["summary"]["layout"][k] for k in ("dp", "pp", "tp")}
    assert grid == {"dp": 2, "pp": 1, "tp": 4} and report["summary"]["world_size"] == 8

    from mpirt.checkpoint.store import CheckpointReader
    from mpirt.models.hf import HFReader

    ckpt, hf = CheckpointReader(out / "then" / "ckpt"), HFReader(out / "hf")
    for name in ("wte.weight", "h.3.attn.c_attn.weight", "ln_f.bias"):
        np.testing.assert_array_equal(hf.read("params", name), ckpt.read("params", name), err_msg=name)
    shutil.rmtree(out)  # ~3 GB of checkpoints and export


def test_the_budget_comes_from_the_prediction_and_nothing_is_left_behind(tmp_path, tiny_data):
    """Without --budget the per-rank budget is the layout's largest predicted peak plus 15%, rounded
    up (`python bench/fit.py` as the README writes it refused in 2 s against a fixed 1.5 GiB); the
    temporary directory is named and removed; results are written only when asked."""
    sys.path.insert(0, str(ROOT / "bench"))
    import fit
    from common import LoadMonitor, write_results

    assert fit.auto_budget(1_000 * 2**20) == 1_150 * 2**20 and fit.auto_budget(1_001 * 2**20) == 1_160 * 2**20
    assert fit.auto_budget(2**31) == 46 * (2**30 // 20)    # 2.3 GiB in steps of 0.05 GiB
    twin = [a for a in TWIN if not a.startswith("--budget")]
    result = subprocess.run([sys.executable, "bench/fit.py", *twin, f"--data={tiny_data}", "--plan-only",
                             "--min-ratio=3"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    largest = parse_size(result.stdout.split("the largest predicted peak is ")[1].split("\n")[0])
    budget = parse_size(result.stdout.split("x the budget ")[1].split(";")[0])
    assert budget == pytest.approx(fit.auto_budget(largest), rel=0.01), result.stdout
    workdir = result.stdout.split("fit: the runs go to ")[1].split(" ")[0]
    assert f"fit: removed {workdir}" in result.stdout and not os.path.exists(workdir) and not list(tmp_path.iterdir())
    load = LoadMonitor().start().stop()
    write_results("fit", "title", ["a"], [[1]], load, {}, directory=tmp_path / "results", save=False)
    assert not (tmp_path / "results").exists()
