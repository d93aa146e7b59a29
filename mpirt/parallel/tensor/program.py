"""tp's communication in a step, from the modules that make it: every tensor-parallel module of a
model says what one forward and one backward of it send (``tp_calls``: the column- and
row-parallel linears, the vocabulary-split embedding, head and loss), and :func:`step_calls`
counts them over a step's micro-batches and reruns. ``python -m mpirt.verify`` holds a step's
recorded tp calls to it (:mod:`mpirt.verify.traffic`)."""
from __future__ import annotations

from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .loss import VocabParallelHead, VocabParallelLoss

MODULES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def step_calls(model, comm, tokens: int, microbatches: int, reruns=frozenset(), width: int = 0,
               dtype: str = "float32", lookups: bool = True) -> list[tuple[str, str, int, str]]:
    """``(axis, kind, bytes, dtype)`` of the tp calls ``model``'s tensor-parallel modules make in a
    step of ``microbatches`` micro-batches of ``tokens`` tokens each (whole sequences): each
    module's forward once per micro-batch, again for a module whose id is in ``reruns`` (a block
    recomputed whole, every unit under ZeRO-3), and its backward once. The vocabulary-split head
    and loss (model attributes) take the hidden ``width`` and the model's ``dtype``. ``lookups``:
    whether the part looks tokens up (a pipeline's last stage holds the vocabulary table only for
    its tied head)."""
    parts = []
    for _, m in model.named_modules():
        if isinstance(m, MODULES) and (lookups or not isinstance(m, VocabParallelEmbedding)):
            parts.append((m, m.tp_calls(tokens)))
    for m in vars(model).values():
        if isinstance(m, VocabParallelHead):
            parts.append((m, m.tp_calls(tokens, width, dtype)))
        elif isinstance(m, VocabParallelLoss):   # part of no unit or block: it never reruns
            parts.append((None, m.tp_calls(tokens, dtype)))
    out = []
    for m, (forward, backward) in parts:
        out += (forward * (1 + (id(m) in reruns)) + backward) * microbatches
    return [(comm.axis, *call) for call in out]
