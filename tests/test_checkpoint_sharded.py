"""Sharded checkpoints (format 3): boxes of flat ranges, damaged shards named on load, the CLI,
and each rank's memory during a save and a load (mpi tier)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tracemalloc

import numpy as np
import pytest

from conftest import agree, run_module
from mpirt.checkpoint.store import CheckpointError, CheckpointReader, load_state, verify_checkpoint
from mpirt.parallel.shards import _flat_boxes

TINY = ["--model.n_layer=2", "--model.n_embd=32", "--model.n_head=4", "--model.n_positions=32", "--seq-len=16",
        "--batch-size=8", "--eval-batches=2", "--eval-interval=0", "--progress=false", "--steps=2"]


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_flat_boxes_cover_the_range_in_order(shape):
    n = int(np.prod(shape))
    for lo in range(n):
        for hi in range(lo, n + 1):
            got = []
            for start, box in _flat_boxes(shape, lo, hi):
                idx = np.arange(n).reshape(shape)[tuple(slice(s, s + b) for s, b in zip(start, box))]
                got += idx.reshape(-1).tolist()
            assert got == list(range(lo, hi))


@pytest.fixture(scope="module")
def tp2_ckpt(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--out-dir={out}", "--tp=2", ranks=2)
    return out / "ckpt"


def test_each_rank_wrote_its_own_file(tp2_ckpt):
    meta = verify_checkpoint(tp2_ckpt)
    assert meta["version"] == 3 and sorted(meta["files"]) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    files = {sh["file"] for sh in meta["params"]["h.0.attn.c_attn.weight"]["shards"]}
    assert files == set(meta["files"])  # split over tp: a box from each rank (one per q/k/v block)
    assert {sh["file"] for sh in meta["params"]["h.0.ln_1.weight"]["shards"]} == {"rank-00000.safetensors"}


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("rank", [0, 1])
def test_damaged_shards_are_named_on_load(tp2_ckpt, tmp_path, rank, damage):
    root = tmp_path / "ckpt"
    shutil.copytree(tp2_ckpt, root)
    version = root / (root / "latest").read_text().strip()
    path = version / f"rank-{rank:05d}.safetensors"
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(rank)
    if damage == "flip":
        data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    else:
        data = data[:int(rng.integers(len(data)))]
    path.write_bytes(bytes(data))
    meta = json.loads((version / "meta.json").read_text())
    name = next(n for n, e in meta["params"].items() if any(sh["file"] == path.name for sh in e["shards"]))
    with pytest.raises(CheckpointError, match=f"{path.name} is (truncated or )?corrupted"):
        CheckpointReader(root).read("params", name)
    with pytest.raises(CheckpointError, match=f"{path.name} is (truncated or )?corrupted"):
        verify_checkpoint(root)


def test_info_into_a_closed_pipe_and_a_bad_directory_are_one_line_at_most(tp2_ckpt, tmp_path):
    """`... info DIR | head` closes the pipe early: no traceback; a bad path: one line on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "mpirt.checkpoint", "info", str(tp2_ckpt)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()                                   # the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err
    bad = run_module("mpirt.checkpoint", "info", tmp_path / "nowhere", check=False)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert bad.stderr.startswith("error: ")


