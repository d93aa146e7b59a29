"""Per-rank memory: the process baseline and the peak predicted from the config (the budget it is
checked against: :mod:`mpirt.plan.budget`).

Over 400 lines: each term of the prediction sits beside the measurement that set it, and the
terms are one model that a change to one of them has to be read against.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from mpirt.parallel.context import ring_message_bytes
from mpirt.parallel.layout import AXES, Layout
from mpirt.parallel.pipeline.stage import message_bytes
from mpirt.plan.holdings import peak_in_flight

# =============================================================================================
# the prediction: a rank's peak from the config and layout, before anything is built
# =============================================================================================
# The process: Python, NumPy, mpi4py and MPI's shared-memory segments, mpirt's modules, BLAS set-up
# and the monitor's start-up probes, as memory the rank owns (monitor.steps.owned_bytes: the file-backed
# pages of the libraries' code, about 41 MiB here, are not counted). A run measures its own
# (measured_baseline). What it adds after its pre-flight checks besides what predict models
# (communicators and their segments, the watchdog thread, modules imported later, the monitor's
# probes, the graph's Python objects) is LATE_BYTES: measured peak less predicted with the measured
# baseline over the 14 layouts of tests/test_memory.py (24 ranks; GPT and Llama, pp 1-4, ZeRO 2/3,
# recompute, half), 5.8 to 13.3 MiB, median 8.2, the same in the development install and a
# minimal `.[mpich]` one within 1 MiB per layout (their start-up baselines differ).
LATE_BYTES = int(8.2 * 2**20)
# The planner has no process to measure: a start-up baseline here (35.8 MiB on ranks without
# TensorBoard's writer) plus LATE_BYTES, rounded up; rank 0 holds its writer on top (WRITER_BYTES:
# its measured baseline less the other ranks', 9.0 MiB in the development install).
PROCESS_BYTES = 44 * 2**20
WRITER_BYTES = 9 * 2**20
# A split (zero-bubble) schedule frees a micro-batch in two parts, its stash at B and its weight
# passes' inputs at W, between other micro-batches' arrays and each action's transients: in the host
# heap (which keeps freed memory resident for reuse, mpirt.cpu.hostalloc) the holes are not refilled.
# Measured over pp 8 zb-h1 stages (llama-tiny 16 x 256 and 8 x 256, with and without --recompute
# full): 3-23% of what a stage holds, median 10% (17% before the forward's ops wrote their results
# into the inputs they consume, ops.add's into_first and the like).
# Handing the free pages back after each action removes them, but cost 19-24% more CPU time a step
# (page faults, madvise): the runtime keeps them and the prediction counts them.
SPLIT_HOST_HEAP_HOLES = 0.10
CATEGORIES = ("baseline", "data", "parameters", "gradients", "optimizer_state", "activations", "communication",
              "workspace")


def measured_baseline() -> int:
    """This rank's process baseline for :func:`predict`, measured: the memory it owns now
    (:func:`mpirt.monitor.steps.owned_bytes`, before anything of the model is built; the heap's free
    pages handed back first, so what start-up freed is not counted) plus :data:`LATE_BYTES`. It
    follows the environment (which libraries the install loads, the MPI library's segments), which
    a constant calibrated in one install cannot. Where the process cannot be read (no
    ``/proc/self/status``): :data:`PROCESS_BYTES`."""
    from mpirt.cpu.hostalloc import release_freed_memory
    from mpirt.monitor.steps import owned_bytes
    release_freed_memory()
    owned = owned_bytes()
    return owned + LATE_BYTES if owned else PROCESS_BYTES  # 0: no /proc/self/status to read


def planned_baseline(rank: int, process_bytes: int | None = None) -> int:
    """The baseline the planner gives world rank ``rank`` (no process to measure):
    ``process_bytes`` (a calibrated one) or :data:`PROCESS_BYTES`, plus on rank 0
    :data:`WRITER_BYTES` when the ``tensorboard`` package is installed (rank 0 writes its scalars)."""
    writer = rank == 0 and _tensorboard_installed()
    return (process_bytes or PROCESS_BYTES) + (WRITER_BYTES if writer else 0)


@functools.lru_cache(maxsize=1)
def _tensorboard_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("tensorboard") is not None


def _kept(acts: dict, mode: str, recomputed: bool) -> int:
    """One block's kept bytes under ``mode`` (``recomputed``: the block is among the chosen)."""
    if not recomputed or mode == "none":
        return acts["block"]
    return acts["block"] - acts["core"] if mode == "selective" else acts["input"]


def _handed_to_w(acts: dict, mode: str, picked: set, rerun_w: int, lo: int, hi: int) -> int:
    """What a split B of blocks ``lo..hi-1`` holds beyond its start as a block's backward runs:
    it goes block by block from the last, each block's stash giving way to its weight-pass hold,
    so a block runs beside the blocks after it already handed to W (the most over the blocks)."""
    handed = most = 0
    for i in range(hi - 1, lo, -1):
        handed += acts["weight_pass"] + (i in picked) * rerun_w - _kept(acts, mode, i in picked)
        most = max(most, handed)
    return most


def _block_backward(acts_of, mode: str, picked: set, chunks: list) -> int:
    """The most a block's backward holds beyond the kept activations, blocks differing (a mixture
    of experts' measured routing per block): its gradients (``backward``) less what the blocks
    after it in its chunk kept, freed by then; where the blocks are alike, the deepest block's."""
    most = 0
    for lo, hi in chunks:
        freed = 0
        for i in range(hi - 1, lo - 1, -1):
            most = max(most, acts_of(i)["backward"] - freed)
            freed += _kept(acts_of(i), mode, i in picked)
    return most


def recompute_pays(cfg, model_cfg, layout: dict, rank: int) -> bool:
    """Whether ``cfg.recompute`` lowers the predicted peak of the training step (the activations
    kept plus the backward's transient, the rerun's included) on world rank ``rank``'s pipeline
    stage; the same answer on every rank of a stage. A stage whose micro-batches go from F to B
    one at a time (a zero-bubble schedule's last stage) or whose blocks keep little beyond what a
    rerun makes again (selective without attention dropout: the core keeps only its
    log-sum-exp) would only add the rerun's transient: the engine recomputes only where this says
    it pays. Blocks named in ``recompute_layers`` always recompute (the user's choice), and
    ZeRO-3 always reruns its units."""
    if cfg.recompute == "none" or cfg.zero == 3 or cfg.recompute_layers:
        return cfg.zero == 3 or cfg.recompute != "none"
    first = Layout.of(cfg, layout).stage_rank(rank)
    return _activation_peak(cfg, model_cfg, layout, first, cfg.recompute) < \
        _activation_peak(cfg, model_cfg, layout, first, "none")


_PEAKS: dict = {}
# config fields the step's activation peak does not read under ZeRO 0-2 (those shard the states, not
# the activations; ZeRO-3 never asks), or that the key carries as the mode in effect instead
_NOT_IN_PEAK = ("zero", "recompute", "model_overrides")


def _activation_peak(cfg, model_cfg, layout, stage_rank: int, recompute: str) -> int:
    """:func:`_predict`'s activation peak of the stage whose first rank is ``stage_rank`` under
    ``recompute``, remembered: the planner asks it of every stage for each ZeRO stage and
    recomputation mode of a shape, and the answer without recomputation is the same for all."""
    from mpirt.core.modeling import config_key

    fields = tuple((k, v) for k, v in vars(cfg).items() if k not in _NOT_IN_PEAK and not isinstance(v, (dict, list)))
    key = (recompute, config_key(model_cfg), fields, tuple(int(layout.get(a, 1)) for a in AXES), stage_rank)
    if key not in _PEAKS:
        if len(_PEAKS) >= 1 << 16:
            _PEAKS.clear()
        _PEAKS[key] = _predict(cfg, model_cfg, layout, stage_rank, recompute=recompute)[1]
    return _PEAKS[key]


def recompute_where_it_pays(cfg, model_cfg, layout: Layout) -> Layout:
    """``layout`` (resolved with the model) without recomputation on the pipeline ranks where it
    would not lower the peak (:func:`recompute_pays`): the blocks the engine recomputes; the
    blocks left out are its ``recompute_unpaid``."""
    idle = {r for r in range(layout.pp) if not recompute_pays(cfg, model_cfg, layout, r * layout.cp * layout.tp)}
    unpaid = tuple(i for i in layout.recomputed if layout.pipeline_rank(i) in idle)
    return dataclasses.replace(layout, recomputed=tuple(i for i in layout.recomputed if i not in unpaid),
                               recompute_unpaid=unpaid)


def expert_load_bound(cfg, model_cfg, ep: int) -> float:
    """The rows a rank's experts run, over the even share (its own tokens x top_k), that the
    prediction plans for under expert parallelism: ``capacity_factor`` when routing has a capacity
    (each expert takes at most that share of a sequence's assignments), else ``cfg.moe_imbalance``
    (dropless routing has no bound of its own); never more than the whole ep group's rows on one
    rank's ``E / ep`` experts can be. 1 without ep (a rank runs every routed row)."""
    n_expert, top_k = getattr(model_cfg, "n_expert", 0), getattr(model_cfg, "top_k", 1)
    if ep <= 1 or not n_expert:
        return 1.0
    most = ep * min(top_k, n_expert // ep) / top_k
    return min(_imbalance_bound(cfg, model_cfg), most)


def busiest_expert_bound(cfg, model_cfg) -> float:
    """The rows the busiest expert runs in one forward, over an expert's even share of the ep
    group's assignments (``top_k`` x its tokens / ``n_expert``), that the prediction plans for:
    the capacity factor or ``cfg.moe_imbalance`` as :func:`expert_load_bound`, never more than
    every token of the group (a token picks an expert once: ``n_expert / top_k``), with or without
    ep. 1 for a model without experts."""
    n_expert, top_k = getattr(model_cfg, "n_expert", 0), getattr(model_cfg, "top_k", 1)
    return min(_imbalance_bound(cfg, model_cfg), n_expert / top_k) if n_expert else 1.0


def _imbalance_bound(cfg, model_cfg) -> float:
    """An expert's rows over its even share that routing allows: the capacity factor, else
    ``--moe-imbalance`` (dropless routing has no bound of its own)."""
    capacity = getattr(model_cfg, "capacity_factor", 0.0)
    return capacity if capacity > 0 else cfg.moe_imbalance


def predict(cfg, model_cfg, layout: dict, rank: int, data_bytes: int = 0, *, process_bytes: int | None = None,
            checkpoint_gather: bool = False, expert_load: float | None = None,
            busiest_expert: float | None = None, host_heap: bool = False) -> dict:
    """Predicted peak bytes of world rank ``rank`` by category (:data:`CATEGORIES`) plus ``"peak"``,
    their sum, from the run's config alone (pure: nothing is built or communicated).

    ``baseline``: the process (:data:`PROCESS_BYTES`); ``data``: ``data_bytes``, dataset bytes a
    caller holds in memory (none for ``mpirt.train``: its token files are read window by window,
    never mapped, :class:`mpirt.data.tokens.TokenFile`); ``parameters``, ``gradients``,
    ``optimizer_state`` (AdamW's two moments): this rank's share under tp, its pipeline stage's
    layers (the tied table on both end stages), ZeRO's sharding over dp x cp (stage 2: the shard, the
    buckets being reduced, the gradients in flight and a pipeline's tied embedding gradient); ``activations``: one micro-batch's kept bytes (the model's
    ``activation_bytes_of`` under the recomputation setting; ZeRO-3 keeps only unit inputs) times the
    pipeline schedule's peak in flight (a pipeline stash also holds the stage's received input and
    its output); ``communication``: pipeline receive buffers, the MPI library's message pool an
    expert-parallel token exchange grows (``EXCHANGE_POOL_BYTES_PER_PEER`` in
    :mod:`mpirt.parallel.experts`), ZeRO-3's gathered unit (parameters and gradient); ``workspace``:
    the largest of the backward's transients (the logits' gradient, a block's backward, ring
    attention's keys and values in flight under context parallelism), plus one recomputed block
    whole again; or, on the host, data parallelism's allreduce temporaries beside the activations
    (MPI's, one per bucket in flight, at most :data:`mpirt.parallel.ddp.MAX_IN_FLIGHT` of them); or,
    less the activations (freed by then), what saving a checkpoint holds: every rank streams the
    boxes it owns (format 3), one at a time, so at most the largest local tensor once and its
    finiteness mask. Split (zero-bubble) schedules hold a
    micro-batch's weight-pass bytes from its B to its W. Rank 0's writing (metrics, summary,
    TensorBoard) is in its baseline: its writer's modules are loaded before a run measures it.

    The options (defaults give the figures above): ``process_bytes`` replaces
    :data:`PROCESS_BYTES` (a run's :func:`measured_baseline`, or the planner's calibrated baseline of
    a machine's environment); ``checkpoint_gather=True`` models the older whole-state checkpoints instead (the
    full state gathered on every rank without pp, on pp rank 0 with it); ``expert_load``: under
    expert parallelism, the rows this rank's experts run over the even share (a run's measured
    ``moe_expert_load``; None: :func:`expert_load_bound`, what a budget is checked against);
    ``busiest_expert``: the busiest expert's rows in one forward over its even share, which the
    grouped experts' backward holds, in the deepest layer (its backward runs beside every layer's
    kept activations; a run's measured ``moe_busiest_expert_load``; None: :func:`busiest_expert_bound`);
    both may be lists, one entry per block this rank holds in model order (a run's measured
    ``moe_*_per_layer``): each block then keeps its own rows, and a block's backward counts beside
    the blocks before it only (the later ones' arrays are freed by then), where an earlier block
    whose experts ran more rows can make the peak;
    ``host_heap``: the arrays live in the host heap (the NumPy backend), where a split schedule's
    stage also holds the holes its freed arrays leave (:data:`SPLIT_HOST_HEAP_HOLES` of its
    activations; a GPU's pool is not modelled) and data parallelism's MPI temporaries count.
    """
    return _predict(cfg, model_cfg, layout, rank, data_bytes, process_bytes=process_bytes,
                    checkpoint_gather=checkpoint_gather, expert_load=expert_load, busiest_expert=busiest_expert,
                    host_heap=host_heap,  # recomputing as the engine does
                    recompute=None if recompute_pays(cfg, model_cfg, layout, rank) else "none")[0]


def _routing(cfg, model_cfg, ep: int, expert_load, busiest_expert) -> dict:
    """A mixture of experts' loads :func:`predict` counts: the measured ones given, else their bounds."""
    routing = {}
    if getattr(model_cfg, "n_expert", 0):
        routing["busiest"] = busiest_expert_bound(cfg, model_cfg) if busiest_expert is None else busiest_expert
    if ep > 1:
        routing["expert_load"] = expert_load_bound(cfg, model_cfg, ep) if expert_load is None else expert_load
    return routing


def _states_and_buffers(cfg, model_cfg, lay: Layout, stage: int, costs, n_local: float, experts: float, e: int) -> tuple:
    """``(parameters, gradients, optimizer state, communication)`` bytes of a rank of pipeline stage
    ``stage`` holding ``n_local`` dense parameters and ``experts`` expert parameters (its tp slice)."""
    from mpirt.core.precision import bytes_per_parameter
    replicas = lay.replicas  # ZeRO shards over dp and cp together (the ranks holding the same parameters)
    per_param = bytes_per_parameter(cfg.dtype, replicas, cfg.zero)  # masters and moments in float32 for half
    per_expert = bytes_per_parameter(cfg.dtype, lay.dp // lay.ep, cfg.zero)
    params, grads, optimizer = (n_local * per_param[k] + experts / lay.ep * per_expert[k]
                                for k in ("params", "grads", "optimizer"))
    comm = 0.0
    if cfg.zero == 3:  # the largest unit (its tp slice), gathered with its gradient; the next unit's
        # prefetched parameters are not counted: measured here they reuse freed memory (+0.2 MiB for a
        # 0.76 MiB unit at dp 2 x pp 2, zb-h1), and a zb first stage is already predicted 3-5 % high
        unit = max(c.params for c in costs) / lay.tp
        comm += 2 * unit * e
    elif cfg.zero == 2:  # buckets reduced during backward: the staging buffer and the reduction's own
        # (the parts bound for the other ranks), and the gradients being filled: a bucket that spans
        # two parameters holds the first until the second is final (two weight matrices, each a
        # third of a block)
        from mpirt.parallel.zero import BUCKET_BYTES
        bucket = min(BUCKET_BYTES, n_local * e)
        grads += bucket * (2 - 1 / replicas) + 2 * min(max(c.params for c in costs[1:-1]) / 3 / lay.tp * e, n_local * e)
        if lay.pp > 1 and stage in (0, lay.pp - 1):  # the tied embedding's gradient, held for the step
            grads += costs[0].params / lay.tp * e
    if lay.ep > 1:  # the MPI library's message pool, grown by the first token exchange and kept
        from mpirt.parallel.experts import EXCHANGE_POOL_BYTES_PER_PEER
        comm += (lay.ep - 1) * EXCHANGE_POOL_BYTES_PER_PEER
    if lay.pp > 1:  # receive buffers posted ahead (activation and gradient), one message each
        comm += 2 * message_bytes(lay, model_cfg, cfg.dtype)
    return params, grads, optimizer, comm


def _end_of_step(cfg, lay: Layout, rank: int, stage: int, costs, n_full: int, n_local: float, experts: float,
                 e: int, state_e: int, checkpoint_gather: bool, host_heap: bool) -> tuple:
    """``(checkpoint, buckets)``: what saving a checkpoint holds once the backward has freed the
    activations, and data parallelism's allreduce temporaries, beside them (see :func:`predict`);
    ``state_e``: the itemsize a checkpoint holds (float32 masters of a half run)."""
    gathers_state = lay.pp == 1 or stage == 0
    checkpoint = 3 * n_full * state_e * (2 if rank == 0 else 1) if gathers_state else 3 * n_local * lay.tp * state_e
    if not checkpoint_gather:  # format 3: boxes stream from the arrays, one at a time copied when not
        # contiguous, after a finiteness mask (1 byte per element); the token table is the largest
        checkpoint = max(costs[0].params, max(c.params for c in costs[1:-1]) / 4) / lay.tp * (state_e + 1)
    # DataParallel on the host (one per parameter group: the dense parameters, the experts): each
    # bucket's non-blocking allreduce holds MPI's temporary of its size (half: a float32 copy and its
    # temporary) from launch to completion, at most MAX_IN_FLIGHT at once, beside the activations.
    # Measured with 25 MiB buckets, the rank that grows most, above the activations: launched as
    # backward fills them, dp 4, 2 buckets (float32): 35 MiB; 4 and 8 (float64): 54-56 MiB; dp 2: 62
    # MiB: one bucket more than in flight, less three quarters of one; under pp, launched after the
    # schedule: 48-49 MiB for 2 and 4 buckets, those in flight. Where a block's activations are
    # larger than a bucket the temporaries reuse them and the count is over (by up to 14%): hence
    # buckets of 4 MiB on the host. On a device NCCL reduces in place; a staged allreduce's copies
    # are host memory.
    from mpirt.parallel.ddp import HOST_BUCKET_BYTES, MAX_IN_FLIGHT
    red = 4 if e == 2 else e
    bucket = HOST_BUCKET_BYTES // e * red

    def temporaries(synced: float) -> float:
        if synced <= bucket:  # nothing visible for one bucket (it reuses freed activations)
            held = 0
        elif not MAX_IN_FLIGHT:
            held = synced
        elif lay.pp > 1:  # launched after the schedule, as many at once as may be
            held = min(synced, MAX_IN_FLIGHT * bucket)
        else:
            held = min(synced, (MAX_IN_FLIGHT + 1) * bucket) - bucket * 3 / 4
        return held * (2 if e == 2 else 1)
    dense = n_local * red if lay.replicas > 1 else 0
    routed = experts / lay.ep * red if lay.dp // lay.ep > 1 else 0
    buckets = temporaries(dense) + temporaries(routed) if host_heap and not cfg.zero else 0
    return checkpoint, buckets


class _RankBlocks:
    """The blocks a rank holds and what each keeps for its backward (:func:`predict`): ``acts`` the
    blocks' common figures (the model's ``activation_bytes_of`` at the mean expert load and the
    deepest block's busiest expert), :meth:`of` a block's own where the loads were measured per
    block, ``mode`` the recomputation that applies (ZeRO-3's units rerun: full), ``picked`` the
    blocks it applies to, ``mine`` the rank's chunks as ``(lo, hi)`` block ranges."""

    def __init__(self, cfg, model_cfg, lay: Layout, rank: int, e: int, routing: dict, recompute: str):
        from mpirt.core.modeling import activation_bytes
        self.zero = cfg.zero
        self.per_layer = {k: v for k, v in routing.items() if isinstance(v, (list, tuple))}  # measured per block
        self.acts = activation_bytes(model_cfg, lay, itemsize=e, **{
            **routing, **{k: (v[-1] if k == "busiest" else sum(v) / len(v)) for k, v in self.per_layer.items()}})
        self.mode = "full" if cfg.zero == 3 and recompute == "none" else recompute
        self.picked = set(lay.recomputed)
        stage = lay.position(rank)["pp"]
        self.mine = [(0, model_cfg.n_layer)] if lay.pp == 1 else [lay.bounds[c * lay.pp + stage] for c in range(lay.chunks)]
        self.held = [i for lo, hi in self.mine for i in range(lo, hi)]
        if self.per_layer and any(len(v) != len(self.held) for v in self.per_layer.values()):
            raise ValueError(f"memory.predict: rank {rank} holds {len(self.held)} blocks, got per-block loads "
                             f"{ {k: len(v) for k, v in self.per_layer.items()} }")
        self._own = {i: activation_bytes(model_cfg, lay, itemsize=e, **{**routing, **{k: v[n] for k, v in self.per_layer.items()}})
                     for n, i in enumerate(self.held)} if self.per_layer else {}

    def of(self, i: int) -> dict:
        return self._own.get(i, self.acts)

    def stage_bytes(self, lo: int, hi: int, first: bool, last: bool) -> int:
        """What a micro-batch keeps on blocks ``lo`` to ``hi`` (with the embedding, the head): a
        pipeline stash holds neither the received input nor the output it sent (the executor lets go
        of what no op saved; a fully recomputed block's input is in the block's count)."""
        acts = self.acts
        kept = sum(_kept(self.of(i), self.mode, i in self.picked) for i in range(lo, hi))
        if self.zero == 3:  # embed and head are units too: the embedding output, the logits and loss
            return kept + (acts["input"] if first else 0) + (acts["head"] - acts["input"] if last else 0)
        return kept + (acts["embed"] if first else 0) + (acts["head"] if last else 0)

    def weight_pass_holdings(self, ends: list) -> tuple[list, list]:
        """Per chunk (``ends``: whether it holds the embedding, the head): what a micro-batch holds
        between its B and its W, and what its blocks have handed to W before the last block's B.
        Between B and W a chunk holds its weight passes' inputs and output gradients (the rerun's B
        leaves the same) and the buffers it received them in; a fully recomputed block's rerun is
        itself a deferred weight pass, holding its input and its output's gradient until W."""
        acts, picked = self.acts, self.picked
        rerun_w = 2 * acts["input"] if self.mode == "full" else 0
        per_chunk_w = [(sum(self.of(i)["weight_pass"] for i in range(lo, hi)) if self.per_layer
                        else (hi - lo) * acts["weight_pass"])
                       + sum(i in picked for i in range(lo, hi)) * rerun_w
                       + first * acts["embed_weight_pass"] + last * acts["head_weight_pass"]
                       + acts["input"] * ((not first) + (not last))  # the received input and gradient
                       for (first, last), (lo, hi) in zip(ends, self.mine)]
        return per_chunk_w, [_handed_to_w(acts, self.mode, picked, rerun_w, lo, hi) for lo, hi in self.mine]


def _predict(cfg, model_cfg, layout: dict, rank: int, data_bytes: int = 0, *, process_bytes: int | None = None,
             checkpoint_gather: bool = False, expert_load: float | None = None, busiest_expert: float | None = None,
             host_heap: bool = False, recompute: str | None = None) -> dict:
    """:func:`predict`'s categories with ``recompute`` (default ``cfg.recompute``) applied as it
    is, and the step's activation peak (kept activations plus the backward's transient)."""
    from mpirt.core.precision import compute_dtype
    from mpirt.core.modeling import layer_costs, model_class, num_parameters

    lay = Layout.of(cfg, layout, model_cfg)
    pos = lay.position(rank)
    pp, tp, chunks, rows = lay.pp, lay.tp, lay.chunks, lay.rows
    seq = cfg.seq_len // lay.cp  # the tokens of each sequence this rank holds
    e = np.dtype(cfg.dtype).itemsize  # activations, buffers and gradients travel in the compute/storage dtype
    state_e = compute_dtype(cfg.dtype).itemsize  # float32 masters of a half run: a checkpoint's, the widened backward
    costs = layer_costs(model_cfg, cfg.seq_len)
    n_full = num_parameters(model_cfg)
    blocks = _RankBlocks(cfg, model_cfg, lay, rank, e, _routing(cfg, model_cfg, lay.ep, expert_load, busiest_expert),
                         cfg.recompute if recompute is None else recompute)
    acts, acts_of, mode, picked, mine, held = blocks.acts, blocks.of, blocks.mode, blocks.picked, blocks.mine, blocks.held
    if pp == 1:
        n_local = n_full / tp
        activations = blocks.stage_bytes(0, model_cfg.n_layer, True, True)
    else:
        ends = [(c == 0 and pos["pp"] == 0, c == chunks - 1 and pos["pp"] == pp - 1) for c in range(chunks)]
        per_chunk = [blocks.stage_bytes(lo, hi, *ends[c]) for c, (lo, hi) in enumerate(mine)]
        per_chunk_w, handed_before = blocks.weight_pass_holdings(ends)
        activations = peak_in_flight(lay.pipeline_schedule, pos["pp"], per_chunk, per_chunk_w)
        n_local = sum(costs[0].params * first + costs[-1].params * last + sum(costs[1 + i].params for i in range(lo, hi))
                      for (first, last), (lo, hi) in zip(ends, mine)) / tp
    # a mixture of experts' stacked experts: replicated over tp, split over ep, sharded over edp
    experts = len(held) * getattr(model_class(model_cfg), "expert_weights_of", lambda c: 0)(model_cfg)
    n_local -= experts / tp
    params, grads, optimizer, comm = _states_and_buffers(cfg, model_cfg, lay, pos["pp"], costs, n_local, experts, e)
    # ring attention's keys and values in flight, with their gradient in the backward (a transient)
    ring = 4 * ring_message_bytes(lay, model_cfg, cfg.dtype) if lay.cp > 1 and held else 0
    vocab = -(-model_cfg.vocab_size // tp) * tp
    has_head = pp == 1 or pos["pp"] == pp - 1
    logits = 2 * rows * seq * vocab / tp * e  # the logits' gradient and a temporary
    # the gradients alive inside a block's backward; without a split schedule the stage with the
    # head reaches its blocks after freeing what the head kept
    block = max(0, (_block_backward(acts_of, mode, picked, mine) if blocks.per_layer else acts["backward"])
                - (acts["head"] if has_head and not lay.split_backward else 0)) if held else 0
    if state_e > e:  # half: fused ops widen to float32 in backward (mpirt.core.precision.float32_compute):
        # the loss's float32 gradient beside its rounding, or the MLP activation's backward
        logits = rows * seq * vocab / tp * (state_e + e)
        block = max(block, acts["widened"] if held else 0)
    # the ring's keys and values live inside a block's attention, whose backward starts once its MLP's
    # activations are freed (and whose forward before they are made): a transient of their own
    backward = max(logits if has_head else 0, block, ring)
    if any(i in picked for i in held) and mode != "none":  # one rerun, alive while its backward runs
        backward += acts["block"] if mode == "full" else acts["rerun"]
    if pp > 1 and lay.split_backward:  # a split stage holds most after a B, not while it runs
        during = [gain + backward for gain in handed_before]
        backward = max(0, peak_in_flight(lay.pipeline_schedule, pos["pp"], per_chunk, per_chunk_w, during)
                       - activations)
    checkpoint, buckets = _end_of_step(cfg, lay, rank, pos["pp"], costs, n_full, n_local, experts, e, state_e,
                                       checkpoint_gather, host_heap)
    if host_heap and pp > 1 and lay.split_backward:
        activations *= 1 + SPLIT_HOST_HEAP_HOLES
    # the step's transient comes on top of the activations, the end of the run's after they are freed
    workspace = max(backward, checkpoint - activations, buckets)
    out = {"baseline": PROCESS_BYTES if process_bytes is None else process_bytes, "data": data_bytes, "parameters": params, "gradients": grads, "optimizer_state": optimizer,
           "activations": activations, "communication": comm, "workspace": workspace}
    out = {k: int(v) for k, v in out.items()}
    out["peak"] = sum(out.values())
    return out, activations + backward
