"""The plan: turning a model's modules into their tensor-parallel versions (:func:`parallelize`)
and seeding its dropouts consistently over the tp group."""
from __future__ import annotations

import fnmatch
import zlib

import mpirt.core.backend as B
from mpirt.core.nn import Dropout, Embedding, Linear, Module, ShardSpec

from .layers import (ColumnParallelLinear, RowParallelLinear, SequenceParallelEmbedding,
                     VocabParallelEmbedding)
from .axis import AXIS, PaddedParameter, check_tp_layout, pad_rows, pad_vocab
from .loss import VocabParallelHead, VocabParallelLoss


# =============================================================================================
# the plan: turning a model's modules into their parallel versions
# =============================================================================================
KINDS = {
    "column": "Linear -> ColumnParallelLinear (weight (None, tp), bias (tp,); blocks from the spec)",
    "row": "Linear -> RowParallelLinear (weight (tp, None), bias replicated)",
    "vocab": "Embedding -> VocabParallelEmbedding (rows split, vocabulary padded to a multiple of tp)",
    "positions": "Embedding of sequence positions: replicated; sliced to the sequence chunk under SP",
    "qkv": "the fused q|k|v Linear of the attention module that owns it -> ColumnParallelLinear whose column "
           "blocks (n_head, n_kv_head, n_kv_head heads) are each split over tp: every rank holds whole heads",
    "heads": "module attributes n_head (and n_kv_head, where there is one) divided by tp",
    "sharded_dropout": "a Dropout acting on tp-split data (dimension 1): its part of the tp=1 mask",
    "vocab_head": "a model attribute (callable (x, table) -> logits) -> VocabParallelHead",
    "vocab_loss": "a model attribute (callable (logits, targets) -> loss) -> VocabParallelLoss",
    "replicated": "unchanged, replicated over tp",
}


def _matches(pattern: str, name: str) -> bool:
    """Dotted-name match where ``*`` stands for one path segment (``h.*.attn`` -> ``h.3.attn``)."""
    ps, ns = pattern.split("."), name.split(".")
    return len(ps) == len(ns) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(ps, ns))


def _owner(model: Module, name: str):
    parent = model
    *path, last = name.split(".")
    for part in path:
        parent = parent._modules[part]
    return parent, last


def _qkv_specs(attention) -> dict:
    """The ShardSpecs of a fused q|k|v projection owned by ``attention`` (its ``n_head`` and, for
    grouped-query attention, ``n_kv_head``): three column blocks in proportion to the heads."""
    heads = (attention.n_head, *(2 * [getattr(attention, "n_kv_head", attention.n_head)]))
    return {"weight": ShardSpec((None, AXIS), blocks=(1, heads)), "bias": ShardSpec((AXIS,), blocks=(heads,))}


def _new_module(kind, old, spec: dict, comm, sp, regather):
    w = old.weight
    dtype = str(w.dtype)
    if kind in ("column", "row"):
        if not isinstance(old, Linear):
            raise TypeError(f"tp plan: {kind} needs a Linear, got {type(old).__name__}")
        n_in, n_out = w.global_shape
        has_bias = old.bias is not None
        if kind == "column":
            want = spec.get("weight", ShardSpec((None, AXIS)))
            if want.dims != (None, AXIS):
                raise ValueError(f"tp plan: column weight spec must be (None, 'tp'), got {want.dims}")
            blocks = want.blocks[1] if want.blocks else 1
            return ColumnParallelLinear(n_in, n_out, comm, has_bias, sequence_parallel=sp, blocks=blocks,
                                        std=w.std, dtype=dtype, regather=regather)
        want = spec.get("weight", ShardSpec((AXIS, None)))
        if want.dims != (AXIS, None) or want.is_blocked:
            raise ValueError(f"tp plan: row weight spec must be ('tp', None), got {want}")
        return RowParallelLinear(n_in, n_out, comm, has_bias, sequence_parallel=sp, std=w.std, dtype=dtype)
    if not isinstance(old, Embedding):
        raise TypeError(f"tp plan: {kind} needs an Embedding, got {type(old).__name__}")
    v, c = w.global_shape
    if kind == "vocab":
        return VocabParallelEmbedding(v, c, comm, sequence_parallel=sp, std=w.std, dtype=dtype)
    return SequenceParallelEmbedding(v, c, comm, std=w.std, dtype=dtype)


