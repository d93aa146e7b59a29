"""The run's layout as data (mpirt.parallel.layout.Layout): every derived value in one table, pure
(no MPI), and the start-up's plan_layout returning it."""
from dataclasses import replace

import pytest

from mpirt.run.config import ConfigError, TrainConfig
from mpirt.core.modeling import load_model_config
from mpirt.parallel.layout import Layout, LayoutError
from mpirt.run.train import plan_layout

BASE = replace(TrainConfig(), batch_size=16)

# (config changes, sizes) -> (microbatches, rows, chunks, stages, sequence parallel, split backward)
CASES = [
    ({}, (1, 1, 1), (1, 16, 1, 1, False, False)),
    ({"grad_accum": 4}, (2, 1, 1), (4, 2, 1, 1, False, False)),
    ({"sequence_parallel": True}, (1, 1, 2), (1, 16, 1, 1, True, False)),
    ({"sequence_parallel": True}, (2, 1, 1), (1, 8, 1, 1, False, False)),     # no tp: no SP
    ({}, (1, 2, 1), (2, 8, 1, 2, False, False)),                              # pp: m defaults to pp
    ({"microbatches": 8, "schedule": "interleaved"}, (1, 2, 1), (8, 2, 2, 4, False, False)),
    ({"microbatches": 8, "schedule": "interleaved", "chunks": 3}, (1, 2, 1), (8, 2, 3, 6, False, False)),
    ({"microbatches": 4, "schedule": "zb-h1"}, (2, 2, 1), (4, 2, 1, 2, False, True)),
    ({"microbatches": 4, "schedule": "zb"}, (1, 2, 2), (4, 4, 1, 2, False, True)),
    ({"schedule": "interleaved", "grad_accum": 2}, (2, 1, 1), (2, 4, 1, 1, False, False)),  # no pp: no chunks
]


@pytest.mark.parametrize("changes, sizes, want", CASES, ids=str)
def test_derived_values(changes, sizes, want):
    lay = Layout.of(replace(BASE, **changes), dict(zip(("dp", "pp", "tp"), sizes)))
    got = (lay.microbatches, lay.rows, lay.chunks, lay.stages, lay.sequence_parallel, lay.split_backward)
    assert got == want
    assert dict(lay) == {**dict(zip(("dp", "pp", "tp"), sizes)), "cp": 1, "ep": 1} and lay.world_size == sizes[0] * sizes[1] * sizes[2]
    assert (lay.pipeline_schedule is None) == (sizes[1] == 1)


