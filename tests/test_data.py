"""Tests of mpirt.data: preparation, memmap datasets, deterministic DP-sharded batches."""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from mpirt.data import tokens as data
from mpirt.data.tokens import (TokenDataset, default_dataset_dir, get_batch, get_eval_batch,
                               num_eval_batches, prepare, split_microbatches)

DOCS = {
    "a.txt": "hello world\n" * 40,
    "sub/b.txt": "the quick brown fox jumps over the lazy dog\n" * 30,
    "sub/c.txt": "caf\u00e9 na\u00efve r\u00e9sum\u00e9\n" * 20,
    "d.txt": "lorem ipsum dolor sit amet\n" * 25,
    "e.md": "# title\n\nsome markdown\n" * 10,
}


def write_tree(root, docs=DOCS):
    for rel, text in docs.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return root


@pytest.fixture
def src(tmp_path):
    return write_tree(tmp_path / "src")


def test_prepare_bytes_roundtrip(src, tmp_path):
    (src / ".hidden").write_text("never read")
    out = tmp_path / "ds"
    meta = prepare(src, out, val_fraction=0.2)
    ds = TokenDataset(out)
    assert isinstance(ds.train, data.TokenFile) and isinstance(ds.val, data.TokenFile)   # read, never mapped
    assert ds.train.dtype == np.uint16 and ds.vocab_size == 256
    assert json.loads((out / "meta.json").read_text()) == meta == ds.meta
    total = sum(len(t.encode()) + 1 for t in DOCS.values())  # + one separator per document
    assert meta["train_tokens"] + meta["val_tokens"] == total
    assert (out / "train.bin").stat().st_size == 2 * meta["train_tokens"]
    assert meta["val_tokens"] > 0 and meta["train_tokens"] > 0
    assert meta["train_files"] + meta["val_files"] == len(DOCS)
    # every document appears whole, NUL-terminated, in sorted order within its split
    text = ds.decode(ds.train) + ds.decode(ds.val)
    docs = [d for d in text.split("\0") if d]
    assert sorted(docs) == sorted(DOCS.values())
    train_docs = [d for d in ds.decode(ds.train).split("\0") if d]
    order = sorted(DOCS, key=lambda r: r)
    ranks = [order.index(next(r for r in DOCS if DOCS[r] == d)) for d in train_docs]
    assert ranks == sorted(ranks)
    assert ds.decode(ds.encode("caf\u00e9")) == "caf\u00e9"
    assert ds.decode([0xC3]) == "\ufffd"
    assert not list(tmp_path.glob(".ds.tmp-*"))
    # deterministic: a second preparation is byte-identical
    prepare(src, tmp_path / "ds2", val_fraction=0.2)
    for name in ("train.bin", "val.bin"):
        assert (out / name).read_bytes() == (tmp_path / "ds2" / name).read_bytes()


def test_prepare_single_file_splits_tokens(tmp_path):
    src = write_tree(tmp_path / "one", {"only.txt": "x" * 999, "empty.txt": ""})  # empty skipped
    meta = prepare(src, tmp_path / "ds", val_fraction=0.1)
    assert (meta["train_tokens"], meta["val_tokens"]) == (900, 100)  # 999 bytes + separator
    assert (meta["train_max_id"], meta["val_max_id"]) == (ord("x"), ord("x"))  # the separator 0 is in val
    ds = TokenDataset(tmp_path / "ds")
    assert ds.decode(ds.train) + ds.decode(ds.val) == "x" * 999 + "\0"


def test_prepare_pattern_and_errors(src, tmp_path):
    meta = prepare(src, tmp_path / "txt", pattern="*.txt")
    assert meta["train_files"] + meta["val_files"] == 4
    with pytest.raises(FileExistsError, match="txt"):
        prepare(src, tmp_path / "txt")
    with pytest.raises(ValueError, match="no files"):
        prepare(src, tmp_path / "none", pattern="*.rst")
    with pytest.raises(FileNotFoundError, match="missing"):
        prepare(tmp_path / "missing", tmp_path / "x")
    with pytest.raises(ValueError, match="val_fraction"):
        prepare(src, tmp_path / "x", val_fraction=0)


