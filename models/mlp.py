"""A small MLP language model: the simplest model to test and to split into pipeline stages.

    x = wte[idx]                                      # (B, T, C)
    for block in h:
        x = x + c_proj(gelu(c_fc(ln(x))))             # pre-LayerNorm residual MLP block
    logits = ln_f(x) @ wte.weight^T                   # (B, T, V), head tied to wte

There is no attention and no position embedding: each position predicts the next token from its
own token only (a learned bigram model). ``n_positions`` still bounds the sequence length so the
data pipeline treats both models alike. Uses n_layer, n_embd, n_inner (hidden size), vocab_size,
n_positions, layer_norm_epsilon, resid_pdrop and initializer_range from :class:`GPTConfig`.
"""
from __future__ import annotations

import math

from mpirt.core import ops
from mpirt.core.modeling import LayerCost, register
from mpirt.core.nn import Dropout, Embedding, LayerNorm, Linear, Module, ModuleList
from mpirt.models.model_config import GPTConfig
from mpirt.models.lm import TiedLM, activation_bytes, stack_costs


class MLPBlock(Module):
    """``x + dropout(c_proj(gelu(c_fc(ln(x)))))``."""

    def __init__(self, cfg: GPTConfig, dtype="float32"):
        super().__init__()
        std = cfg.initializer_range
        self.ln = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon, dtype=dtype)
        self.c_fc = Linear(cfg.n_embd, cfg.hidden, std=std, dtype=dtype)
        self.c_proj = Linear(cfg.hidden, cfg.n_embd, std=std / math.sqrt(2 * cfg.n_layer), dtype=dtype)
        self.dropout = Dropout(cfg.resid_pdrop)

    def forward(self, x):
        return x + self.dropout(self.c_proj(ops.gelu(self.c_fc(self.ln(x)))))


@register
class MLP(TiedLM):
    """MLP language model with GPT's interface: ``forward(idx, targets=None)``, ``embed``, ``h``,
    ``head``. Pass ``seed`` to initialize the weights at construction."""

    model_type = "mlp"
    config_class = GPTConfig
    block_class = MLPBlock

    def __init__(self, cfg: GPTConfig, dtype="float32", seed: int | None = None):
        super().__init__()
        self.config = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, std=cfg.initializer_range, dtype=dtype)
        self.h = ModuleList(MLPBlock(cfg, dtype) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon, dtype=dtype)
        self._finish(seed)

    @classmethod
    def num_parameters_of(cls, cfg: GPTConfig) -> int:
        """Parameters of the model ``cfg`` describes (module-level :func:`num_parameters`)."""
        return num_parameters(cfg)

    @classmethod
    def flops_per_token_of(cls, cfg: GPTConfig, seq_len: int = 0) -> float:
        """Training FLOPs per token of the model ``cfg`` describes (module-level :func:`flops_per_token`)."""
        return flops_per_token(cfg, seq_len)

    @classmethod
    def activation_bytes_of(cls, cfg: GPTConfig, layout, *, itemsize: int = 4) -> dict:
        """Embedding and head as :func:`~mpirt.models.lm.activation_bytes`; a block keeps the
        norm's normalised input, 1/std and output, GELU's derivative and output (``u = b s h``):
        ``e (2u + 2 b s f) + e' b s``, with dropout a mask of ``u`` bytes more. No attention core."""
        out = activation_bytes(cfg, layout, itemsize=itemsize)
        tokens = layout.rows * layout.tokens
        u, e = tokens * cfg.n_embd, itemsize
        block = e * (2 * u + 2 * tokens * cfg.hidden) + (4 if e == 2 else e) * tokens
        block += u if cfg.resid_pdrop > 0 else 0
        # until the weight passes: the norm's normalised input and gradient, both projections'
        # inputs and output gradients
        weight_pass = e * (4 * u + 2 * tokens * cfg.hidden)
        return {**out, "block": block, "core": 0, "rerun": 0, "weight_pass": weight_pass}

    @classmethod
    def layer_costs_of(cls, cfg: GPTConfig, seq_len: int) -> list:
        """Per block ``6 x`` its two weight matrices; the embedding one lookup and scatter-add;
        the head the tied projection (``6 V C``) and its own copy of ``wte``."""
        c, h, v = cfg.n_embd, cfg.hidden, cfg.vocab_size
        mat = 2 * c * h
        return stack_costs(cfg, LayerCost("embed", 2.0 * c, v * c), LayerCost("", 6.0 * mat, mat + h + c + 2 * c),
                           LayerCost("head", 6.0 * v * c + 10.0 * c, v * c + 2 * c))

    def flops_per_token(self, seq_len: int) -> float:
        return flops_per_token(self.config, seq_len)


def num_parameters(cfg: GPTConfig) -> int:
    """Parameter count of the MLP model (tied head counted once)."""
    c, h = cfg.n_embd, cfg.hidden
    return cfg.vocab_size * c + cfg.n_layer * (2 * c + c * h + h + h * c + c) + 2 * c


def flops_per_token(cfg: GPTConfig, seq_len: int = 0) -> float:
    """Training FLOPs per token, ``6 N`` (N includes wte once: the tied head's GEMM).
    ``seq_len`` is accepted for symmetry with GPT; nothing here depends on it."""
    return 6.0 * num_parameters(cfg)
