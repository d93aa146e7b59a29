"""What one micro-batch asks of one rank, layer by layer, before any machine is involved.

For every layer (embed, each block, head) and each pass (F, B, W) a :class:`Work`: GEMM FLOPs
(and the GEMMs' smallest dimension, which sets their rate), bytes the elementwise passes move,
autograd Functions called, and the tensor-parallel collectives the pass makes. From the model
interface only (``layer_costs``, ``activation_bytes``) and a count of the Functions in one block
(:func:`ops_per_block`: a narrow copy of the model's block, its head and expert ratios kept,
is run once on a 2 x 4 batch).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

from mpirt.parallel.layout import Layout
from mpirt.parallel.pipeline.schedules import BACKWARD, FORWARD, WEIGHT


@dataclass
class Work:
    """One pass of one layer on one rank. ``tp``: ``[(op, bytes), ...]`` collectives over tp;
    ``more_gemms``: ``[(flops, smallest dimension), ...]`` added to the pass at another shape than
    its own (a selective rerun's attention core), each priced at its own rate."""

    gemm_flops: float = 0.0
    gemm_dim: float = 1e9
    ew_bytes: float = 0.0
    ops: float = 0.0
    tp: list = field(default_factory=list)
    more_gemms: list = field(default_factory=list)

    def __iadd__(self, o: "Work") -> "Work":
        if o.gemm_dim == self.gemm_dim or not o.gemm_flops:
            self.gemm_flops += o.gemm_flops
        else:
            self.more_gemms = self.more_gemms + [(o.gemm_flops, o.gemm_dim)]
        self.more_gemms = self.more_gemms + o.more_gemms
        self.ew_bytes += o.ew_bytes
        self.ops += o.ops
        self.tp = self.tp + o.tp
        return self

    def scaled(self, k: float) -> "Work":
        return Work(self.gemm_flops * k, self.gemm_dim, self.ew_bytes * k, self.ops * k, self.tp * int(round(k)),
                    [(f * k, d) for f, d in self.more_gemms])


@functools.lru_cache(maxsize=64)
def _count(model_type: str, frozen: tuple) -> tuple[int, int]:
    from mpirt.core import modeling
    from mpirt.core.tensor import Tensor, graph_functions

    cfg = modeling.config_from_dict(dict(frozen))
    block = modeling.block_class(cfg)(cfg, "float32").initialize(0)
    x = Tensor(np.ones((2, 4, cfg.n_embd), dtype=np.float32), requires_grad=True)
    out = block(x)
    return len(graph_functions(out)), len(list(block.parameters()))


def ops_per_block(model_cfg) -> int:
    """Autograd Functions one forward of the model's block calls (its backward calls as many)."""
    return _block_counts(model_cfg)[0]


def tensors_per_block(model_cfg) -> int:
    """Parameter tensors of one block (the optimizer's and clipping's per-tensor work)."""
    return _block_counts(model_cfg)[1]


def _block_counts(model_cfg) -> tuple:
    """(Functions, parameter tensors) of one block, counted on a narrow copy of the model that
    keeps its own ratios: the heads per key/value head (grouped-query attention), the experts and
    top-k, so that the copy is a model the architecture accepts."""
    kv = getattr(model_cfg, "n_kv_head", None)
    group = model_cfg.n_head // kv if kv else 1  # query heads per key/value head
    heads = 2 * group
    small = dataclasses.replace(model_cfg, n_embd=8 * heads, n_head=heads, n_positions=8, vocab_size=16, n_layer=1,
                                **({"n_kv_head": 2} if kv else {}))
    if hasattr(small, "n_inner") and model_cfg.n_inner is not None:
        small = dataclasses.replace(small, n_inner=32)
    if hasattr(small, "intermediate_size"):
        small = dataclasses.replace(small, intermediate_size=32)
    d = dataclasses.asdict(small)
    return _count(d["model_type"], tuple(sorted((k, v) for k, v in d.items() if not isinstance(v, (list, dict)))))


# Functions outside the blocks: the embedding (lookups, sum, dropout), the head (norm, projection,
# reshapes) and the loss, counted from the bundled models; tensor parallelism adds its f/g ops.
EMBED_OPS, HEAD_OPS, TP_OPS_PER_BLOCK = 4, 8, 4


def layer_work(model_cfg, costs: list, *, rows: int, seq_len: int, tp: int, sp: bool, itemsize: int,
               recompute: str, recomputed: set, split: bool) -> list:
    """Per layer ``[embed, h.0 .. h.{L-1}, head]`` a dict ``{"F", "B", "W"}`` of :class:`Work`
    for one micro-batch of ``rows`` sequences on one tp rank (``W`` empty unless ``split``).

    GEMM FLOPs: a third of the layer's training FLOPs (``layer_costs``) forward, two thirds
    backward (input and weight gradients: a third each when split), over tp; a recomputed block
    runs its forward again in B (selective: only the attention core, ``4 s h`` FLOPs per token).
    (The attention's backward computes its scores again: that time is in the calibrated block
    time, which ``ew_passes`` absorbs beside the GEMMs.)
    Elementwise bytes: ``ew_passes`` (the cluster's) times the kept bytes, a third forward and two
    thirds backward, charged by the caller; here the kept bytes. tp collectives per block: two
    allreduces of ``b s h`` forward and two backward (sequence parallel: allgather + reduce-scatter
    pairs), the embedding one allreduce forward, the head's input gradient one backward.
    """
    from mpirt.core.modeling import activation_bytes

    e = itemsize
    acts = activation_bytes(model_cfg, Layout.micro_batch(rows, seq_len, tp=tp, sequence_parallel=sp), itemsize=e)
    tokens = rows * seq_len
    c = model_cfg.n_embd
    u_bytes = tokens * c * e
    n_ops = ops_per_block(model_cfg) + (TP_OPS_PER_BLOCK if tp > 1 else 0)
    dim = min(tokens, c, model_cfg.hidden / tp)
    if tp > 1:
        pair = [("allgather", u_bytes), ("reduce_scatter", u_bytes)] if sp else [("allreduce", u_bytes)]
    else:
        pair = []
    out = []
    for i, cost in enumerate(costs):
        kind = "embed" if i == 0 else "head" if i == len(costs) - 1 else "block"
        fwd = cost.flops / 3 * tokens
        if kind == "embed":
            f = Work(0.0, 1e9, acts["embed"], EMBED_OPS, [("allreduce", u_bytes)] if tp > 1 else [])
            b = Work(0.0, 1e9, acts["embed"], EMBED_OPS, [])
            w = Work()
        elif kind == "head":
            vocab_dim = min(tokens, c, model_cfg.vocab_size / tp)
            head_tp = [("allreduce", tokens * 4)] * 3 if tp > 1 else []   # vocab-parallel loss: max, sum, target
            f = Work(fwd / tp, vocab_dim, acts["head"], HEAD_OPS, head_tp + (pair[:1] if sp else []))
            b = Work(2 * fwd / tp, vocab_dim, acts["head"], HEAD_OPS, (pair[1:] if sp else pair))
            w = Work()
        else:
            f = Work(fwd / tp, dim, acts["block"], n_ops, pair * 2)
            b = Work(2 * fwd / tp, dim, acts["block"], n_ops, pair * 2)
            w = Work()
            idx = i - 1
            if idx in recomputed and recompute == "full":
                b += Work(f.gemm_flops, dim, acts["block"], n_ops, pair * 2)
            elif idx in recomputed and recompute == "selective":
                b += Work(4.0 * c * seq_len * tokens / tp, min(seq_len, c / model_cfg.n_head), acts["core"], 4, [])
        if split:  # the weight gradients leave B for W
            w = Work(fwd / tp if kind != "embed" else 0.0, f.gemm_dim, b.ew_bytes / 3, f.ops / 2, [])
            b = Work(b.gemm_flops - w.gemm_flops, b.gemm_dim, b.ew_bytes - w.ew_bytes, b.ops, b.tp, b.more_gemms)
        out.append({FORWARD: f, BACKWARD: b, WEIGHT: w})
    return out
