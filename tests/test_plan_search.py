"""The planner search's shortcuts answer what the direct computation answers: the remembered
activation peaks behind ``recompute_pays`` (shared over ZeRO 0-2 and over the recomputation
modes' common "none"), for every pipeline stage, and memory pruning on the layout's sizes alone.
Pure: no MPI."""
import dataclasses

import pytest

from mpirt.core.modeling import load_model_config
from mpirt.parallel.layout import Layout
from mpirt.plan import memory
from mpirt.run.config import TrainConfig


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_remembered_recompute_decision_is_the_direct_comparison(schedule, recompute):
    model = dataclasses.replace(load_model_config("tiny", {}), attn_pdrop=0.1)
    for zero in (0, 1, 2):
        cfg = dataclasses.replace(TrainConfig(), dp=2, pp=2, tp=1, microbatches=4, seq_len=64, batch_size=16,
                                  schedule=schedule, chunks=2 if schedule == "interleaved" else 1, zero=zero,
                                  recompute=recompute)
        lay = Layout.of(cfg, {"dp": 2, "pp": 2, "tp": 1}, model)
        for rank in (0, 1):  # the two stages' first ranks
            for mode in (recompute, "none"):
                assert memory._activation_peak(cfg, model, lay, rank, mode) == \
                    memory._predict(cfg, model, lay, rank, recompute=mode)[1], (zero, rank, mode)
            direct = memory._predict(cfg, model, lay, rank)[1] < memory._predict(cfg, model, lay, rank,
                                                                                  recompute="none")[1]
            assert memory.recompute_pays(cfg, model, lay, rank) == direct, (zero, rank)
    # a model changed in place is another key: the answer follows it
    model.n_embd *= 2
    again = memory._predict(cfg, model, lay, 0)[1] < memory._predict(cfg, model, lay, 0, recompute="none")[1]
    assert memory.recompute_pays(cfg, model, lay, 0) == again


def test_memory_pruning_without_the_engine_layout_predicts_the_same_peaks():
    """The search prunes by :func:`peak_memory` on the layout's sizes alone (each rank's prediction
    decides its own stage's recomputation); the engine's layout gives the same per-rank peaks."""
    from mpirt.plan import hardware
    from mpirt.plan.model import _engine_layout, peak_memory

    model = dataclasses.replace(load_model_config("tiny", {}), attn_pdrop=0.1)
    cluster = hardware.load("h100").with_shape(1, 8)
    for recompute in ("none", "selective", "full"):
        cfg = dataclasses.replace(TrainConfig(), dp=2, pp=4, tp=1, microbatches=8, seq_len=64, batch_size=16,
                                  schedule="zb-h1", zero=1, recompute=recompute, dtype="bfloat16")
        plain = peak_memory(cfg, model, cluster, memory_ranks="all")
        engine = peak_memory(cfg, model, cluster, memory_ranks="all", layout=_engine_layout(cfg, model))
        assert plain["per_rank"] == engine["per_rank"], recompute
