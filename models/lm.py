"""What the bundled decoder models share: the tied-head base class, the pre-norm residual block,
causal self-attention (optionally rotary, optionally without biases) and its tensor-parallel plan.

GPT-2, the MLP model and the Llama-style model are built from these; each adds only what differs
(position embeddings, norms, the MLP, the config).
"""
from __future__ import annotations

import dataclasses
import math

import mpirt.backend as B
from mpirt import ops
from mpirt.modeling import CausalLM, LayerCost, as_index_array, seed_dropouts
from mpirt.nn import Dropout, Linear, Module, ShardSpec
from mpirt.ops.attention import rotary_tables


def check_seq_len(cfg, idx) -> None:
    """Refuse a batch whose sequence length exceeds the model's ``n_positions``."""
    if idx.ndim != 2:
        raise ValueError(f"idx: expected shape (batch, seq_len), got {tuple(idx.shape)}")
    if idx.shape[1] > cfg.n_positions:
        raise ValueError(f"sequence length {idx.shape[1]} exceeds n_positions={cfg.n_positions}")


def tied_head(x, wte_weight):
    """Logits ``x @ wte_weight^T``: (B, T, C) -> (B, T, V), as one GEMM over all tokens.

    A plain matmul through a transpose (not ``ops.linear``): the weight gradient then flows back
    through the transpose to the shared embedding table, also when a zero-bubble schedule defers
    weight gradients (those only reach leaf weights).
    """
    b, t, c = x.shape
    logits = ops.matmul(ops.reshape(x, (b * t, c)), ops.transpose(wte_weight, (1, 0)))  # (B*T, V)
    return ops.reshape(logits, (b, t, wte_weight.shape[0]))


def stack_costs(cfg, embed: LayerCost, block: LayerCost, head: LayerCost) -> list:
    """``[embed, h.0 .. h.{L-1}, head]``: the per-layer costs of a model of ``cfg.n_layer`` equal blocks."""
    return [embed, *(dataclasses.replace(block, name=f"h.{i}") for i in range(cfg.n_layer)), head]


class TiedLM(CausalLM):
    """A :class:`~mpirt.modeling.CausalLM` whose head is the final norm ``ln_f`` and the output
    projection tied to the token table ``wte``. Subclasses build ``wte``, ``h`` and ``ln_f``, then
    call :meth:`_finish`; ``embed`` defaults to the token lookup alone (no positions)."""

    head_fn = staticmethod(tied_head)

    def _finish(self, seed: int | None) -> None:
        """Name the parameters, seed each Dropout, and initialize the weights when ``seed`` is given."""
        for name, p in self.named_parameters():
            p.name = name
        seed_dropouts(self, 0 if seed is None else seed)  # distinct masks per Dropout module
        if seed is not None:
            self.initialize(seed)

    def embed(self, idx):
        """(B, T) token ids -> (B, T, C)."""
        idx = as_index_array(idx)
        check_seq_len(self.config, idx)
        return self.wte(idx)

    def head(self, x):
        """Final norm and the tied output projection: (B, T, C) -> logits (B, T, V)."""
        return self.head_fn(self.ln_f(x), self.wte.weight)


class PreNormBlock(Module):
    """``x + attn(ln_1(x))`` then ``+ mlp(ln_2(x))``; subclasses build the four modules."""

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CausalSelfAttention(Module):
    """Fused qkv projection ``c_attn`` (C -> 3C), causal multi-head attention, output projection
    ``c_proj``. ``bias=False`` drops the projections' biases; ``rope_theta`` rotates q and k by
    their positions (rotary embeddings, base ``rope_theta``) before the scores."""

    def __init__(self, cfg, dtype="float32", bias: bool = True, rope_theta: float | None = None):
        super().__init__()
        c = cfg.n_embd
        self.n_head, self.rope_theta = cfg.n_head, rope_theta
        self.c_attn = Linear(c, 3 * c, bias=bias, std=cfg.initializer_range, dtype=dtype)
        self.c_proj = Linear(c, c, bias=bias, std=cfg.initializer_range / math.sqrt(2 * cfg.n_layer), dtype=dtype)
        self.attn_dropout = Dropout(cfg.attn_pdrop)  # its p/seed/calls drive the fused attention op
        self.resid_dropout = Dropout(cfg.resid_pdrop)

    def forward(self, x):
        qkv = self.c_attn(x)                                       # (B, T, 3C); 3C / tp under tp
        if self.rope_theta is not None:
            head_dim = qkv.shape[-1] // (3 * self.n_head)          # n_head is the local count under tp
            cos, sin = rotary_tables(qkv.shape[1], head_dim, self.rope_theta, B.xp.dtype(qkv.dtype))
            qkv = ops.rotary_embedding(qkv, cos, sin)
        d = self.attn_dropout
        if self.training and d.p > 0.0:
            d.calls += 1
            y = ops.causal_self_attention(qkv, self.n_head, dropout_p=d.p, seed=(d.seed, d.calls))
        else:
            y = ops.causal_self_attention(qkv, self.n_head)        # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


# Tensor-parallel plan entries, read by mpirt.parallel.tensor.parallelize(model, tp_comm, ...):
# (module pattern, kind, ShardSpec per parameter); "*" is one path segment; first match wins.
# Specs of parameters a module does not have (biases of bias-free projections) are skipped.
COLUMN = {"weight": ShardSpec((None, "tp")), "bias": ShardSpec(("tp",))}
ROW = {"weight": ShardSpec(("tp", None)), "bias": ShardSpec((None,))}
VOCAB_TABLE = ("wte", "vocab", {"weight": ShardSpec(("tp", None))})  # rows (vocabulary, padded) split
ATTENTION_PLAN = (
    ("h.*.attn.c_attn", "column",                             # q | k | v each split: whole heads
     {"weight": ShardSpec((None, "tp"), blocks=(1, 3)), "bias": ShardSpec(("tp",), blocks=(3,))}),
    ("h.*.attn.c_proj", "row", ROW),
    ("h.*.attn", "heads", {}),                                 # n_head -> n_head / tp
    ("h.*.attn.attn_dropout", "sharded_dropout", {}),
)
VOCAB_HEAD_PLAN = (
    ("head_fn", "vocab_head", {}),                             # logits stay split over the vocabulary
    ("loss_fn", "vocab_loss", {}),                             # cross-entropy without gathering them
)
