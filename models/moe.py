"""A Mixtral-style mixture-of-experts decoder: the Llama-style model with each MLP replaced by
``n_expert`` SwiGLU experts and a softmax router that sends every token to its ``top_k``.

    x = wte[idx]
    for block in h:
        x = x + attn(ln_1(x))                         # as Llama: RMSNorm, rotary, grouped-query attention
        x = x + moe(ln_2(x))                          # router -> top-k experts -> weighted sum
    logits = ln_f(x) @ wte.weight^T

**Routing** (Mixtral's): ``p = softmax(x @ gate)`` over the experts; a token goes to its ``top_k``
largest (ties to the lower expert), weighted by those probabilities renormalised to sum to 1.
**Capacity** (``capacity_factor`` > 0): expert ``e`` takes at most ``ceil(capacity_factor * T *
top_k / n_expert)`` tokens of each sequence, the first in token order; the others of its
assignments are dropped (the token keeps its residual; :attr:`MoEMLP.stats` counts them).
``capacity_factor = 0`` is dropless.
**Load-balancing loss** (Switch / Mixtral): per layer and sequence ``E * sum_e f_e P_e`` with
``f_e`` the share of the sequence's tokens that chose expert ``e`` among their ``top_k`` (before
capacity; the shares sum to ``top_k``) and ``P_e`` its mean router probability; the model's is the mean over layers and
sequences, times ``aux_loss_coef``, added to the loss's gradient inside each layer (its value is in
:attr:`MoEMLP.stats`). Defined per sequence and layer so that every layout (rows over dp and
micro-batches, layers over pipeline stages) computes exactly the one-rank value; Hugging Face's
``load_balancing_loss_func`` pools all layers and sequences of a batch, and equals it for one
layer and one sequence.

Parameters: ``h.N.mlp.gate.weight`` (C, E) the router; ``h.N.mlp.w_gate``, ``w_up`` (E, C, F)
and ``w_down`` (E, F, C) the experts, stacked (mpirt's (in, out) layout per expert; Hugging Face's
``experts.gate_up_proj`` (E, 2F, C) and ``experts.down_proj`` (E, C, F) are their transposes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import mpirt.core.backend as B
from mpirt.core import ops
from mpirt.core.injected import injected
from mpirt.core.modeling import LayerCost, register
from mpirt.core.nn import Dropout, Linear, Module, Parameter
from mpirt.core.ops.moe import grouped_swiglu
from mpirt.core.tensor import Function, Tensor
from mpirt.models.lm import ATTENTION_PLAN, VOCAB_HEAD_PLAN, VOCAB_TABLE, activation_bytes, stack_costs
from mpirt.models.llama import Llama, LlamaBlock, LlamaConfig


@dataclass
class MoEConfig(LlamaConfig):
    """A Llama-style architecture with ``n_expert`` SwiGLU experts of ``hidden`` width per block."""

    n_expert: int = 4
    top_k: int = 2
    aux_loss_coef: float = 0.01        # the load-balancing loss's weight (Mixtral: router_aux_loss_coef)
    capacity_factor: float = 0.0       # 0: dropless
    model_type: str = "mixtral"


class AuxLossGradient(Function):
    """Identity on the router probabilities whose backward adds the load-balancing loss's
    gradient ``extra`` (per unit of loss), times the loss's backward seed when it runs
    (``owner.loss_seed``: loss scale / micro-batches, set by the local part before backward)."""

    def forward(self, probs, extra=None, owner=None):
        self.extra, self.owner = extra, owner
        return probs

    def backward(self, g):
        return (g + self.owner.loss_seed * self.extra,)


class MoEMLP(Module):
    """The router and the stacked experts (see the module docstring). ``stats`` after a forward:
    ``tokens_per_expert`` (assignments each expert took), ``dropped`` (assignments over capacity)
    and ``aux_loss`` (the layer's load-balancing loss, mean over the sequences)."""

    loss_seed = 1.0
    expert_parallel = None  # mpirt.parallel.experts sets it under ep: this rank runs only its experts
    stats_keys = ("tokens_per_expert", "dropped", "aux_loss")  # what the monitor reads (expert_figures)

    def __init__(self, cfg: MoEConfig, dtype="float32"):
        super().__init__()
        c, f, e, std = cfg.n_embd, cfg.hidden, cfg.n_expert, cfg.initializer_range
        self.gate = Linear(c, e, bias=False, std=std, dtype=dtype)
        self.w_gate = Parameter((e, c, f), std=std, dtype=dtype)
        self.w_up = Parameter((e, c, f), std=std, dtype=dtype)
        self.w_down = Parameter((e, f, c), std=std / math.sqrt(2 * cfg.n_layer), dtype=dtype)
        self.dropout = Dropout(cfg.resid_pdrop)
        self.n_expert, self.top_k, self.capacity_factor = e, cfg.top_k, cfg.capacity_factor
        self.aux_weight = cfg.aux_loss_coef / cfg.n_layer  # the model's loss is the mean over layers
        self.stats: dict = {}

    def expert_weights(self) -> tuple:
        """The stacked expert weights (E, C, F), (E, C, F), (E, F, C) (ep splits their dim 0)."""
        return self.w_gate, self.w_up, self.w_down

    def run_experts(self, x, counts, assignments: int):
        """The experts' outputs for rows ``x`` grouped by expert (``counts[e]`` for expert ``e``) of
        ``assignments`` (tokens x top_k, dropped ones included): here, or through the
        expert-parallel hook on the ranks holding them."""
        if self.expert_parallel is None:
            return grouped_swiglu(x, *self.expert_weights(), counts)
        return self.expert_parallel.run(x, counts, *self.expert_weights(), assignments=assignments)

    def route(self, p: np.ndarray, rows: int):
        """``(choice (N, k), kept (N * k,) bool)`` of router probabilities ``p`` (N, E) of ``rows``
        sequences: each token's top-k experts, and which assignments fit their expert's capacity."""
        n, e, k = p.shape[0], self.n_expert, self.top_k
        if injected("moe-router-bias"):  # test-only (mpirt.core.injected): expert 0 first for every token
            p = p + (np.arange(e) == 0)
        choice = np.argsort(-p, axis=-1, kind="stable")[:, :k]
        if self.capacity_factor <= 0:
            return choice, np.ones(n * k, dtype=bool)
        t = n // rows
        cap = math.ceil(self.capacity_factor * t * k / e)
        per_seq = choice.reshape(rows, t * k)                       # assignments in token order
        onehot = per_seq[..., None] == np.arange(e)                 # (rows, T k, E)
        place = np.take_along_axis(np.cumsum(onehot, axis=1), per_seq[..., None], axis=2)[..., 0]  # 1-based
        return choice, (place <= cap).reshape(-1)

    def forward(self, x):
        b, t, c = x.shape
        n, e, k = b * t, self.n_expert, self.top_k
        flat = ops.reshape(x, (n, c))
        probs = ops.softmax(self.gate(flat), axis=-1)              # (N, E)
        p = B.to_host(probs.data)
        choice, kept = self.route(p, b)
        counts_seq = np.zeros((b, e))                               # assignments per sequence and expert
        np.add.at(counts_seq, (np.repeat(np.arange(b), t * k), choice.reshape(-1)), 1.0)
        share = counts_seq / t                                      # f: (rows, E), summing to k
        mean_p = p.reshape(b, t, e).mean(axis=1)                    # P: (rows, E)
        aux = e * (share * mean_p).sum(axis=1)                      # per sequence
        if self.aux_weight and probs.requires_grad:                 # d(weight * mean_s aux_s) / dp[s, t, e]
            extra = np.repeat(self.aux_weight * e * share / (b * t), t, axis=0).astype(p.dtype)
            probs = AuxLossGradient.apply(probs, extra=B.asarray(extra), owner=self)
        top = ops.getitem(probs, (np.arange(n)[:, None], choice))   # (N, k)
        weights = ops.reshape(top / ops.sum(top, axis=-1, keepdims=True), (n * k,))
        expert = choice.reshape(-1)
        ids = np.flatnonzero(kept)
        ids = ids[np.argsort(expert[ids], kind="stable")]           # kept assignments grouped by expert
        counts = np.bincount(expert[ids], minlength=e)
        ys = self.run_experts(ops.getitem(flat, ids // k), counts, n * k)  # (M, C)
        ys = ys * ops.reshape(ops.getitem(weights, ids), (len(ids), 1))
        slot = np.full(n * k, len(ids))                             # each assignment's row; dropped: the zero row
        slot[ids] = np.arange(len(ids))
        padded = ops.concat([ys, Tensor(B.xp.zeros((1, c), dtype=ys.dtype))], axis=0)
        out = ops.sum(ops.reshape(ops.getitem(padded, slot), (n, k, c)), axis=1)
        self.stats = {"tokens_per_expert": counts, "dropped": int(n * k - len(ids)), "aux_loss": float(aux.mean())}
        return self.dropout(ops.reshape(out, (b, t, c)))


class MoEBlock(LlamaBlock):
    """Pre-RMSNorm block: rotary bias-free attention, then the experts."""

    mlp_class = MoEMLP


# the F-wide arrays one expert's backward holds at once beyond its kept gate and up products (its
# sigmoid, silu, the down projection's input gradient, the gate and up gradients, two temporaries)
GROUPED_BACKWARD_ARRAYS = 7
TP_PLAN = (VOCAB_TABLE, *ATTENTION_PLAN, *VOCAB_HEAD_PLAN)  # attention split; router and experts replicated


@register
class Mixtral(Llama):
    """Mixtral-style mixture-of-experts language model (tied head, as mpirt's Llama). Init: the
    Llama-style model's, the experts' down projections with std initializer_range / sqrt(2 n_layer)."""

    model_type = "mixtral"
    config_class = MoEConfig
    block_class = MoEBlock
    tp_plan = TP_PLAN
    routes_per_sequence = True

    @classmethod
    def check_config(cls, cfg: MoEConfig) -> None:
        """Llama's rules, and ``1 <= top_k <= n_expert``, ``capacity_factor >= 0``."""
        super().check_config(cfg)
        if not (isinstance(cfg.n_expert, int) and cfg.n_expert >= 1):
            raise ValueError(f"n_expert: must be a positive integer, got {cfg.n_expert!r}")
        if not (isinstance(cfg.top_k, int) and 1 <= cfg.top_k <= cfg.n_expert):
            raise ValueError(f"top_k: must be in 1..n_expert={cfg.n_expert}, got {cfg.top_k!r}")
        if not cfg.capacity_factor >= 0 or not cfg.aux_loss_coef >= 0:
            raise ValueError("capacity_factor and aux_loss_coef: must be >= 0, got "
                             f"{cfg.capacity_factor!r} and {cfg.aux_loss_coef!r}")

    @classmethod
    def expert_weights_of(cls, cfg: MoEConfig) -> int:
        """One block's stacked expert weights, ``3 E C F`` (what ep splits; tp replicates them)."""
        return 3 * cfg.n_expert * cfg.n_embd * cfg.hidden

    @classmethod
    def _expert_params(cls, cfg: MoEConfig) -> int:
        """One block's router and experts: ``C E + 3 E C F``."""
        return cfg.n_embd * cfg.n_expert * (1 + 3 * cfg.hidden)

    @classmethod
    def num_parameters_of(cls, cfg: MoEConfig) -> int:
        """``V C`` + per block the attention, the router and every expert, two norms; the final norm."""
        c = cfg.n_embd
        return cfg.vocab_size * c + cfg.n_layer * (cls._attention_params(cfg) + cls._expert_params(cfg) + 2 * c) + c

    @classmethod
    def active_parameters_of(cls, cfg: MoEConfig) -> int:
        """Parameters a token's forward multiplies: the router and ``top_k`` experts per block."""
        c = cfg.n_embd
        per_block = cls._attention_params(cfg) + c * cfg.n_expert + 3 * c * cfg.hidden * cfg.top_k + 2 * c
        return cfg.vocab_size * c + cfg.n_layer * per_block + c

    @classmethod
    def flops_per_token_of(cls, cfg: MoEConfig, seq_len: int) -> float:
        """``6 N_active + 12 L C T``: a token's GEMMs touch the router and its ``top_k`` experts."""
        return 6.0 * cls.active_parameters_of(cfg) + 12.0 * cfg.n_layer * cfg.n_embd * seq_len

    @classmethod
    def activation_bytes_of(cls, cfg: MoEConfig, layout, *, itemsize: int = 4, expert_load: float = 1.0,
                            busiest: float | None = None) -> dict:
        """Llama's formulas with an MLP ``top_k`` experts wide whose two kept arrays are each
        token's experts' gate and up products (the grouped op keeps no output of its own: the
        backward makes ``silu(g) u`` again), plus the grouped input and output (``2 k u``) and the
        router's probabilities with the load-balancing loss's gradient (``2 b s E``).

        Under expert parallelism (the layout's ``ep`` > 1) a rank runs the rows the whole ep group routed to
        its experts: ``expert_load`` times the ``k b s`` it sends (1: even routing; the rest of
        the block does not depend on routing). The experts' arrays (gate and up products, the
        rows received) scale with it; the outputs go back and the exchange keeps only its row
        orders, so the block keeps the rows received and the outputs received back, ``(1 + load)
        k u`` in place of ``2 k u`` (neither the rows sent nor the outputs before they go back).

        The backward: the grouped op runs expert by expert, holding its incoming gradient and
        ``dx`` (the rank's rows, ``C`` wide) and one expert's seven ``F``-wide intermediates
        (:class:`mpirt.core.ops.moe.GroupedSwiGLU`): the busiest expert's rows, ``busiest`` times
        an expert's even share of the group's assignments ``ep k b s / E`` (None: ``expert_load``,
        the rank's experts alike). A token exchange's backward holds the gradient in the order it
        travels beside the one received, ``(1 + load) k u``, before or after it."""
        ep = layout.ep
        load = expert_load if ep > 1 else 1.0  # one rank runs every routed row: no imbalance
        busiest = load if busiest is None else busiest
        out = activation_bytes(cfg, layout, itemsize=itemsize, mlp_saved=1, mlp_width=cfg.top_k * cfg.hidden * load)
        e = itemsize
        tokens = layout.rows * layout.tokens
        routed = e * tokens * cfg.top_k * cfg.n_embd  # one (tokens x top_k, C) array
        extra = int(routed * (1 + load) + e * tokens * 2 * cfg.n_expert)
        busiest_rows = min(busiest * ep * tokens * cfg.top_k / cfg.n_expert, ep * tokens)  # a token picks an expert once
        grouped = 2 * routed * load + GROUPED_BACKWARD_ARRAYS * e * busiest_rows * cfg.hidden
        exchange = routed * (1 + load) if ep > 1 else 0
        # lm's MLP gradients and the block output's: the grouped op's (its incoming gradient) instead
        dense_mlp = e * 2 * tokens * cfg.top_k * cfg.hidden * load / layout.tp + e * tokens * cfg.n_embd
        return {**out, "block": out["block"] + extra, "backward": int(out["backward"] - dense_mlp + max(grouped, exchange))}

    @classmethod
    def layer_costs_of(cls, cfg: MoEConfig, seq_len: int) -> list:
        """Per block ``6 x`` the active matrices plus attention's ``12 C T``, holding every expert."""
        c, v = cfg.n_embd, cfg.vocab_size
        attn = cls._attention_params(cfg)
        active = attn + c * cfg.n_expert + 3 * c * cfg.hidden * cfg.top_k
        return stack_costs(cfg, LayerCost("embed", 2.0 * c, v * c),
                           LayerCost("", 6.0 * active + 12.0 * c * seq_len, attn + cls._expert_params(cfg) + 2 * c),
                           LayerCost("head", 6.0 * v * c + 6.0 * c, v * c + c))
