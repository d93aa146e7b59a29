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
import zlib

import mpirt.backend as B
from mpirt import ops
from mpirt.nn import Dropout, Embedding, LayerNorm, Linear, Module, ModuleList, ShardSpec
from mpirt.tensor import Tensor
from models.config import GPTConfig


def as_index_array(idx, name: str = "idx"):
    """``idx`` (Tensor, xp array or nested list) as an integer xp array."""
    a = idx.data if isinstance(idx, Tensor) else B.xp.asarray(idx)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
    return a


def check_seq_len(cfg: GPTConfig, idx) -> None:
    """Refuse a batch whose sequence length exceeds the model's position table."""
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


def lm_loss(logits, targets):
    """Mean cross-entropy of (B, T, V) logits against (B, T) targets; -100 entries are ignored."""
    t = as_index_array(targets, "targets")
    if tuple(t.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"targets: shape {tuple(t.shape)} does not match logits {tuple(logits.shape[:2])}")
    v = logits.shape[-1]
    return ops.cross_entropy(ops.reshape(logits, (-1, v)), t.reshape(-1), ignore_index=-100)


def seed_dropouts(model: Module, seed: int) -> None:
    """Give every Dropout module of ``model`` its own seed, derived from ``seed`` and its name,
    and restart its call counter (so two layers never draw the same mask)."""
    for name, m in model.named_modules():
        if isinstance(m, Dropout):
            m.seed = zlib.crc32(f"{seed}:{name}".encode())
            m.calls = 0


class CausalSelfAttention(Module):
    """Fused qkv projection, causal multi-head attention, output projection."""

    def __init__(self, cfg: GPTConfig, dtype="float32"):
        super().__init__()
        c = cfg.n_embd
        self.n_head = cfg.n_head
        self.c_attn = Linear(c, 3 * c, std=cfg.initializer_range, dtype=dtype)
        self.c_proj = Linear(c, c, std=cfg.initializer_range / math.sqrt(2 * cfg.n_layer), dtype=dtype)
        self.attn_dropout = Dropout(cfg.attn_pdrop)  # its p/seed/calls drive the fused attention op
        self.resid_dropout = Dropout(cfg.resid_pdrop)

    def forward(self, x):
        qkv = self.c_attn(x)                                       # (B, T, 3C)
        d = self.attn_dropout
        if self.training and d.p > 0.0:
            d.calls += 1
            y = ops.causal_self_attention(qkv, self.n_head, dropout_p=d.p, seed=(d.seed, d.calls))
        else:
            y = ops.causal_self_attention(qkv, self.n_head)        # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(Module):
    """c_fc (C -> hidden), GELU (tanh form), c_proj (hidden -> C)."""

    def __init__(self, cfg: GPTConfig, dtype="float32"):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, cfg.hidden, std=cfg.initializer_range, dtype=dtype)
        self.c_proj = Linear(cfg.hidden, cfg.n_embd, std=cfg.initializer_range / math.sqrt(2 * cfg.n_layer),
                             dtype=dtype)
        self.dropout = Dropout(cfg.resid_pdrop)

    def forward(self, x):
        return self.dropout(self.c_proj(ops.gelu(self.c_fc(x))))


class Block(Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig, dtype="float32"):
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_1 = LayerNorm(cfg.n_embd, eps=eps, dtype=dtype)
        self.attn = CausalSelfAttention(cfg, dtype)
        self.ln_2 = LayerNorm(cfg.n_embd, eps=eps, dtype=dtype)
        self.mlp = GPTMLP(cfg, dtype)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# Tensor-parallel plan, read by mpirt.parallel.tensor.parallelize(model, tp_comm, sequence_parallel):
