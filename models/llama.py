"""A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, no biases, tied output head.

    x = wte[idx]                                      # (B, T, C), no position table
    for block in h:
        x = x + attn(ln_1(x))                         # RMSNorm -> fused qkv -> rotary q, k -> causal attention -> c_proj
        x = x + mlp(ln_2(x))                          # RMSNorm -> down_proj(silu(gate_proj x) * up_proj x)
    logits = ln_f(x) @ wte.weight^T                   # (B, T, V), head tied to wte (as Llama 3.2 1B/3B)

Names follow mpirt's GPT-2 where the parts are shared (``wte``, ``h.N.attn.c_attn``/``c_proj``,
``ln_1``, ``ln_2``, ``ln_f``) and Hugging Face Llama's for the MLP (``gate_proj``, ``up_proj``,
``down_proj``). Rotary embeddings use the "rotate half" layout of each head (GPT-NeoX, HF Llama).
Grouped-query attention: ``n_kv_head`` key and value heads (Hugging Face ``num_key_value_heads``;
None: one per query head), each read by ``n_head / n_kv_head`` query heads, fused in ``c_attn``
as q | k | v column blocks (C + 2 Ck columns, ``Ck = n_kv_head D``). Tensor parallelism splits the
heads (each block of ``c_attn`` by whole heads: tp divides ``n_kv_head`` too),
``gate_proj``/``up_proj`` by columns and ``down_proj`` by rows; the RMSNorms are replicated
(sequence-split under sequence parallelism).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpirt.core import ops
from mpirt.core.modeling import LayerCost, register
from mpirt.core.nn import Dropout, Embedding, Linear, Module, ModuleList, RMSNorm
from mpirt.models.lm import (ATTENTION_PLAN, COLUMN, ROW, VOCAB_HEAD_PLAN, VOCAB_TABLE, CausalSelfAttention,
                             PreNormBlock, TiedLM, activation_bytes, kv_heads, stack_costs)


@dataclass
class LlamaConfig:
    """Architecture of a Llama-style decoder (fields named as :class:`~mpirt.models.model_config.GPTConfig`
    where they mean the same)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_positions: int = 256
    vocab_size: int = 256
    n_inner: int | None = None          # SwiGLU hidden size; None: 8/3 n_embd rounded up to 64
    n_kv_head: int | None = None        # key/value heads (grouped-query attention); None: n_head
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attn_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    initializer_range: float = 0.02
    model_type: str = "llama"

    @property
    def hidden(self) -> int:
        """Hidden size of the SwiGLU MLP."""
        return self.n_inner if self.n_inner is not None else 64 * math.ceil(8 * self.n_embd / 3 / 64)