def test_positions_follow_the_grid_with_tp_innermost():
    lay = Layout.of(BASE, {"dp": 2, "pp": 2, "tp": 2})
    assert [tuple(lay.position(r).values()) for r in range(8)] == [
        (0, 0, 0, 0, 0), (0, 0, 0, 1, 0), (0, 1, 0, 0, 0), (0, 1, 0, 1, 0), (1, 0, 0, 0, 0), (1, 0, 0, 1, 0),
        (1, 1, 0, 0, 0), (1, 1, 0, 1, 0)]
    assert [lay.stage_rank(r) for r in range(8)] == [0, 0, 2, 2, 0, 0, 2, 2]
    lay = Layout.of(BASE, {"dp": 1, "pp": 2, "tp": 2, "cp": 2})              # cp between pp and tp
    assert [lay.position(r)["cp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [lay.stage_rank(r) for r in range(8)] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert lay.describe() == "dp 1 x pp 2 x cp 2 x tp 2, 1f1b schedule, 2 micro-batches"
    lay = Layout.of(BASE, {"dp": 4, "pp": 1, "tp": 2, "ep": 2})              # ep: the place in a group of dp ranks
    assert [lay.position(r)["ep"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert lay.describe() == "dp 4 x pp 1 x tp 2, experts over ep 2"


def test_plan_layout_resolves_dp_and_describes_itself():
    cfg = replace(BASE, pp=2, tp=2, zero=1, microbatches=4, schedule="zb-h1", sequence_parallel=True)
    lay = plan_layout(cfg, 8)
    assert isinstance(lay, Layout) and (lay.dp, lay.pp, lay.tp, lay.rows) == (2, 2, 2, 2)
    assert lay.describe() == "dp 2 x pp 2 x tp 2, ZeRO-1, zb-h1 schedule, 4 micro-batches, sequence parallel"
    assert Layout.of(cfg, lay) == lay and Layout.of(replace(cfg, microbatches=8), lay).rows == 1
    assert lay["cp"] == lay["ep"] == 1
    with pytest.raises(KeyError):
        lay["sp"]


# (config changes, world size) -> the refusal's start (each names the key to change)
REFUSALS = [
    ({"tp": 3}, 4, "dp/pp/tp: "),
    ({"dp": 3}, 4, "dp/pp/tp: "),
    ({"pp": 2, "grad_accum": 2}, 2, "grad_accum: with pp=2 the pipeline's micro-batches replace gradient"),
    ({"pp": 2, "microbatches": 3}, 2, "microbatches: the 16 rows per data-parallel replica (batch_size 16 / dp 1) "
                                      "do not split into 3 micro-batches"),
    ({"pp": 2, "schedule": "interleaved", "chunks": 1}, 2, "schedule: interleaved 1F1B needs chunks >= 2"),
    ({"sequence_parallel": True}, 2, "sequence_parallel: needs tp > 1"),
    ({"grad_accum": 3}, 2, "batch_size: the global batch 16 does not divide into dp=2 x grad_accum=3 = 6"),
    ({"cp": 3}, 4, "dp/pp/tp: world size 4 is not divisible by pp(1)*cp(3)*tp(1)=3"),
    ({"cp": 2, "seq_len": 10}, 2, "cp: seq_len 10 does not cut into 2 x cp = 4 equal chunks"),
    ({"ep": 4}, 2, "ep: 4 does not divide dp=2 (expert-parallel groups are carved out of the data-parallel ranks); "
                   "ep may be at most dp=2"),
    ({"ep": 3, "tp": 2}, 8, "ep: 3 does not divide dp=4"),
    ({"ep": 2, "zero": 3}, 2, "zero: ZeRO-3 shards the parameters over dp, the experts under ep=2"),
]


@pytest.mark.parametrize("changes, world, message", REFUSALS, ids=str)
def test_refusals(changes, world, message):
    cfg = replace(BASE, **changes)
    with pytest.raises(LayoutError) as err:
        Layout.resolve(cfg, world)
    assert str(err.value).startswith(message), str(err.value)
    with pytest.raises(ConfigError, match="^" + message.split(":")[0] + ":"):  # the start-up's form: one line
        plan_layout(cfg, world)


def test_model_refusals():
    tiny = load_model_config("tiny", {})                       # 4 layers, 4 heads, n_embd 128
    lay = Layout.resolve(replace(BASE, pp=2, microbatches=4, schedule="interleaved", chunks=3), 2)
    with pytest.raises(LayoutError, match="^pp: n_layer=4 cannot fill pp x chunks = 6 pipeline stages"):
        lay.check_model(BASE, tiny)
    with pytest.raises(LayoutError, match="^tp: tensor parallelism: tp=8 must divide n_head=4"):
        Layout.resolve(replace(BASE, tp=8), 8).check_model(BASE, tiny)
    Layout.resolve(replace(BASE, tp=2), 2).check_model(BASE, tiny)  # fits
    mlp, moe = load_model_config("mlp", {}), load_model_config("mixtral-tiny", {})
    for changes, model, message in [
        ({"seq_len": tiny.n_positions + 1}, tiny, f"seq_len: {tiny.n_positions + 1} exceeds the model's n_positions"),
        ({"recompute": "selective"}, mlp, "recompute: model_type 'mlp' names no attention core"),
        ({"recompute": "full", "recompute_layers": "2,9"}, tiny,
         "recompute_layers: block 9 does not exist (n_layer=4)"),
        ({"cp": 2}, mlp, "cp: model_type 'mlp' has no attention to split a sequence over"),
        ({"cp": 2}, moe, "cp: model_type 'mixtral' routes each sequence's tokens together"),
        ({"tp": 2, "sequence_parallel": True}, moe, "sequence_parallel: model_type 'mixtral' routes each sequence's"),
        ({"cp": 2, "tp": 4, "sequence_parallel": True, "seq_len": 12}, tiny,
         "tp: tensor parallelism: tp=4 must divide seq_len=6"),
        ({"ep": 2, "dp": 2}, tiny, "ep: model_type 'gpt2' has no experts to split"),
        ({"ep": 4, "dp": 4}, replace(moe, n_expert=6), "ep: 4 does not divide the model's n_expert=6"),
    ]:
        cfg = replace(BASE, **changes)
        with pytest.raises(LayoutError) as err:
            Layout.resolve(cfg, max(cfg.dp, 1) * cfg.cp * cfg.tp).check_model(cfg, model)
        assert str(err.value).startswith(message) and err.value.key == message.split(":")[0], str(err.value)


# (config changes, sizes) -> (stage bounds, recomputed blocks) of the 4-block tiny model
MODEL_CASES = [
    ({}, (1, 1, 1), (((0, 4),), ())),
    ({"recompute": "full"}, (2, 1, 1), (((0, 4),), (0, 1, 2, 3))),
    ({"recompute": "selective", "recompute_layers": "1,3"}, (1, 1, 2), (((0, 4),), (1, 3))),
    ({"zero": 3}, (2, 1, 1), (((0, 4),), (0, 1, 2, 3))),                    # ZeRO-3's units always rerun
    ({"zero": 3, "microbatches": 4, "schedule": "zb-h1"}, (2, 2, 1), (((0, 2), (2, 4)), (0, 1, 2, 3))),  # in stages
    ({"recompute": "full", "recompute_layers": "0-1"}, (1, 2, 1), (((0, 2), (2, 4)), (0, 1))),
    ({"schedule": "interleaved", "microbatches": 4, "chunks": 2}, (1, 2, 1), (((0, 1), (1, 2), (2, 3), (3, 4)), ())),
]


@pytest.mark.parametrize("changes, sizes, want", MODEL_CASES, ids=str)
def test_stage_bounds_and_recomputed_blocks(changes, sizes, want):
    from mpirt.core.modeling import layer_costs
    from mpirt.parallel.pipeline.partition import partition

    tiny = load_model_config("tiny", {})
    cfg = replace(BASE, **changes)
    lay = Layout.of(cfg, dict(zip(("dp", "pp", "tp"), sizes)), tiny)
    assert (lay.bounds, lay.recomputed) == want
    if lay.pp > 1:  # the pipeline stage builds from the same partition
        assert list(lay.bounds) == partition(layer_costs(tiny, cfg.seq_len), lay.stages)
    assert Layout.of(cfg, lay).bounds == ()  # without the model: none


def test_slurm_reads_layout_refusals_as_its_flags():
    import dataclasses

    from mpirt.run.slurm import JobSpec, SlurmScriptError, job_layout

    spec = JobSpec(ntasks_per_node=4, tp=2, model="tiny")
    assert job_layout(spec) == Layout.of(TrainConfig(), {"dp": 2, "pp": 1, "tp": 2})
    for changes, message in [({"tp": 3}, "--dp/--tp/--pp: "), ({"tp": 4, "model": "mlp"}, "--tp: "),
                             ({"tp": 1, "train_args": ["--sequence-parallel"]},
                              "training arguments: sequence_parallel: needs tp > 1"),
                             ({"train_args": ["--recompute-layers", "7", "--recompute", "full"]},
                              "training arguments: recompute_layers: block 7 does not exist (n_layer=4)")]:
        with pytest.raises(SlurmScriptError) as err:
            job_layout(dataclasses.replace(spec, **changes))
        assert str(err.value).startswith(message), str(err.value)
