"""Building a big model never holds it whole: lazy parameters, seeded slices generated chunk by
chunk, and the memory (tracemalloc: NumPy reports its allocations to it) of building a model, a
tensor-parallel model, a pipeline stage, loading a sharded checkpoint and initialising from a
Hugging Face directory, each against this rank's own slices plus the largest full parameter."""
import contextlib
import os
import shutil
import tempfile
import zlib

import numpy as np
import pytest

import mpirt.core.nn as nn
from mpirt.core.nn import NotMaterializedError, Parameter, ShardSpec
from mpirt.parallel.tensor.axis import PaddedParameter

SPECS = [((12, 6), None), ((12, 6), ShardSpec(("tp", None))), ((12, 6), ShardSpec((None, "tp"))),
         ((4, 12), ShardSpec((None, "tp"), blocks=(1, 3))), ((12, 5), ShardSpec(("tp", None), blocks=(3, 1))),
         ((10,), ShardSpec(("tp",))), ((5,), None), ((3, 4, 6), ShardSpec((None, None, "tp")))]


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 19])
def test_init_slice_is_the_full_init_sliced_bit_for_bit(monkeypatch, dtype, chunk):
    """Generated in chunks (cut inside rows, at rows, or whole), every rank's slice of every spec
    is ``spec.shard(full_init)`` rounded to the dtype, for every init kind and the padded table."""
    monkeypatch.setattr(nn, "INIT_CHUNK", chunk)
    params = [Parameter(shape, init=init, std=0.3, spec=spec, dtype=dtype)
              for shape, spec in SPECS for init in ("normal", "ones", "zeros")]
    params += [PaddedParameter((12, 4), (11, 4), init=init, spec=ShardSpec(("tp", None)), dtype=dtype)
               for init in ("normal", "ones")]
    for i, p in enumerate(params):
        p.name = f"layer.{i}.weight"
        for tp in (1, 2, 3, 4):
            try:
                p.spec.local_shape(p.global_shape, {"tp": tp})
            except ValueError:
                continue  # this tp does not divide the shape
            for r in range(tp):
                want = np.asarray(p.spec.shard(p.full_init(7), {"tp": tp}, {"tp": r}), dtype=dtype)
                got = p.init_slice(7, {"tp": tp}, {"tp": r})
                assert got.dtype == np.dtype(dtype) and got.shape == want.shape
                assert got.tobytes() == want.tobytes(), (p, tp, r)
                flat = np.full(got.size + 3, 9.0)  # into a view of a flat store (float64: unrounded)
                p.init_slice(7, {"tp": tp}, {"tp": r}, out=flat[1:-2].reshape(got.shape))
                exact = np.asarray(p.spec.shard(p.full_init(7), {"tp": tp}, {"tp": r})).reshape(-1)
                assert np.array_equal(flat[1:-2], exact) and flat[0] == flat[-1] == 9


def test_full_init_numbers_unchanged():
    """The seeded numbers themselves (what every checkpoint and parity test builds on)."""
    p = Parameter((3, 2), std=0.02)
    p.name = "h.0.mlp.c_fc.weight"
    rng = np.random.default_rng([5, zlib.crc32(p.name.encode())])
    assert p.full_init(5).tobytes() == (rng.standard_normal((3, 2)) * 0.02).tobytes()


def test_a_lazy_parameter_says_so_and_knows_its_shape():
    from mpirt.models import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, n_positions=8, vocab_size=11), dtype="float64")
    p = model.h[0].attn.c_attn.weight
    assert not p.materialized and p.shape == (8, 24) and p.dtype == np.float64 and p.size == 192
    with pytest.raises(NotMaterializedError, match=r"h\.0\.attn\.c_attn\.weight \(8, 24\) float64 has no value yet"):
        p.data
    with pytest.raises(NotMaterializedError, match="wte.weight"):
        model(np.zeros((1, 4), np.int64))
    with pytest.raises(NotMaterializedError):
        model.state_dict()
    model.load_state_dict({n: np.ones(q.shape) for n, q in model.named_parameters()})  # loading materialises
    assert p.materialized and (p.data == 1).all()
    model.initialize(3)
    assert np.array_equal(p.data, p.full_init(3))