def test_prepare_is_atomic(src, tmp_path, monkeypatch):
    calls = []

    def failing(path, tok):
        calls.append(path)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        yield np.frombuffer(path.read_bytes(), np.uint8).astype(np.uint16)

    monkeypatch.setattr(data, "_document_tokens", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        prepare(src, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
    assert list(tmp_path.iterdir()) == [src]  # no temporary directory left behind


def test_plain_nanogpt_dir_and_file_errors(tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    np.arange(100, dtype=np.uint16).tofile(d / "train.bin")
    with pytest.raises(FileNotFoundError, match=str(d / "val.bin")):
        TokenDataset(d)
    (d / "val.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="val.bin"):
        TokenDataset(d)
    (d / "val.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="3 bytes"):
        TokenDataset(d)
    np.arange(10, dtype=np.uint16).tofile(d / "val.bin")
    ds = TokenDataset(d)
    assert ds.vocab_size is None and ds.tokenizer is None and ds.meta == {}
    assert len(ds.train) == 100 and ds.val[-1] == 9
    with pytest.raises(ValueError, match="tokenizer is unknown"):
        ds.decode([1, 2])
    (d / "meta.json").write_text(json.dumps({"train_tokens": 99, "val_tokens": 10}))
    with pytest.raises(ValueError, match="99"):
        TokenDataset(d)


def test_token_ids_are_checked_against_the_vocabulary(src, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    meta = prepare(src, out, val_fraction=0.2)
    ds = TokenDataset(out)
    for split in ("train", "val"):
        assert meta[f"{split}_max_id"] == int(np.asarray(getattr(ds, split)).max())
    scanned = []
    monkeypatch.setattr(data, "max_token_id", lambda t: scanned.append(len(t)) or 0)
    ds.check_ids(max(meta["train_max_id"], meta["val_max_id"]) + 1)  # from the record: nothing read
    assert not scanned
    with pytest.raises(ValueError, match=rf"data: {out / 'train.bin'} holds token id {meta['train_max_id']} "
                                         rf">= the model's vocab_size {meta['train_max_id']}"):
        ds.check_ids(meta["train_max_id"])
    monkeypatch.undo()

    # an id written into val.bin after preparation changes its mtime: the stale record is not trusted
    val = np.memmap(out / "val.bin", dtype=np.uint16, mode="r+")
    val[len(val) // 2] = 50300
    val.flush()
    del val
    os.utime(out / "val.bin", ns=(0, meta["val_mtime_ns"] + 10**9))
    with pytest.raises(ValueError, match=r"val\.bin holds token id 50300 >= the model's vocab_size 50257"):
        TokenDataset(out).check_ids(50257)

    # a dataset without the record (nanoGPT's, or an older prepare) is scanned in bounded chunks
    for key in ("val_max_id", "val_mtime_ns"):
        del meta[key]
    (out / "meta.json").write_text(json.dumps(meta))
    monkeypatch.setattr(data, "_SCAN", 7)
    assert TokenDataset(out).max_id("val") == 50300
    assert data.max_token_id(np.arange(20, dtype=np.uint16)[::-1]) == 19


def test_a_large_split_without_a_record_is_checked_as_it_is_read(src, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    meta = prepare(src, out, val_fraction=0.2)
    for key in ("train_max_id", "train_mtime_ns"):
        del meta[key]
    (out / "meta.json").write_text(json.dumps(meta))
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    tokens[100] = 300
    tokens.tofile(out / "train.bin")
    monkeypatch.setattr(data, "SCAN_TOKENS", 10)           # "large": not scanned at start-up
    scanned = []
    monkeypatch.setattr(data, "max_token_id", lambda t: scanned.append(t.path.name) or 0)
    ds = TokenDataset(out)
    notes = ds.check_ids(256)
    assert [n.split(" (")[0] for n in notes] == [str(out / "train.bin")] and scanned == []   # val: its record
    assert ds.train[:100].max() < 256                        # reads short of the bad id pass
    with pytest.raises(data.TokenIdError, match=rf"{out / 'train.bin'} holds token id 300 >= the model's "
                                                rf"vocab_size 256 \(token 100\)"):
        get_eval_batch(ds.train, 0, batch_size=2, seq_len=64)


def test_a_token_file_changed_under_a_reader_is_named_with_what_changed(tmp_path):
    """Truncated, grown or rewritten in place after opening: the next read says which, naming the
    file (not ``OSError: short read``); a file replaced by a rename keeps reading the opened one."""
    path = tmp_path / "train.bin"

    def opened():
        np.arange(1000, dtype=np.uint16).tofile(path)
        return data.TokenFile(path, 1000)

    tokens = opened()
    os.truncate(path, 200)
    with pytest.raises(data.TokenFileChanged, match=rf"data: {path} changed under the running job: truncated from "
                                                    rf"2,000 to 200 bytes"):
        tokens.read(900, 16)                                # past the new end
    tokens = opened()
    with open(path, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(data.TokenFileChanged, match="grown from 2,000 to 2,002 bytes"):
        tokens.read(0, 16)                                  # inside the file: still refused
    tokens = opened()
    np.zeros(1000, dtype=np.uint16).tofile(path)
    os.utime(path, ns=(0, 10**18))
    with pytest.raises(data.TokenFileChanged, match="rewritten in place"):
        tokens.read(0, 16)
    tokens = opened()
    np.zeros(1000, dtype=np.uint16).tofile(tmp_path / "new.bin")
    os.replace(tmp_path / "new.bin", path)
    assert tokens.read(10, 3).tolist() == [10, 11, 12]


def test_token_files_are_read_not_mapped(tmp_path):
    """Windows come from pread: nothing of the file is mapped, however large (a sparse 4 GiB file)."""
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(4 << 30)
    tokens = data.TokenFile(path, (4 << 30) // 2)
    x, y = get_batch(tokens, 3, batch_size=8, seq_len=256, seed=0)
    assert x.shape == (8, 256) and not x.any() and len(tokens) == 2 << 30
    assert str(path) not in Path("/proc/self/maps").read_text()
    small = tmp_path / "small.bin"
    np.arange(100, dtype=np.uint16).tofile(small)
    t = data.TokenFile(small, 100)                            # slices as an array's, steps of either sign
    for key in (slice(5, 8), slice(None, None, -1), slice(10, 0, -3), slice(None, None, 25), slice(5, 5)):
        assert np.array_equal(t[key], np.arange(100, dtype=np.uint16)[key]), key
    assert t[-1] == 99


def test_get_batch_deterministic_and_shifted():
    tokens = np.arange(5000, dtype=np.uint16)
    kw = dict(batch_size=8, seq_len=16, seed=3)
    x, y = get_batch(tokens, 7, **kw)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == np.int64
    x2, y2 = get_batch(tokens, 7, **kw)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert not np.array_equal(x, get_batch(tokens, 8, **kw)[0])
    assert not np.array_equal(x, get_batch(tokens, 7, batch_size=8, seq_len=16, seed=4)[0])
    assert np.array_equal(y[:, :-1], x[:, 1:]) and np.array_equal(y[:, -1], x[:, -1] + 1)
    assert np.array_equal(x, x[:, :1] + np.arange(16))  # contiguous windows of tokens
    assert x.min() >= 0 and y.max() <= 4999


def test_get_batch_covers_all_starts():
    tokens = np.arange(12, dtype=np.uint16)  # seq_len 4: starts 0..7
    starts = np.concatenate([get_batch(tokens, s, batch_size=16, seq_len=4, seed=0)[0][:, 0]
                             for s in range(20)])
    assert set(starts.tolist()) == set(range(8))
    x, y = get_batch(tokens[:5], 0, batch_size=2, seq_len=4, seed=0)  # exactly seq_len+1
    assert np.array_equal(x, [[0, 1, 2, 3]] * 2) and np.array_equal(y, [[1, 2, 3, 4]] * 2)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_get_batch_dp_shards_concatenate_to_global(dp, tmp_path):
    path = tmp_path / "t.bin"
    np.random.default_rng(0).integers(0, 60000, 20000).astype(np.uint16).tofile(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    kw = dict(batch_size=8, seq_len=32, seed=11)
    for step in (0, 5):
        gx, gy = get_batch(tokens, step, **kw)
        parts = [get_batch(tokens, step, dp_rank=r, dp_size=dp, **kw) for r in range(dp)]
        assert all(p[0].shape == (8 // dp, 32) for p in parts)
        assert np.array_equal(np.concatenate([p[0] for p in parts]), gx)
        assert np.array_equal(np.concatenate([p[1] for p in parts]), gy)


def test_split_microbatches():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = get_batch(tokens, 0, batch_size=8, seq_len=5, seed=0, dp_rank=1, dp_size=2)
    micro = split_microbatches(x, y, 2)
    assert len(micro) == 2 and micro[0][0].shape == (2, 5)
    assert np.array_equal(np.concatenate([m[0] for m in micro]), x)
    assert np.array_equal(np.concatenate([m[1] for m in micro]), y)
    with pytest.raises(ValueError, match="4 rows"):
        split_microbatches(x, y, 3)


def test_batch_errors():
    tokens = np.arange(100, dtype=np.uint16)
    with pytest.raises(ValueError, match=r"batch_size 6 .* dp_size 4"):
        get_batch(tokens, 0, batch_size=6, seq_len=4, seed=0, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank 2"):
        get_batch(tokens, 0, batch_size=4, seq_len=4, seed=0, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="100 tokens.*101"):
        get_batch(tokens, 0, batch_size=4, seq_len=100, seed=0)
    with pytest.raises(ValueError, match=r"batch_size 6 .* dp_size 4"):
        get_eval_batch(tokens, 0, batch_size=6, seq_len=4, dp_size=4)


def test_eval_windows():
    tokens = np.arange(103, dtype=np.uint16)  # (103-1)//10 = 10 windows
    assert num_eval_batches(tokens, 3, 10) == 3
    assert num_eval_batches(tokens[:101], 1, 10) == 10
    assert num_eval_batches(tokens[:100], 1, 10) == 9
    for index in range(3):
        x, y = get_eval_batch(tokens, index, batch_size=3, seq_len=10)
        for j in range(3):
            i = index * 3 + j
            assert np.array_equal(x[j], np.arange(i * 10, i * 10 + 10))
            assert np.array_equal(y[j], np.arange(i * 10 + 1, i * 10 + 11))
    gx, gy = get_eval_batch(tokens, 1, batch_size=4, seq_len=10)
    parts = [get_eval_batch(tokens, 1, batch_size=4, seq_len=10, dp_rank=r, dp_size=2)
             for r in range(2)]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), gx)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), gy)
    with pytest.raises(ValueError, match="eval batch 3 .* only 3 batches"):
        get_eval_batch(tokens, 3, batch_size=3, seq_len=10)


def make_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "</s>"])
    tok.train_from_iterator(DOCS.values(), trainer)
    tok.save(str(path))
    return tok


def test_prepare_hf_tokenizer(src, tmp_path):
    tok = make_tokenizer(tmp_path / "tok.json")
    (src / "binary.dat").write_bytes(b"\x00\x01\x02 bin")
    (src / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    meta = prepare(src, tmp_path / "ds", tokenizer=tmp_path / "tok.json", val_fraction=0.2)
    eos = tok.token_to_id("</s>")
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["eos_id"] == eos
    assert meta["train_files"] + meta["val_files"] == len(DOCS)  # binary and latin-1 skipped
    ds = TokenDataset(tmp_path / "ds")
    assert ds.meta["tokenizer"] == "tokenizer.json" and (tmp_path / "ds/tokenizer.json").exists()
    ids = np.concatenate([ds.train, ds.val])
    expected = sum(len(tok.encode(t).ids) + 1 for t in DOCS.values())
    assert len(ids) == expected and (ids == eos).sum() == len(DOCS)
    assert ds.encode("hello world") == tok.encode("hello world").ids
    assert ds.decode(ds.encode("hello world")) == "hello world"


def test_prepare_refuses_big_vocab(src, tmp_path):
    from tokenizers import Tokenizer, models
    vocab = {f"w{i}": i for i in range(70000)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "big.json"))
    with pytest.raises(ValueError, match="70000"):
        prepare(src, tmp_path / "ds", tokenizer=tmp_path / "big.json")
    assert not (tmp_path / "ds").exists()


def test_default_dataset_prepared_once(tmp_path, monkeypatch):
    calls = []
    real = data.prepare
    monkeypatch.setattr(data, "prepare", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setenv("MPIRT_CACHE", str(tmp_path / "cache"))
    results = []
    threads = [threading.Thread(target=lambda: results.append(data.prepare_default()))
               for _ in range(2)]  # flock excludes separate open()s, even in one process
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1
    out = results[0]
    assert out.parent == tmp_path / "cache" and out.name.startswith("stdlib-py")
    stamp = [(out / n).stat().st_mtime_ns for n in ("meta.json", "train.bin", "val.bin")]
    assert default_dataset_dir() == out and len(calls) == 1
    assert stamp == [(out / n).stat().st_mtime_ns for n in ("meta.json", "train.bin", "val.bin")]
    ds = TokenDataset(out)
    assert ds.vocab_size == 256 and len(ds.train) > 1_000_000 and len(ds.val) > 10_000
    assert "def " in ds.decode(ds.train[:5000])


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-m", "mpirt.data", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=60)


def test_cli(src, tmp_path):
    r = run_cli("prepare", src, tmp_path / "ds", "--val-fraction", "0.2")
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "ds/meta.json").read_text())
    assert f"train {meta['train_tokens']} tokens" in r.stdout and "vocab 256" in r.stdout
    r = run_cli("prepare", tmp_path / "nope", tmp_path / "ds2")
    assert r.returncode == 2 and "nope" in r.stderr and not (tmp_path / "ds2").exists()
    r = run_cli("prepare", src, tmp_path / "ds3", "--tokenizer", tmp_path / "missing.json")
    assert r.returncode == 2 and r.stderr.strip() == f"error: tokenizer file not found: {tmp_path / 'missing.json'}"
    assert not (tmp_path / "ds3").exists()


def test_first_run_prepares_the_corpus_outside_its_memory(tmp_path):
    """A fresh machine's first `python -m mpirt.train` prepares the built-in corpus in a child
    process: the run's measured peak is its training's (within 10% of the prediction, under a
    budget that fits it), not the preparation's (584 MiB against 94 predicted when it ran in the
    training process)."""
    from conftest import run_module
    from mpirt.cpu.sysinfo import cache_dir

    cache = tmp_path / "cache"   # a fresh data directory that shares the built kernels and GEMM choice
    cache.mkdir()
    for entry in cache_dir().glob("*"):
        if not entry.name.startswith("stdlib-"):
            (cache / entry.name).symlink_to(entry)
    run = run_module("mpirt.train", "--steps", 2, "--batch-size", 4, "--seq-len", 64, "--eval-batches", 1,
                     "--progress", "false", "--memory-budget", "150MiB", "--out-dir", tmp_path / "out",
                     env={"MPIRT_CACHE": str(cache)}, timeout=180)
    assert "preparing the built-in corpus" in run.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["peak_memory_bytes"] <= 1.1 * summary["predicted_peak_bytes"], summary
    assert summary["exit_code"] == 0
    r = run_cli("default", "--cache-dir", cache)  # the CLI finds what the run prepared
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == default_dataset_dir(cache) and (Path(r.stdout.strip()) / "meta.json").is_file()
