"""Pipeline parallelism (mpirt.parallel.pipeline.stage) against the single-rank run on the same global batch.

Multi-rank tests split MPI_COMM_WORLD into groups of the size they need (pp, or dp x pp); every
complete group runs the same test, leftover ranks only join the verdict, so the tests are valid
at 2, 4 and 8 ranks. Every rank computes the single-rank reference itself (no communication) and
compares its own stage's parameters; the verdict is reduced over all ranks (:func:`conftest.agree`).
"""
from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from mpirt.comm import Comm
from mpirt.run.config import TrainConfig
from mpirt.parallel.grid import Grid
from mpirt.parallel.engine import Engine, Hyper
from mpirt.parallel.layout import Layout
from mpirt.parallel.pipeline.partition import layer_costs, partition
from mpirt.parallel.pipeline.stage import PipelineStage
from mpirt.parallel.pipeline.check import simulate
from mpirt.parallel.pipeline.schedules import ScheduleError, build
from mpirt.models import GPTConfig

from conftest import agree
from parity import CFG, LR, SEQ, STEPS, WD, batch, max_rel_err, reference_run, rel_err, within

BATCH = 8


def config(n_layer: int) -> GPTConfig:
    return replace(CFG, n_layer=n_layer)


# --- helpers -----------------------------------------------------------------------------------
@pytest.fixture
def grid(group):
    """``grid(pp, dp=1, tp=1)``: a Grid over this rank's group of ``pp * dp * tp`` consecutive
    ranks, or None on leftover ranks; the grids (and their groups) are freed after the test."""
    grids = []

    def make(pp: int, dp: int = 1, tp: int = 1):
        comm = group(pp * dp * tp)
        if comm is None:
            return None
        grids.append(Grid(dp=dp, pp=pp, tp=tp, comm=comm))
        return grids[-1]

    yield make
    for g in grids:
        g.free()


def pipeline_run(g, cfg, dtype, schedule, m, chunks=1, steps=STEPS, clip=None, rows=BATCH, zero=0, **kw):
    """The stage, built here (split, wait mode ...), trained by the engine with ``zero``."""
    stage = PipelineStage.standalone(cfg, g, schedule, m, chunks, dtype=dtype, seed=1, **kw)
    train_cfg = replace(TrainConfig(), dp=g.dp, pp=g.pp, tp=g.tp, dtype=dtype, lr=LR, weight_decay=WD, beta1=0.9,
                        beta2=0.999, zero=zero, sequence_parallel=kw.get("sequence_parallel", False))
    engine = Engine(Layout.of(train_cfg, g.sizes, cfg), cfg, g, Hyper.of(train_cfg), dropout_seed=0, local=stage)
    d, dp = g.coords["dp"], g.dp
    losses, norms, grads, stats = [], [], None, []
    for step in range(steps):
        x, y = batch(step, d, dp, rows=rows)
        losses.append(engine.train_step(x, y))
        grads = grads or {n: p.grad.copy() for n, p in stage.named_parameters()}
        if clip is not None:
            norms.append(engine.clip(clip))
        engine.optimizer.step()
        stats.append(dict(stage.stats))
    x, y = batch(100, d, dp, rows=rows)
    eval_loss = engine.evaluate(x, y)
    engine.close()
    return stage, engine.optimizer, np.array(losses), grads, norms, stats, eval_loss


def tied_copies_identical(stage, g) -> bool:
    """The wte copies on the first and last pp ranks hold the same bits."""
    comm = g.comm["pp"]
    if g.pp == 1:
        return True
    w = dict(stage.named_parameters()).get("wte.weight")
    mine = None if w is None else w.data.copy()
    every = comm.allgather_object(mine)
    return np.array_equal(every[0], every[-1])