# --- memory ----------------------------------------------------------------------------------------
# The models are small but their arrays dominate what tracemalloc sees (own slices of 0.5-4 MB,
# Python objects of the module tree ~25 KB measured): the largest full parameter (c_fc, or the
# vocabulary table: 512 x 128 float64 = 512 KiB) is a quarter of the model, so building the whole
# model before slicing it (tp, a pipeline stage), or holding two full parameters at once, fails the
# bounds below. (GPT-2 124M, float32, measured once: the build's peak beyond its weights went from
# 442 MiB to 9 MiB at tp 1 and from 1061 MiB to 9 MiB per rank at tp 2.)
CFG = dict(n_layer=2, n_head=4, n_embd=128, n_positions=64, vocab_size=511)  # 511: padded to 512 under tp 2
# the module tree's Python objects (~25 KB), index arrays of a chunk (8 B per row of the largest
# table), meta.json / header parsing, pickled small objects of the collectives
SLACK = 128 << 10


def gpt_cfg(**kw):
    from mpirt.models import GPTConfig
    return GPTConfig(**{**CFG, **kw})


def traced(fn):
    """``(result, peak bytes above the start, bytes still held at the end)`` of ``fn()``."""
    import gc
    import tracemalloc
    gc.collect()
    tracemalloc.start()
    try:
        result = fn()
        now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak, now


def largest_full(params) -> int:
    """Bytes of the largest full parameter as its seeded float64 tensor (unpadded)."""
    return max(int(np.prod(getattr(p, "logical_shape", p.global_shape))) * 8 for p in params)


def own_bytes(params) -> int:
    """This rank's parameter arrays and any gradient buffers they hold."""
    return sum(p.data.nbytes + (p.grad.nbytes if p.grad is not None else 0) for p in params)


def check_build(params, peak: int, held: int) -> tuple[bool, str]:
    own, largest = own_bytes(params), largest_full(params)
    detail = f"own {own} B, largest full {largest} B, peak {peak} B, held after {held} B"
    print(detail)
    return peak <= own + largest + SLACK and held <= own + SLACK, detail


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_building_a_seeded_model_holds_its_weights_plus_one_parameter(dtype):
    from mpirt.core.modeling import build_model
    build_model(gpt_cfg(), dtype=dtype, seed=1)  # imports and caches outside the measurement
    model, peak, held = traced(lambda: build_model(gpt_cfg(), dtype=dtype, seed=1))
    ok, detail = check_build(model.parameters(), peak, held)
    assert ok, detail


def test_with_small_chunks_the_build_never_holds_a_full_parameter(monkeypatch):
    """INIT_CHUNK caps what initialisation generates at a time: with 4096 draws (32 KiB) the
    peak stays within the model plus a few chunks, well under one full parameter (512 KiB)."""
    from mpirt.core.modeling import build_model
    monkeypatch.setattr(nn, "INIT_CHUNK", 4096)
    model, peak, _ = traced(lambda: build_model(gpt_cfg(), dtype="float64", seed=1))
    own = own_bytes(model.parameters())
    assert peak <= own + 4 * 4096 * 8 + SLACK, (peak, own)
    monkeypatch.setattr(nn, "INIT_CHUNK", 1 << 19)
    whole = build_model(gpt_cfg(), dtype="float64", seed=1)  # one chunk per parameter: the same numbers
    assert all(np.array_equal(p.data, q.data) for p, q in zip(model.parameters(), whole.parameters()))


def test_the_lazy_build_allocates_no_parameter():
    from mpirt.core.modeling import build_model
    model, peak, held = traced(lambda: build_model(gpt_cfg(), dtype="float64"))
    assert not any(p.materialized for p in model.parameters())
    assert peak <= SLACK, peak


