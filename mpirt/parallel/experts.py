"""Expert parallelism: a mixture of experts' experts split over the ``ep`` ranks of an ep group.

The ep groups are carved out of dp (:class:`mpirt.parallel.grid.Grid`: ``ep`` consecutive dp
ranks; ``edp`` the ranks at the same place in their groups). Each rank of an ep group holds
``E / ep`` whole experts of every MoE layer (its slice of the stacked ``(E, C, F)`` expert
weights, ``ShardSpec(("ep", None, None))``) and routes its own tokens (the router is replicated).
A layer's experts then run as:

1. counts: every rank tells every other how many of its rows go to each of the other's experts
   (one all-to-all of ``E / ep`` integers per pair);
2. dispatch: the rows, already grouped by global expert (so by destination rank), go to the
   ranks holding their experts (``MPI_Alltoallv``); the receiver regroups them by its local
   expert (source order kept within an expert) and runs the grouped SwiGLU GEMMs;
3. combine: the outputs go back the same way, in the order their rows came.

Forward and backward are two all-to-alls each (the backward of a dispatch is a combine of the
gradients, and the reverse); every rank takes part in all of them even when it sends or
receives no row (an expert nobody chose). Exact: a token's output is its expert's rows'
product as on one rank, and an expert's weight gradient sums the same rows' contributions (in
another order).

Gradients: the dense parameters (attention, norms, the router, the embedding) are averaged over
dp as always. An expert's gradient on its rank already sums the contributions of the whole ep
group's tokens (each seeded with its own rank's loss); summing over edp adds the other groups',
and dividing by dp makes the global batch's mean. So the grouped GEMMs scale the experts' weight
gradients by ``1 / ep`` (exact for powers of two) and their own store is averaged over edp
(a parameter group of its own, synced by DataParallel or ZeRO over ``grid.comm["edp"]``,
:mod:`mpirt.parallel.groups`).
The global norm counts an expert's elements once: summed over ep (different experts), not over
edp (replicas).
"""
from __future__ import annotations

import numpy as np

from mpirt.core.injected import injected
from mpirt.core.nn import Module, ShardSpec
from mpirt.core.ops.moe import grouped_swiglu
from mpirt.core.tensor import Function
from mpirt.parallel.step_simulation import Op

AXIS = "ep"
EXPERT_SPEC = ShardSpec((AXIS, None, None))  # stacked expert weights (E, C, F): whole experts per rank
# What the MPI library keeps after a rank's first all-to-all of rows, per peer: MPICH's shared-memory
# transport grows a pool of message buffers and keeps it (measured here, MPICH 5.0, MPI_Alltoallv of
# 0.5-2 MiB rows: 1.0 MiB per peer, 1-3 MiB at 4 ranks, whatever the rows' size); the memory
# prediction counts it under ep (mpirt.plan.memory)
EXCHANGE_POOL_BYTES_PER_PEER = 2**20


def routed_bytes(layout, model_cfg, dtype: str) -> int:
    """A rank's routed rows of one MoE layer and micro-batch, evenly routed: its tokens x top_k rows
    of ``n_embd`` (each all-to-all's send buffer, out and back, forward and backward)."""
    return layout.rows * layout.tokens * getattr(model_cfg, "top_k", 1) * model_cfg.n_embd * np.dtype(dtype).itemsize


def count_bytes(layout, model_cfg) -> int:
    """The expert counts' all-to-all before the rows move: an int64 count per expert."""
    return model_cfg.n_expert // layout.ep * 8 * layout.ep


def exchange_program(label: str, backward: bool, counts: int, routed: int, dtype: str) -> list[Op]:
    """One MoE layer's all-to-alls on the ep group as the pre-flight proof's operations (what
    :class:`TokenExchange` runs): forward, the expert counts (``counts`` bytes of int64,
    :func:`count_bytes`), the rows out and the outputs back (``routed``, :func:`routed_bytes`);
    backward, the outputs' gradient out and the rows' gradient back."""
    if backward:
        return [Op("alltoall", "ep", routed, label=f"{label} {step}", dtype=dtype)
                for step in ("outputs' gradient out", "rows' gradient back")]
    return [Op("alltoall", "ep", counts, label=f"{label} expert counts", dtype="int64"),
            Op("alltoall", "ep", routed, label=f"{label} rows out", dtype=dtype),
            Op("alltoall", "ep", routed, label=f"{label} outputs back", dtype=dtype)]


def _inverse(order: np.ndarray) -> np.ndarray:
    inv = np.empty_like(order)
    inv[order] = np.arange(len(order))
    return inv


