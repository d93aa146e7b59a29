"""Tensor and sequence parallelism (mpirt.parallel.tensor) against the unsharded computation.

Multi-rank tests split MPI_COMM_WORLD into groups of the tp (x dp) size they need, so they are
valid at any world size that the group size divides (2, 4, 8). Every rank computes the unsharded
reference itself from the same full weights and data (no communication), runs the sharded version
in its group, and compares its own slices; the verdict is reduced over all ranks (:func:`conftest.agree`)
so a failure on one rank fails every rank instead of hanging them.
"""
import os
import tempfile
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
from mpi4py import MPI

from mpirt import comm as C
from mpirt.core import ops
from mpirt.data.tokens import get_batch
from mpirt.parallel.grid import Grid
from mpirt.core.nn import kept_bytes
from mpirt.core.modeling import activation_bytes
from mpirt.core.nn import ShardSpec
from mpirt.core.optim import AdamW
from mpirt.parallel.layout import Layout
from mpirt.parallel import tensor as TP
from mpirt.parallel.ddp import DataParallel
from mpirt.parallel.flat import FlatParams, count_once
from mpirt.core.tensor import Tensor
from mpirt.models import GPT, GPTConfig, Llama, LlamaConfig

from conftest import agree
import parity
from parity import SEQ, STEPS, TOKENS, WD, max_rel_err, reference_run, rel_err, within

CFG = replace(parity.CFG, n_head=4)  # vocabulary 37: padded at tp 2, 4
BATCH, LR, CLIP = 8, 3e-3, 0.5
LAYER_TOL = 1e-12  # float64 single layers
rel = partial(rel_err, norm=2)  # ||a - b|| / ||b|| (L2)
batch = partial(parity.batch, rows=BATCH, ignore=2)  # ignored targets take part


# --- helpers -----------------------------------------------------------------------------------
def shard(full, spec, comm):
    return spec.shard(np.asarray(full), {"tp": comm.size}, {"tp": comm.rank})


def seq_chunk(a, comm, dim=1):
    m = a.shape[dim] // comm.size
    idx = (slice(None),) * dim + (slice(comm.rank * m, (comm.rank + 1) * m),)
    return np.ascontiguousarray(a[idx])


LAST = lambda ndim: ShardSpec((None,) * (ndim - 1) + ("tp",))  # noqa: E731


# --- pure tests (no MPI) ---------------------------------------------------------------------------
class FakeComm:
    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank


def test_shardspec_blocks_hold_whole_qkv_heads():
    full = np.arange(4 * 12).reshape(4, 12)                  # C=4, 3C=12: q 0:4, k 4:8, v 8:12
    spec = ShardSpec((None, "tp"), blocks=(1, 3))
    r1 = spec.shard(full, {"tp": 2}, {"tp": 1})
    assert r1[0].tolist() == [2, 3, 6, 7, 10, 11]            # second half of each of q, k and v
    assert spec.local_shape((4, 12), {"tp": 2}) == (4, 6)
    back = np.zeros_like(full)
    for r in range(2):
        spec.place(back, spec.shard(full, {"tp": 2}, {"tp": r}), {"tp": 2}, {"tp": r})
    assert (back == full).all()
    with pytest.raises(ValueError, match="use local_index"):
        spec.local_slices((4, 12), {"tp": 2}, {"tp": 0})
    with pytest.raises(ValueError, match="3 blocks each split over tp=3"):
        spec.local_shape((4, 12), {"tp": 3})
    with pytest.raises(ValueError, match="not split over any axis"):
        ShardSpec((None,), blocks=(3,))