# --- multi-rank: tp and pipeline builds, sharded and Hugging Face loads ---------------------------
def _tp_model(comm, dtype="float64", seed=1):
    from mpirt.core.modeling import build_model
    from mpirt.parallel import tensor as TP
    return TP.parallelize(build_model(gpt_cfg(), dtype=dtype), comm, seed=seed)


@pytest.mark.mpi
def test_tp2_build_holds_its_slices_plus_one_parameter(group):
    from conftest import agree
    comm = group(2, "tp")
    ok, detail = True, ""
    if comm is not None:
        _tp_model(comm)  # warm
        model, peak, held = traced(lambda: _tp_model(comm))
        ok, detail = check_build(model.parameters(), peak, held)
        ok = ok and _same_as_single_rank(model.named_parameters(), comm.rank, 2)
    agree(ok, detail)


@pytest.mark.mpi
@pytest.mark.parametrize("pp, tp", [(2, 1), (2, 2)])
def test_pipeline_stage_build_holds_its_layers_plus_one_parameter(group, pp, tp):
    from conftest import agree
    from mpi4py import MPI

    from mpirt.parallel.grid import Grid
    from mpirt.parallel.pipeline.stage import PipelineStage
    if MPI.COMM_WORLD.size < pp * tp:
        pytest.skip(f"needs {pp * tp} ranks")
    comm = group(pp * tp)
    ok, detail = True, ""
    if comm is not None:
        grid = Grid(dp=1, pp=pp, tp=tp, comm=comm)
        make = lambda: PipelineStage.standalone(gpt_cfg(), grid, microbatches=2, dtype="float64", seed=1)  # noqa: E731
        make()  # warm
        stage, peak, held = traced(make)
        ok, detail = check_build(stage.parameters(), peak, held)
        ok = ok and _same_as_single_rank(stage.named_parameters(), grid.coords["tp"], tp)
        grid.free()
    agree(ok, detail)


@pytest.mark.mpi
@pytest.mark.parametrize("zero, tp", [(3, 1), (3, 2), (1, 2), (0, 1)])
def test_engine_build_holds_its_shard_plus_one_parameter(group, zero, tp, monkeypatch):
    """The engine builds the model lazily and generates each parameter's slice straight into the
    parameter store (ZeRO-1/2, DataParallel) or, at ZeRO-3, one parameter at a time of which the
    rank keeps its chunk: the peak is what the rank holds (parameters, gradients, AdamW state)
    plus one full parameter (and one chunk of draws, made small here), and the values are the
    single-rank model's."""
    from dataclasses import replace

    from conftest import agree
    from mpi4py import MPI

    from mpirt.run.config import TrainConfig
    from mpirt.parallel.grid import Grid
    from mpirt.parallel.engine import Engine, Hyper
    from mpirt.parallel.layout import Layout
    if MPI.COMM_WORLD.size < 2 * tp:
        pytest.skip(f"needs {2 * tp} ranks")
    comm = group(2 * tp)
    ok, detail = True, ""
    if comm is not None:
        monkeypatch.setattr(nn, "INIT_CHUNK", 4096)
        grid = Grid(dp=2, pp=1, tp=tp, comm=comm)
        cfg = replace(TrainConfig(), dp=2, tp=tp, zero=zero, dtype="float64", seed=1)
        layout, model_cfg = Layout.of(cfg, grid.sizes, gpt_cfg()), gpt_cfg()
        make = lambda: Engine(layout, model_cfg, grid, Hyper.of(cfg), dropout_seed=0)  # noqa: E731
        make().close()  # warm: imports, communicators
        engine, peak, held = traced(make)
        opt = engine.optimizer
        own = sum(engine.groups[0].sync.memory_bytes().values())  # params, grads, optimizer state
        largest = largest_full(engine.model.parameters())
        detail = f"zero {zero} tp {tp}: own {own} B, largest full {largest} B, peak {peak} B, held {held} B"
        print(detail)
        slack = SLACK * (2 if zero == 3 else 1)  # ZeRO-3: its unit plan, groups and the chunk's index arrays
        ok = peak <= own + largest + slack and held <= own + slack
        with opt.full_parameters() if zero == 3 else contextlib.nullcontext():
            ok = ok and _same_as_single_rank(engine.model.named_parameters(), grid.coords["tp"], tp)
        engine.close()
        grid.free()
    agree(ok, detail)


