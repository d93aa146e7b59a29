"""GPT-2: a pre-LayerNorm decoder with learned positions and an output head tied to ``wte``.

Module and attribute names reproduce Hugging Face GPT-2's parameter names exactly
(``wte.weight``, ``h.0.attn.c_attn.weight``, ``ln_f.bias`` ...), and ``Linear`` weights are stored
(in, out) like GPT-2's Conv1D, so a GPT-2 ``model.safetensors`` loads without any transposes.

    x = drop(wte[idx] + wpe[0:T])                     # (B, T, C)
    for block in h:
        x = x + attn(ln_1(x))                         # fused qkv -> causal attention -> c_proj
        x = x + mlp(ln_2(x))                          # c_fc -> GELU (tanh form) -> c_proj
    logits = ln_f(x) @ wte.weight^T                   # (B, T, V), no separate lm_head

The forward pass is split into :meth:`GPT.embed`, the blocks ``GPT.h`` and :meth:`GPT.head` so a
pipeline stage can run just its part.
"""
from __future__ import annotations

import math

import mpirt.core.backend as B
from mpirt.core import ops
from mpirt.core.modeling import LayerCost, as_index_array, register
from mpirt.core.nn import Dropout, Embedding, LayerNorm, Linear, Module, ModuleList
from mpirt.models.model_config import GPTConfig
from mpirt.models.lm import (ATTENTION_PLAN, COLUMN, ROW, VOCAB_HEAD_PLAN, VOCAB_TABLE, CausalSelfAttention,
                             PreNormBlock, TiedLM, activation_bytes, check_seq_len, stack_costs)


class GPTMLP(Module):
    """c_fc (C -> hidden), GELU (tanh form), c_proj (hidden -> C)."""

    def __init__(self, cfg: GPTConfig, dtype="float32"):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, cfg.hidden, std=cfg.initializer_range, dtype=dtype)
        self.c_proj = Linear(cfg.hidden, cfg.n_embd, std=cfg.initializer_range / math.sqrt(2 * cfg.n_layer),
                             dtype=dtype)
        self.dropout = Dropout(cfg.resid_pdrop)

    def forward(self, x):
        return self.dropout(self.c_proj(ops.gelu(self.c_fc(x), into_input=True)))  # c_fc's output: nothing saved it


class Block(PreNormBlock):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig, dtype="float32"):
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_1 = LayerNorm(cfg.n_embd, eps=eps, dtype=dtype)
        self.attn = CausalSelfAttention(cfg, dtype)
        self.ln_2 = LayerNorm(cfg.n_embd, eps=eps, dtype=dtype)
        self.mlp = GPTMLP(cfg, dtype)


TP_PLAN = (
    VOCAB_TABLE,
    ("wpe", "positions", {}),                                  # replicated; sequence chunk under SP
    *ATTENTION_PLAN,
    ("h.*.mlp.c_fc", "column", COLUMN),
    ("h.*.mlp.c_proj", "row", ROW),
    *VOCAB_HEAD_PLAN,
)                                                              # the rest (LayerNorms) is replicated