class TokenExchange(Function):
    """Rows to the ranks of ``comm``: ``x[before]`` (or ``x``), its first ``send[0]`` rows to rank
    0, the next ``send[1]`` to rank 1, ...; the rows received (in rank order), taken in ``after``
    order. The backward sends the gradient back the reverse way (an all-to-all with the counts
    swapped). Collective over ``comm`` in forward and backward."""

    def forward(self, x, comm=None, send=(), before=None, after=None):
        rows, self.recv = comm.alltoallv(x if before is None else x[before], send)
        self.comm, self.before, self.after = comm, before, after
        return rows if after is None else rows[after]

    def backward(self, g):
        if self.after is not None:
            g = g[_inverse(self.after)]
        back, _ = self.comm.alltoallv(g, self.recv)
        return (back if self.before is None else back[_inverse(self.before)],)


class ExpertParallel:
    """The hook a MoE layer runs its experts through under ep (``MoEMLP.expert_parallel``): this
    rank holds experts ``[rank * E / ep, (rank + 1) * E / ep)`` of the ep ``comm``."""

    def __init__(self, comm, n_expert: int):
        if n_expert % comm.size:
            raise ValueError(f"ep: {comm.size} does not divide n_expert={n_expert}")
        self.comm, self.n_expert, self.local = comm, n_expert, n_expert // comm.size
        # rows run, assignments and the busiest expert's load of the training forwards since the monitor last read them
        self.routed = [0, 0, 0.0]

    def run(self, x, counts, w_gate, w_up, w_down, assignments: int):
        """The experts' outputs for rows ``x`` (M, C) grouped by global expert (``counts[e]`` rows
        for expert e), in the same order; ``w_*`` this rank's experts' weights; ``assignments``:
        this rank's tokens x top_k, the rows it would run under even routing (the load's
        denominator, :meth:`take_load`). Collective over ep."""
        ep, local = self.comm.size, self.local
        sent = np.asarray(counts, dtype=np.int64).reshape(ep, local)   # rows for each rank's experts
        got, _ = self.comm.alltoallv(sent, [1] * ep)                     # (ep, local): from each source
        local_ids, per_expert = np.arange(local), got.sum(axis=0)
        if x.requires_grad:  # what a training step keeps for backward (an evaluation keeps nothing)
            self.routed[0] += int(got.sum())
            self.routed[1] += assignments
            # an expert's even share of the group's assignments is assignments * ep / E = assignments / local
            self.routed[2] = max(self.routed[2], int(per_expert.max()) * local / assignments if assignments else 0.0)
        if local > 1 and injected("ep-expert-swap"):  # test-only (mpirt.core.injected): rows meet the wrong weights
            local_ids, per_expert = local_ids[::-1], per_expert[::-1]
        expert_of_row = np.repeat(np.tile(local_ids, ep), got.reshape(-1))  # source-major rows
        order = np.argsort(expert_of_row, kind="stable")                 # grouped by local expert
        xs = TokenExchange.apply(x, comm=self.comm, send=sent.sum(axis=1), after=order)
        ys = grouped_swiglu(xs, w_gate, w_up, w_down, per_expert, weight_grad_scale=1.0 / ep)  # the group's mean
        return TokenExchange.apply(ys, comm=self.comm, send=got.sum(axis=1), before=_inverse(order))

    def take_load(self) -> tuple[int, int, float]:
        """``(rows this rank's experts ran, this rank's assignments, busiest)`` over the training
        forwards since the last call: the first two's ratio is the rank's expert load, ``busiest``
        the most rows one of its experts ran in one forward over an expert's even share of the
        group's assignments (1: even routing), the two loads the memory prediction plans for."""
        taken, self.routed = tuple(self.routed), [0, 0, 0.0]
        return taken


def expert_layers(model: Module) -> list:
    """The modules of ``model`` that hold stacked experts (a ``expert_parallel`` hook)."""
    return [m for _, m in model.named_modules() if hasattr(m, "expert_parallel")]


def parallelize_experts(model: Module, comm) -> Module:
    """Split every MoE layer's experts over the ep ``comm`` in place: the stacked weights get
    :data:`EXPERT_SPEC` and this rank's shape (lazy: initialise or load them afterwards, e.g.
    ``model.initialize(seed, {"ep": ep}, {"ep": rank})``) and the layer its
    :class:`ExpertParallel` hook. Nothing changes when ``comm`` has one rank. Returns ``model``."""
    if comm.size == 1:
        return model
    for layer in expert_layers(model):
        hook = ExpertParallel(comm, layer.n_expert)
        for p in layer.expert_weights():
            p.spec = EXPERT_SPEC
            p.defer(EXPERT_SPEC.local_shape(p.global_shape, {AXIS: comm.size}))
        layer.expert_parallel = hook
    return model


def is_expert(p) -> bool:
    """Whether ``p`` is split over ep (an expert's weight)."""
    return AXIS in p.spec.dims