def _save(comm, model, root):
    """A sharded checkpoint of ``model`` (tp over ``comm`` when it is split) with AdamW state."""
    from mpirt.checkpoint.sharded import save_sharded
    from mpirt.core.optim import AdamW
    from mpirt.parallel.shards import save_shards, tp_axes
    opt = AdamW(model.parameters(), lr=1e-3)
    tp = comm if getattr(model, "tp_info", None) else None
    return save_sharded(root, comm, lambda w: save_shards(w, model, opt, tp_axes(tp), replica=lambda p: tp is not None or comm.rank == 0),
                        step=1, config={}, extra=None, optimizer={"type": "AdamW", "scalars": opt.scalars()})


@pytest.mark.mpi
@pytest.mark.parametrize("written, loaded", [("tp2", "tp1"), ("tp1", "tp2"), ("tp2", "tp2")])
def test_loading_a_sharded_checkpoint_holds_no_box_twice(group, written, loaded):
    """Each box goes straight from the file's pages into the parameter or the optimizer state:
    loading allocates nothing that scales with a tensor (the bound is the slack alone)."""
    from conftest import agree

    from mpirt.checkpoint.store import CheckpointReader
    from mpirt.core.modeling import build_model
    from mpirt.core.optim import AdamW
    from mpirt.parallel.shards import load_shards, tp_axes
    comm = group(2, "tp")
    ok, detail = True, ""
    if comm is not None:
        root = comm.broadcast_object(tempfile.mkdtemp(prefix="build-ckpt-") if comm.rank == 0 else None)
        src = _tp_model(comm, seed=4) if written == "tp2" else build_model(gpt_cfg(), dtype="float64", seed=4)
        path = _save(comm, src, root)
        model = _tp_model(comm, seed=9) if loaded == "tp2" else build_model(gpt_cfg(), dtype="float64", seed=9)
        opt = AdamW(model.parameters(), lr=1e-3)
        tp = comm if loaded == "tp2" else None
        reader, first, _ = traced(lambda: _load(CheckpointReader(path), model, opt, tp))
        same = _same_as_single_rank(model.named_parameters(), comm.rank if tp else 0, 2 if tp else 1, seed=4)
        _, again, held = traced(lambda: load_shards(reader, model, opt, tp_axes(tp)))  # headers parsed: the boxes alone
        box = max(int(np.prod(p.shape)) * 8 for p in model.parameters())
        detail = (f"rank {comm.rank}: load peak {first} B (with the reader: meta.json, checksums), {again - held} B "
                  f"beyond what stays on a second load; largest box {box} B, same weights {same}")
        print(detail)
        ok = same and first <= META_SLACK and again - held <= BOX_SLACK
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(root)
    agree(ok, detail)


# loading: meta.json parsed into Python objects (~150 KB for these ~120 tensor entries), the 64 KiB
# buffer that checks each file's sha256, the files' headers; and per box a few small objects
META_SLACK, BOX_SLACK = 320 << 10, 32 << 10


def _load(reader, model, opt, tp):
    from mpirt.parallel.shards import load_shards, tp_axes
    load_shards(reader, model, opt, tp_axes(tp))
    return reader


