"""Pipeline partitioning: the contiguous split of the layers
``[embed, h.0, ..., h.{L-1}, head]`` into ``S = pp * chunks`` virtual stages.

    bounds = partition(layer_costs(model_cfg, seq_len), stages=pp * chunks)   # [(lo, hi), ...]

The costs per layer come from the model type (``layer_costs_of``, :func:`mpirt.core.modeling.layer_costs`).

:func:`partition` either validates a user ``split`` (blocks per stage) or finds the split that
minimises the most expensive stage (embed counted on the first, head on the last). Pure Python:
no MPI, no arrays; :class:`mpirt.parallel.pipeline.stage.PipelineStage` uses it to pick its layers.
"""
from __future__ import annotations

import functools

from mpirt.core.modeling import LayerCost, layer_costs

__all__ = ["LayerCost", "layer_costs", "partition"]  # the costs come from the model type (mpirt.core.modeling)


def partition(costs: list, stages: int, split=None, balance: str = "flops") -> list:
    """Block ranges ``[(lo, hi), ...]`` of the ``stages`` virtual stages (``costs`` as from
    :func:`layer_costs`: embed, blocks, head). ``split`` (blocks per stage) is validated and
    used as given; otherwise the contiguous split minimising the most expensive stage (embed
    counted on the first, head on the last; by ``"flops"`` or ``"params"``)."""
    n = len(costs) - 2
    if split is not None:
        split = [int(k) for k in split]
        if len(split) != stages or any(k < 1 for k in split) or sum(split) != n:
            raise ValueError(f"split {split}: need {stages} stages (pp x chunks) of >= 1 blocks each, "
                             f"summing to n_layer={n}")
    else:
        if n < stages:
            raise ValueError(f"n_layer={n} cannot fill pp x chunks = {stages} virtual stages with at least one "
                             "block each: use fewer stages or chunks")
        if balance not in ("flops", "params"):
            raise ValueError(f"balance: expected flops or params, got {balance!r}")
        split = _min_max_split(tuple(getattr(x, balance) for x in costs), stages)
    bounds, lo = [], 0
    for k in split:
        bounds.append((lo, lo + k))
        lo += k
    return bounds


@functools.lru_cache(maxsize=1024)  # the planner asks for the same split of a model many times
def _min_max_split(w: tuple, stages: int) -> list:
    """Blocks per stage of the contiguous split of blocks ``w[1:-1]`` into ``stages`` minimising
    the most expensive stage (``w[0]``, the embedding, counted on the first; ``w[-1]``, the head,
    on the last): dynamic programming over (stage, blocks so far)."""
    n = len(w) - 2
    pre = [0.0]
    for x in w[1:-1]:
        pre.append(pre[-1] + x)

    def cost(k, i, j):  # blocks i..j-1 as stage k
        return pre[j] - pre[i] + (w[0] if k == 0 else 0.0) + (w[-1] if k == stages - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                val = max(best[k - 1][i], cost(k - 1, i, j))
                if val < best[k][j] - 1e-9 * abs(val):
                    best[k][j], arg[k][j] = val, i
    split, j = [], n
    for k in range(stages, 0, -1):
        i = arg[k][j]
        split.append(j - i)
        j = i
    split.reverse()
    return split
