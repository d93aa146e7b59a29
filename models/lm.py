"""What the bundled decoder models share: the tied-head base class, the pre-norm residual block,
causal self-attention (optionally rotary, optionally without biases) and its tensor-parallel plan.

GPT-2, the MLP model and the Llama-style model are built from these; each adds only what differs
(position embeddings, norms, the MLP, the config).
"""
from __future__ import annotations

import dataclasses
import math

import mpirt.core.backend as B
from mpirt.core import ops
from mpirt.core.modeling import CausalLM, LayerCost, as_index_array, seed_dropouts
from mpirt.core.nn import Dropout, Linear, Module, ShardSpec
from mpirt.core.ops.rotary import rotary_tables


def kv_heads(cfg) -> int:
    """Key/value heads of the attention: ``n_kv_head`` where the config has one (grouped-query
    attention), else ``n_head``."""
    return getattr(cfg, "n_kv_head", None) or cfg.n_head


def check_seq_len(cfg, idx) -> None:
    """Refuse a batch whose sequence length exceeds the model's ``n_positions``."""
    if idx.ndim != 2:
        raise ValueError(f"idx: expected shape (batch, seq_len), got {tuple(idx.shape)}")
    if idx.shape[1] > cfg.n_positions:
        raise ValueError(f"sequence length {idx.shape[1]} exceeds n_positions={cfg.n_positions}")


def tied_head(x, wte_weight):
    """Logits ``x @ wte_weight^T``: (B, T, C) -> (B, T, V), as one GEMM over all tokens.

    ``ops.linear_transposed`` takes the shared (V, C) table itself as its weight: the table's
    gradient from the head is a weight gradient like any other (added by its GEMM straight into
    ``wte.grad``, deferred with the others by a zero-bubble schedule); the embedding lookup adds
    its rows to the same buffer.
    """
    return ops.linear_transposed(x, wte_weight)


def stack_costs(cfg, embed: LayerCost, block: LayerCost, head: LayerCost) -> list:
    """``[embed, h.0 .. h.{L-1}, head]``: the per-layer costs of a model of ``cfg.n_layer`` equal blocks."""
    return [embed, *(dataclasses.replace(block, name=f"h.{i}") for i in range(cfg.n_layer)), head]