def _same_as_single_rank(named, tp_rank: int, tp: int, seed: int = 1) -> bool:
    """Whether every parameter is, bit for bit, its slice of the single-rank model built with
    ``seed`` (the vocabulary table padded with zero rows)."""
    from mpirt.core.modeling import build_model
    ref = dict(build_model(gpt_cfg(), dtype="float64", seed=seed).named_parameters())
    for name, p in named:
        full = ref[name].data
        if full.shape != p.global_shape:
            full = np.concatenate([full, np.zeros((p.global_shape[0] - full.shape[0],) + full.shape[1:])])
        if not np.array_equal(p.data, p.spec.shard(full, {"tp": tp}, {"tp": tp_rank})):
            print(f"{name} differs from the single-rank model's slice")
            return False
    return True


# --- initialising from a Hugging Face directory ---------------------------------------------------
def hf_dir(path, seed: int = 11, **kw):
    """A GPT-2 Hugging Face directory (float32 safetensors, ``transformer.`` names, tied head not
    stored) written from a seeded single-rank mpirt model with spread-out weights."""
    from mpirt.core.modeling import build_model
    from mpirt.models.hf import save_hf_gpt2
    model = build_model(gpt_cfg(**kw), dtype="float64", seed=seed)
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        gain = 1.0 if "ln_" in name and name.endswith("weight") else 0.0
        p.data = p.data + rng.standard_normal(p.shape) * 0.1 + gain
    return save_hf_gpt2(model, model.config, path)


BATCH = np.random.default_rng(2).integers(0, 511, (4, 16))


def _hf_reference(directory):
    """The single-rank model loaded whole (float64) and its loss on BATCH."""
    from mpirt.core.modeling import build_model
    from mpirt.models.hf import load_hf_gpt2
    cfg, full = load_hf_gpt2(directory, dtype="float64")
    model = build_model(cfg, dtype="float64")
    model.load_state_dict(full)
    x, y = BATCH[:, :-1], BATCH[:, 1:]
    return full, model(x, y)[1].item()


def test_hf_init_at_tp1_reads_into_place_and_matches_the_full_load(tmp_path):
    from mpirt.core.modeling import build_model, open_hf
    from mpirt.core.optim import AdamW
    from mpirt.parallel.shards import load_shards
    d = hf_dir(tmp_path / "hf")
    full, ref_loss = _hf_reference(d)
    cfg, reader = open_hf(d, dtype="float64")
    model = build_model(cfg, dtype="float64", seed=0)
    opt = AdamW(model.parameters(), lr=1e-3)
    _, first, _ = traced(lambda: load_shards(reader, model, opt, with_optimizer=False))
    _, again, held = traced(lambda: load_shards(reader, model, opt, with_optimizer=False))
    print(f"HF load at tp1: peak {first} B with the headers, {again - held} B on a second load")
    assert first <= META_SLACK and again - held <= BOX_SLACK
    assert all(np.array_equal(p.data, full[n]) for n, p in model.named_parameters())
    assert model(BATCH[:, :-1], BATCH[:, 1:])[1].item() == ref_loss


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_reader_gives_the_state_the_full_tensor_path_gave(tmp_path, dtype):
    """Same parameters and float32 masters as loading load_hf_gpt2's full tensors (converted to the
    model dtype) into the masters: under bfloat16 the masters hold the rounded values."""
    from mpirt.core.modeling import build_model, load_hf, open_hf
    from mpirt.core.optim import AdamW
    from mpirt.parallel.shards import load_shards
    d = hf_dir(tmp_path / "hf")
    runs = []
    for way in ("reader", "full"):
        cfg, reader = open_hf(d, dtype=dtype)
        model = build_model(cfg, dtype=dtype, seed=0)
        opt = AdamW(model.parameters(), lr=1e-3)
        if way == "reader":
            load_shards(reader, model, opt, with_optimizer=False)
        else:
            with opt.full_parameters():
                model.load_state_dict(load_hf(d, dtype=dtype)[1])
        with opt.full_parameters():
            masters = {n: np.array(p.data) for n, p in model.named_parameters()}
        runs.append(({n: np.array(p.data) for n, p in model.named_parameters()}, masters))
    for a, b in zip(*runs):
        assert a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and a[n].tobytes() == b[n].tobytes() for n in a)