def parity(g, cfg, dtype, schedule, m, chunks=1, steps=STEPS, clip=None, rows=BATCH, **kw):
    """Run the pipeline and the reference; return (ok, detail, stage, stats)."""
    if g is None:
        return True, "idle rank", None, None
    ref = reference_run(dtype, cfg=cfg, steps=steps, clip=clip, rows=rows, eval_step=100)
    stage, opt, losses, grads, norms, stats, eval_loss = pipeline_run(g, cfg, dtype, schedule, m, chunks, steps,
                                                                      clip, rows, **kw)
    weights = {n: p.data for n, p in stage.named_parameters()}
    ref_w, ref_grads = ({n: r[n] for n in weights} for r in (ref.weights, ref.grads))  # this stage's
    if g.tp > 1:  # compare this rank's slices
        from mpirt.parallel.tensor import shard_state_dict
        sizes, ranks = {"tp": g.tp}, {"tp": g.coords["tp"]}
        ref_w = shard_state_dict(stage.model, ref_w, sizes, ranks)
        ref_grads = shard_state_dict(stage.model, ref_grads, sizes, ranks)
    errs = {"loss": rel_err(losses, ref.losses), "grad": max_rel_err(grads, ref_grads),
            "weights": max_rel_err(weights, ref_w), "eval": rel_err(eval_loss, ref.eval_loss)}
    if clip is not None:
        errs["norm"] = rel_err(norms, ref.norms)
    kinds = {str(a.dtype) for p in stage.parameters() for a in (p.data, p.grad) if a is not None}
    kinds |= {str(a.dtype) for st in getattr(opt, "state", []) for a in st.values()}
    tied = tied_copies_identical(stage, g)  # collective: on every rank, whatever its own errors
    ok = within(errs, dtype) and tied and kinds == {dtype}  # weights: AdamW's float32 noise (parity.WEIGHTS_TOL)
    return ok, f"{schedule} pp={g.pp} dp={g.dp} tp={g.tp} {dtype}: errors {errs}, dtypes {kinds}", stage, stats


# --- parity with the single-rank run -------------------------------------------------------------
PP4 = pytest.mark.mpi(min_size=4)
CASES = [pytest.param(p, s, marks=pytest.mark.mpi(min_size=p)) for p in (2, 4)
         for s in ("gpipe", "1f1b", "interleaved", "zb-h1")]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("pp,schedule", CASES)
def test_schedule_matches_single_rank(pp, schedule, dtype, grid):
    cfg = config(4 if pp == 2 else 8)
    chunks = 2 if schedule == "interleaved" else 1
    m = 2 * pp
    ok, detail, stage, stats = parity(grid(pp), cfg, dtype, schedule, m, chunks)
    agree(ok, detail)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_pp2_dp2_matches_single_rank(schedule, grid):
    chunks = 2 if schedule == "interleaved" else 1
    ok, detail, _, _ = parity(grid(2, dp=2), config(4), "float64", schedule, 2, chunks)
    agree(ok, detail)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_pp2_tp2_matches_single_rank(schedule, sequence_parallel, grid):
    """Tensor-parallel stages (vocabulary-split tied wte on both ends); with clipping, so the norm
    over pp and tp is checked too."""
    chunks = 2 if schedule == "interleaved" else 1
    ok, detail, _, _ = parity(grid(2, tp=2), config(4), "float64", schedule, 2, chunks, clip=0.05,
                              sequence_parallel=sequence_parallel)
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_clipping_matches_single_rank(dtype, grid):
    """The global grad norm over the stages (tied wte counted once) and the clipped updates."""
    ok, detail, _, _ = parity(grid(2), config(4), dtype, "1f1b", 4, clip=0.05)
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("split", [[1, 3], [3, 1]])
def test_uneven_partition(split, grid):
    g = grid(2)
    ok, detail, stage, _ = parity(g, config(4), "float64", "1f1b", 4, split=split)
    if stage is not None:
        lo, hi = stage.chunk_bounds[0]
        ok = ok and hi - lo == split[g.coords["pp"]]
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
def test_microbatches_not_a_multiple_of_pp(grid):
    """1F1B and ZB-H1 take any m (here 3 on 2 stages, and m < p on 4); interleaved refuses."""
    ok, detail, _, _ = parity(grid(2), config(4), "float64", "1f1b", 3, rows=6)
    agree(ok, detail)
    ok, detail, _, _ = parity(grid(2), config(4), "float64", "zb-h1", 3, rows=6, steps=2)
    agree(ok, detail)
    g = grid(2)
    msg = ""
    if g is not None:
        with pytest.raises(ScheduleError) as err:
            PipelineStage.standalone(config(4), g, "interleaved", 3, 2, dtype="float64")
        msg = str(err.value)
    agree(g is None or "needs microbatches to be a multiple of pp: microbatches=3, pp=2" in msg, msg)


