"""ZeRO composed with tensor and pipeline parallelism (the distributed optimizer), end to end through
:class:`mpirt.parallel.engine.Engine`, against the single-rank run on the same global batches.

ZeRO-1/2 shard the optimizer state (and gradients) over the dp group of each (pp, tp) coordinate;
ZeRO-3 shards the tp slices of the parameters over dp. After >= 5 clipped AdamW steps every rank's
slices of the weights, the losses and the global norms equal the single-rank run's (float64,
1e-10). Each test splits the world into groups of the size it needs; leftover ranks only vote.
"""
from dataclasses import replace
from functools import partial

import numpy as np
import pytest

from mpirt.run.config import TrainConfig
from mpirt.parallel.grid import Grid
from mpirt.parallel.engine import Engine, Hyper
from mpirt.parallel.layout import Layout
from mpirt.parallel.tensor import shard_state_dict
from mpirt.parallel.zero import ZeroOptimizer

from conftest import agree
from parity import CFG as MODEL, SEQ, STEPS, Reference, max_rel_err, reference_run, rel_err
from parity import batch as parity_batch  # this module's parity() is the check below

ROWS, CLIP = 8, 0.05
batch = partial(parity_batch, rows=ROWS, token_seed=3)


def engine_of(cfg, model, grid) -> Engine:
    """The engine of ``cfg``'s layout on ``grid``."""
    return Engine(Layout.of(cfg, grid.sizes, model), model, grid, Hyper.of(cfg), dropout_seed=0)


def train_config(dp, pp, tp, zero, **kw) -> TrainConfig:
    return replace(TrainConfig(), dp=dp, pp=pp, tp=tp, zero=zero, dtype="float64", seed=5, lr=1e-2, beta1=0.9,
                   beta2=0.95, weight_decay=0.1, batch_size=ROWS, seq_len=SEQ,
                   **{"microbatches": 2 if pp > 1 else 0, "schedule": "1f1b", **kw})


def reference(cfg: TrainConfig, model=MODEL) -> Reference:
    """The single-rank run of ``model`` with ``cfg``'s seed and AdamW settings."""
    return reference_run("float64", cfg=model, seed=cfg.seed, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                         weight_decay=cfg.weight_decay, clip=CLIP, rows=ROWS, token_seed=3)


def local_weights(engine) -> dict:
    """This rank's (tp-sliced) weights, full over dp."""
    opt = engine.optimizer
    if isinstance(opt, ZeroOptimizer) and opt.stage == 3:
        with opt.full_parameters():
            return {n: p.data.copy() for n, p in engine.model.named_parameters()}
    return {n: p.data.copy() for n, p in engine.model.named_parameters()}


def run(engine, grid, steps=STEPS):
    losses, norms = [], []
    d, dp = grid.coords["dp"], grid.dp
    for step in range(steps):
        x, y = batch(step, d, dp)
        losses.append(engine.train_step(x, y))
        norms.append(engine.clip(CLIP))
        engine.optimizer.step()
    return np.array(losses), np.array(norms)


