"""The performance model: one training step of a layout on a cluster, predicted part by part.

    est = estimate(cfg, model_cfg, cluster)   # cfg: a TrainConfig (dp, tp, pp, schedule, zero, ...)
    est.step_s, est.parts, est.memory, est.comm, est.bubble, est.bottleneck

- **Compute** per pass (F, B, W) of each layer (:mod:`mpirt.plan.work`): GEMM FLOPs at the
  cluster's GEMM rate for the pass's smallest dimension, plus the elementwise bytes at the memory
  bandwidth, plus the autograd Functions at ``op_overhead_s`` each. On a CPU node whose ranks
  outnumber its cores, every rank runs at ``cores / ranks`` of a core (a rank waiting in MPI spins:
  MPICH) and the Python overhead stretches alike; one rank alone uses the node's cores.
- **Communication**, alpha-beta per collective: ring allreduce ``2(g-1) (a + n/(g b))``,
  reduce-scatter and allgather ``(g-1)(a + n/(g b))``, p2p ``a + n/b``; intra-node links while the
  group fits in a node, else the inter-node ones. A calibrated CPU preset uses the (alpha, beta)
  measured for that op at that world and group size instead.
- **Pipeline**: the schedule's own action lists (``schedules.build``) run by
  ``pipeline.check.timed`` (proved once per schedule, then its run's order replayed) with each
  action's predicted time and each message's p2p time: the makespan and each rank's idle time
  (the bubble) come from the lists the executor runs.
- **Data parallel**, where mpirt's engines run it: DDP's bucketed allreduce overlaps the last
  micro-batch's backward where the cluster progresses MPI on its own (``overlap``), else it is
  exposed; ZeRO-1's allreduce and allgather run in ``step()`` (exposed); ZeRO-2 reduce-scatters
  each micro-batch's gradients inside its backward (blocking: part of each B, or W) and allgathers
  in ``step()``; ZeRO-3 gathers and reduce-scatters per unit and micro-batch.
- **Optimizer**: clipping's pass over the gradients and AdamW over the local shard: per tensor
  and per byte as calibrated (else ~12 array passes of 4 bytes).
- A calibrated CPU preset holds, per rank count N, how much slower a block runs on each of N
  concurrent ranks than on one alone (``compute_by_ranks``): that replaces ``cores / N`` at that N.
- **Memory**: :func:`mpirt.plan.memory.predict` for rank 0 and the last stage's first rank (or all),
  with the cluster's calibrated process baseline (:func:`mpirt.plan.memory.planned_baseline`).

Over 400 lines: the parts above are one model of one step; each is a function of its own, kept
beside the others it is added to.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

from mpirt.parallel.context import ring_message_bytes
from mpirt.parallel.experts import routed_bytes
from mpirt.parallel.layout import Layout
from mpirt.parallel.pipeline.stage import message_bytes
from mpirt.parallel.pipeline.schedules import BACKWARD, FORWARD, WEIGHT
from mpirt.plan.hardware import Cluster
from mpirt.plan.work import Work, layer_work, tensors_per_block

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "p2p")


def coll_time(cluster: Cluster, op: str, nbytes: float, group: int, world: int, spans_nodes: bool) -> float:
    """Seconds of one ``op`` of ``nbytes`` (the full buffer: allreduce's input, allgather's output,
    reduce-scatter's input) over ``group`` ranks of a ``world``-rank job (see the module docstring)."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    measured = cluster.collectives.get(world, {}).get(group, {})
    fit = measured.get(op) or (measured.get("allgather") if op == "reduce_scatter" else None)
    if fit:
        return fit[0] + fit[1] * nbytes
    a, b = (cluster.inter_latency, cluster.inter_bandwidth) if spans_nodes else \
        (cluster.intra_latency, cluster.intra_bandwidth)
    g = group
    if op == "p2p":
        return a + nbytes / b
    if op == "allreduce":
        return 2 * (g - 1) * (a + nbytes / (g * b))
    return (g - 1) * (a + nbytes / (g * b))


@dataclass
class Estimate:
    """What :func:`estimate` predicts for one layout (times in seconds, per step)."""

    layout: dict
    step_s: float
    parts: dict              # forward, backward, weight_grad, bubble, grad_sync, optimizer, other (rank 0's view)
    comm: dict               # per axis: {"bytes", "s"} per rank per step
    bubble: float            # idle over total inside the pipeline schedule (all ranks)
    memory: dict             # the largest rank's categories + "peak"; "per_rank": {rank: peak}
    tokens_per_s: float
    mfu: float
    bottleneck: str
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Machine:
    """Times of work items on one rank of a ``world``-rank job on ``cluster``."""

    def __init__(self, cluster: Cluster, world: int, dtype: str):
        self.c, self.world, self.dtype = cluster, world, dtype
        per_node = min(world, cluster.devices_per_node) if cluster.cores == 0 else world // max(cluster.nodes, 1) or 1
        self.table, self.bandwidth = cluster.gemm_rates, cluster.memory_bandwidth
        self.op_s, self.ew_passes = cluster.op_overhead_s, cluster.ew_passes
        self.opt = (cluster.opt_tensor_s, cluster.opt_byte_s) if cluster.opt_byte_s or cluster.opt_tensor_s else None
        measured = cluster.compute_by_ranks.get(per_node) if cluster.cores and per_node > 1 else None
        if measured:  # each of per_node concurrent ranks, measured at --calibrate: its slowdown
            self.share = self.python_share = 1.0 / measured["slowdown"]
        elif cluster.cores:
            threads = max(1, int(cluster.cores // per_node))
            share = min(float(threads), cluster.cores / per_node)
            # one rank with two threads: the measured speed-up of the second thread
            self.share = 1 + (share - 1) * cluster.threads_per_core if share > 1 else share
            self.python_share = min(1.0, cluster.cores / per_node)
        else:
            self.share = self.python_share = 1.0
        self.rate = cluster.peak(dtype) * cluster.gemm_efficiency

    def gemm_rate(self, d: float) -> float:
        """FLOP/s of one core (device) on GEMMs whose smallest dimension is ``d``."""
        table = self.table
        if table:
            dims = sorted(table)
            return float(np.interp(np.log(d), np.log(dims), [table[k] for k in dims]))
        return self.rate * d / (d + self.c.gemm_half_dim)

    def compute(self, w: Work, ew_share: float) -> float:
        gemm = sum(f / (self.gemm_rate(d) * self.share) for f, d in [(w.gemm_flops, w.gemm_dim), *w.more_gemms] if f)
        ew = w.ew_bytes * self.ew_passes * ew_share / (self.bandwidth * self.share)
        return gemm + ew + w.ops * self.op_s / self.python_share

    def optimizer(self, tensors: float, shard_bytes: float, grad_bytes: float) -> float:
        """Clipping (a pass over the gradients) and AdamW over this rank's shard: measured per
        tensor and per byte where calibrated, else ~12 passes of 4 bytes per parameter."""
        clip = grad_bytes / (self.bandwidth * self.share) + tensors * self.op_s / self.python_share
        if self.opt:
            return clip + tensors * self.opt[0] + shard_bytes * self.opt[1]
        return clip + 12 * shard_bytes / (self.bandwidth * self.share) + 12 * self.op_s / self.python_share


def _spans_nodes(cluster: Cluster, axis: str, layout: dict) -> bool:
    """Whether a group of ``axis`` crosses a node (tp innermost, then cp, pp, dp; ep groups of
    consecutive dp ranks)."""
    dp, pp, tp, cp = layout["dp"], layout["pp"], layout["tp"], layout.get("cp", 1)
    n = cluster.devices_per_node if not cluster.cores else max(1, (dp * pp * cp * tp) // max(cluster.nodes, 1))
    extent = {"tp": tp, "cp": cp * tp, "pp": pp * cp * tp, "dp": dp * pp * cp * tp,
              "ep": layout.get("ep", 1) * pp * cp * tp}[axis]  # ep: consecutive dp ranks
    return extent > n


def _engine_layout(cfg, model_cfg) -> Layout:
    """The layout the engine runs for ``cfg``: resolved with the model, recomputing only where it pays."""
    from mpirt.plan import memory

    return memory.recompute_where_it_pays(
        cfg, model_cfg, Layout.of(cfg, {"dp": cfg.dp or 1, "pp": cfg.pp, "tp": cfg.tp, "cp": cfg.cp, "ep": cfg.ep},
                                  model_cfg))


def peak_memory(cfg, model_cfg, cluster: Cluster, data_bytes: int = 0, memory_ranks: str = "stages",
                layout: Layout | None = None) -> dict:
    """The memory part of :func:`estimate` alone (the planner prunes by it before timing a layout):
    :func:`mpirt.plan.memory.predict` for rank 0 and the last stage's first rank (the first stage
    stashes the most micro-batches, the last holds the logits, rank 0 writes), every rank with
    ``memory_ranks="all"``. Returns the largest rank's categories and ``"peak"``, its ``"rank"``
    and ``"per_rank"``: {rank: peak}."""
    from mpirt.plan import memory

    # each rank's prediction decides its own stage's recomputation: the sizes are all it needs here
    layout = layout or Layout.of(cfg, {"dp": cfg.dp or 1, "pp": cfg.pp, "tp": cfg.tp, "cp": cfg.cp, "ep": cfg.ep})
    pp, cp, tp = layout.pp, layout.cp, layout.tp
    ranks = range(layout.world_size) if memory_ranks == "all" else sorted({0, (pp - 1) * cp * tp})
    mcfg = dataclasses.replace(cfg, dp=layout.dp, microbatches=layout.microbatches if pp > 1 else cfg.microbatches)
    per_rank = {r: memory.predict(mcfg, model_cfg, layout, r, data_bytes, checkpoint_gather=cluster.checkpoint_gather,
                                  process_bytes=memory.planned_baseline(r, int(cluster.process_bytes)))
                for r in ranks}
    big = max(per_rank, key=lambda r: per_rank[r]["peak"])
    return {**per_rank[big], "rank": big, "per_rank": {r: v["peak"] for r, v in per_rank.items()}}


def _stage_layers(layout, n_costs: int) -> dict:
    """Each (pp rank, chunk)'s layer indices into ``[embed, h.0 .. h.{L-1}, head]`` (``n_costs``
    layers): the first stage holds the embedding, the last the head."""
    if layout.pp == 1:
        return {(0, 0): list(range(n_costs))}
    out = {}
    for s, (lo, hi) in enumerate(layout.bounds):
        idx = [1 + i for i in range(lo, hi)]
        if s == 0:
            idx = [0] + idx
        if s == layout.stages - 1:
            idx = idx + [n_costs - 1]
        out[(s % layout.pp, s // layout.pp)] = idx
    return out


def _dp_ops(zero: int, n: float, group: int, itemsize: int) -> tuple[list, list]:
    """(collectives inside each micro-batch's backward, collectives at the step's end) of ``n``
    gradients over ``group`` ranks at ZeRO stage ``zero``, where mpirt's engines run them: DDP
    allreduces its buckets from the backward's hooks (:mod:`mpirt.parallel.ddp`: may overlap the
    last backward); ZeRO-1 allreduces and allgathers in ``step()``; ZeRO-2 reduce-scatters every
    micro-batch's gradients bucket by bucket inside its backward, blocking, and allgathers in
    ``step()`` (:mod:`mpirt.parallel.zero`); ZeRO-3 gathers each unit forward and backward and
    reduce-scatters its gradient, per micro-batch. Reductions of half dtypes travel as float32."""
    if group == 1 or n == 0:
        return [], []
    grads, weights = n * (4 if itemsize == 2 else itemsize), n * itemsize
    return {0: ([], [("allreduce", grads)]), 1: ([], [("allreduce", grads), ("allgather", weights)]),
            2: ([("reduce_scatter", grads)], [("allgather", weights)]),
            3: ([("allgather", weights), ("allgather", weights), ("reduce_scatter", grads)], [])}[zero]


def _ring_cost(cluster: Cluster, layout, model_cfg, dtype: str, block_s: float) -> tuple[float, dict]:
    """(exposed seconds, ``{"bytes", "s"}`` sent) of ring attention in one step of ``layout``: per
    block and micro-batch the keys and values go round the ring ``cp - 1`` times forward and
    backward, hidden behind the block's compute (``block_s``) where shorter, and the keys'
    gradient ``cp`` times, exposed (each pass waits for it)."""
    cp = layout.cp
    kv = ring_message_bytes(layout, model_cfg, dtype)
    hop = coll_time(cluster, "p2p", kv, 2, layout.world_size, _spans_nodes(cluster, "cp", layout))
    blocks = layout.microbatches * model_cfg.n_layer / layout.pp
    hidden = 2 * (cp - 1) * hop
    return blocks * (cp * hop + max(0.0, hidden - block_s)), {"bytes": blocks * (3 * cp - 2) * kv,
                                                              "s": blocks * (hidden + cp * hop)}


def _exchange_cost(cluster: Cluster, layout, model_cfg, dtype: str) -> tuple[float, dict]:
    """(exposed seconds, ``{"bytes", "s"}`` sent) of the experts' token exchange in one step of
    ``layout``: per MoE block and micro-batch the routed rows out and back, forward and backward,
    four all-to-alls the block waits for."""
    ep = layout.ep
    routed = routed_bytes(layout, model_cfg, dtype)
    # the full send buffer, as comm records an all-to-all: (ep - 1) / ep of it leaves the rank
    one = coll_time(cluster, "alltoall", routed, ep, layout.world_size, _spans_nodes(cluster, "ep", layout))
    blocks = layout.microbatches * model_cfg.n_layer / layout.pp
    return blocks * 4 * one, {"bytes": blocks * 4 * routed * (ep - 1) / ep, "s": blocks * 4 * one}


def _tp_time(cluster: Cluster, layout, span: bool, w: Work) -> float:
    """Seconds of the tp collectives of one layer's pass ``w``."""
    return sum(coll_time(cluster, op, n, layout.tp, layout.world_size, span) for op, n in w.tp)


def _stage_times(mach, tp_time, work: list, stage_layers: dict) -> dict:
    """(pp rank, chunk) -> op -> (compute, tp comm) seconds of one micro-batch's pass over the
    chunk's layers."""
    share = {FORWARD: 1 / 3, BACKWARD: 2 / 3, WEIGHT: 2 / 3}  # W's bytes: already a third of B's

    def pass_time(ws: list, op: str) -> tuple[float, float]:
        return sum(mach.compute(w[op], share[op]) for w in ws), sum(tp_time(w[op]) for w in ws)

    return {k: {op: pass_time([work[i] for i in v], op) for op in (FORWARD, BACKWARD, WEIGHT)}
            for k, v in stage_layers.items()}


def _local_parameters(layout, model_cfg, costs, stage_layers: dict) -> tuple[dict, dict]:
    """Per pp rank, the dense parameters it holds (its tp slice) and its experts' (a mixture of
    experts' stacked experts: replicated over tp, split over ep, synced over edp)."""
    from mpirt.core.modeling import model_class
    pp, tp = layout.pp, layout.tp
    local = {r: sum(costs[i].params for (rr, _), v in stage_layers.items() if rr == r for i in v) / tp
             for r in range(pp)}
    per_block = getattr(model_class(model_cfg), "expert_weights_of", lambda c: 0)(model_cfg)
    blocks_of = {r: sum(hi - lo for s, (lo, hi) in enumerate(layout.bounds) if s % pp == r) for r in range(pp)}
    experts = {r: blocks_of[r] * per_block / layout.ep for r in range(pp)}
    return {r: local[r] - blocks_of[r] * per_block / tp for r in range(pp)}, experts  # the dense rest


def _pipeline_run(layout, times: dict, p2p: float, parts: dict) -> tuple[float, float, list | None]:
    """(the passes' seconds, the bubble fraction, each stage's idle seconds (None without pp)) of
    the step's micro-batches; fills ``parts``' forward, backward, weight_grad and bubble (rank 0's)."""
    from mpirt.parallel.pipeline.check import timed
    m, chunks = layout.microbatches, layout.chunks
    if layout.pp == 1:
        t = times[(0, 0)]
        parts["forward"] = m * (t[FORWARD][0] + t[FORWARD][1])
        parts["backward"] = m * (t[BACKWARD][0] + t[BACKWARD][1])
        return parts["forward"] + parts["backward"], 0.0, None
    sim = timed(layout.pipeline_schedule, lambda r, op, chunk: sum(times[(r, chunk)][op]), latency=p2p)
    r0 = {op: sum(times[(0, c)][op][0] + times[(0, c)][op][1] for c in range(chunks)) for op in (FORWARD, BACKWARD, WEIGHT)}
    parts.update(forward=m * r0[FORWARD], backward=m * r0[BACKWARD], weight_grad=m * r0[WEIGHT],
                 bubble=sim.makespan - sim.busy[0])
    return sim.makespan, sim.bubble, [sim.makespan - b for b in sim.busy]


def _step_end_sync(cluster: Cluster, cfg, layout, model_cfg, costs, dp_s: float, dp_bytes: float,
                   last_b: float) -> tuple[float, float, float]:
    """(the exposed part of the dp sync ``dp_s``, the whole gradient sync, the clipping's norm sum)
    seconds at the step's end: DDP's sync overlaps the last backward (``last_b``); the tied
    embedding's gradient sum (pp), the sequence-parallel partial sums (tp) and the loss's allreduce
    over dp come after it."""
    from mpirt.parallel.ddp import BUCKET_BYTES, HOST_BUCKET_BYTES  # not at the top: it loads MPI
    tp, pp, world, e = layout.tp, layout.pp, layout.world_size, np.dtype(cfg.dtype).itemsize
    replicas = layout.replicas
    exposed = dp_s
    if cluster.overlap and dp_s and cfg.zero == 0:
        bucket = HOST_BUCKET_BYTES if cluster.cores else BUCKET_BYTES
        exposed = max(dp_s / max(1, -(-dp_bytes // bucket)), dp_s - 0.9 * last_b)  # the last bucket's
    # the loss's allreduce over dp ends the step's sync; clipping reduces the norm over the group that
    # shards the gradients (ZeRO: dp x cp; tp; pp: the stages' tp x pp), none for plain data parallelism
    small = coll_time(cluster, "allreduce", 8, replicas, world, _spans_nodes(cluster, "dp", layout))
    clip_group = (replicas if cfg.zero else 1) * tp * pp
    clip = coll_time(cluster, "allreduce", 8, clip_group, world, clip_group > cluster.devices_per_node and not cluster.cores)
    tied = coll_time(cluster, "p2p", costs[0].params / tp * (4 if e == 2 else e), 2, world,
                     _spans_nodes(cluster, "pp", layout)) if pp > 1 else 0.0
    sp_sync = coll_time(cluster, "allreduce", 4 * model_cfg.n_embd * model_cfg.n_layer * e, tp, world,
                        _spans_nodes(cluster, "tp", layout)) if layout.sequence_parallel else 0.0
    return exposed, exposed + tied + sp_sync + small, clip


def _dp_cost(cluster: Cluster, zero: int, layout, local_params: dict, local_experts: dict, e: int, r: int,
             which: int) -> tuple[float, float]:
    """(seconds, bytes) of pp rank ``r``'s dense and expert gradients' :func:`_dp_ops` part ``which``
    (0: inside the backward, 1: at the step's end); the dense ones over dp x cp, the experts' over
    the dp / ep ranks holding them."""
    replicas = layout.replicas
    ops = [(op, n, g) for n, g in ((local_params[r], replicas), (local_experts[r], replicas // layout.ep))
           for op, n in _dp_ops(zero, n, g, e)[which]]
    span = _spans_nodes(cluster, "dp", layout)
    return sum(coll_time(cluster, op, n, g, layout.world_size, span) for op, n, g in ops), sum(n for _, n, _ in ops)


def _tp_comm(stage_layers: dict, work: list, m: int, tp_time) -> dict:
    """``{"bytes", "s"}`` of tp's collectives a step on pp rank 0 (its chunks' layers, ``m``
    micro-batches)."""
    out = {"bytes": 0.0, "s": 0.0}
    for (r, c), v in stage_layers.items():
        if r == 0:
            for i in v:
                for op in (FORWARD, BACKWARD, WEIGHT):
                    out["bytes"] += m * sum(n for _, n in work[i][op].tp)
                    out["s"] += m * tp_time(work[i][op])
    return out


def _optimizer_time(mach, zero: int, layout, model_cfg, local_params: dict, local_experts: dict, worst: int,
                    e: int) -> float:
    """Seconds of the optimizer's update on the rank holding the most parameters: ZeRO shards the
    dense part over dp x cp, the experts over the dp / ep ranks holding them."""
    replicas = layout.replicas
    n_local = max(local_params[r] + local_experts[r] for r in range(layout.pp))
    shard = local_params[worst] / replicas + local_experts[worst] / (replicas // layout.ep) if zero else n_local
    tensors = model_cfg.n_layer / layout.pp * tensors_per_block(model_cfg) + 4
    if zero:
        tensors = max(1.0, tensors / replicas)
    return mach.optimizer(tensors, shard * 4, n_local * e)


def estimate(cfg, model_cfg, cluster: Cluster, data_bytes: int = 0, memory_ranks: str = "stages",
             memory: dict | None = None) -> Estimate:
    """Predict one step of the layout ``cfg`` (a :class:`mpirt.run.config.TrainConfig`: dp, tp, pp,
    cp, microbatches, schedule, chunks, zero, sequence_parallel, recompute, dtype, batch_size,
    seq_len, grad_accum) for ``model_cfg`` on ``cluster``. Under context parallelism a rank
    computes ``seq_len / cp`` tokens of each sequence at the whole sequence's FLOPs per token
    (1/cp of the attention), and each block's ring attention sends the keys and values ``cp - 1``
    times forward and backward, hidden behind the block's compute where it is shorter, and the
    keys' gradient ``cp`` times, exposed (each pass waits for it). Under expert parallelism each
    MoE block's routed rows (``rows x seq x top_k``, hidden size wide) go to the ep ranks holding
    their experts and come back, forward and backward (four all-to-alls sending ``(ep - 1) / ep`` of
    them, exposed: the block waits for its rows), the experts' weights count ``1 / ep`` on a rank
    (replicated over tp) and their gradients are synced over edp (``dp / ep`` ranks).
    ``memory_ranks``: ``"stages"`` (rank 0 and the last stage's first rank: the most stashed
    micro-batches and the logits) or ``"all"``; ``memory``: :func:`peak_memory`'s answer for these
    arguments when the caller has it already."""
    from mpirt.core.modeling import flops_per_token, layer_costs

    layout = _engine_layout(cfg, model_cfg)
    pp, world, chunks, m = layout.pp, layout.world_size, layout.chunks, layout.microbatches
    mach = _Machine(cluster, world, cfg.dtype)
    e = np.dtype(cfg.dtype).itemsize
    costs = layer_costs(model_cfg, cfg.seq_len)
    stage_layers = _stage_layers(layout, len(costs))
    work = layer_work(model_cfg, costs, rows=layout.rows, seq_len=cfg.seq_len // layout.cp, tp=layout.tp,
                      sp=layout.sequence_parallel, itemsize=e, split=layout.split_backward, recomputed=set(layout.recomputed),
                      recompute="full" if cfg.zero == 3 and cfg.recompute == "none" else cfg.recompute)
    tp_time = functools.partial(_tp_time, cluster, layout, _spans_nodes(cluster, "tp", layout))
    times = _stage_times(mach, tp_time, work, stage_layers)
    local_params, local_experts = _local_parameters(layout, model_cfg, costs, stage_layers)
    dp_cost = functools.partial(_dp_cost, cluster, cfg.zero, layout, local_params, local_experts, e)
    in_backward = {r: dp_cost(r, 0) for r in range(pp)}
    reduced_in = WEIGHT if layout.split_backward else BACKWARD  # where a micro-batch's gradients are final
    for (r, c), t in times.items():
        t[reduced_in] = (t[reduced_in][0], t[reduced_in][1] + in_backward[r][0] / chunks)
    parts = dict.fromkeys(("forward", "backward", "weight_grad", "bubble", "grad_sync", "optimizer", "other"), 0.0)
    comm = {axis: {"bytes": 0.0, "s": 0.0} for axis in ("tp", "pp", "dp", "cp", "ep")}
    act_msg = message_bytes(layout, model_cfg, cfg.dtype)
    p2p = coll_time(cluster, "p2p", act_msg, 2, world, _spans_nodes(cluster, "pp", layout)) if pp > 1 else 0.0
    pipe, bubble, stage_bubble = _pipeline_run(layout, times, p2p, parts)
    last_b = times[(0, 0)][BACKWARD][0]
    if pp > 1:
        comm["pp"] = {"bytes": 2 * m * chunks * act_msg, "s": 2 * m * chunks * p2p}
    comm["tp"] = _tp_comm(stage_layers, work, m, tp_time)
    # dp sync at the step's end: the slowest stage's (the most parameters); DDP's overlaps the last backward
    worst = max(range(pp), key=lambda r: local_params[r] + local_experts[r])
    dp_s, dp_bytes = dp_cost(worst, 1)
    comm["dp"] = {"bytes": dp_bytes + m * in_backward[worst][1], "s": dp_s + m * in_backward[worst][0]}
    exposed, parts["grad_sync"], clip = _step_end_sync(cluster, cfg, layout, model_cfg, costs, dp_s, dp_bytes, last_b)
    ring_exposed = exchange_exposed = 0.0
    if layout.cp > 1:
        block_s = (times[(0, 0)][FORWARD][0] + times[(0, 0)][BACKWARD][0]) / max(1, len(stage_layers[(0, 0)]))
        ring_exposed, comm["cp"] = _ring_cost(cluster, layout, model_cfg, cfg.dtype, block_s)
    if layout.ep > 1:
        exchange_exposed, comm["ep"] = _exchange_cost(cluster, layout, model_cfg, cfg.dtype)
    parts["optimizer"] = _optimizer_time(mach, cfg.zero, layout, model_cfg, local_params, local_experts, worst, e) + clip
    parts["other"] = 20 * cluster.op_overhead_s / mach.python_share   # data, monitor (the flags come after the step)
    step = pipe + ring_exposed + exchange_exposed + parts["grad_sync"] + parts["optimizer"] + parts["other"]
    parts["backward"] += ring_exposed  # the ring's waits are inside the measured passes
    parts["forward"] += exchange_exposed / 2  # as the all-to-alls' (half of them each way)
    parts["backward"] += exchange_exposed / 2
    tokens = cfg.batch_size * cfg.seq_len
    mfu = flops_per_token(model_cfg, cfg.seq_len) * tokens / step / (world * cluster.peak(cfg.dtype))
    mem = memory or peak_memory(cfg, model_cfg, cluster, data_bytes, memory_ranks, layout)
    shares = {"compute": parts["forward"] + parts["backward"] + parts["weight_grad"] - comm["tp"]["s"] - ring_exposed
              - exchange_exposed - m * in_backward[0][0] + parts["optimizer"],
              "dp comm": exposed + m * in_backward[0][0], "tp comm": comm["tp"]["s"], "cp comm": ring_exposed,
              "ep comm": exchange_exposed, "bubble": (bubble * pipe) if pp > 1 else 0.0}
    neck = "memory" if mem["peak"] > 0.9 * cluster.memory_bytes else max(shares, key=shares.get)
    notes = [f"{world} ranks on {cluster.cores * cluster.nodes} cores: each rank runs at {mach.share:.2f} of a core"] \
        if cluster.cores and world > cluster.cores * cluster.nodes else []
    est = Estimate(layout={**layout, "microbatches": m, "schedule": cfg.schedule if pp > 1 else None,
                           "chunks": chunks, "zero": cfg.zero, "sequence_parallel": layout.sequence_parallel,
                           "recompute": cfg.recompute, "dtype": cfg.dtype, "rows_per_microbatch": layout.rows},
                   step_s=step, parts=parts, comm=comm, bubble=bubble, memory=mem,
                   tokens_per_s=tokens / step, mfu=mfu, bottleneck=neck, notes=notes)
    if pp > 1:
        est.parts["bubble_per_rank"] = stage_bubble
    return est