@PP4
def test_fewer_microbatches_than_stages(grid):
    ok, detail, _, _ = parity(grid(4), config(8), "float64", "zb-h1", 2, rows=4, steps=2)
    agree(ok, detail)
    ok, detail, _, _ = parity(grid(4), config(8), "float64", "1f1b", 2, rows=4, steps=2)
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
def test_refusals(grid):
    g = grid(2)
    msgs = []
    if g is not None:
        for kwargs, expect in [({"split": [2, 3]}, "split [2, 3]: need 2 stages"),
                               ({"split": [0, 4]}, "of >= 1 blocks each"),
                               ({"chunks": 3, "schedule": "interleaved"}, "n_layer=4 cannot fill pp x chunks = 6")]:
            kw = {"schedule": "1f1b", **kwargs}
            try:
                PipelineStage.standalone(config(4), g, kw.pop("schedule"), 4, dtype="float64", **kw)
                msgs.append(f"no error for {kwargs}")
            except (ValueError, ScheduleError) as err:
                if expect not in str(err):
                    msgs.append(f"{kwargs}: {err}")
        stage = PipelineStage.standalone(config(4), g, "1f1b", 4, dtype="float64")
        x, y = batch(0, rows=6)
        try:
            stage.train_step(x, y)
            msgs.append("6 rows into 4 micro-batches accepted")
        except ValueError as err:
            if "6 rows cannot be split into microbatches=4" not in str(err):
                msgs.append(str(err))
    agree(not msgs, "; ".join(msgs))


@pytest.mark.mpi(min_size=2)
def test_ranks_agree_on_shapes_before_sending(grid):
    """Stages given different batch shapes refuse together, before any activation is sent."""
    g = grid(2)
    msg = ""
    if g is not None:
        stage = PipelineStage.standalone(config(4), g, "1f1b", 2, dtype="float64")
        x, y = batch(0, rows=8 if g.coords["pp"] == 0 else 4)
        try:
            stage.train_step(x, y)
        except ValueError as err:
            msg = str(err)
    agree(g is None or "pipeline ranks disagree on (rows, seq_len" in msg, msg)


# --- memory: stashed activations measured by the executor ----------------------------------------
@PP4
def test_peak_stashed_activations(grid):
    g = grid(4)
    detail, ok = "", True
    if g is not None:
        p, m, r = 4, 8, g.coords["pp"]
        peaks = {}
        for name in ("gpipe", "1f1b", "zb-h1", "interleaved"):
            chunks = 2 if name == "interleaved" else 1
            stage, *_, stats, _ = pipeline_run(g, config(8), "float64", name, m, chunks, steps=1)
            peaks[name] = stats[0]["peak_stash"]
            sim = simulate(build(name, p, m, chunks)).peak_stash[r]
            ok = ok and peaks[name] == sim
            bytes_ = stats[0]["peak_stash_bytes"]
            ok = ok and (chunks > 1 or bytes_ == peaks[name] * stats[0]["stash_bytes_per_mb"][0] > 0)
        every = g.comm["pp"].allgather_object(peaks)
        ok = ok and peaks["gpipe"] == m and peaks["1f1b"] == p - r
        ok = ok and max(e["zb-h1"] for e in every) <= max(e["1f1b"] for e in every)
        detail = f"rank {r}: peaks {peaks}"
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_stash_lets_go_of_the_received_input_and_the_sent_output(grid, monkeypatch, recompute):
    """Once a forward has run, the first stage's output is sent and its data let go of (the stash
    keeps its graph for the backward) and the second stage's received input goes back to the
    buffer pool, its tensor keeping only its shape; a block rerun in backward (--recompute full)
    saved the input, which stays. The per-micro-batch stash bytes leave out what was let go of, and
    the step still equals one rank (float64)."""
    from mpirt.core.nn import kept_bytes
    g = grid(2)
    ok, detail = True, ""
    if g is not None:
        seen = []
        forward = PipelineStage._forward

        def watched(self, chunk, mb, inp, xs, ys):
            out, loss = forward(self, chunk, mb, inp, xs, ys)
            seen.append((inp, out, kept_bytes(out), inp.data.nbytes if inp is not None else 0, out.data.nbytes))
            return out, loss
        monkeypatch.setattr(PipelineStage, "_forward", watched)
        cfg = replace(TrainConfig(), pp=2, dp=1, dtype="float64", microbatches=4, batch_size=BATCH, seq_len=SEQ,
                      recompute=recompute, lr=LR, weight_decay=WD)
        engine = Engine(Layout.of(cfg, g.sizes, config(4)), config(4), g, Hyper.of(cfg), dropout_seed=0)
        x, y = batch(0, rows=BATCH)
        engine.train_step(x, y)
        first = g.coords["pp"] == 0
        inp, out, kept, in_bytes, out_bytes = seen[0]
        held = lambda t: int(t.data.base.nbytes if t.data.base is not None else t.data.nbytes)  # noqa: E731
        let_go = first or recompute == "none"  # the rerun block keeps the second stage's input
        ok = (held(out) < out_bytes) == first and (first or (held(inp) < in_bytes) == let_go)
        expected = kept - (out_bytes if first else 0) - (0 if first or not let_go else in_bytes)
        ok = ok and engine.local.stats["stash_bytes_per_mb"][0] == expected
        detail = f"pp rank {g.coords['pp']}: held out {held(out)} of {out_bytes}, " \
                 f"stash {engine.local.stats['stash_bytes_per_mb']} expected {expected}"
        engine.close()
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
def test_timers_and_bubble_are_reported(grid):
    g = grid(2)
    ok, detail = True, ""
    if g is not None:
        stage, *_, stats, _ = pipeline_run(g, config(4), "float32", "1f1b", 4, steps=2)
        s = stats[-1]
        ok = (s["op_count"] == {"F": 4, "B": 4, "W": 0} and 0 < s["compute_s"] <= s["step_s"]
              and 0 <= s["bubble"] < 1 and s["sync_s"] >= 0)
        detail = str(s)
    agree(ok, detail)


