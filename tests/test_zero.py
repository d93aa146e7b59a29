"""ZeRO stages 1-3 (mpirt.parallel.zero) against the single-rank AdamW run on the same global batch,
plus per-rank memory against the ZeRO formulas. Valid at any world size; verdicts are reduced over
the ranks (see conftest.agree)."""
import contextlib
import gc
import shutil
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpirt import comm as C, Tensor, enable_grad, is_grad_enabled
from mpirt.checkpoint.store import CheckpointReader, load_checkpoint, save_checkpoint
from mpirt.checkpoint.sharded import save_sharded
from mpirt.comm import Comm, chunk_bounds
from mpirt.data.tokens import split_microbatches
from mpirt.core.optim import AdamW
from mpirt.parallel.ddp import DataParallel
from mpirt.parallel.shards import load_shards, save_shards
from mpirt.parallel.zero import ZeroOptimizer
from mpirt.core.tensor import no_grad
from mpirt.models import GPTConfig
from conftest import agree
from parity import (LR, STEPS, TOL, WD, batch, dp_comm, global_loss, make_model, max_rel_err, reference_run, rel_err,
                    within, worst)

STAGES = [1, 2, 3]


def zero_run(dtype, stage, *, accum=1, clip=None, steps=STEPS, cfg=None, start=0, setup=None, model=None,
             comm=None):
    """The ZeRO run on this rank's share (of ``comm``, default the world as dp) of each global batch
    (sized for the world): (losses, first-step gradient segments, full final weights, grad norms,
    optimizer, model). ``setup(opt, model)`` runs after construction (e.g. loads a checkpoint)."""
    comm = comm or dp_comm()
    model = model or (make_model(dtype) if cfg is None else make_model(dtype, cfg))
    opt = ZeroOptimizer(model, comm, stage=stage, lr=LR, weight_decay=WD)
    if setup is not None:
        setup(opt, model)
    losses, norms, grads = [], [], None
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = batch(step, comm.rank, comm.size, world=MPI.COMM_WORLD.size, accum=accum)
        loss_sum = 0.0
        for xm, ym in split_microbatches(x, y, accum):
            _, loss = model(xm, ym)
            (loss * (1.0 / accum)).backward()
            loss_sum += loss.item() / accum
        if grads is None:
            opt.reduce_gradients()
            grads = [(p.name, a, b, opt.grad_shard[s:s + b - a].copy()) for p, a, b, s in opt.owned_segments()]
        if clip is not None:
            norms.append(opt.clip_grad_norm(clip))
        losses.append(global_loss(comm, loss_sum))
        opt.step()
    return np.array(losses), grads, opt.gather_parameters(), norms, opt, model