@register
class GPT(TiedLM):
    """GPT-2 language model (parameter names as Hugging Face's ``GPT2Model``).

    Parameters are allocated at construction and named; their values are set by
    :meth:`Module.initialize` (GPT-2's init: normal(0, initializer_range), the residual projections
    ``attn.c_proj`` and ``mlp.c_proj`` with std initializer_range / sqrt(2 n_layer), zero biases,
    LayerNorm ones/zeros). Pass ``seed`` to initialize here; without it the weights stay zero until
    ``initialize`` or a checkpoint load. Each Dropout module gets its own mask seed, derived from
    ``seed`` (0 without one) and its name; :func:`seed_dropouts` re-seeds them (e.g. per rank).
    """

    model_type = "gpt2"
    config_class = GPTConfig
    block_class = Block
    tp_plan = TP_PLAN
    attention_core = "attn.core"
    context = None  # a ContextShard under context parallelism (mpirt.parallel.context)

    def __init__(self, cfg: GPTConfig, dtype="float32", seed: int | None = None):
        super().__init__()
        self.check_config(cfg)
        self.config = cfg
        std = cfg.initializer_range
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, std=std, dtype=dtype)
        self.wpe = Embedding(cfg.n_positions, cfg.n_embd, std=std, dtype=dtype)
        self.drop = Dropout(cfg.embd_pdrop)
        self.h = ModuleList(Block(cfg, dtype) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon, dtype=dtype)
        self._finish(seed)

    def embed(self, idx):
        """Token plus position embeddings (then embedding dropout): (B, T) ints -> (B, T, C)."""
        idx = as_index_array(idx)
        check_seq_len(self.config, idx)
        tok = self.wte(idx)                                        # (B, T, C)
        held = idx.shape[1]                                        # under cp: this rank's chunks
        pos = self.wpe(self.context.positions(held) if self.context else B.xp.arange(held))  # (T, C)
        # pos + tok (the same sum): the backward then runs the wte lookup's gradient after wpe's, so
        # the tied wte (registered first: DataParallel's last bucket) is the last gradient to be final
        return self.drop(pos + tok)

    @classmethod
    def check_config(cls, cfg: GPTConfig) -> None:
        """Whole heads: ``n_head`` must divide ``n_embd``."""
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_head: must divide n_embd={cfg.n_embd}, got {cfg.n_head}")

    @classmethod
    def num_parameters_of(cls, cfg: GPTConfig) -> int:
        """Parameters of the model ``cfg`` describes (module-level :func:`num_parameters`)."""
        return num_parameters(cfg)

    @classmethod
    def flops_per_token_of(cls, cfg: GPTConfig, seq_len: int) -> float:
        """Training FLOPs per token of the model ``cfg`` describes (module-level :func:`flops_per_token`)."""
        return flops_per_token(cfg, seq_len)

    @classmethod
    def layer_costs_of(cls, cfg: GPTConfig, seq_len: int) -> list:
        """Per layer: ``6 x`` the multiply-adds of every weight matrix plus attention's ``12 C T``;
        the embedding costs its two lookups and scatter-adds (``2 C`` per table) and holds both
        tables; the head costs the tied projection (``6 V C``) and holds its own copy of ``wte``."""
        c, h, v = cfg.n_embd, cfg.hidden, cfg.vocab_size
        mat = 4 * c * c + 2 * c * h
        return stack_costs(cfg, LayerCost("embed", 4.0 * c, (v + cfg.n_positions) * c),
                           LayerCost("", 6.0 * mat + 12.0 * c * seq_len, mat + 3 * c + c + h + c + 4 * c),
                           LayerCost("head", 6.0 * v * c + 10.0 * c, v * c + 2 * c))

    @classmethod
    def activation_bytes_of(cls, cfg: GPTConfig, layout, *, itemsize: int = 4) -> dict:
        """:func:`~mpirt.models.lm.activation_bytes` with learned positions (their ids kept) and the
        GELU's backward one hidden-wide gradient above what its block has freed by then."""
        return activation_bytes(cfg, layout, itemsize=itemsize, positions=True, mlp_backward=1)

    @classmethod
    def read_hf_config(cls, path) -> dict:
        """GPTConfig field values from a Hugging Face GPT-2 ``config.json`` (see :mod:`.presets`)."""
        from mpirt.models.presets import _read_hf
        return _read_hf(path)

    @classmethod
    def load_hf(cls, directory, dtype="float32"):
        """``(GPTConfig, full weights)`` of a Hugging Face GPT-2 directory (:func:`.hf.load_hf_gpt2`)."""
        from mpirt.models.hf import load_hf_gpt2
        return load_hf_gpt2(directory, dtype=dtype)

    @classmethod
    def open_hf(cls, directory, dtype="float32"):
        """``(GPTConfig, reader)`` of a Hugging Face GPT-2 directory: the reader
        (:class:`.hf.HFReader`) gives each rank its boxes only (``engine.load_sharded``)."""
        from mpirt.models.hf import HFReader
        reader = HFReader(directory, dtype=dtype)
        return reader.config, reader

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len`` (see the module-level :func:`flops_per_token`)."""
        return flops_per_token(self.config, seq_len)


def param_shapes(cfg: GPTConfig) -> dict[str, tuple]:
    """Name -> shape of every GPT parameter, in ``named_parameters`` order, without building it."""
    c, h = cfg.n_embd, cfg.hidden
    shapes = {"wte.weight": (cfg.vocab_size, c), "wpe.weight": (cfg.n_positions, c)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (c,), p + "ln_1.bias": (c,),
            p + "attn.c_attn.weight": (c, 3 * c), p + "attn.c_attn.bias": (3 * c,),
            p + "attn.c_proj.weight": (c, c), p + "attn.c_proj.bias": (c,),
            p + "ln_2.weight": (c,), p + "ln_2.bias": (c,),
            p + "mlp.c_fc.weight": (c, h), p + "mlp.c_fc.bias": (h,),
            p + "mlp.c_proj.weight": (h, c), p + "mlp.c_proj.bias": (c,),
        })
    shapes.update({"ln_f.weight": (c,), "ln_f.bias": (c,)})
    return shapes


def num_parameters(cfg: GPTConfig, non_embedding: bool = False) -> int:
    """Parameter count of the GPT (tied head counted once); ``non_embedding`` leaves out wpe."""
    n = sum(math.prod(s) for s in param_shapes(cfg).values())
    return n - cfg.n_positions * cfg.n_embd if non_embedding else n


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), for MFU: ``6 N + 12 L C T``.

    ``6 N``: each parameter costs one multiply-add forward and two backward. N leaves out the
    position table ``wpe`` (a lookup, no arithmetic) but keeps ``wte`` once: the tied head's GEMM
    costs V*C multiply-adds per token. ``12 L C T``: the attention scores QK^T and the weighted sum
    AV, 2*T*C FLOPs each per token and layer forward, times 3 for the backward; counted over the
    full T x T square, as PaLM and nanoGPT do (the causal half is not subtracted). LayerNorm,
    GELU, softmax and the loss are left out.
    """
    return 6.0 * num_parameters(cfg, non_embedding=True) + 12.0 * cfg.n_layer * cfg.n_embd * seq_len