class LlamaMLP(Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases."""

    def __init__(self, cfg: LlamaConfig, dtype="float32"):
        super().__init__()
        c, h, std = cfg.n_embd, cfg.hidden, cfg.initializer_range
        self.gate_proj = Linear(c, h, bias=False, std=std, dtype=dtype)
        self.up_proj = Linear(c, h, bias=False, std=std, dtype=dtype)
        self.down_proj = Linear(h, c, bias=False, std=std / math.sqrt(2 * cfg.n_layer), dtype=dtype)
        self.dropout = Dropout(cfg.resid_pdrop)

    def forward(self, x):
        return self.dropout(self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x))))  # (B, T, H / tp) inside


class LlamaBlock(PreNormBlock):
    """Pre-RMSNorm block: rotary bias-free attention, SwiGLU MLP (``mlp_class``)."""

    mlp_class = LlamaMLP

    def __init__(self, cfg: LlamaConfig, dtype="float32"):
        super().__init__()
        self.ln_1 = RMSNorm(cfg.n_embd, eps=cfg.rms_norm_eps, dtype=dtype)
        self.attn = CausalSelfAttention(cfg, dtype, bias=False, rope_theta=cfg.rope_theta)
        self.ln_2 = RMSNorm(cfg.n_embd, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = self.mlp_class(cfg, dtype)


TP_PLAN = (
    VOCAB_TABLE,
    *ATTENTION_PLAN,
    ("h.*.mlp.gate_proj", "column", COLUMN),
    ("h.*.mlp.up_proj", "column", COLUMN),
    ("h.*.mlp.down_proj", "row", ROW),
    *VOCAB_HEAD_PLAN,
)                                                              # the rest (RMSNorms) is replicated


@register
class Llama(TiedLM):
    """Llama-style language model. Init: normal(0, initializer_range), the residual projections
    ``attn.c_proj`` and ``mlp.down_proj`` with std initializer_range / sqrt(2 n_layer), RMSNorm
    weights one. Pass ``seed`` to initialize at construction."""

    model_type = "llama"
    config_class = LlamaConfig
    block_class = LlamaBlock
    tp_plan = TP_PLAN
    attention_core = "attn.core"

    def __init__(self, cfg: LlamaConfig, dtype="float32", seed: int | None = None):
        super().__init__()
        self.check_config(cfg)
        self.config = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, std=cfg.initializer_range, dtype=dtype)
        self.h = ModuleList(self.block_class(cfg, dtype) for _ in range(cfg.n_layer))
        self.ln_f = RMSNorm(cfg.n_embd, eps=cfg.rms_norm_eps, dtype=dtype)
        self._finish(seed)

    @classmethod
    def read_hf_config(cls, path) -> dict:
        """Config field values from a Hugging Face Llama (or Mixtral) ``config.json``."""
        from mpirt.models.hf_decoder import read_decoder_config
        return read_decoder_config(path)

    @classmethod
    def load_hf(cls, directory, dtype="float32"):
        """``(config, full weights)`` of a Hugging Face Llama (or Mixtral) directory
        (:func:`.hf_decoder.load_hf_decoder`)."""
        from mpirt.models.hf_decoder import load_hf_decoder
        return load_hf_decoder(directory, dtype=dtype)

    @classmethod
    def check_config(cls, cfg: LlamaConfig) -> None:
        """Whole heads of an even size (rotary embeddings rotate pairs); key/value heads that
        divide the query heads into equal groups."""
        if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
            raise ValueError(f"n_head: must divide n_embd={cfg.n_embd} into heads of an even size, got {cfg.n_head}")
        if cfg.n_kv_head is not None and (not isinstance(cfg.n_kv_head, int) or cfg.n_kv_head < 1
                                          or cfg.n_head % cfg.n_kv_head):
            raise ValueError(f"n_kv_head: must divide n_head={cfg.n_head} into equal groups of query heads, "
                             f"got {cfg.n_kv_head!r}")

    @staticmethod
    def _attention_params(cfg: LlamaConfig) -> int:
        """``c_attn`` and ``c_proj``: ``2 C^2 + 2 C Ck`` with ``Ck = n_kv_head C / n_head``."""
        c = cfg.n_embd
        return 2 * c * c + 2 * c * (kv_heads(cfg) * c // cfg.n_head)

    @classmethod
    def num_parameters_of(cls, cfg: LlamaConfig) -> int:
        """``V C`` (tied table) + per block the attention's ``2 C^2 + 2 C Ck`` (``4 C^2`` without
        grouped-query attention), ``3 C H + 2 C`` + ``C`` (final norm)."""
        c, h = cfg.n_embd, cfg.hidden
        return cfg.vocab_size * c + cfg.n_layer * (cls._attention_params(cfg) + 3 * c * h + 2 * c) + c

    @classmethod
    def flops_per_token_of(cls, cfg: LlamaConfig, seq_len: int) -> float:
        """``6 N + 12 L C T``, as GPT-2's (N includes the tied table once: the head's GEMM)."""
        return 6.0 * cls.num_parameters_of(cfg) + 12.0 * cfg.n_layer * cfg.n_embd * seq_len

    @classmethod
    def activation_bytes_of(cls, cfg: LlamaConfig, layout, *, itemsize: int = 4) -> dict:
        """:func:`~mpirt.models.lm.activation_bytes` with SwiGLU's two saved arrays (gate and up)
        and no position table (the rotary embedding keeps only its cos/sin tables); the fused qkv
        is ``C + 2 Ck`` wide."""
        return activation_bytes(cfg, layout, itemsize=itemsize, mlp_saved=2)

    @classmethod
    def layer_costs_of(cls, cfg: LlamaConfig, seq_len: int) -> list:
        """Per block ``6 x`` its weight matrices plus attention's ``12 C T``; the embedding one
        lookup and scatter-add; the head the tied projection and its own copy of ``wte``."""
        c, h, v = cfg.n_embd, cfg.hidden, cfg.vocab_size
        mat = cls._attention_params(cfg) + 3 * c * h
        return stack_costs(cfg, LayerCost("embed", 2.0 * c, v * c),
                           LayerCost("", 6.0 * mat + 12.0 * c * seq_len, mat + 2 * c),
                           LayerCost("head", 6.0 * v * c + 6.0 * c, v * c + c))
