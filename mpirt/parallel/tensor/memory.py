"""Activation memory of a (tensor-parallel) forward: measured from the graph and predicted."""
from __future__ import annotations

from mpirt.memory import array_base, arrays_in
from mpirt.tensor import Tensor

from .layout import pad_vocab


# =============================================================================================
# activation memory: measured and predicted
# =============================================================================================
def saved_activation_bytes(root: Tensor) -> int:
    """Bytes of the arrays that the Functions of ``root``'s graph hold for backward.

    Walks the graph from ``root`` (call before ``backward``), collects every array attribute of
    every Function (not its inputs), and sums ``nbytes`` once per underlying buffer (views are
    resolved to their base, so an array saved by two Functions counts once). Parameter data (a
    leaf input's array, e.g. a weight saved by a linear layer) is not an activation and is left out.
    """
    seen_fn, stack, fns = set(), [root._ctx] if root._ctx is not None else [], []
    params = set()
    while stack:
        fn = stack.pop()
        if id(fn) in seen_fn:
            continue
        seen_fn.add(id(fn))
        fns.append(fn)
        for x in getattr(fn, "inputs", ()):
            if isinstance(x, Tensor):
                if x._ctx is None:
                    params.add(id(array_base(x.data)))
                elif id(x._ctx) not in seen_fn:
                    stack.append(x._ctx)
    total, counted = 0, set()
    for fn in fns:
        for key, value in vars(fn).items():
            if key in ("inputs", "needs_input_grad"):
                continue
            for a in arrays_in(value):
                base = array_base(a)
                if id(base) in params or id(base) in counted:
                    continue
                counted.add(id(base))
                total += int(base.nbytes)
    return total


def activation_bytes(*, n_layer, n_embd, n_head, hidden, vocab_size, batch, seq_len, tp=1,
                     sequence_parallel=False, itemsize=4) -> int:
    """Predicted :func:`saved_activation_bytes` of one GPT forward with loss (no dropout), per rank.

    With ``b`` the batch, ``s`` the sequence, ``h`` the width, ``a`` the heads, ``f`` the MLP hidden
    size, ``t`` = tp, ``p = t`` with sequence parallelism (else 1) and ``V'`` the vocabulary padded
    to a multiple of t, one transformer layer saves (elements, as mpirt's fused ops do):

    ===============================================  ===================
    saved by                                         elements
    ===============================================  ===================
    ln_1, ln_2: normalised input and 1/std per row   2 (bsh + bs) / p
    c_attn, c_fc inputs (the LayerNorm outputs)      2 bsh / p
    qkv (c_attn output, kept by attention)           3 bsh / t
    attention: log-sum-exp per query                 a b s / t
    attention output = c_proj input                  bsh / t
    GELU derivative, GELU output = c_proj input      2 b s f / t
    ===============================================  ===================

    ``layer = itemsize * [(4 bsh + 2 bs) / p + (4 bsh + 2 bsf + a b s) / t]``: without sequence
    parallelism the LayerNorm region (4bsh + 2bs) is replicated on every tp rank, with it (and
    the column-parallel input re-gathered in backward) everything is divided by t. (For f = 4h
    this is Korthikanti et al.'s ``sbh (10 + 24/t + 5as/(ht))`` with fp32 instead of 16-bit
    activations, no dropout masks, and without the ``5as/(ht)`` term of the score-sized arrays:
    the attention computes its scores again in backward, as FlashAttention does.)

    Outside the layers: ln_f (bsh + bs) / p, the head input bsh / p, the loss softmax b s V' / t
    (at t = 1 with its 1/rowsum per row, bs);
    int64 index arrays: targets bs and token ids (bs at t = 1, else ~bs/t: only the ids in this
    rank's vocabulary range), position ids s / p; bool masks: 1 (t = 1) or 3 (t > 1) of bs bytes.
    The ~bs/t term assumes ids spread evenly over the vocabulary (the only data-dependent term).
    """
    b, s, h, a, f, t = batch, seq_len, n_embd, n_head, hidden, tp
    v = pad_vocab(vocab_size, t)
    p = t if sequence_parallel else 1
    layer = (4 * b * s * h + 2 * b * s) / p + (4 * b * s * h + 2 * b * s * f + a * b * s) / t
    outside = (2 * b * s * h + b * s) / p + b * s * v / t + (b * s if t == 1 else 0)  # t = 1: the loss's 1/rowsum
    index = 8 * (b * s + b * s / t + s / p) + (3 * b * s if t > 1 else b * s)
    return int(round(itemsize * (n_layer * layer + outside) + index))