def parity(group, dp, pp, tp, zero, model=MODEL, **kw):
    comm = group(dp * pp * tp)
    if comm is None:
        agree(True)
        return
    grid = Grid(dp=dp, pp=pp, tp=tp, comm=comm)
    cfg = train_config(dp, pp, tp, zero, **kw)
    engine = engine_of(cfg, model, grid)
    losses, norms = run(engine, grid)
    weights = local_weights(engine)
    ref = reference(cfg, model)
    ref_w = {n: ref.weights[n] for n in weights}
    ref_w = shard_state_dict(engine.model, ref_w, {"tp": tp}, {"tp": grid.coords["tp"]})
    errs = {"loss": rel_err(losses, ref.losses), "norm": rel_err(norms, ref.norms),
            "weights": max_rel_err(weights, ref_w, np.inf, whole=True)}
    engine.close()
    grid.free()
    agree(min(ref.norms) > CLIP and max(errs.values()) <= 1e-10,
          f"zero={zero} dp{dp} pp{pp} tp{tp} {kw}: errors {errs}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_with_tp_matches_single_rank(zero, group):
    parity(group, dp=2, pp=1, tp=2, zero=zero)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_with_pp_matches_single_rank(zero, group):
    parity(group, dp=2, pp=2, tp=1, zero=zero)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_with_pp_and_a_shard_inside_the_tied_copy(zero, group):
    """A vocabulary of 4096 makes the last stage's tied embedding copy (uncounted in the norm)
    larger than a ZeRO shard, so one dp rank's shard holds no counted element: its part of the
    norm is an exact zero that must still travel as float64 (it once went as int64 and its peers
    read a norm of 2e9)."""
    wide = replace(MODEL, vocab_size=4096)
    parity(group, dp=2, pp=2, tp=1, zero=zero, model=wide)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_with_tp_and_pp_matches_single_rank(zero, group):
    parity(group, dp=2, pp=2, tp=2, zero=zero, sequence_parallel=True)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_zero3_with_tp_matches_single_rank(sequence_parallel, group):
    parity(group, dp=2, pp=1, tp=2, zero=3, sequence_parallel=sequence_parallel)


@pytest.mark.mpi(min_size=4)
def test_zero2_with_sequence_parallel_tp_matches_single_rank(group):
    parity(group, dp=2, pp=1, tp=2, zero=2, sequence_parallel=True)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule, microbatches", [("1f1b", 2), ("gpipe", 2), ("zb-h1", 4)])
def test_zero3_with_pp_matches_single_rank(schedule, microbatches, group):
    """ZeRO-3 inside each pipeline stage: its embed, blocks and head are units gathered for every
    micro-batch's forward and backward (zb-h1: a micro-batch's gradients stay apart from B to
    W), the tied embedding's gradient shards summed over the pipeline ends. (The interleaved
    schedule needs more blocks than this model's two: tests/test_train_parallel.py runs it.)"""
    parity(group, dp=2, pp=2, tp=1, zero=3, schedule=schedule, microbatches=microbatches)


@pytest.mark.mpi(min_size=8)
def test_zero3_with_tp_and_pp_matches_single_rank(group):
    parity(group, dp=2, pp=2, tp=2, zero=3, sequence_parallel=True, schedule="zb-h1", microbatches=4)


@pytest.mark.mpi(min_size=8)
def test_sharded_checkpoint_moves_between_zero_pp_and_plain_tp(group):
    """A ZeRO-1 x pp2 x tp2 checkpoint (dp2) loads into ZeRO-0 x tp2 (dp4) and continues the
    uninterrupted run's loss curve."""
    import tempfile

    from mpirt.checkpoint.store import CheckpointReader
    from mpirt.checkpoint.sharded import save_sharded

    comm = group(8)
    if comm is None:
        agree(True)
        return
    root = comm.broadcast_object(tempfile.mkdtemp() if comm.rank == 0 else None)
    first = engine_of(train_config(2, 2, 2, 1), MODEL, g1 := Grid(dp=2, pp=2, tp=2, comm=comm))
    run(first, g1, steps=3)
    path = save_sharded(root, comm, first.save_sharded, step=3, config={}, extra=None,
                        optimizer={"type": "AdamW", "scalars": first.optimizer.scalars()})
    first.close()
    g1.free()
    second = engine_of(train_config(4, 1, 2, 0), MODEL, g2 := Grid(dp=4, pp=1, tp=2, comm=comm))
    second.load_sharded(CheckpointReader(path))
    d = g2.coords["dp"]
    losses = []
    for step in range(3, STEPS):
        x, y = batch(step, d, 4)
        losses.append(second.train_step(x, y))
        second.clip(CLIP)
        second.optimizer.step()
    ref_losses = reference(train_config(1, 1, 1, 0)).losses
    err = rel_err(losses, ref_losses[3:])
    second.close()
    g2.free()
    agree(err <= 1e-10, f"resumed losses {losses} vs {ref_losses[3:]}: {err}")