def test_shardspec_weighted_blocks_hold_whole_grouped_query_heads():
    """Grouped-query attention's c_attn: 4 query heads, 2 key and 2 value heads of size 1 (C=4,
    Ck=2): at tp=2 each rank holds 2 query heads, 1 key and 1 value head."""
    full = np.arange(3 * 8).reshape(3, 8)                    # q 0:4, k 4:6, v 6:8
    spec = ShardSpec((None, "tp"), blocks=(1, (2, 1, 1)))
    assert spec.blocks == (1, (2, 1, 1)) and ShardSpec((None, "tp"), blocks=(1, (2, 2, 2))).blocks == (1, 3)
    assert spec.shard(full, {"tp": 2}, {"tp": 0})[0].tolist() == [0, 1, 4, 6]
    assert spec.shard(full, {"tp": 2}, {"tp": 1})[0].tolist() == [2, 3, 5, 7]
    back = np.zeros_like(full)
    for r in range(2):
        spec.place(back, spec.shard(full, {"tp": 2}, {"tp": r}), {"tp": 2}, {"tp": r})
    assert (back == full).all()
    with pytest.raises(ValueError, match=r"3 \(2:1:1\) blocks each split over tp=4"):
        spec.local_shape((3, 8), {"tp": 4})
    with pytest.raises(ValueError, match="positive integer or a tuple"):
        ShardSpec((None, "tp"), blocks=(1, (2, 0)))


def test_layout_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"tp=3 must divide n_head=4, n_embd=16, MLP hidden size=64"):
        TP.check_tp_layout(3, n_head=4, n_embd=16, hidden=64, vocab_size=37)
    with pytest.raises(ValueError, match=r"tp=4 must divide n_head=6"):
        TP.check_tp_layout(4, n_head=6, n_embd=48, hidden=192)
    with pytest.raises(ValueError, match=r"seq_len=6 \(sequence parallelism\)"):
        TP.check_tp_layout(4, n_head=4, n_embd=16, hidden=64, seq_len=6, sequence_parallel=True)
    TP.check_tp_layout(4, n_head=4, n_embd=16, hidden=64, vocab_size=37)  # vocabulary gets padded
    assert TP.pad_vocab(37, 4) == 40 and TP.pad_vocab(40, 4) == 40 and TP.pad_vocab(50257, 8) == 50264
    # parallelize checks before it communicates or changes anything (a comm stub is enough)
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=16, n_inner=40, vocab_size=37), seed=0)
    with pytest.raises(ValueError, match=r"tp=3 must divide n_head=4, n_embd=16, MLP hidden size=40"):
        TP.parallelize(model, FakeComm(3))
    assert model.wte.weight.shape == (37, 16)


def kept_per_rank(cfg, *, batch, seq_len, tp=1, sequence_parallel=False) -> int:
    """The model's activation formula for one forward with loss: embed, blocks, head."""
    a = activation_bytes(cfg, Layout.micro_batch(batch, seq_len, tp=tp, sequence_parallel=sequence_parallel))
    return a["embed"] + cfg.n_layer * a["block"] + a["head"]


def test_activation_formula_is_exact_on_one_rank():
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, n_positions=16, vocab_size=37)
    x, y = get_batch(TOKENS, 0, batch_size=4, seq_len=16, seed=0)
    _, loss = GPT(cfg, seed=1)(x, y)
    assert kept_bytes(loss) == kept_per_rank(cfg, batch=4, seq_len=16) + loss.data.nbytes