def _check_changes(changes: list, t: int, sizes: dict) -> None:
    """Refuse a plan's ``(name, module, kind, specs)`` changes that tp ``t`` cannot make: an
    unknown kind, heads that ``t`` does not divide, a parameter whose shape its spec cannot split."""
    for name, module, kind, specs in changes:
        if kind not in KINDS:
            raise ValueError(f"tp plan: {name}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        for heads in ("n_head", "n_kv_head"):
            if kind == "heads" and getattr(module, heads, 0) % t:
                raise ValueError(f"tensor parallelism: tp={t} must divide {name}.{heads}={getattr(module, heads)}")
        for pname, spec in specs.items():
            p = module._parameters.get(pname)
            if p is not None:
                shape = p.global_shape
                if kind == "vocab":
                    shape = (pad_vocab(shape[0], t),) + tuple(shape[1:])
                try:
                    spec.local_shape(shape, sizes)
                except ValueError as err:
                    raise ValueError(f"tensor parallelism: {name}.{pname} {shape} with tp={t}: {err}") from None


def parallelize(model: Module, comm, sequence_parallel: bool = False, seed: int | None = None, plan=None,
                regather: bool = True) -> Module:
    """Make ``model`` tensor parallel over ``comm`` (the tp Comm) in place, following its plan.

    ``plan`` (default ``model.tp_plan``) is a sequence of ``(pattern, kind, specs)``: ``pattern`` a
    dotted module name (``*`` = one segment) or, for ``vocab_head``/``vocab_loss``, a model
    attribute; ``kind`` one of :data:`KINDS`; ``specs`` the ShardSpec of each parameter of the
    module (``{"weight": ShardSpec((None, "tp"), blocks=(1, 3))}``). The first matching entry wins.
    Every parameter keeps its name and global shape (the vocabulary table is padded) and gets its
    ShardSpec; its value is this rank's slice of the current full value (a lazy parameter stays
    lazy, shaped as its slice), or with ``seed`` this rank's slice of the seeded full initial
    tensor (so any tp starts from the tp=1 model), generated without building the full tensor
    (:meth:`mpirt.core.nn.Parameter.init_slice`): build the model lazily (no seed) and pass it here. Build the optimizer (and
    DataParallel) afterwards. ``regather`` (sequence parallelism): column-parallel layers save the
    sequence-split input and allgather it again for the weight gradient (True, less memory) or
    save the gathered input (False, one allgather less per layer in backward). Returns ``model``.
    """
    plan = getattr(model, "tp_plan", None) if plan is None else plan
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no tp_plan: pass plan=")
    t, r = comm.size, comm.rank
    sizes, ranks = {AXIS: t}, {AXIS: r}
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "n_head"):
        check_tp_layout(t, n_head=cfg.n_head, n_embd=cfg.n_embd, hidden=cfg.hidden, vocab_size=cfg.vocab_size,
                        sequence_parallel=sequence_parallel, n_kv_head=getattr(cfg, "n_kv_head", None))
    for name, p in model.named_parameters():  # names and full values, before anything changes
        p.name = name
    modules = dict(model.named_modules())
    changes = []
    for name, module in modules.items():
        entry = next((e for e in plan if e[1] not in ("vocab_head", "vocab_loss") and _matches(e[0], name)), None)
        if entry is not None:
            kind, specs = entry[1], entry[2] if len(entry) > 2 else {}
            if kind == "qkv":
                kind, specs = "column", _qkv_specs(modules[name.rpartition(".")[0]])
            changes.append((name, module, kind, specs))
    _check_changes(changes, t, sizes)  # everything, with the numbers, before anything changes
    for name, module, kind, specs in changes:
        if kind in ("column", "row", "vocab") or (kind == "positions" and sequence_parallel):
            new = _new_module(kind, module, specs, comm, sequence_parallel, regather)
            for pname, p in new._parameters.items():
                old = module._parameters[pname]
                p.name = old.name
                if seed is None and old.materialized:  # a lazy one stays lazy (its slice's shape)
                    full = B.to_host(old.data)
                    if isinstance(p, PaddedParameter):
                        full = pad_rows(full, p.global_shape[0])
                    p.data = B.asarray(p.spec.shard(full, sizes, ranks), dtype=p.dtype)
            parent, attr = _owner(model, name)
            setattr(parent, attr, new)
        elif kind == "heads":
            module.n_head //= t
            if hasattr(module, "n_kv_head"):
                module.n_kv_head //= t
        elif kind == "sharded_dropout":
            module.tp_split = True
    for pattern, kind, *_ in plan:
        if kind == "vocab_head":
            setattr(model, pattern, VocabParallelHead(comm, sequence_parallel, regather))
        elif kind == "vocab_loss":
            vocab = next((m.vocab_size for _, m in model.named_modules() if isinstance(m, VocabParallelEmbedding)), None)
            if vocab is None:
                raise ValueError("tp plan: vocab_loss needs a 'vocab' module (the vocabulary-split table)")
            setattr(model, pattern, VocabParallelLoss(comm, vocab))
    for _, p in model.named_parameters():  # replicated parameters see 1/t of the tokens under SP
        p.tp_partial_grad = bool(sequence_parallel and AXIS not in p.spec.dims)
    object.__setattr__(model, "tp_info", {"size": t, "rank": r, "sequence_parallel": sequence_parallel})
    reseed_dropouts(model, None, r, t, sequence_parallel)
    if seed is not None:
        model.initialize(seed, sizes, ranks)
    return model


def reseed_dropouts(model: Module, seed: int | None, tp_rank: int, tp_size: int,
                    sequence_parallel: bool = False) -> None:
    """Seed every Dropout of a (tensor-parallel) model from ``seed`` and its name (``seed=None``
    keeps the seeds) and tell those whose input is split over tp along dimension 1 which part
    they hold (the attention probabilities of the local heads; every dropout under sequence
    parallelism, on its sequence chunk): masks depend on the global position
    (:mod:`mpirt.core.ops.dropout`), so replicated activations draw one mask on every tp rank and a
    split one its part of the tp=1 mask. ``seed`` must be equal over the tp group."""
    for name, m in model.named_modules():
        if not isinstance(m, Dropout):
            continue
        if seed is not None:
            m.seed, m.calls = zlib.crc32(f"{seed}:{name}".encode()), 0
        split = tp_size > 1 and (sequence_parallel or getattr(m, "tp_split", False))
        m.split = (tp_rank, tp_size) if split else None