def activation_bytes(cfg, layout, *, itemsize: int = 4, positions: bool = False, mlp_saved: int = 1,
                     mlp_width: float | None = None, mlp_backward: int | None = None) -> dict:
    """Bytes one micro-batch keeps alive for backward, per rank, in a model built from this module's
    pre-norm block (see ``CausalLM.activation_bytes_of``; docs/memory.md has the table beside
    Korthikanti et al. 2022). The autograd keeps what each op saved and nothing else (an op's
    output is held only as its producer, :class:`mpirt.core.tensor.Edge`).

    ``layout`` (a :class:`mpirt.parallel.layout.Layout`) gives ``b`` (``rows``) of ``s`` tokens
    (``tokens``: a cp rank's share), ``t`` (``tp``), sequence parallelism and ``cp``.
    With ``u = b s h``, ``p = t`` under sequence parallelism (else 1), ``f`` the MLP width, ``a``
    the heads, ``e`` the itemsize and ``e'`` that of per-row statistics (float32 in half
    precision), a block keeps:

    - ``4 e u / p + 2 e' b s / p``: each norm's normalised input and 1/std per row, and its output
      (the input of the projection after it);
    - ``e ((2 + 2r) u + (mlp_saved + 1) b s f) / t``: qkv (``(1 + 2r) u``, ``r = n_kv_head /
      n_head``: 1 without grouped-query attention) and the attention output (the output
      projection's input); the MLP activation's saved arrays (GELU: its derivative; SwiGLU: gate
      and up) and its output (the down projection's input);
    - the attention core: ``e' a b s / t`` (the log-sum-exp of each query's scores; the backward
      computes the scores again), plus ``a b s^2 / t`` bytes of mask with attention dropout: what
      selective recomputation drops (under context parallelism ``s`` is the ``seq_len / cp``
      tokens a rank holds, and ring attention keeps the masks of its ``2 cp + 1`` blocks of
      ``(s / 2)^2``);
    - with residual dropout, two masks of ``u / p`` bytes.

    The residual sums, the projections' outputs (partial sums under tp), the norms' inputs and
    the MLP's pre-activation are not kept. Full recomputation keeps the block input, ``e u / p``.
    Outside the blocks: the token ids (int64; ``positions``: the position ids too), with
    embedding dropout its mask ``u / p`` bytes; the final norm and the head's input ``2 e u / p +
    e' b s / p``, the loss's probabilities ``b s V' / t`` (float32 in half precision; ``V'``
    padded to a multiple of t) with 1/rowsum per row, the targets and their mask.

    ``mlp_width``: the MLP's ``f`` when it is not ``cfg.hidden`` (a mixture of experts' routed
    rows, counted as one MLP that many wide).

    ``weight_pass``: what a block holds between its input-gradient pass and its deferred weight
    pass (split pipeline schedules): the norms' normalised inputs and output gradients ``4u/p``,
    the projections' inputs ``2u/p + (u + bsf)/t``, the column projections' output gradients
    ``((1 + 2r)u + m bsf)/t`` and the row projections' (before the reduction) ``2u``, times ``e``
    (``m`` = ``mlp_saved``: the up projections). ``embed_weight_pass``: the token ids and the
    embedding's output gradient; ``head_weight_pass``: the final norm's and the head's, the
    logits' gradient ``e b s V'/t`` above all.

    ``widened``: in half precision the largest float32 transient of the backward
    (:func:`mpirt.core.precision.float32_compute`), the MLP activation's: the incoming gradient and the
    ``mlp_saved`` hidden arrays its op saved widened to float32, a float32 gradient per saved
    array and its rounding.
    ``rerun``: what a selective rerun of the core makes again while its backward runs: the core
    plus its output, ``e u / t``. ``backward``: the gradients alive at once inside a block's
    backward, ``e (2u/p + (1 + m) b s f / t)``: the residual's and the current op's output gradient,
    the MLP activation's incoming and outgoing gradients (``mlp_backward`` replaces ``1 + m``: GPT's
    GELU holds one above what its block freed by then, the output projection's input).
    Returns ``{"block", "core", "rerun", "input", "embed", "head", "weight_pass", "embed_weight_pass",
    "head_weight_pass", "widened", "backward"}`` in bytes.
    """
    b, s, h, t, cp = layout.rows, layout.tokens, cfg.n_embd, layout.tp, layout.cp
    a, f = cfg.n_head, cfg.hidden if mlp_width is None else mlp_width
    p = t if layout.sequence_parallel else 1
    u, e = b * s * h, itemsize
    qkv_out = (2 + 2 * kv_heads(cfg) / a) * u  # qkv and the attention output
    stat = 4 if e == 2 else e  # per-row statistics and the loss's probabilities stay float32 in half
    attn_p, resid_p = getattr(cfg, "attn_pdrop", 0.0), getattr(cfg, "resid_pdrop", 0.0)
    block = e * (4 * u / p + (qkv_out + (mlp_saved + 1) * b * s * f) / t) + stat * 2 * b * s / p
    masked_keys = s if cp == 1 else s * (2 * cp + 1) / 4  # per query: the keys of its kept mask blocks
    core = ((attn_p > 0) * masked_keys + stat) * a * b * s / t
    if resid_p > 0:
        block += 2 * u / p
    embed = 8 * b * s + (8 * s if positions else 0)
    if getattr(cfg, "embd_pdrop", 0.0) > 0:
        embed += u / p
    v = -(-cfg.vocab_size // t) * t
    head = e * 2 * u / p + stat * (b * s / p + b * s * v / t + b * s) + 9 * b * s
    widened = b * s * f / t * ((1 + mlp_saved) * 4 + mlp_saved * (4 + e))
    weight_pass = e * (6 * u / p + (qkv_out + (1 + mlp_saved) * b * s * f) / t + 2 * u)
    return {"block": int(block + core), "core": int(core), "rerun": int(core + e * u / t), "input": int(e * u / p),
            "embed": int(embed),
            "head": int(head), "weight_pass": int(weight_pass), "embed_weight_pass": int(e * u / p + 8 * b * s),
            "head_weight_pass": int(e * (3 * u / p + b * s * v / t)), "widened": int(widened),
            "backward": int(e * (2 * u / p + ((1 + mlp_saved) if mlp_backward is None else mlp_backward) * b * s * f / t))}


class TiedLM(CausalLM):
    """A :class:`~mpirt.core.modeling.CausalLM` whose head is the final norm ``ln_f`` and the output
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
        # each branch's output is its sum's buffer (nothing saved it): no hole left in the heap
        x = ops.add(self.attn(self.ln_1(x)), x, into_first=True)
        return ops.add(self.mlp(self.ln_2(x)), x, into_first=True)


class CausalSelfAttention(Module):
    """Fused qkv projection ``c_attn`` (C -> C + 2 Ck: ``n_head`` query heads, then ``n_kv_head``
    key and value heads of the same size, ``Ck = C`` without grouped-query attention), causal
    multi-head attention, output projection ``c_proj``. ``bias=False`` drops the projections'
    biases; ``rope_theta`` rotates q and k by their positions (rotary embeddings, base
    ``rope_theta``) before the scores."""

    context = None  # a ContextShard under context parallelism (mpirt.parallel.context)

    def __init__(self, cfg, dtype="float32", bias: bool = True, rope_theta: float | None = None):
        super().__init__()
        c = cfg.n_embd
        self.n_head, self.n_kv_head, self.rope_theta = cfg.n_head, kv_heads(cfg), rope_theta
        qkv_width = c + 2 * self.n_kv_head * (c // cfg.n_head)
        self.c_attn = Linear(c, qkv_width, bias=bias, std=cfg.initializer_range, dtype=dtype)
        self.c_proj = Linear(c, c, bias=bias, std=cfg.initializer_range / math.sqrt(2 * cfg.n_layer), dtype=dtype)
        self.attn_dropout = Dropout(cfg.attn_pdrop)  # its p/seed/calls drive the fused attention op
        self.resid_dropout = Dropout(cfg.resid_pdrop)

    def forward(self, x):
        qkv = self.c_attn(x)                                       # (B, T, C + 2 Ck); / tp under tp
        if self.rope_theta is not None:
            head_dim = qkv.shape[-1] // (self.n_head + 2 * self.n_kv_head)  # local head counts under tp
            held = qkv.shape[1]
            cos, sin = rotary_tables(held * (self.context.size if self.context else 1), head_dim, self.rope_theta,
                                     B.xp.dtype(qkv.dtype))
            if self.context is not None:                           # the rows of the positions held
                where = self.context.positions(held)
                cos, sin = cos[where], sin[where]
            qkv = ops.rotary_embedding(qkv, cos, sin, n_kv_head=self.n_kv_head, into_input=True)
        return self.resid_dropout(self.c_proj(self.core(qkv)))

    def core(self, qkv):
        """The attention core, (B, T, C + 2 Ck) -> (B, T, C): scores, softmax, dropout on the
        probabilities, their product with v. No parameters: selective recomputation reruns it."""
        d = self.attn_dropout
        dropout = dict(dropout_p=d.p, seed=d.next_source()) if self.training and d.p > 0.0 else {}
        if self.context is not None:                               # the sequence split over cp: a ring
            return self.context.attention(qkv, self.n_head, n_kv_head=self.n_kv_head, **dropout)
        return ops.causal_self_attention(qkv, self.n_head, n_kv_head=self.n_kv_head, **dropout)


# Tensor-parallel plan entries, read by mpirt.parallel.tensor.parallelize(model, tp_comm, ...):
# (module pattern, kind, ShardSpec per parameter); "*" is one path segment; first match wins.
# Specs of parameters a module does not have (biases of bias-free projections) are skipped.
COLUMN = {"weight": ShardSpec((None, "tp")), "bias": ShardSpec(("tp",))}
ROW = {"weight": ShardSpec(("tp", None)), "bias": ShardSpec((None,))}
VOCAB_TABLE = ("wte", "vocab", {"weight": ShardSpec(("tp", None))})  # rows (vocabulary, padded) split
ATTENTION_PLAN = (
    ("h.*.attn.c_attn", "qkv", {}),                            # q | k | v each split: whole heads
    ("h.*.attn.c_proj", "row", ROW),
    ("h.*.attn", "heads", {}),                                 # n_head, n_kv_head -> / tp
    ("h.*.attn.attn_dropout", "sharded_dropout", {}),
)
VOCAB_HEAD_PLAN = (
    ("head_fn", "vocab_head", {}),                             # logits stay split over the vocabulary
    ("loss_fn", "vocab_loss", {}),                             # cross-entropy without gathering them
)