def test_an_export_loads_with_transformers_tokenizer_included_and_generates(tp2_ckpt, tmp_path):
    """transformers' recipe on an export: AutoTokenizer encodes as training did (the byte dataset:
    id = byte value), AutoModelForCausalLM gives mpirt's logits, and generate() writes text."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mpirt.core.modeling import build_model, config_from_dict
    from mpirt.core.tensor import no_grad
    run_module("mpirt.checkpoint", "export", tp2_ckpt, tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def main():\n    return 0"
    ids = tokenizer(text).input_ids
    assert ids == list(text.encode()) and tokenizer.decode(ids) == text
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    meta, weights, _ = load_state(tp2_ckpt)
    model = build_model(config_from_dict(meta["extra"]["model_config"]))
    model.load_state_dict(weights)
    with no_grad():
        ours = model(np.asarray([ids])).data                 # (1, T, V)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert out.shape[1] == len(ids) + 8 and tokenizer.decode(out[0]).startswith(text)


def exported_logits_match(run_dir, out, architecture: str):
    """Export ``run_dir``'s checkpoint to ``out``; transformers loads it as ``architecture`` and
    gives the logits mpirt's model of the checkpoint gives. Returns the loaded model and the ids."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mpirt.core.modeling import build_model, config_from_dict
    from mpirt.core.tensor import no_grad
    run_module("mpirt.checkpoint", "export", run_dir / "ckpt", out)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == architecture
    ids = AutoTokenizer.from_pretrained(out)("x = 1 + 2").input_ids
    meta, weights, _ = load_state(run_dir / "ckpt")
    model = build_model(config_from_dict(meta["extra"]["model_config"]))
    model.load_state_dict(weights)
    with no_grad():
        ours = model(np.asarray([ids])).data
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)
    return hf, ids


def test_a_llama_checkpoint_exports_to_llama_for_causal_lm(tiny_data, tmp_path):
    """A Llama-style run with grouped-query attention (2 key/value heads, trained at tp 2) exports
    to LlamaForCausalLM: transformers gives mpirt's logits (q | k | v split from the fused c_attn,
    num_key_value_heads 2, matrices transposed, the same rotary layout)."""
    torch = pytest.importorskip("torch")
    run_module("mpirt.train", "--model=llama-tiny", "--model.n_layer=2", "--model.n_embd=64", "--model.n_head=4",
               "--model.n_kv_head=2", "--model.n_positions=32", "--seq-len=16", "--batch-size=8", "--eval-batches=2", "--eval-interval=0",
               "--progress=false", "--steps=3", "--tp=2", f"--data={tiny_data}", f"--out-dir={tmp_path / 'run'}", ranks=2)
    hf, ids = exported_logits_match(tmp_path / "run", tmp_path / "hf", "LlamaForCausalLM")
    assert hf.config.num_key_value_heads == 2
    assert hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False).shape == (1, len(ids) + 4)


def test_a_mixture_of_experts_checkpoint_exports_to_mixtral_for_causal_lm(tiny_data, tmp_path):
    """A Mixtral-style run (trained at pp 2) exports to MixtralForCausalLM: transformers gives
    mpirt's logits (router transposed, each expert's gate and up matrices stacked as gate_up_proj)."""
    run_module("mpirt.train", "--model=mixtral-tiny", "--model.n_layer=2", "--model.n_embd=32", "--model.n_inner=48",
               "--model.n_positions=32", "--seq-len=16", "--batch-size=8", "--eval-batches=2", "--eval-interval=0",
               "--progress=false", "--steps=3", "--pp=2", f"--data={tiny_data}", f"--out-dir={tmp_path / 'run'}", ranks=2)
    hf, _ = exported_logits_match(tmp_path / "run", tmp_path / "hf", "MixtralForCausalLM")
    assert hf.config.num_local_experts == 4 and hf.config.num_experts_per_tok == 2


def test_info_and_export(tp2_ckpt, tmp_path):
    info = run_module("mpirt.checkpoint", "info", tp2_ckpt).stdout
    assert "version 3, step 2" in info and "rank-00001.safetensors" in info
    assert "(gpt2: n_layer 2, n_head 4, n_embd 32" in info and "dtype float32, training loss at this step " in info
    assert "not recorded" not in info
    assert "params h.0.attn.c_attn.weight: (32, 96) float32, 6 shard(s)" in info
    run_module("mpirt.checkpoint", "export", tp2_ckpt, tmp_path / "hf")
    from mpirt.models.hf import load_hf_gpt2
    _, hf = load_hf_gpt2(tmp_path / "hf")
    _, weights, _ = load_state(tp2_ckpt)
    assert hf.keys() == weights.keys()
    for name, w in weights.items():
        np.testing.assert_array_equal(hf[name], w, err_msg=name)