def test_a_model_without_open_hf_is_served_from_its_full_tensors(tmp_path, monkeypatch):
    from mpirt.core import modeling
    from mpirt.models import GPT
    d = hf_dir(tmp_path / "hf")
    monkeypatch.delattr(GPT, "open_hf")
    cfg, reader = modeling.open_hf(d, dtype="float64")
    assert isinstance(reader, modeling.FullWeightsReader)
    _, full = modeling.load_hf(d, dtype="float64")
    w = full["h.0.attn.c_attn.weight"]
    assert np.array_equal(reader.read("params", "h.0.attn.c_attn.weight", (3, 10), (5, 7)), w[3:8, 10:17])
    out = np.empty((5, 7), np.float32)
    reader.read("params", "h.0.attn.c_attn.weight", (3, 10), (5, 7), out=out)
    assert np.array_equal(out, w[3:8, 10:17].astype(np.float32))
    with pytest.raises(ValueError, match="has shape"):
        reader.entry("params", "wte.weight", (3, 3))


def test_hf_reader_boxes_bf16_and_stored_head(tmp_path):
    """Boxes of any tensor equal the full load's; a BF16 file reads as float32 exactly; a stored
    head equal to the table is accepted, a different one refused at opening (headers and a
    row-wise comparison, before any rank reads its weights)."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from mpirt.models.hf import HFReader, load_hf_gpt2
    d = hf_dir(tmp_path / "hf")
    _, full = load_hf_gpt2(d)
    reader = HFReader(d)
    for name, start, shape in [("wte.weight", (100, 3), (50, 60)), ("h.1.mlp.c_proj.bias", (7,), (9,))]:
        assert np.array_equal(reader.read("params", name, start, shape),
                              full[name][tuple(slice(s, s + n) for s, n in zip(start, shape))])
    raw = load_file(str(d / "model.safetensors"))
    bf = {k: v.astype(ml_dtypes.bfloat16) for k, v in raw.items()}
    save_file(bf, str(d / "model.safetensors"))
    w = HFReader(d, "float32").read("params", "h.0.attn.c_attn.weight", (0, 32), (128, 64))
    want = bf["transformer.h.0.attn.c_attn.weight"][:, 32:96].astype(np.float32)
    assert w.dtype == np.float32 and np.array_equal(w, want)
    save_file({**raw, "lm_head.weight": raw["transformer.wte.weight"].copy()}, str(d / "model.safetensors"))
    HFReader(d)
    bad = raw["transformer.wte.weight"].copy()
    bad[-1, -1] += 1
    save_file({**raw, "lm_head.weight": bad}, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="untied lm_head not supported"):
        HFReader(d)


@pytest.mark.mpi
@pytest.mark.parametrize("pp, tp", [(1, 2), (2, 1), (2, 2)])
def test_hf_init_reads_only_this_ranks_boxes_and_gives_the_single_rank_loss(group, pp, tp):
    """Each rank of a tp and/or pipeline layout loads its boxes straight from the HF files (no
    full tensor, no box held twice), ends up with its slices of the HF weights (the padded
    vocabulary rows zero), and the layout's loss equals the single-rank model's."""
    from conftest import agree
    from mpi4py import MPI

    from mpirt.parallel.grid import Grid
    from mpirt.core.modeling import open_hf
    from mpirt.core.optim import AdamW
    from mpirt.parallel.pipeline.stage import PipelineStage
    from mpirt.parallel.shards import load_shards, tp_axes
    if MPI.COMM_WORLD.size < pp * tp:
        pytest.skip(f"needs {pp * tp} ranks")
    comm = group(pp * tp)
    ok, detail = True, ""
    if comm is not None:
        tmp = tempfile.TemporaryDirectory(prefix=f"build-hf-{MPI.COMM_WORLD.rank}-")
        d = hf_dir(os.path.join(tmp.name, "hf"))  # every rank its own copy: same bytes
        full, ref_loss = _hf_reference(d)
        grid = Grid(dp=1, pp=pp, tp=tp, comm=comm)
        tp_comm = grid.comm["tp"] if tp > 1 else None
        cfg, reader = open_hf(d, dtype="float64")
        if pp > 1:
            stage = PipelineStage.standalone(cfg, grid, microbatches=2, dtype="float64", seed=0)
            model, params = stage.model, stage.parameters()
        else:
            model = _tp_model(tp_comm, seed=0)
            params = model.parameters()
        opt = AdamW(params, lr=1e-3)
        _, first, _ = traced(lambda: load_shards(reader, model, opt, tp_axes(tp_comm), with_optimizer=False))
        _, again, held = traced(lambda: load_shards(reader, model, opt, tp_axes(tp_comm), with_optimizer=False))
        same = True
        for name, p in model.named_parameters():
            want = full[name]
            if want.shape != p.global_shape:
                want = np.concatenate([want, np.zeros((p.global_shape[0] - want.shape[0],) + want.shape[1:])])
            same = same and np.array_equal(p.data, p.spec.shard(want, {"tp": tp}, {"tp": grid.coords["tp"]}))
        x, y = BATCH[:, :-1], BATCH[:, 1:]
        loss = stage.evaluate(x, y) if pp > 1 else model(x, y)[1].item()
        err = abs(loss - ref_loss) / abs(ref_loss)
        detail = (f"rank {comm.rank}: HF load peak {first} B with the headers, {again - held} B on a second load; "
                  f"slices equal {same}; loss {loss} vs single-rank {ref_loss} (rel {err:.1e})")
        print(detail)
        ok = same and err <= 1e-12 and first <= META_SLACK and again - held <= BOX_SLACK
        grid.free()
        tmp.cleanup()
    agree(ok, detail)


# --- end to end: python -m mpirt.train --init-from HF_DIR on several layouts -----------------------
HF_MODEL = dict(n_layer=2, n_head=4, n_embd=32, n_positions=32, vocab_size=257)  # 257: padded under tp 2
EVAL = ["--seq-len=16", "--batch-size=4", "--eval-batches=2", "--progress=false", "--dtype=float64", "--eval-only"]


@pytest.mark.parametrize("ranks, layout", [(0, []), (2, ["--tp=2"]), (2, ["--pp=2"]), (2, ["--dp=2", "--zero=1"])],
                         ids=["1rank", "tp2", "pp2", "zero1"])
def test_train_init_from_hf_gives_the_hf_models_loss_on_every_layout(tiny_data, tmp_path, ranks, layout):
    """The evaluation loss of a run initialised from a HF directory is the HF model's (loaded
    whole, evaluated here) on one rank and on tp, pipeline and ZeRO layouts (float64)."""
    import json

    from conftest import run_module
    from mpirt.data.tokens import TokenDataset, get_eval_batch
    from mpirt.core.modeling import build_model
    from mpirt.models import GPTConfig
    from mpirt.models.hf import load_hf_gpt2
    d = hf_dir(tmp_path / "hf", **HF_MODEL)
    model = build_model(GPTConfig(**HF_MODEL), dtype="float64")
    model.load_state_dict(load_hf_gpt2(d, dtype="float64")[1])
    model.eval()
    val = TokenDataset(tiny_data).val
    want = np.mean([model(*get_eval_batch(val, i, batch_size=4, seq_len=16))[1].item() for i in range(2)])
    out = tmp_path / "run"
    run_module("mpirt.train", *EVAL, f"--data={tiny_data}", f"--init-from={d}", f"--out-dir={out}", *layout,
               ranks=ranks)
    got = json.loads((out / "eval.json").read_text())["val_loss"]
    assert abs(got - want) <= 1e-10 * abs(want), (got, want)