@pytest.mark.mpi(min_size=2)
def test_poll_wait_mode(grid):
    ok, detail, _, _ = parity(grid(2), config(4), "float64", "zb-h1", 4, steps=2, wait="poll")
    agree(ok, detail)


# --- pure partitioning (no MPI) --------------------------------------------------------------------
def test_partition_balances_cost():
    cfg = config(8)
    costs = layer_costs(cfg, SEQ)
    assert [c.name for c in costs] == ["embed"] + [f"h.{i}" for i in range(8)] + ["head"]
    bounds = partition(costs, 4)
    assert bounds[0][0] == 0 and bounds[-1][1] == 8 and all(hi > lo for lo, hi in bounds)
    stage_cost = [sum(c.flops for c in costs[lo + 1:hi + 1]) + (costs[0].flops if k == 0 else 0)
                  + (costs[-1].flops if k == 3 else 0) for k, (lo, hi) in enumerate(bounds)]
    # no contiguous split does better than the chosen one
    import itertools
    best = min(max(sum(c.flops for c in costs[a + 1:b + 1]) + (costs[0].flops if k == 0 else 0)
                   + (costs[-1].flops if k == 3 else 0) for k, (a, b) in enumerate(zip((0,) + cut, cut + (8,))))
               for cut in itertools.combinations(range(1, 8), 3))
    assert max(stage_cost) == best
    # a heavy head (large vocabulary) pushes blocks off the last stage
    big = GPTConfig(n_layer=8, n_head=2, n_embd=16, n_positions=SEQ, vocab_size=5000)
    b = partition(layer_costs(big, SEQ), 4)
    assert b[-1][1] - b[-1][0] < b[0][1] - b[0][0]
    assert partition(costs, 2, split=[5, 3]) == [(0, 5), (5, 8)]
    with pytest.raises(ValueError, match="cannot fill pp x chunks = 9"):
        partition(costs, 9)


def test_one_stage_is_the_plain_model():
    """pp = 1 (one rank holds embed, blocks and head, wte once): the executor alone."""
    g = Grid(dp=1, pp=1, tp=1, comm=Comm(MPI.COMM_SELF, "world"))
    for name in ("1f1b", "zb-h1"):
        ok, detail, stage, _ = parity(g, config(2), "float64", name, 2, steps=3)
        assert ok, detail
        assert [n for n, _ in stage.named_parameters()].count("wte.weight") == 1