def test_a_box_reads_only_the_shards_it_overlaps(tp2_ckpt, monkeypatch):
    reader = CheckpointReader(tp2_ckpt)
    full = reader.read("params", "h.0.attn.c_attn.weight")
    np.testing.assert_array_equal(reader.read("params", "h.0.attn.c_attn.weight", (3, 10), (5, 4)), full[3:8, 10:14])
    assert list(reader._handles) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    reader = CheckpointReader(tp2_ckpt)
    reader.read("params", "h.0.attn.c_attn.weight", (0, 0), (32, 16))  # q's first half: rank 0's box only
    assert list(reader._handles) == ["rank-00000.safetensors"]


# --- memory per rank (mpi tier) ------------------------------------------------------------
LAYOUTS = [({"dp": 2}, {"tp": 2}), ({"dp": 2, "zero": 1}, {"pp": 2}), ({"tp": 2}, {"dp": 2, "zero": 3}),
           ({"pp": 2}, {"dp": 2})]
SLACK = 192 << 10  # meta.json (parsed on every rank), the gathered shard lists, pickles, comm buffers


def _engine(layout: dict, comm):
    from mpirt.run.config import parse_args
    from mpirt.parallel.grid import Grid
    from mpirt.core.modeling import load_model_config
    from mpirt.parallel.engine import Engine, Hyper
    from mpirt.parallel.layout import Layout

    cfg = parse_args([f"--{k}={v}" for k, v in layout.items()] + ["--dtype=float64", "--seed=3"])
    model_cfg = load_model_config("tiny", {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 32})
    grid = Grid(dp=layout.get("dp", 1), pp=layout.get("pp", 1), tp=layout.get("tp", 1), comm=comm)
    return Engine(Layout.of(cfg, grid.sizes, model_cfg), model_cfg, grid, Hyper.of(cfg), dropout_seed=0), grid


@pytest.mark.mpi
@pytest.mark.parametrize("first, then", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_save_and_load_memory_stays_within_own_shard_plus_one_tensor(group, first, then):
    from mpirt.checkpoint.sharded import ShardWriter, save_sharded

    comm = group(2)
    ok, detail = True, ""
    if comm is not None:
        root = comm.broadcast_object(tempfile.mkdtemp() if comm.rank == 0 else None)
        engine, grid = _engine(first, comm)
        largest = max(int(np.prod(getattr(p, "logical_shape", p.global_shape))) * 8
                      for _, p in engine.model.named_parameters())
        own = ShardWriter(comm.rank)
        engine.save_sharded(own)
        tracemalloc.start()
        path = save_sharded(root, comm, engine.save_sharded, step=1, config={}, extra=None,
                            optimizer={"type": "AdamW", "scalars": engine.optimizer.scalars()})
        save_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        other, grid2 = _engine(then, comm)
        tracemalloc.start()
        other.load_sharded(CheckpointReader(path))
        load_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        root2 = comm.broadcast_object(tempfile.mkdtemp() if comm.rank == 0 else None)
        again = save_sharded(root2, comm, other.save_sharded, step=1, config={}, extra=None,
                             optimizer={"type": "AdamW", "scalars": other.optimizer.scalars()})
        detail = (f"rank {comm.rank}: own shard {own.nbytes} B, largest tensor {largest} B; peak save {save_peak} B, "
                  f"load {load_peak} B")
        print(detail)
        # loading reads each box straight into its place: what a load holds beyond the state is
        # meta.json and the headers (test_build_memory.py measures the boxes alone: a few KB)
        ok = save_peak <= own.nbytes + largest + SLACK and load_peak <= largest + SLACK
        if comm.rank == 0:
            a, b = load_state(path), load_state(again)
            ok = ok and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])
            ok = ok and all(np.array_equal(a[2][k], b[2][k]) for k in a[2] if hasattr(a[2][k], "shape"))
            for d in (root, root2):
                shutil.rmtree(d)
        grid.free()
        grid2.free()
    agree(ok, detail)
