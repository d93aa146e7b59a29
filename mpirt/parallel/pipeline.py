"""Pipeline parallelism: stage partitioning and the one executor that runs any schedule.

    stage = PipelineStage(model_cfg, grid, schedule="1f1b", microbatches=8, dtype="float32", seed=0)
    opt = AdamW(stage.parameters(), lr=3e-4)
    for step in range(steps):
        loss = stage.train_step(x, y)   # every pp rank passes its dp share of the batch (same x, y)
        norm = stage.clip_grad_norm(1.0)
        opt.step()                      # train_step zeroes the gradients itself

The model's layers ``[embed, h.0, ..., h.{L-1}, head]`` are cut into ``S = pp * chunks`` contiguous
virtual stages (:func:`partition`, balanced by a per-layer cost estimate, or a user ``split``);
chunk ``c`` of pp rank ``r`` is virtual stage ``c * pp + r``. Each rank builds only its own layers,
with the parameter names of the full model, and initialises them from the same name-derived
seeds, so any layout starts from the weights of the single-rank model. The tied embedding/head
``wte`` lives on the first and the last rank; after every backward the two copies' gradients are
summed between those two ranks (one send/recv pair), so the copies stay identical.

With ``grid.tp > 1`` each stage's modules are made tensor parallel by the model's ``tp_plan``
(:func:`mpirt.parallel.tensor.parallelize`); pipeline messages then go between the ranks of equal
tp coordinate (``grid.comm["pp"]``), and with ``sequence_parallel`` carry ``T / tp`` positions.
With ``grid.dp > 1`` the gradients are averaged over dp after the tied-weight sum.

The schedule (:mod:`mpirt.parallel.schedules`) is checked before anything runs; then every rank
walks its action list: receives are posted ahead (one per neighbour and kind) into preallocated
buffers and waited on where the list says ``recv``; sends are non-blocking. Activations are
``(micro-batch rows, T, n_embd)`` in the model dtype on every link: the shape is agreed once per
batch shape by all pp ranks (one allgather of a small tuple), and every receive checks that the
message fills its buffer exactly. Per-rank timers, the peak number of stashed activations and
their estimated bytes are in :attr:`PipelineStage.stats` after each step.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import time
from dataclasses import dataclass

import numpy as np

import mpirt.backend as B
from mpirt.nn import Module, Parameter
from mpirt.parallel.schedules import (F, W, Schedule, ScheduleError, build, canonical_name, check)
from mpirt.tensor import Tensor, no_grad

TAG_ACT, TAG_GRAD, TAG_TIED = 11, 12, 13
_BLOCKS = {"gpt2": ("models.gpt", "Block"), "mlp": ("models.mlp", "MLPBlock")}


# ---------------------------------------------------------------------------------------------
# partitioning

@dataclass(frozen=True)
class LayerCost:
    """Training FLOPs per token (forward + backward) and parameter count of one layer."""

    name: str
    flops: float
    params: int


def layer_costs(cfg, seq_len: int | None = None) -> list:
    """Costs of ``[embed, h.0, ..., h.{L-1}, head]``: ``6 x`` the multiply-adds of every weight
    matrix, plus attention's ``12 C T`` for GPT blocks; the embedding costs its lookup and
    scatter-add (``2 C`` per table) and holds the tables; the head costs the tied projection
    (``6 V C``) and holds its own copy of ``wte``."""
    c, h, v, t = cfg.n_embd, cfg.hidden, cfg.vocab_size, seq_len or cfg.n_positions
    if cfg.model_type == "gpt2":
        mat = 4 * c * c + 2 * c * h
        block = LayerCost("", 6.0 * mat + 12.0 * c * t, mat + 3 * c + c + h + c + 4 * c)
        embed = LayerCost("embed", 4.0 * c, (v + cfg.n_positions) * c)
    elif cfg.model_type == "mlp":
        mat = 2 * c * h
        block = LayerCost("", 6.0 * mat, mat + h + c + 2 * c)
        embed = LayerCost("embed", 2.0 * c, v * c)
    else:
        raise ValueError(f"layer_costs: no cost model for model_type {cfg.model_type!r}; pass split=")
    blocks = [dataclasses.replace(block, name=f"h.{i}") for i in range(cfg.n_layer)]
    return [embed, *blocks, LayerCost("head", 6.0 * v * c + 10.0 * c, v * c + 2 * c)]


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
        w = [getattr(x, balance) for x in costs]
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
    bounds, lo = [], 0
    for k in split:
        bounds.append((lo, lo + k))
        lo += k
    return bounds


# ---------------------------------------------------------------------------------------------
# this rank's part of the model

class _Blocks(Module):
    """Blocks registered under their global index, so names read ``h.5.attn...``."""


def _block_class(cfg):
    if cfg.model_type in _BLOCKS:
        module, name = _BLOCKS[cfg.model_type]
        return getattr(importlib.import_module(module), name)
    from models import build_model
    return type(build_model(dataclasses.replace(cfg, n_layer=1)).h[0])


def _leaf_params(out: Tensor) -> list:
    """The Parameters that ``out`` was computed from."""
    found, seen, stack = {}, set(), [out._ctx]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        for x in getattr(fn, "inputs", ()):
            if isinstance(x, Parameter):
                found[id(x)] = x
            elif isinstance(x, Tensor):
                stack.append(x._ctx)
    return list(found.values())


def _array_bytes(out: Tensor, skip=()) -> int:
    """Bytes of the arrays that the graph behind ``out`` keeps alive (saved by its Functions, its
    non-parameter leaves and ``out`` itself), each underlying buffer counted once."""
    bases, seen, stack = {}, set(), [out._ctx]

    def add(a):
        if hasattr(a, "nbytes") and hasattr(a, "shape"):
            base = a.base if getattr(a, "base", None) is not None else a
            bases[id(base)] = base.nbytes
        elif isinstance(a, (tuple, list)):
            for b in a:
                add(b)

    add(out.data)
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        for k, val in vars(fn).items():
            if k != "inputs":
                add(val)
        for x in fn.inputs:
            if isinstance(x, Tensor) and not isinstance(x, Parameter):
                if x._ctx is None:
                    add(x.data)
                else:
                    stack.append(x._ctx)
    return int(sum(v for k, v in bases.items() if k not in skip))


class PipelineStage:
    """This rank's stage of a pipeline-parallel model and the executor of its schedule.

    ``model_cfg``: a :class:`models.config.GPTConfig` (GPT or MLP); ``grid``: a
    :class:`mpirt.grid.Grid` (tp > 1 makes every stage tensor parallel through the model's
    ``tp_plan``, :func:`mpirt.parallel.tensor.parallelize`; ``sequence_parallel`` then splits the
    activations between stages along the sequence too); ``schedule``: a name (gpipe, 1f1b,
    interleaved, zb-h1) or a :class:`Schedule`; ``microbatches`` per step (default pp);
    ``chunks``: model chunks per rank (interleaved); ``split``: blocks per virtual stage, else
    balanced by ``balance`` ("flops" or "params") at ``seq_len`` (default n_positions); ``wait``:
    ``"block"`` (MPI Wait) or ``"poll"`` (test and sleep ``poll_s``: yields the CPU to other
    ranks when cores are oversubscribed).
    """

    def __init__(self, model_cfg, grid, schedule="1f1b", microbatches: int | None = None, chunks: int = 1,
                 dtype="float32", seed: int = 0, split=None, balance: str = "flops", seq_len: int | None = None,
                 wait: str = "block", poll_s: float = 2e-5, sequence_parallel: bool = False):
        if wait not in ("block", "poll"):
            raise ValueError(f"wait: expected block or poll, got {wait!r}")
        self.cfg, self.grid, self.dtype = model_cfg, grid, np.dtype(dtype)
        self.comm = grid.comm["pp"]
        self.rank, self.pp = self.comm.rank, self.comm.size
        self.tp, self.sequence_parallel = grid.tp, bool(sequence_parallel and grid.tp > 1)
        self.wait_mode, self.poll_s = wait, poll_s
        if isinstance(schedule, Schedule):
            sched = schedule
            if sched.pp != self.pp:
                raise ScheduleError(f"schedule {sched.name} was made for pp={sched.pp}, the grid has pp={self.pp}")
        else:
            sched = build(canonical_name(schedule), self.pp, microbatches or self.pp, chunks)
        check(sched)                     # the pre-flight proof, on every rank, before any communication
        self.schedule, self.eval_schedule = sched, sched.forward_only()
        check(self.eval_schedule)
        self.m, self.v, self.S = sched.microbatches, sched.chunks, sched.num_stages
        self.bounds = partition(layer_costs(model_cfg, seq_len) if split is None else [None] * (model_cfg.n_layer + 2),
                                self.S, split, balance)
        self.chunk_bounds = [self.bounds[c * self.pp + self.rank] for c in range(self.v)]
        self.has_embed, self.has_head = self.rank == 0, self.rank == self.pp - 1
        self._build(seed)
        self._shape_key = None
        self.trace = False  # True: stats["trace"] lists (start, end, op, mb, chunk) of every compute and wait
        self.stats: dict = {}
        self._stash_bytes: dict = {}

    # -- construction ----------------------------------------------------------------------
    def _build(self, seed: int) -> None:
        from models import build_model
        from models.gpt import lm_loss, seed_dropouts

        cfg, dtype = self.cfg, str(self.dtype)
        if cfg.model_type == "gpt2" and cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_head={cfg.n_head} must divide n_embd={cfg.n_embd}")
        self.lm_loss = lm_loss
        model = Module()
        model.config = cfg
        self.shell, self.tied_names, registered = None, [], []
        if self.has_embed or self.has_head:
            # embed/head come from the model class itself, built without blocks
            shell = build_model(dataclasses.replace(cfg, n_layer=0), dtype=dtype)
            # which parameters do embed and head use? run each once on a dummy input and look
            e_params = _leaf_params(shell.embed(B.xp.zeros((1, 1), dtype=np.int64)))
            h_params = _leaf_params(shell.head(Tensor(B.xp.zeros((1, 1, cfg.n_embd), dtype))))
            used = {id(p) for p in (e_params if self.has_embed else []) + (h_params if self.has_head else [])}
            for name, child in list(shell._modules.items()):
                if any(id(p) in used for p in child.parameters()):
                    setattr(model, name, child)
                    registered.append(name)
                elif child.parameters():  # e.g. ln_f on a first stage: never runs here, so not kept
                    del shell._modules[name]
                    object.__setattr__(shell, name, None)
            if self.has_head:
                self.lm_loss = getattr(shell, "loss_fn", lm_loss)
                for fn in ("head_fn", "loss_fn"):
                    if hasattr(shell, fn):
                        setattr(model, fn, getattr(shell, fn))
            names = {id(p): n for n, p in shell.named_parameters()}
            self.tied_names = sorted(names[id(p)] for p in e_params if any(p is q for q in h_params))
            self.shell = shell
        blocks, cls = _Blocks(), _block_class(cfg)
        self.blocks = {}
        for lo, hi in self.chunk_bounds:
            for i in range(lo, hi):
                self.blocks[i] = cls(cfg, dtype)
                setattr(blocks, str(i), self.blocks[i])
        model.h = blocks
        for name, p in model.named_parameters():
            p.name = name
        seed_dropouts(model, seed)
        if self.shell is not None:
            seed_dropouts(self.shell, seed)
        if self.tp > 1:
            self._parallelize(model, seed, registered)
        else:
            model.initialize(seed)
        self.model = model
        self._params = model.parameters()
        if any(p.dtype != self.dtype for p in self._params):
            raise TypeError(f"PipelineStage: parameters of mixed dtypes {sorted({str(p.dtype) for p in self._params})}")
        n = sum(p.size for p in self._params)
        self.flat_grad = B.xp.zeros(n, dtype=self.dtype)  # every p.grad is a view into it
        off = 0
        for p in self._params:
            p.grad = self.flat_grad[off:off + p.size].reshape(p.shape)
            off += p.size
        named = dict(model.named_parameters())
        # the norm counts every element once: the tied copy on the first rank only, and a
        # parameter replicated over tp on tp rank 0 only
        tp_rank = self.grid.comm["tp"].rank if self.tp > 1 else 0
        self._counted = [p for name, p in named.items()
                         if not (self.pp > 1 and self.has_head and name in self.tied_names)
                         and not (tp_rank and "tp" not in p.spec.dims)]

    def _parallelize(self, model, seed: int, registered: list) -> None:
        """Tensor parallelism inside the stage: the model class's plan applied to this stage's
        modules (entries for the head and loss only on the last stage), then the swapped modules
        handed back to the shell whose embed/head run them."""
        from models import MODELS
        from mpirt.parallel import tensor as TP

        plan = getattr(MODELS.get(self.cfg.model_type), "tp_plan", None)
        if plan is None:
            raise NotImplementedError(f"PipelineStage: model_type {self.cfg.model_type!r} has no tp_plan; "
                                      "tensor parallelism needs one")
        plan = [e for e in plan if e[1] not in ("vocab_head", "vocab_loss") or self.has_head]
        TP.parallelize(model, self.grid.comm["tp"], sequence_parallel=self.sequence_parallel, seed=seed, plan=plan)
        for name in registered:
            setattr(self.shell, name, getattr(model, name))
        if self.has_head:
            for fn in ("head_fn", "loss_fn"):
                if hasattr(model, fn):
                    object.__setattr__(self.shell, fn, getattr(model, fn))
            self.lm_loss = getattr(model, "loss_fn", self.lm_loss)

    # -- the public surface ----------------------------------------------------------------
    def parameters(self) -> list:
        """This rank's parameters (each once; with pp > 1 the tied ``wte`` is on two ranks)."""
        return list(self._params)

    def named_parameters(self) -> list:
        return list(self.model.named_parameters())

    def zero_grad(self) -> None:
        self.flat_grad.fill(0)

    def describe_partition(self) -> str:
        """``stage s (rank r, chunk c): h.lo-h.hi [+ embed] [+ head]`` per virtual stage."""
        out = []
        for s, (lo, hi) in enumerate(self.bounds):
            extra = (" + embed" if s == 0 else "") + (" + head" if s == self.S - 1 else "")
            out.append(f"stage {s} (rank {s % self.pp}, chunk {s // self.pp}): h.{lo}..h.{hi - 1}{extra}")
        return "\n".join(out)

    def grad_norm(self) -> float:
        """Global L2 norm of the gradients over the pipeline and tp (each element once)."""
        sq = sum(float(B.xp.vdot(p.grad.reshape(-1), p.grad.reshape(-1))) for p in self._counted)
        if self.tp > 1:
            sq = self.grid.comm["tp"].allreduce_scalar(sq)
        return math.sqrt(self.comm.allreduce_scalar(sq) if self.pp > 1 else sq)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale every gradient by ``max_norm / (norm + 1e-6)`` when the global norm exceeds
        ``max_norm`` (as :func:`mpirt.optim.clip_grad_norm`; both tied copies alike); returns the
        norm before clipping (non-finite: nothing is scaled)."""
        norm = self.grad_norm()
        if norm > max_norm:
            self.flat_grad *= float(max_norm) / (norm + 1e-6)
        return norm

    def train_step(self, x, y) -> float:
        """Forward and backward of the batch ``(x, y)`` (this dp replica's rows, split into
        ``microbatches``), then the tied-weight gradient sum over the pipeline ends and the
        average over dp. Returns the mean loss of the global batch on every rank."""
        x, y = self._prepare(x, y)
        self.zero_grad()
        loss = self._run(self.schedule, x, y, training=True)
        t0 = time.perf_counter()
        self._sync_tied()
        if self.sequence_parallel:
            from mpirt.parallel.tensor import sync_sequence_parallel_grads
            sync_sequence_parallel_grads(self.model, self.grid.comm["tp"])
        if self.grid.dp > 1:
            self.grid.comm["dp"].allreduce(self.flat_grad, op="avg", out=self.flat_grad)
        loss = self._share_loss(loss)
        self.stats["sync_s"] = time.perf_counter() - t0
        return loss

    def evaluate(self, x, y) -> float:
        """Mean loss of ``(x, y)`` without gradients (forward-only schedule)."""
        x, y = self._prepare(x, y)
        with no_grad():
            loss = self._run(self.eval_schedule, x, y, training=False)
        return self._share_loss(loss)

    # -- the step ----------------------------------------------------------------------------
    def _prepare(self, x, y):
        if x is None or len(x.shape) != 2:
            raise ValueError(f"pipeline batch: expected x of shape (rows, seq_len) on every pp rank, got "
                             f"{None if x is None else tuple(x.shape)}")
        if y is not None and tuple(y.shape) != tuple(x.shape):
            raise ValueError(f"pipeline batch: y shape {tuple(y.shape)} != x shape {tuple(x.shape)}")
        rows, t = int(x.shape[0]), int(x.shape[1])
        if rows % self.m:
            raise ValueError(f"pipeline batch: {rows} rows cannot be split into microbatches={self.m} equal "
                             "micro-batches")
        key = (rows, t)
        if key != self._shape_key:  # agree on shapes and layout once, before any p2p
            mine = (rows, t, str(self.dtype), self.schedule.name, self.m, self.v, tuple(self.bounds),
                    self.cfg.n_embd, self.tp, self.sequence_parallel)
            every = self.comm.allgather_object(mine) if self.pp > 1 else [mine]
            bad = [r for r, s in enumerate(every) if s != mine]
            if bad:
                raise ValueError(f"pipeline ranks disagree on (rows, seq_len, dtype, schedule, m, chunks, split, "
                                 f"n_embd, tp, sequence_parallel): rank {self.rank} has {mine}, rank {bad[0]} has {every[bad[0]]}")
            self._shape_key = key
            if self.sequence_parallel and t % self.tp:
                raise ValueError(f"sequence parallelism: seq_len {t} is not divisible by tp={self.tp}")
            self.act_shape = (rows // self.m, t // self.tp if self.sequence_parallel else t, self.cfg.n_embd)
            self._pool = {"act": [], "grad": []}
            self._stash_bytes = {}
        xs = ys = None
        if self.has_embed:
            xa = B.xp.asarray(x)
            xs = [xa[i * self.act_shape[0]:(i + 1) * self.act_shape[0]] for i in range(self.m)]
        if self.has_head:
            if y is None:
                raise ValueError("pipeline batch: the last stage needs the targets y")
            ya = B.xp.asarray(y)
            ys = [ya[i * self.act_shape[0]:(i + 1) * self.act_shape[0]] for i in range(self.m)]
        return xs, ys

    def _buffer(self, kind):
        pool = self._pool[kind]
        return pool.pop() if pool else B.xp.empty(self.act_shape, dtype=self.dtype)

    def _wait(self, handle) -> None:
        if self.wait_mode == "block":
            handle.wait()
        else:
            while not handle.test():
                time.sleep(self.poll_s)

    def _forward(self, chunk, mb, inp, xs, ys):
        """Chunk ``chunk`` on micro-batch ``mb``: the stage output, or the scaled loss (last stage)."""
        s = chunk * self.pp + self.rank
        h = self.shell.embed(xs[mb]) if s == 0 else inp
        lo, hi = self.chunk_bounds[chunk]
        for i in range(lo, hi):
            h = self.blocks[i](h)
        if s < self.S - 1:
            return h, None
        loss = self.lm_loss(self.shell.head(h), ys[mb])
        return loss * (1.0 / self.m), loss.item()

    def _run(self, sched: Schedule, xs, ys, training: bool):
        comm, rank, last = self.comm, self.rank, self.S - 1
        acts = sched.actions[rank]
        split = sched.split_backward
        queues: dict = {}
        for a in acts:
            if a.is_recv:
                queues.setdefault((a.peer, a.kind), []).append(a)
        heads = {k: 0 for k in queues}
        posted: dict = {}

        def post(key):
            i = heads[key]
            if i < len(queues[key]):
                a = queues[key][i]
                heads[key] = i + 1
                buf = self._buffer(a.kind)
                tag = TAG_ACT if a.kind == "act" else TAG_GRAD
                posted[key] = (a, comm.irecv(buf, a.peer, tag), buf)

        stash, inbox, outbox, wpasses, sends = {}, {}, {}, {}, []
        losses = [0.0] * self.m
        op_time = {F: 0.0, "B": 0.0, W: 0.0}
        op_count = {F: 0, "B": 0, W: 0}
        recv_wait = 0.0
        trace = [] if self.trace else None
        live = peak = 0
        live_bytes = peak_bytes = 0
        t_start = time.perf_counter()
        for key in queues:
            post(key)

        def release(key):
            nonlocal live, live_bytes
            entry = stash.pop(key)
            for kind, buf in (("act", entry[2]), ("grad", entry[3])):
                if buf is not None:
                    self._pool[kind].append(buf)
            live -= 1
            live_bytes -= self._stash_bytes.get(key[1], 0)

        for a in acts:
            key = (a.mb, a.chunk)
            s = a.chunk * self.pp + rank
            if a.is_recv:
                pk = (a.peer, a.kind)
                pa, handle, buf = posted.pop(pk)
                if pa is not a:  # cannot happen: receives are posted in list order per (peer, kind)
                    raise RuntimeError(f"pipeline rank {rank}: posted {pa}, expected {a}")
                t0 = time.perf_counter()
                self._wait(handle)
                t1 = time.perf_counter()
                recv_wait += t1 - t0
                if trace is not None:
                    trace.append((t0 - t_start, t1 - t_start, "wait", a.mb, a.chunk))
                inbox[(a.kind,) + key] = buf
                post(pk)
            elif a.is_send:
                data = outbox.pop((a.kind,) + key)
                sends.append(comm.isend(data, a.peer, TAG_ACT if a.kind == "act" else TAG_GRAD))
            else:
                t0 = time.perf_counter()
                if a.op == F:
                    buf = inbox.pop(("act",) + key) if s > 0 else None
                    inp = Tensor(buf, requires_grad=training) if buf is not None else None
                    out, loss = self._forward(a.chunk, a.mb, inp, xs, ys)
                    if loss is not None:
                        losses[a.mb] = loss
                    if s < last:
                        outbox[("act",) + key] = out.data
                    if training:
                        stash[key] = [inp, out, buf, None]
                        if a.chunk not in self._stash_bytes:
                            self._stash_bytes[a.chunk] = _array_bytes(out, skip={id(p.data) for p in self._params})
                        live += 1
                        live_bytes += self._stash_bytes[a.chunk]
                        peak, peak_bytes = max(peak, live), max(peak_bytes, live_bytes)
                    elif buf is not None:
                        self._pool["act"].append(buf)
                elif a.op == "B":
                    entry = stash[key]
                    g = inbox.pop(("grad",) + key) if s < last else None
                    entry[3] = g
                    wp = entry[1].backward(g, defer_weight_grad=split)
                    if s > 0:
                        outbox[("grad",) + key] = entry[0].grad
                    entry[0] = entry[1] = None
                    if split:
                        wpasses[key] = wp
                    else:
                        release(key)
                else:  # W
                    wpasses.pop(key).run()
                    release(key)
                t1 = time.perf_counter()
                op_time[a.op] += t1 - t0
                op_count[a.op] += 1
                if trace is not None:
                    trace.append((t0 - t_start, t1 - t_start, a.op, a.mb, a.chunk))
            if sends and a.op in (F, "B", W):
                sends = [h for h in sends if not h.test()]  # drives MPI progress of the sends
        t0 = time.perf_counter()
        for h in sends:
            self._wait(h)
        send_wait = time.perf_counter() - t0
        total = time.perf_counter() - t_start
        if stash or wpasses or inbox or outbox:
            raise RuntimeError(f"pipeline rank {rank}: schedule left work behind: stash {sorted(stash)}, "
                               f"W {sorted(wpasses)}, inbox {sorted(inbox)}, outbox {sorted(outbox)}")
        compute = sum(op_time.values())
        self.stats = {"step_s": total, "compute_s": compute, "idle_s": total - compute,
                      "bubble": (total - compute) / total if total > 0 else 0.0,
                      "recv_wait_s": recv_wait, "send_wait_s": send_wait,
                      "op_s": dict(op_time), "op_count": dict(op_count),
                      "peak_stash": peak, "peak_stash_bytes": peak_bytes,
                      "stash_bytes_per_mb": dict(self._stash_bytes)}
        if trace is not None:
            self.stats["trace"] = trace
        return sum(losses) / self.m if self.has_head else 0.0

    def _sync_tied(self) -> None:
        """Sum the gradients of the tied copies on the first and last pp ranks."""
        if self.pp == 1 or not self.tied_names or not (self.has_embed or self.has_head):
            return
        peer = self.pp - 1 if self.has_embed else 0
        named = dict(self.model.named_parameters())
        for name in self.tied_names:
            g = named[name].grad
            other = B.xp.empty_like(g)
            hs = self.comm.isend(g, peer, TAG_TIED)
            hr = self.comm.irecv(other, peer, TAG_TIED)
            self._wait(hr)
            self._wait(hs)
            g += other  # a + b == b + a exactly: both copies get the same bits

    def _share_loss(self, loss: float) -> float:
        buf = np.array([loss if self.has_head else 0.0], dtype=np.float64)
        if self.pp > 1:
            self.comm.broadcast(buf, root=self.pp - 1)
        if self.grid.dp > 1:
            self.grid.comm["dp"].allreduce(buf, op="avg", out=buf)
        return float(buf[0])