# (module pattern, kind, ShardSpec per parameter); "*" is one path segment; first match wins.
_COLUMN = {"weight": ShardSpec((None, "tp")), "bias": ShardSpec(("tp",))}
_ROW = {"weight": ShardSpec(("tp", None)), "bias": ShardSpec((None,))}
TP_PLAN = (
    ("wte", "vocab", {"weight": ShardSpec(("tp", None))}),   # rows (vocabulary, padded) split
    ("wpe", "positions", {}),                                  # replicated; sequence chunk under SP
    ("h.*.attn.c_attn", "column",                             # q | k | v each split: whole heads
     {"weight": ShardSpec((None, "tp"), blocks=(1, 3)), "bias": ShardSpec(("tp",), blocks=(3,))}),
    ("h.*.attn.c_proj", "row", _ROW),
    ("h.*.attn", "heads", {}),                                 # n_head -> n_head / tp
    ("h.*.attn.attn_dropout", "sharded_dropout", {}),
    ("h.*.mlp.c_fc", "column", _COLUMN),
    ("h.*.mlp.c_proj", "row", _ROW),
    ("head_fn", "vocab_head", {}),                             # logits stay split over the vocabulary
    ("loss_fn", "vocab_loss", {}),                             # cross-entropy without gathering them
)                                                              # the rest (LayerNorms) is replicated


class CausalLM(Module):
    """What GPT and MLP share: ``embed`` -> the blocks ``h`` -> ``head`` (ln_f and the output
    projection tied to ``wte``) and the loss. ``head_fn``/``loss_fn`` are swappable per instance
    (tensor parallelism installs vocab-parallel ones). Subclasses build their modules, then call
    :meth:`_finish`."""

    head_fn = staticmethod(tied_head)
    loss_fn = staticmethod(lm_loss)

    def _finish(self, seed: int | None) -> None:
        """Name the parameters, seed each Dropout, and initialize the weights when ``seed`` is given."""
        for name, p in self.named_parameters():
            p.name = name
        seed_dropouts(self, 0 if seed is None else seed)  # distinct masks per Dropout module
        if seed is not None:
            self.initialize(seed)

    def head(self, x):
        """Final LayerNorm and the tied output projection: (B, T, C) -> logits (B, T, V)."""
        return self.head_fn(self.ln_f(x), self.wte.weight)

    def forward(self, idx, targets=None):
        """Logits (B, T, V) for token ids ``idx`` (B, T); with ``targets`` (B, T), also the mean
        cross-entropy over the targets that are not -100: returns ``(logits, loss)``."""
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return logits, self.loss_fn(logits, targets)


class GPT(CausalLM):
    """GPT-2 language model (parameter names as Hugging Face's ``GPT2Model``).

    Parameters are allocated at construction and named; their values are set by
    :meth:`Module.initialize` (GPT-2's init: normal(0, initializer_range), the residual projections
    ``attn.c_proj`` and ``mlp.c_proj`` with std initializer_range / sqrt(2 n_layer), zero biases,
    LayerNorm ones/zeros). Pass ``seed`` to initialize here; without it the weights stay zero until
    ``initialize`` or a checkpoint load. Each Dropout module gets its own mask seed, derived from
    ``seed`` (0 without one) and its name; :func:`seed_dropouts` re-seeds them (e.g. per rank).
    """

    def __init__(self, cfg: GPTConfig, dtype="float32", seed: int | None = None):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_head={cfg.n_head} must divide n_embd={cfg.n_embd}")
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
        pos = self.wpe(B.xp.arange(idx.shape[1]))                  # (T, C)
        return self.drop(tok + pos)

    # what the registry (models.MODELS) and the pipeline need to know about the class
    block_class = Block
    tp_plan = TP_PLAN

    @staticmethod
    def num_parameters_of(cfg: GPTConfig) -> int:
        """Parameters of the model ``cfg`` describes (module-level :func:`num_parameters`)."""
        return num_parameters(cfg)

    @staticmethod
    def flops_per_token_of(cfg: GPTConfig, seq_len: int) -> float:
        """Training FLOPs per token of the model ``cfg`` describes (module-level :func:`flops_per_token`)."""
        return flops_per_token(cfg, seq_len)

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