def segment_err(segments, ref_grads) -> float:
    """Largest relative error of this rank's gradient segments against the full reference."""
    err = 0.0
    for name, a, b, g in segments:
        r = ref_grads[name].reshape(-1)
        err = max(err, float(np.abs(g - r[a:b]).max() / max(np.abs(r).max(), 1e-300)))
    return err


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("stage", STAGES)
def test_zero_matches_single_rank(stage, dtype):
    size = MPI.COMM_WORLD.size
    ref = reference_run(dtype, world=size)
    losses, grads, w, _, opt, model = zero_run(dtype, stage)
    errs = {"loss": worst(rel_err(losses, ref.losses)), "grad": worst(segment_err(grads, ref.grads)),
            "weights": worst(max_rel_err(w, ref.weights))}
    # every element of every parameter is owned by exactly one rank
    owned = MPI.COMM_WORLD.allreduce(sum(b - a for _, a, b, _ in opt.owned_segments()))
    # inference after training (stage 3: parameters gathered per unit under no_grad too)
    ref_model = make_model(dtype)
    ref_model.load_state_dict(ref.weights)
    x, y = batch(0, 0, 1, world=size)
    with no_grad():
        logits_err = worst(rel_err(model(x).data, ref_model(x).data))
    dtypes = {str(a.dtype) for a in (opt.param_shard, opt.grad_shard, opt.exp_avg, opt.exp_avg_sq)}
    agree(within(errs, dtype) and logits_err <= TOL[dtype] and owned == opt.numel
          and dtypes == {dtype}, f"stage {stage} {dtype}: {errs}, logits {logits_err}, owned {owned}/{opt.numel}, "
                                 f"dtypes {dtypes}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("stage", STAGES)
def test_zero_grad_accumulation_equals_one_large_batch(stage, dtype):
    size = MPI.COMM_WORLD.size
    ref = reference_run(dtype, world=size, steps=3, accum=2)
    losses, _, w, _, _, _ = zero_run(dtype, stage, accum=2, steps=3)
    errs = {"loss": worst(rel_err(losses, ref.losses)), "weights": worst(max_rel_err(w, ref.weights))}
    agree(within(errs, dtype), f"stage {stage}: errors {errs}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", STAGES)
def test_zero_clipping_matches_unsharded(stage):
    size = MPI.COMM_WORLD.size
    ref = reference_run("float64", world=size, steps=3, clip=0.05)
    losses, _, w, norms, _, _ = zero_run("float64", stage, clip=0.05, steps=3)
    errs = (worst(rel_err(losses, ref.losses)), worst(max_rel_err(w, ref.weights)), worst(rel_err(norms, ref.norms)))
    agree(min(ref.norms) > 0.05 and max(errs) <= TOL["float64"], f"norms {ref.norms}, errors {errs}")


@pytest.mark.mpi(min_size=2)
def test_stage3_replays_dropout_like_stage1():
    """Stage 3 recomputes each unit in backward; with dropout on, the recomputation must draw the
    forward's masks again: its run equals stage 1's (same shards, same masks, no recomputation)."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, n_positions=8, vocab_size=37, embd_pdrop=0.1,
                    attn_pdrop=0.1, resid_pdrop=0.1)
    l1, _, w1, _, _, _ = zero_run("float64", 1, cfg=cfg, steps=3)
    l3, _, w3, _, _, _ = zero_run("float64", 3, cfg=cfg, steps=3)
    l0, _, w0, _, _, _ = zero_run("float64", 1, steps=3)  # without dropout: a different run
    errs = (worst(rel_err(l3, l1)), worst(max_rel_err(w3, w1)), worst(rel_err(l0, l1)))
    agree(errs[0] < 1e-10 and errs[1] < 1e-10 and errs[2] > 1e-6, f"errors {errs}")


@pytest.mark.mpi(min_size=2)
def test_stage3_gathers_one_unit_at_a_time_and_again_in_backward():
    """Inside unit h.0 only its parameters are whole, in forward and in the backward's rerun; each
    pass gathers every unit's groups once, all but its first unit's prefetched (an all-gather
    started while the unit before computes); nothing stays gathered after backward."""
    comm = dp_comm()
    model = make_model("float64")
    opt = ZeroOptimizer(model, comm, stage=3, lr=LR)
    seen = {}
    ln_1 = model.h[0].ln_1
    original = ln_1.forward

    def spy(x):  # inside unit h.0: which parameters are materialised right now?
        seen.setdefault("sizes", []).append({p.name: p.data.size for p in model.parameters()})
        return original(x)
    ln_1.forward = spy
    gathers_per_pass = sum(len(u.group_ids) for u in opt.units)

    def gathers():  # (blocking, prefetched: started during the unit before)
        return C.stats.calls("allgather"), C.stats.calls("iallgather")
    start = gathers()
    x, y = batch(0, comm.rank, comm.size)
    _, loss = model(x, y)
    after_forward = gathers()
    loss.backward()
    after_backward = gathers()
    forward_gathers = sum(after_forward) - sum(start)
    backward_gathers = sum(after_backward) - sum(after_forward)
    # each pass gathers its first unit's groups itself and every later unit's while the one before runs
    prefetched = (after_forward[1] - start[1], after_backward[1] - after_forward[1])
    ok = prefetched == (gathers_per_pass - len(opt.units[0].group_ids), gathers_per_pass - len(opt.units[-1].group_ids))
    full = {p.name for p in model.parameters() if p.name.startswith("h.0.")}
    ok = ok and len(seen["sizes"]) == 2  # forward, then the recomputation in backward
    for sizes in seen["sizes"]:
        ok = ok and all((sizes[n] > 0) == (n in full) for n in sizes)
    released = all(p.data.size == 0 and p.grad is None for p in model.parameters())
    mem = opt.memory_bytes()
    agree(ok and released and forward_gathers == backward_gathers == gathers_per_pass
          and mem["params"] == opt.shard_numel * 8,
          f"sizes {seen}, gathers {forward_gathers}/{backward_gathers}/{gathers_per_pass}, prefetched {prefetched}, "
          f"released {released}")


# --- memory ------------------------------------------------------------------------------------
MEM_CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=256)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_per_rank_matches_the_zero_formula(stage):
    """Persistent bytes per parameter (fp32 AdamW, N dp ranks): DP 4+4+8, ZeRO-1 4+4+8/N,
    ZeRO-2 4+(4+8)/N, ZeRO-3 16/N; measured after a step (stage 2's full gradient is released).
    memory_bytes() must match the formula, and tracemalloc (NumPy reports its allocations to it)
    must find no large array it leaves out (stage 3: no gathered parameter kept alive)."""
    comm = dp_comm()
    n_ranks = comm.size
    x, y = batch(0, comm.rank, comm.size)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    model = make_model("float32", MEM_CFG)
    n = model.num_parameters()
    if stage == 0:
        dp = DataParallel(model, comm)
        opt = AdamW(model.parameters(), lr=LR)
    else:
        opt = ZeroOptimizer(model, comm, stage=stage, lr=LR)
    opt.zero_grad()
    model(x, y)[1].backward()
    if stage == 0:
        dp.finish()
    opt.step()
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    mem = dp.memory_bytes(opt) if stage == 0 else opt.memory_bytes()
    expected = {0: 16, 1: 8 + 8 / n_ranks, 2: 4 + 12 / n_ranks, 3: 16 / n_ranks}[stage] * n
    measured = sum(mem.values())
    ratio = measured / expected
    # slack: Python objects of the model, and AdamW's scratch buffer (the largest parameter) for DP
    slack = 128 * 1024 + (4 * max(p.size for p in model.parameters()) if stage == 0 else 0)
    agree(abs(ratio - 1) <= 0.02 and measured * 0.98 <= traced <= measured * 1.02 + slack,
          f"stage {stage}: {mem} = {measured} B for {n} params on {n_ranks} ranks, expected {expected:.0f} "
          f"({ratio:.4f}); tracemalloc {traced}")


# --- checkpoints -------------------------------------------------------------------------------
@contextlib.contextmanager
def shared_dir():
    """A directory made by rank 0, known to every rank, removed at the end."""
    root = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="zero-ckpt-") if MPI.COMM_WORLD.rank == 0 else None)
    try:
        yield Path(root)
    finally:
        MPI.COMM_WORLD.Barrier()
        if MPI.COMM_WORLD.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def save_zero(root, opt, model, step):
    """Save a ZeRO run's checkpoint as training does: every rank writes its own segments (collective)."""
    save_sharded(root, Comm(MPI.COMM_WORLD, "world"), lambda writer: save_shards(writer, model, opt), step=step,
                 config={}, extra=None, optimizer={"type": "AdamW", "scalars": opt.scalars()})


def load_zero(root):
    """``zero_run`` setup: read this rank's boxes of the checkpoint (weights and optimizer state)."""
    def setup(opt, model):
        load_shards(CheckpointReader(root), model, opt)
    return setup


def adamw_continue(root, start, steps):
    """Load ``root`` into plain AdamW at dp=1 (locally) and run ``steps`` steps on the whole global
    batch: (losses, final weights, model, optimizer)."""
    model = make_model("float64")
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WD)
    load_checkpoint(root, model, opt)
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad()
        _, loss = model(*batch(step, world=MPI.COMM_WORLD.size))
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return np.array(losses), {p.name: p.data.copy() for p in model.parameters()}, model, opt


@pytest.mark.mpi(min_size=2)
def test_checkpoint_moves_between_zero_stages_dp_sizes_and_adamw():
    """Saved from ZeRO-2 at dp=world, loaded into AdamW at dp=1, ZeRO-1/3 at dp=world and ZeRO-3
    at dp=1; saved from that AdamW, loaded into ZeRO-3 at dp=world: every continuation equals the
    uninterrupted ZeRO-2 run."""
    tol = TOL["float64"]
    losses, _, w, _, _, _ = zero_run("float64", 2, steps=4)
    first, _, _, _, opt, model = zero_run("float64", 2, steps=2)
    zstate = opt.state_dict()
    errs = {"first": worst(rel_err(first, losses[:2]))}
    with shared_dir() as root, shared_dir() as root2:
        save_zero(root, opt, model, step=2)
        a_losses, a_w, a_model, a_opt = adamw_continue(root, 2, 2)
        errs["adamw dp=1"] = worst(max(rel_err(a_losses, losses[2:]), max_rel_err(a_w, w)))
        # the same format: the gathered ZeRO state is what AdamW holds after loading it
        a_model2 = make_model("float64")
        a_opt2 = AdamW(a_model2.parameters(), lr=LR, weight_decay=WD)
        load_checkpoint(root, a_model2, a_opt2)
        astate = a_opt2.state_dict()
        same = set(astate) == set(zstate) and all(
            np.array_equal(astate[k], zstate[k]) if hasattr(zstate[k], "shape") else astate[k] == zstate[k]
            for k in zstate)
        if MPI.COMM_WORLD.rank == 0:
            save_checkpoint(root2, a_model2, a_opt2, step=2, config={})
        MPI.COMM_WORLD.Barrier()
        for stage, comm, src in ((1, None, root), (3, None, root), (3, Comm(MPI.COMM_SELF, "dp"), root),
                                 (3, None, root2)):
            second, _, w_end, _, _, _ = zero_run("float64", stage, steps=2, start=2, setup=load_zero(src),
                                                 comm=comm)
            key = f"zero-{stage} dp={(comm or dp_comm()).size} from {'adamw' if src == root2 else 'zero-2'}"
            errs[key] = worst(max(rel_err(second, losses[2:]), max_rel_err(w_end, w)))
    agree(same and all(e <= tol for e in errs.values()), f"same format {same}, errors {errs}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", STAGES)
def test_state_dict_resumes_exactly(stage):
    """Same stage and dp size: resuming from the gathered state (and, for stage 3, the weights
    re-sharded through full_parameters) is bit-identical to the uninterrupted run."""
    losses, _, w, _, _, _ = zero_run("float64", stage, steps=4)
    first, _, w_mid, _, opt, _ = zero_run("float64", stage, steps=2)
    state = opt.state_dict()
    shapes_ok = all(state[f"{p.name}.{k}"].shape == tuple(p.global_shape)
                    for p in make_model("float64").parameters() for k in ("exp_avg", "exp_avg_sq"))

    def setup(opt, model):
        with opt.full_parameters():
            full = model.state_dict()
            model.load_state_dict(w_mid)
        opt.load_state_dict(state)
        setup.full_shapes = all(full[n].shape == w_mid[n].shape for n in w_mid)
    second, _, w_end, _, _, model = zero_run("float64", stage, steps=2, start=2, setup=setup)
    released = stage < 3 or all(p.data.size == 0 for p in model.parameters())
    errs = (worst(rel_err(np.concatenate([first, second]), losses)), worst(max_rel_err(w_end, w)))
    agree(max(errs) == 0.0 and shapes_ok and setup.full_shapes and released and state["type"] == "AdamW",
          f"errors {errs}, shapes {shapes_ok}/{setup.full_shapes}, released {released}")


@pytest.mark.parametrize("stage", STAGES)
def test_load_state_dict_errors_name_the_key(stage):
    comm = Comm(MPI.COMM_SELF, "dp")
    opt = ZeroOptimizer(make_model("float64"), comm, stage=stage, lr=LR)
    state = opt.state_dict()
    bad = dict(state, **{"h.0.attn.c_attn.weight.exp_avg": np.zeros((3, 3))})
    with pytest.raises(ValueError, match="h.0.attn.c_attn.weight.exp_avg has shape"):
        opt.load_state_dict(bad)
    bad = {k: v for k, v in state.items() if k != "ln_f.bias.exp_avg_sq"}
    with pytest.raises(KeyError, match="ln_f.bias.exp_avg_sq"):
        opt.load_state_dict(bad)
    with pytest.raises(KeyError, match="nope.exp_avg"):
        opt.load_state_dict(dict(state, **{"nope.exp_avg": np.zeros(2)}))
    with pytest.raises(ValueError, match="SGD"):
        opt.load_state_dict(dict(state, type="SGD"))
    assert opt.step_count == 0 and not opt.exp_avg.any()


@pytest.mark.mpi(min_size=2)
def test_allgather_flat_with_the_chunk_a_view_of_out():
    """ZeRO gathers its shard in place: the chunk is this rank's part of ``out`` (MPI_IN_PLACE);
    a chunk overlapping ``out`` elsewhere is gathered from a copy."""
    comm, fails = dp_comm(), []
    for n in (3 * comm.size, 3 * comm.size + 1, 1):
        want = np.arange(n, dtype=np.float64)
        lo, hi = chunk_bounds(n, comm.size)[comm.rank]
        out = np.full(n, -1.0)
        out[lo:hi] = want[lo:hi]
        if not np.array_equal(comm.allgather_flat(out[lo:hi], n, out=out), want) or not np.array_equal(out, want):
            fails.append(f"in place n={n}")
        out = np.full(n, -1.0)
        k = hi - lo
        out[n - k:] = want[lo:hi]  # this rank's values, but at the end of out
        comm.allgather_flat(out[n - k:], n, out=out)
        if not np.array_equal(out, want):
            fails.append(f"aliased n={n}")
    agree(not fails, f"{fails}")


def test_enable_grad_inside_no_grad():
    assert is_grad_enabled()
    with no_grad():
        with enable_grad():
            assert is_grad_enabled()
            x = Tensor(np.ones(2), requires_grad=True)
            assert (x * 2.0)._ctx is not None
        assert not is_grad_enabled()
    assert is_grad_enabled()


def test_single_rank_zero_equals_adamw():
    comm = Comm(MPI.COMM_SELF, "dp")
    for stage in STAGES:
        ref, zm = make_model("float64"), make_model("float64")
        ropt = AdamW(ref.parameters(), lr=LR, weight_decay=WD)
        zopt = ZeroOptimizer(zm, comm, stage=stage, lr=LR, weight_decay=WD)
        for step in range(2):
            x, y = batch(step)
            for m, o in ((ref, ropt), (zm, zopt)):
                o.zero_grad()
                m(x, y)[1].backward()
                o.step()
        w = zopt.gather_parameters()
        assert max_rel_err(w, {p.name: p.data for p in ref.parameters()}) == 0.0, stage


def test_rejects_bad_arguments():
    comm = Comm(MPI.COMM_SELF, "dp")
    with pytest.raises(ValueError, match="stage"):
        ZeroOptimizer(make_model("float64"), comm, stage=4)
    with pytest.raises(ValueError, match="stage 3 needs the model"):
        ZeroOptimizer(make_model("float64").parameters(), comm, stage=3)
    model = make_model("float64")
    model.ln_f.bias.data = model.ln_f.bias.data.astype("float32")
    with pytest.raises(ValueError, match="one dtype"):
        ZeroOptimizer(model, comm, stage=1)


def test_the_sharded_store_holds_each_group_once_and_shows_it_only_inside_a_unit():
    """ZeRO-3's parameter store on one rank: its shard is every group whole, each parameter once;
    outside a unit a parameter holds no array, gathered it holds its value; the optimizer works
    over the store it is given, and only at stage 3."""
    from mpirt.parallel.zero3 import ShardedParams

    comm = Comm(MPI.COMM_SELF, "dp")
    model = make_model("float64")
    want = {p.name: p.data.copy() for p in model.parameters()}
    store = ShardedParams(model, comm)
    assert store.shard_numel == store.numel == sum(a.size for a in want.values())
    assert sorted(p.name for g in store.groups for p in g.params) == sorted(want)
    assert all(p.data.size == 0 and p.grad is None for p in store.params)
    for i, g in enumerate(store.groups):
        with store.gathered([i]):
            assert all(np.array_equal(p.data, want[p.name]) for p in g.params)
        assert all(p.data.size == 0 and p.grad is None for p in g.params)
    opt = ZeroOptimizer(store, comm, stage=3)
    assert opt.units is store.units and opt.param_shard is store.data and opt.grad_shard is store.grad
    assert opt.gather_parameters().keys() == want.keys()
    assert all(np.array_equal(v, want[k]) for k, v in opt.gather_parameters().items())
    with pytest.raises(ValueError, match="stages 1-2 take the model, parameters or a FlatParams"):
        ZeroOptimizer(store, comm, stage=1)


def test_stage2_streaming_under_an_interleaved_order_loses_no_gradient():
    """Buckets cut across parameters (5 elements, parameters of 4), backward in an interleaved
    pipeline's order (the store's second half, chunk 1, runs micro-batches before the first half
    does): a parameter whose first bucket was reduced gets the next micro-batch's gradient while
    its bucket that straddles the chunks still waits; nothing of either is lost or counted twice."""
    from mpirt.comm import Comm
    from mpirt.core.nn import Parameter
    from mpirt.parallel.zero import ZeroOptimizer

    ps = [Parameter((4,), dtype="float64") for _ in range(4)]
    for i, p in enumerate(ps):
        p.data, p.name = np.ones(4), f"p{i}"
    opt = ZeroOptimizer(ps, Comm(MPI.COMM_SELF), stage=2, stream_grads=True, bucket_bytes=5 * 8, lr=0.0,
                        weight_decay=0.0)
    chunk = {0: ps[:2], 1: ps[2:]}
    order = [(1, 0), (1, 1), (0, 0), (1, 2), (0, 1), (1, 3), (0, 2), (0, 3)]  # (chunk, micro-batch)
    for _ in range(2):
        opt.zero_grad()
        for c, _mb in order:
            sum((p * 1.0).sum() for p in chunk[c]).backward()
        opt.reduce_gradients()
        np.testing.assert_array_equal(opt.grad_shard, [4.0] * 16)
        assert all(p.grad is None for p in ps)


def test_stage2_streaming_keeps_every_micro_batch_with_an_unused_parameter():
    """ZeRO-2 reducing during backward: a bucket whose parameter never gets a gradient waits, and
    the buckets before it wait through the next micro-batch; the step's shard holds the sum of
    both micro-batches everywhere (one bucket per parameter)."""
    from mpirt.comm import Comm
    from mpirt.core.nn import Parameter
    from mpirt.parallel.zero import ZeroOptimizer

    ps = [Parameter((4,), dtype="float64") for _ in range(3)]
    for i, p in enumerate(ps):
        p.data, p.name = np.ones(4), f"p{i}"
    opt = ZeroOptimizer(ps, Comm(MPI.COMM_SELF), stage=2, stream_grads=True, bucket_bytes=1, lr=0.0,
                        weight_decay=0.0)
    for _ in range(2):  # two steps: the stream starts over after each
        opt.zero_grad()
        for _ in range(2):  # micro-batches; p1 unused
            ((ps[0] * 1.0).sum() + (ps[2] * 2.0).sum()).backward()
        opt.reduce_gradients()
        np.testing.assert_array_equal(opt.grad_shard, [2.0] * 4 + [0.0] * 4 + [4.0] * 4)
        assert all(p.grad is None for p in ps)  # never held whole
