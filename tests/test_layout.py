"""The run's layout as data (mpirt.parallel.layout.Layout): every derived value in one table, pure
(no MPI), and the start-up's plan_layout returning it."""
from dataclasses import replace

import pytest

from mpirt.config import TrainConfig
from mpirt.parallel.layout import Layout
from mpirt.train import plan_layout

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
    assert dict(lay) == dict(zip(("dp", "pp", "tp"), sizes)) and lay.world_size == sizes[0] * sizes[1] * sizes[2]
    assert (lay.pipeline_schedule is None) == (sizes[1] == 1)


def test_positions_follow_the_grid_with_tp_innermost():
    lay = Layout.of(BASE, {"dp": 2, "pp": 2, "tp": 2})
    assert [tuple(lay.position(r).values()) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [lay.stage_rank(r) for r in range(8)] == [0, 0, 2, 2, 0, 0, 2, 2]


def test_plan_layout_resolves_dp_and_describes_itself():
    cfg = replace(BASE, pp=2, tp=2, zero=1, microbatches=4, schedule="zb-h1", sequence_parallel=True)
    lay = plan_layout(cfg, 8)
    assert isinstance(lay, Layout) and (lay.dp, lay.pp, lay.tp, lay.rows) == (2, 2, 2, 2)
    assert lay.describe() == "dp 2 x pp 2 x tp 2, ZeRO-1, zb-h1 schedule, 4 micro-batches, sequence parallel"
    assert Layout.of(cfg, lay) is lay
    with pytest.raises(KeyError):
        lay["cp"]