# --- single layers -------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tp", [2, 4])
def test_communication_functions(tp, group):
    """f, g and the sequence gather / reduce-scatter / scatter: forward values, and backward as the
    adjoint of forward (sum over ranks of <F(x), dy> equals sum over ranks of <x, F^T(dy)>)."""
    if MPI.COMM_WORLD.size < tp:
        pytest.skip(f"needs {tp} ranks")
    comm = group(tp, "tp")
    ok, detail = True, ""
    if comm is not None:
        rng = np.random.default_rng(10 + comm.rank)              # different data on every rank
        total = lambda v: comm.allreduce_scalar(float(v))        # noqa: E731
        errs = {}
        for name, fn, shape in [("f", TP.copy_to_tp, (2, 8, 3)), ("g", TP.reduce_from_tp, (2, 8, 3)),
                                ("gather_seq", TP.gather_seq, (2, 8 // tp, 3)),
                                ("reduce_scatter_seq", TP.reduce_scatter_seq, (2, 8, 3)),
                                ("scatter_seq", TP.scatter_seq, (2, 8, 3))]:
            x = rng.standard_normal(shape)
            if name in ("f", "scatter_seq"):                      # inputs replicated over tp
                x = comm.allreduce(x, "max")
            xt = Tensor(x.copy(), requires_grad=True)
            y = fn(xt, comm)
            dy = rng.standard_normal(y.shape)
            if name == "g":                                       # the output is replicated
                dy = comm.allreduce(dy, "max")
            y.backward(dy)
            full = np.concatenate(comm.mpi.allgather(x), axis=1)  # every rank's x along the sequence
            want = {"f": x, "g": comm.allreduce(x), "gather_seq": full,
                    "reduce_scatter_seq": seq_chunk(comm.allreduce(x), comm), "scatter_seq": seq_chunk(x, comm)}[name]
            # objective sum_r <y_r, dy_r>; a replicated x (f, scatter) is one variable whose
            # gradient every rank holds in full, a replicated y (g) one output counted once
            lhs = float((y.data * dy).sum()) if name == "g" else total((y.data * dy).sum())
            rhs = float((x * xt.grad).sum()) if name in ("f", "scatter_seq") else total((x * xt.grad).sum())
            errs[name] = (rel(y.data, want), abs(lhs - rhs) / abs(rhs))
        ok = max(max(e) for e in errs.values()) <= LAYER_TOL
        detail = str(errs)
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mode", ["plain", "sp", "sp-no-regather", "gather-output"])
def test_column_parallel_linear(tp, mode, group):
    if MPI.COMM_WORLD.size < tp:
        pytest.skip(f"needs {tp} ranks")
    comm = group(tp, "tp")
    ok, detail = True, ""
    if comm is not None:
        rng = np.random.default_rng(1)
        b, t, cin, cout = 2, 8, 6, 12
        x, w, bias, dy = (rng.standard_normal(s) for s in [(b, t, cin), (cin, cout), (cout,), (b, t, cout)])
        for blocks in (1, 3):
            xt = Tensor(x.copy(), requires_grad=True)
            wt, bt = Tensor(w.copy(), requires_grad=True), Tensor(bias.copy(), requires_grad=True)
            y = ops.linear(xt, wt, bt)
            y.backward(dy)
            sp = mode.startswith("sp")
            layer = TP.ColumnParallelLinear(cin, cout, comm, gather_output=mode == "gather-output",
                                            sequence_parallel=sp, blocks=blocks, dtype="float64",
                                            regather=mode != "sp-no-regather")
            layer.load_state_dict(TP.shard_state_dict(layer, {"weight": w, "bias": bias}, {"tp": tp}, {"tp": comm.rank}))
            xin = Tensor(seq_chunk(x, comm) if sp else x.copy(), requires_grad=True)
            yl = layer(xin)
            wspec, bspec = layer.weight.spec, layer.bias.spec
            if mode == "gather-output":
                ref_y, seed_g = y.data, dy
            else:
                ref_y, seed_g = shard(y.data, ShardSpec((None, None, "tp"), (1, 1, blocks)), comm), \
                    shard(dy, ShardSpec((None, None, "tp"), (1, 1, blocks)), comm)
            yl.backward(np.ascontiguousarray(seed_g))
            ref_gx = seq_chunk(xt.grad, comm) if sp else xt.grad
            errs = {"y": rel(yl.data, ref_y), "dx": rel(xin.grad, ref_gx),
                    "dw": rel(layer.weight.grad, shard(wt.grad, wspec, comm)),
                    "db": rel(layer.bias.grad, shard(bt.grad, bspec, comm))}
            if max(errs.values()) > LAYER_TOL:
                ok, detail = False, f"blocks={blocks} {errs}"
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_row_parallel_linear(tp, sp, group):
    if MPI.COMM_WORLD.size < tp:
        pytest.skip(f"needs {tp} ranks")
    comm = group(tp, "tp")
    ok, detail = True, ""
    if comm is not None:
        rng = np.random.default_rng(2)
        b, t, cin, cout = 2, 8, 12, 6
        x, w, bias, dy = (rng.standard_normal(s) for s in [(b, t, cin), (cin, cout), (cout,), (b, t, cout)])
        xt = Tensor(x.copy(), requires_grad=True)
        wt, bt = Tensor(w.copy(), requires_grad=True), Tensor(bias.copy(), requires_grad=True)
        ops.linear(xt, wt, bt).backward(dy)
        layer = TP.RowParallelLinear(cin, cout, comm, sequence_parallel=sp, dtype="float64")
        layer.load_state_dict(TP.shard_state_dict(layer, {"weight": w, "bias": bias}, {"tp": tp}, {"tp": comm.rank}))
        store = FlatParams(list(layer.parameters()))
        xin = Tensor(shard(x, LAST(3), comm).copy(), requires_grad=True)
        yl = layer(xin)
        yl.backward(seq_chunk(dy, comm) if sp else dy)
        store.sync_partial_grads(comm)  # SP: the bias saw 1/tp of the tokens
        ref_y = (x.reshape(-1, cin) @ w + bias).reshape(b, t, cout)
        errs = {"y": rel(yl.data, seq_chunk(ref_y, comm) if sp else ref_y),
                "dx": rel(xin.grad, shard(xt.grad, LAST(3), comm)),
                "dw": rel(layer.weight.grad, shard(wt.grad, layer.weight.spec, comm)),
                "db": rel(layer.bias.grad, bt.grad)}
        ok, detail = max(errs.values()) <= LAYER_TOL, str(errs)
    agree(ok, detail)


def _module_parity(comm, ref, par, x, dy, sp):
    """Run the unsharded module ``ref`` and the parallel ``par`` (loaded with ``ref``'s weights) on
    ``x`` with output gradient ``dy``; relative errors of output, input grad and weight-grad slices."""
    state = {n: p.data.copy() for n, p in ref.named_parameters()}
    par.load_state_dict(TP.shard_state_dict(par, state, {"tp": comm.size}, {"tp": comm.rank}))
    store = FlatParams(list(par.parameters()))
    xt = Tensor(x.copy(), requires_grad=True)
    y = ref(xt)
    y.backward(dy)
    xin = Tensor(seq_chunk(x, comm) if sp else x.copy(), requires_grad=True)
    yl = par(xin)
    yl.backward(seq_chunk(dy, comm) if sp else dy)
    store.sync_partial_grads(comm)
    errs = {"y": rel(yl.data, seq_chunk(y.data, comm) if sp else y.data),
            "dx": rel(xin.grad, seq_chunk(xt.grad, comm) if sp else xt.grad)}
    ref_params = dict(ref.named_parameters())
    full_grads = {n: p.grad for n, p in ref_params.items()}
    mine = TP.shard_state_dict(par, full_grads, {"tp": comm.size}, {"tp": comm.rank})
    for n, p in par.named_parameters():
        errs["d" + n] = rel(p.grad, mine[n])
    return errs


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_parallel_mlp_and_attention(tp, sp, group):
    """GPT's MLP and attention made tensor parallel by the model's own tp_plan (the production
    path): output, input gradient and every weight-gradient slice equal the unsharded modules'."""
    if MPI.COMM_WORLD.size < tp:
        pytest.skip(f"needs {tp} ranks")
    comm = group(tp, "tp")
    ok, detail = True, ""
    if comm is not None:
        cfg = GPTConfig(n_layer=2, n_head=4, n_embd=16, n_positions=8, vocab_size=37)
        rng = np.random.default_rng(3)
        x, dy = rng.standard_normal((2, 8, 16)), rng.standard_normal((2, 8, 16))
        ref = GPT(cfg, dtype="float64")
        for n, p in ref.named_parameters():  # random weights and biases (biases are zero-initialised otherwise)
            p.data = rng.standard_normal(p.shape) * 0.3  # (built lazy: no array yet)
        par = GPT(cfg, dtype="float64")
        TP.parallelize(par, comm, sequence_parallel=sp)
        errs = {"mlp": _module_parity(comm, ref.h[0].mlp, par.h[0].mlp, x, dy, sp),
                "attn": _module_parity(comm, ref.h[0].attn, par.h[0].attn, x, dy, sp)}
        worst = max(v for e in errs.values() for v in e.values())
        ok, detail = worst <= LAYER_TOL, f"worst {worst:.2e}: {errs}"
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("n_head, n_kv_head", [(4, None), (8, 4)], ids=["mha", "gqa"])
def test_llama_block_sharded_by_its_plan_equals_unsharded(tp, sp, n_head, n_kv_head, group):
    """The Llama block (RMSNorm, rotary bias-free attention, SwiGLU) made tensor parallel by the
    model's own tp_plan: output, input gradient and every parameter's gradient slice equal the
    unsharded block's (float64); with grouped-query attention each rank holds whole key/value
    heads (n_kv_head / tp) and the query heads that read them."""
    if MPI.COMM_WORLD.size < tp:
        pytest.skip(f"needs {tp} ranks")
    comm = group(tp, "tp")
    ok, detail = True, ""
    if comm is not None:
        cfg = LlamaConfig(n_layer=1, n_head=n_head, n_embd=16, n_positions=8, vocab_size=37, n_inner=24,
                          n_kv_head=n_kv_head)
        rng = np.random.default_rng(5)
        x, dy = rng.standard_normal((2, 8, 16)), rng.standard_normal((2, 8, 16))
        ref = Llama(cfg, dtype="float64")
        for n, p in ref.named_parameters():  # RMSNorm gains away from 1, projections O(1)
            p.data = rng.standard_normal(p.shape) * 0.3 + (1.0 if "ln_" in n else 0.0)
        par = Llama(cfg, dtype="float64")
        TP.parallelize(par, comm, sequence_parallel=sp)
        errs = _module_parity(comm, ref.h[0], par.h[0], x, dy, sp)
        every = {"d" + n for n, _ in ref.h[0].named_parameters()} | {"y", "dx"}
        worst = max(errs.values())
        ok, detail = worst <= LAYER_TOL and set(errs) == every, f"worst {worst:.2e}: {errs}"
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("vocab", [37, 40])
@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_embedding(tp, vocab, sp, group):
    if MPI.COMM_WORLD.size < tp:
        pytest.skip(f"needs {tp} ranks")
    comm = group(tp, "tp")
    ok, detail = True, ""
    if comm is not None:
        rng = np.random.default_rng(4)
        w = rng.standard_normal((vocab, 8))
        ids = rng.integers(0, vocab, (3, 8))
        ids[0, :2] = [0, vocab - 1]                               # both ends of the vocabulary
        dy = rng.standard_normal((3, 8, 8))
        wt = Tensor(w.copy(), requires_grad=True)
        ops.embedding(ids, wt).backward(dy)
        emb = TP.VocabParallelEmbedding(vocab, 8, comm, sequence_parallel=sp, dtype="float64")
        emb.load_state_dict(TP.shard_state_dict(emb, {"weight": w}, {"tp": tp}, {"tp": comm.rank}))
        y = emb(ids)
        y.backward(seq_chunk(dy, comm) if sp else dy)
        ref_y = w[ids]
        padded = TP.pad_rows(wt.grad, TP.pad_vocab(vocab, tp))
        errs = {"y": rel(y.data, seq_chunk(ref_y, comm) if sp else ref_y),
                "dw": rel(emb.weight.grad, shard(padded, emb.weight.spec, comm))}
        pad_rows_here = emb.weight.data[max(0, vocab - emb.vocab_start):]
        ok = max(errs.values()) <= LAYER_TOL and not pad_rows_here.any()
        ok = ok and emb.weight.shape == (TP.pad_vocab(vocab, tp) // tp, 8)
        detail = str(errs)
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("vocab", [37, 40])
def test_vocab_parallel_cross_entropy(tp, vocab, group):
    if MPI.COMM_WORLD.size < tp:
        pytest.skip(f"needs {tp} ranks")
    comm = group(tp, "tp")
    ok, detail = True, ""
    if comm is not None:
        rng = np.random.default_rng(5)
        n = 24
        logits = rng.standard_normal((n, vocab)) * 3
        targets = rng.integers(0, vocab, n)
        targets[[0, 5, 6]] = -100                                  # ignored
        targets[1], targets[2] = 0, vocab - 1
        errs = {}
        for reduction in ("mean", "sum"):
            lt = Tensor(logits.copy(), requires_grad=True)
            loss = ops.cross_entropy(lt, targets, reduction=reduction)
            loss.backward()
            vp = TP.pad_vocab(vocab, tp)
            padded = np.full((n, vp), 1e3)                          # padding must never win or count
            padded[:, :vocab] = logits
            local = Tensor(shard(padded, LAST(2), comm).copy(), requires_grad=True)
            ploss = TP.vocab_parallel_cross_entropy(local, targets, comm, vocab_size=vocab, reduction=reduction)
            ploss.backward()
            gfull = np.zeros((n, vp))
            gfull[:, :vocab] = lt.grad
            errs[reduction] = (rel(ploss.data, loss.data), rel(local.grad, shard(gfull, LAST(2), comm)))
            pad_grad = local.grad[:, max(0, vocab - comm.rank * (vp // tp)):]
            ok = ok and not pad_grad.any()
        # every target ignored: loss 0, zero gradient (as the unsharded op)
        local = Tensor(shard(logits if vocab % tp == 0 else np.pad(logits, ((0, 0), (0, TP.pad_vocab(vocab, tp) - vocab))),
                             LAST(2), comm).copy(), requires_grad=True)
        zero = TP.vocab_parallel_cross_entropy(local, np.full(n, -100), comm, vocab_size=vocab)
        zero.backward()
        ok = ok and float(zero.data) == 0.0 and not local.grad.any()
        ok = ok and max(max(e) for e in errs.values()) <= LAYER_TOL
        detail = str(errs)
    agree(ok, detail)


# --- the GPT model ------------------------------------------------------------------------------
def tp_run(grid, dtype, sp, steps=STEPS):
    tp, dp = grid.comm["tp"], grid.comm["dp"]
    model = TP.parallelize(GPT(CFG, dtype=dtype), tp, sequence_parallel=sp, seed=1)
    store = FlatParams(model.parameters(), count_once(tp.rank))
    ddp = DataParallel(store, dp, bucket_bytes=4000) if dp.size > 1 else None
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        _, loss = model(*batch(step, dp.rank, dp.size))
        loss.backward()
        if ddp is not None:
            ddp.finish()                      # average over dp first (in-flight buckets), then the SP sum
        store.sync_partial_grads(tp)
        norms.append(store.clip(CLIP, [tp]))
        losses.append(dp.allreduce_scalar(loss.item()) / dp.size)
        opt.step()
    if ddp is not None:
        ddp.close()
    return model, np.array(losses), np.array(norms)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("layout", [(2, 1), (4, 1), (2, 2)], ids=["tp2", "tp4", "tp2xdp2"])
def test_gpt_matches_single_rank(layout, sp, dtype, group):
    tp, dp = layout
    if MPI.COMM_WORLD.size < tp * dp:
        pytest.skip(f"needs {tp * dp} ranks")
    g = group(tp * dp)
    ok, detail = True, ""
    if g is not None:
        ref = reference_run(dtype, cfg=CFG, lr=LR, clip=CLIP, rows=BATCH, ignore=2)
        grid = Grid(dp=dp, pp=1, tp=tp, comm=g)
        model, losses, norms = tp_run(grid, dtype, sp)
        tpc = grid.comm["tp"]
        want = TP.shard_state_dict(model, ref.weights, {"tp": tpc.size}, {"tp": tpc.rank})
        errs = {"loss": rel(losses, ref.losses), "norm": rel(norms, ref.norms),
                "weights": max_rel_err({n: p.data for n, p in model.named_parameters()}, want)}
        kinds = {str(a.dtype) for p in model.parameters() for a in (p.data, p.grad)}
        ok = within(errs, dtype) and kinds == {dtype}  # weights: AdamW's float32 noise (parity.WEIGHTS_TOL)
        detail = f"{errs} dtypes {kinds}"
        grid.free()
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_hf_state_dict_loads_into_tp_and_back(sp, group):
    from mpirt.models.hf import load_hf_gpt2, save_hf_gpt2
    comm = group(2, "tp")
    ok, detail = True, ""
    if comm is not None:
        ref = GPT(CFG, dtype="float32", seed=7)
        x, y = batch(0)
        ref_loss = ref(x, y)[1].item()
        with tempfile.TemporaryDirectory(prefix=f"tp-hf-{MPI.COMM_WORLD.rank}-") as d:
            save_hf_gpt2(ref, CFG, os.path.join(d, "gpt2"))
            _, full = load_hf_gpt2(os.path.join(d, "gpt2"))
        model = TP.parallelize(GPT(CFG, dtype="float32"), comm, sequence_parallel=sp)   # zero weights
        model.load_state_dict(TP.shard_state_dict(model, full, {"tp": 2}, {"tp": comm.rank}))
        loss = model(x, y)[1].item()
        back = {n: TP.gather_param(p, p.data, comm) for n, p in model.named_parameters()}
        same = all(np.array_equal(back[n], full[n]) for n in full) and set(back) == set(full)
        ok, detail = abs(loss - ref_loss) <= 1e-6 * abs(ref_loss) and same, f"loss {loss} vs {ref_loss}, same {same}"
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_parallelize_slices_current_weights_and_logits_gather(sp, group):
    """Without a seed, parallelize keeps the model's current (full) weights: logits gathered over
    the vocabulary equal the unsharded model's."""
    comm = group(2, "tp")
    ok, detail = True, ""
    if comm is not None:
        ref = GPT(CFG, dtype="float64", seed=3)
        x, _ = batch(1)
        ref_logits = ref(x).data
        model = TP.parallelize(GPT(CFG, dtype="float64", seed=3), comm, sequence_parallel=sp)
        logits = TP.gather_last_dim(model(x), comm).data[..., :CFG.vocab_size]  # padding removed
        ok, detail = rel(logits, ref_logits) <= LAYER_TOL, f"{rel(logits, ref_logits)}"
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_dropout_keeps_replicas_identical(sp, group):
    """With dropout, replicated activations draw the same mask on every tp rank (else the
    replicas of the replicated parameters drift apart) and split ones their own part of it."""
    comm = group(2, "tp")
    ok, detail = True, ""
    if comm is not None:
        cfg = GPTConfig(n_layer=2, n_head=4, n_embd=16, n_positions=8, vocab_size=37, embd_pdrop=0.1,
                        attn_pdrop=0.1, resid_pdrop=0.1)
        model = TP.parallelize(GPT(cfg, dtype="float64"), comm, sequence_parallel=sp, seed=1)
        TP.reseed_dropouts(model, 11, comm.rank, comm.size, sp)
        store = FlatParams(list(model.parameters()))
        opt = AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            opt.zero_grad()
            model(*batch(step))[1].backward()
            store.sync_partial_grads(comm)
            opt.step()
        spread = 0.0
        for n, p in model.named_parameters():
            if "tp" not in p.spec.dims:
                spread = max(spread, float(np.abs(comm.allreduce(p.data, "max") - p.data).max()))
        parts = comm.mpi.allgather(model.h[0].attn.attn_dropout.split)
        ok, detail = spread == 0.0 and parts == [(0, 2), (1, 2)], f"spread {spread}, attention dropout parts {parts}"
    agree(ok, detail)


# --- communication and memory ---------------------------------------------------------------------
def expected_comm(cfg, b, s, sp, itemsize=8):
    """Predicted (op, bytes) multisets of one forward and one backward at any tp > 1.

    Per layer: forward 2 allreduces of b*s*h (no SP) or 2 allgathers + 2 reduce-scatters (SP);
    backward 2 allreduces, or 2 reduce-scatters + 2 allgathers + 2 allgathers re-gathering the
    column-parallel inputs. Outside the layers: the embedding's allreduce (SP: reduce-scatter),
    the head's f (SP: allgather), and the loss's two allreduces (row max b*s, then sum-exp and
    target logit 2*b*s)."""
    act = b * s * cfg.n_embd * itemsize
    L = cfg.n_layer
    if not sp:
        fwd = [("allreduce", act)] * (2 * L + 1)
        bwd = [("allreduce", act)] * (2 * L + 1)
    else:
        fwd = [("reduce_scatter", act)] * (2 * L + 1) + [("allgather", act)] * (2 * L + 1)
        bwd = [("reduce_scatter", act)] * (2 * L + 1) + [("allgather", act)] * (4 * L + 2)
    fwd += [("allreduce", b * s * itemsize), ("allreduce", 2 * b * s * itemsize)]
    return sorted(fwd), sorted(bwd)


def _comm_records(model, x, y, comm):
    C.stats.reset()
    loss = model(x, y)[1]
    fwd = sorted((r.op, r.nbytes) for r in C.stats.records if r.axis == "tp")
    C.stats.reset()
    loss.backward()
    bwd = sorted((r.op, r.nbytes) for r in C.stats.records if r.axis == "tp")
    return fwd, bwd


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_communication_per_layer(tp, sp, group):
    if MPI.COMM_WORLD.size < tp:
        pytest.skip(f"needs {tp} ranks")
    comm = group(tp, "tp")
    ok, detail = True, ""
    if comm is not None:
        x, y = batch(0)
        x, y = x[:2], y[:2]
        counts = {}
        for layers in (1, 3):
            cfg = GPTConfig(n_layer=layers, n_head=4, n_embd=16, n_positions=8, vocab_size=37)
            model = TP.parallelize(GPT(cfg, dtype="float64"), comm, sequence_parallel=sp, seed=1)
            got = _comm_records(model, x, y, comm)
            want = expected_comm(cfg, 2, SEQ, sp)
            counts[layers] = got
            ok = ok and got == want
        # per layer: the difference between 3 layers and 1 layer, halved; every layer collective
        # moves one (b, s, h) activation
        diff = [{op: (sum(r[0] == op for r in counts[3][i]) - sum(r[0] == op for r in counts[1][i])) / 2
                 for op in ("allreduce", "allgather", "reduce_scatter")} for i in range(2)]
        want_diff = ([{"allreduce": 2, "allgather": 0, "reduce_scatter": 0}] * 2 if not sp else
                     [{"allreduce": 0, "allgather": 2, "reduce_scatter": 2},
                      {"allreduce": 0, "allgather": 4, "reduce_scatter": 2}])
        extra = sorted(set(counts[3][0] + counts[3][1]) - {(op, 2 * SEQ * 16 * 8) for op in want_diff[0]})
        ok = ok and diff == want_diff and extra == [("allreduce", 2 * SEQ * 8), ("allreduce", 2 * 2 * SEQ * 8)]
        detail = f"per layer (forward, backward) {diff}; other records {extra}; records {counts}"
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
def test_sequence_parallel_without_regather_mirrors_forward(group):
    comm = group(2, "tp")
    ok, detail = True, ""
    if comm is not None:
        x, y = batch(0)
        model = TP.parallelize(GPT(CFG, dtype="float64"), comm, sequence_parallel=True, seed=1, regather=False)
        fwd, bwd = _comm_records(model, x[:2], y[:2], comm)
        n_ag = sum(1 for op, _ in bwd if op == "allgather")
        n_rs = sum(1 for op, _ in bwd if op == "reduce_scatter")
        ok, detail = (n_ag, n_rs) == (2 * CFG.n_layer + 1, 2 * CFG.n_layer + 1), f"backward AG {n_ag}, RS {n_rs}"
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_activation_memory_matches_formula(tp, sp, group):
    if MPI.COMM_WORLD.size < tp:
        pytest.skip(f"needs {tp} ranks")
    comm = group(tp, "tp")
    ok, detail = True, ""
    if comm is not None:
        cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, n_positions=16, vocab_size=37)
        x, y = get_batch(TOKENS, 0, batch_size=4, seq_len=16, seed=0)
        model = TP.parallelize(GPT(cfg, dtype="float32"), comm, sequence_parallel=sp, seed=1)
        loss = model(x, y)[1]
        measured = kept_bytes(loss)
        kw = dict(batch=4, seq_len=16, tp=tp)
        predicted = kept_per_rank(cfg, **kw, sequence_parallel=sp)
        single = kept_per_rank(cfg, **dict(kw, tp=1))
        err = abs(measured - predicted) / predicted
        ok = err <= 0.10 and measured < single
        detail = f"measured {measured} predicted {predicted} ({err:.2%}); tp=1 {single}"
        if sp:  # sequence parallelism saves memory on top of tensor parallelism
            plain = kept_per_rank(cfg, **kw)
            ok = ok and measured < plain
    agree(ok, detail)
