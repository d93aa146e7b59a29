"""Context parallelism: every sequence split over the ``cp`` ranks of the grid's cp axis, attention
computed as ring attention.

**The split, load-balanced for causal attention.** A sequence of T tokens is cut into ``2 cp``
chunks of ``L = T / (2 cp)``; cp rank ``c`` holds chunks ``c`` and ``2 cp - 1 - c``, one from each
end, side by side (:class:`ContextShard`). Under a causal mask a chunk near the start attends to
few keys and one near the end to many: each rank holds one of each, so every rank does the same
work (Megatron-Core and torchtitan split the same way).

**Ring attention** (:class:`RingAttention`; Liu et al. 2023, with FlashAttention's online
softmax). Each rank keeps its queries; the keys and values of every rank travel once around the
cp ring by non-blocking point-to-point, the next block in flight while the current one is
computed. A (query chunk, key chunk) pair is computed whole when the key chunk comes first, with
the causal mask when it is the same chunk, and skipped when it comes later; every rank computes
two chunks' worth per step. Partial results merge by their log-sum-exp: ``lse = logaddexp(lse,
lse_b)``, ``O = O exp(lse_old - lse) + O_b exp(lse_b - lse)``. The forward saves only the rank's
own qkv, the merged output and ``lse`` (as the one-rank op: no (T, T) array); the backward sends
the keys and values around the ring again, each with the gradient of its keys and values, which
every rank adds its part to and passes on: after ``cp`` passes each returns to its owner. Dropout
masks are drawn per block at the global (row, head, query, key) places
(:class:`mpirt.core.ops.dropout.MaskSource` spans), so they are the one-rank op's mask.

The rest of the model sees a shorter sequence: the embedding reads the chunks' global positions
(GPT-2's learned table, Llama's rotary tables), the loss is the mean over the rank's tokens (the
engine averages it over dp and cp, whose ranks hold equal token counts), and gradients are
averaged over dp x cp (:data:`mpirt.parallel.grid.DATA_AXES`). Parameters are not split: a
checkpoint does not know cp.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

import numpy as np

import mpirt.core.backend as B
from mpirt.core.injected import injected
from mpirt.core.nn import Module
from mpirt.core.ops.attention import block_backward, block_forward, split_qkv
from mpirt.core.ops.dropout import _check_p, as_mask_source, dropout_mask
from mpirt.core.precision import float32_compute, is_half
from mpirt.core.tensor import Function
from mpirt.parallel.step_simulation import Op

# the kinds of (query chunk, key chunk) pairs: keys before the queries, the same chunk, keys after
FULL, DIAGONAL, NONE = "full", "diagonal", "none"
_TAG_KV, _TAG_DKV = 71, 72  # ring messages on the cp communicator, which carries nothing else


class ContextShard:
    """This rank's share of every sequence: chunks ``rank`` and ``2 size - 1 - rank`` of ``2 size``,
    over ``comm`` (the grid's cp axis; ``rank``/``size`` its rank and size)."""

    layer = "attention"  # the module whose ring this is, as watchdog reports name it (:meth:`named`)

    def __init__(self, comm):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size

    def named(self, layer: str) -> "ContextShard":
        """This split as module ``layer`` (e.g. ``h.3.attn``) uses it: the same ring, whose messages
        the watchdog's report then names by layer and ring step."""
        view = copy.copy(self)
        view.layer = layer
        return view

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        """The global chunk numbers of cp rank ``rank``'s two halves (default this rank's), in the
        order it holds them."""
        rank = self.rank if rank is None else rank
        return rank, 2 * self.size - 1 - rank

    def owner(self, step: int) -> int:
        """The cp rank whose keys and values this rank holds at ring step ``step``."""
        return (self.rank - step) % self.size

    @property
    def neighbours(self) -> tuple[int, int]:
        """``(next, previous)`` cp ranks: the ring passes to the next, receives from the previous."""
        return (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def check_length(self, t: int) -> None:
        """Refuse a sequence of ``t`` tokens that does not cut into ``2 cp`` equal chunks."""
        if t % (2 * self.size):
            raise ValueError(f"context parallelism: seq_len {t} does not cut into 2 x cp = {2 * self.size} equal "
                             f"chunks (cp={self.size})")

    def runs(self, held: int) -> tuple[int, tuple]:
        """``(T, ((start, L), (start, L)))``: the global sequence length and the two runs of
        positions a rank holding ``held`` tokens of each sequence holds."""
        half = held // 2
        return self.size * held, tuple((k * half, half) for k in self.chunks())

    def positions(self, held: int):
        """The global positions of the ``held`` tokens this rank holds, (held,) int64 on the backend."""
        _, runs = self.runs(held)
        return B.xp.asarray(np.concatenate([np.arange(s, s + n) for s, n in runs]))

    def attention(self, qkv, n_head, **kwargs):
        """:func:`ring_attention` over this split (what a model's attention core calls)."""
        return ring_attention(qkv, n_head, self, **kwargs)

    def shard(self, a):
        """``a`` (B, T, ...) -> (B, T / cp, ...): this rank's two chunks of every row, side by side."""
        self.check_length(a.shape[1])
        half = a.shape[1] // (2 * self.size)
        first, second = (slice(k * half, (k + 1) * half) for k in self.chunks())
        xp = np if isinstance(a, np.ndarray) else B.xp  # host batches stay on the host
        return xp.concatenate([a[:, first], a[:, second]], axis=1)


def ring_message_bytes(layout, model_cfg, dtype: str) -> int:
    """One ring hop's bytes: one block's keys and values of the tokens a cp rank holds, for one
    micro-batch (``layout.rows`` sequences) and this tp rank's share of the KV heads, in float32
    under half precision (what :class:`RingAttention` sends; the proof and the planner count it)."""
    kv_heads = getattr(model_cfg, "n_kv_head", None) or model_cfg.n_head
    carried = np.dtype("float32" if is_half(dtype) else dtype).itemsize
    return layout.rows * layout.tokens * 2 * kv_heads * (model_cfg.n_embd // model_cfg.n_head) // layout.tp * carried


def ring_program(label: str, backward: bool, cp: int, nxt: int, prv: int, nbytes: int, dtype: str) -> list[Op]:
    """One block's ring passes as the pre-flight proof's operations (what :class:`RingAttention`
    sends, for the proof to check and the recorded step to be held to): forward, ``cp - 1``
    exchanges of the keys and values (``nbytes``, :func:`ring_message_bytes`) to world rank
    ``nxt`` and from ``prv``; backward, ``cp - 1`` exchanges of the keys and values with their
    gradient, and the gradient's last pass home. None when ``cp`` is 1."""
    if cp == 1:
        return []
    out, back = ((nxt, nbytes),), ((prv, nbytes),)
    if not backward:
        return [Op("exchange", "cp", sends=out, recvs=back, label=f"{label} ring step {s}", dtype=dtype)
                for s in range(cp - 1)]
    return [Op("exchange", "cp", sends=out * 2, recvs=back * 2, label=f"{label} ring backward step {s}", dtype=dtype)
            for s in range(cp - 1)] + \
        [Op("exchange", "cp", sends=out, recvs=back, label=f"{label} ring backward step {cp - 1}", dtype=dtype)]


class RingLabel(NamedTuple):
    """A ring message as the communication watchdog names it, e.g. ``cp rank 1: ring attention
    forward of h.3.attn, ring step 2 of 3 (keys and values to cp rank 2, from cp rank 0)``; built
    per step, formatted only in a report."""

    shard: "ContextShard"
    direction: str   # "forward" (keys and values) or "backward" (their gradients)
    step: int        # from 0

    def __str__(self) -> str:
        s = self.shard
        nxt, prv = s.neighbours
        what = "keys and values" if self.direction == "forward" else "their gradients"
        return (f"cp rank {s.rank}: ring attention {self.direction} of {s.layer}, ring step {self.step + 1} of "
                f"{s.size - 1} ({what} to cp rank {nxt}, from cp rank {prv})")


def pair(q_chunk: int, k_chunk: int) -> str:
    """How query chunk ``q_chunk`` attends to key chunk ``k_chunk`` under the causal mask."""
    return FULL if k_chunk < q_chunk else DIAGONAL if k_chunk == q_chunk else NONE


def _merge(acc, o_b, lse_b):
    """Merge a block's ``(o_b, lse_b)``, (B, L, C) and (B, H, L, 1), into the running ``acc = [o,
    lse]`` (None: the first), in place on ``acc``'s output."""
    xp = B.xp
    if acc[0] is None:
        acc[0], acc[1] = o_b, lse_b
        return
    b, n, c = o_b.shape
    h = lse_b.shape[1]
    lse = xp.logaddexp(acc[1], lse_b)
    o = acc[0].reshape(b, n, h, c // h)                               # (B, L, H, D): lse's (B, H, L, 1) per head
    o *= xp.exp(acc[1] - lse).transpose(0, 2, 1, 3)
    o += o_b.reshape(o.shape) * xp.exp(lse_b - lse).transpose(0, 2, 1, 3)
    acc[1] = lse


@float32_compute
class RingAttention(Function):
    """Causal attention over a sequence split by :class:`ContextShard`: the local fused ``qkv``
    (B, T / cp, C + 2 Ck) -> (B, T / cp, C); the arguments as
    :func:`mpirt.core.ops.attention.causal_self_attention`'s, plus ``shard``. Each (query chunk,
    key chunk) pair is one :func:`~mpirt.core.ops.attention.block_forward`; this class is the ring
    and the merge."""

    def forward(self, qkv, n_head, shard=None, dropout_p=0.0, seed=None, n_kv_head=None):
        q, kv = split_qkv(qkv, n_head, n_kv_head)
        self.shard, self.n_head, self.n_kv_head, self.chunk_len = shard, n_head, n_kv_head, qkv.shape[1] // 2
        self.source = None if dropout_p == 0 else as_mask_source(seed)
        self.keep_scale = 1.0 / (1.0 - dropout_p) if dropout_p else None
        self.p, self.masks = dropout_p, {}
        acc = [[None, None], [None, None]]                          # per local half: [o, lse]

        def blocks(kvb, step):
            for i, j, kind in self._pairs(step):
                o_b, lse_b = block_forward(q[:, self._rows(i)], n_head, n_kv_head, kv=kvb[:, self._rows(j)],
                                           causal=kind == DIAGONAL, mask=self._mask(i, j, step, qkv.shape[0]),
                                           keep_scale=self.keep_scale)
                _merge(acc[i], o_b, lse_b)

        self._ring(B.xp.ascontiguousarray(kv), blocks)
        self.qkv, self.lse = qkv, (acc[0][1], acc[1][1])            # each half's (B, H, T/2cp, 1)
        self.out = B.xp.concatenate([acc[0][0], acc[1][0]], axis=1)
        return self.out

    # --- the blocks -------------------------------------------------------------------------------
    def _rows(self, which: int) -> slice:
        """The rows of the rank's chunk ``which`` (0: the one from the start, 1: from the end)."""
        return slice(which * self.chunk_len, (which + 1) * self.chunk_len)

    def _pairs(self, step: int):
        """``(query half, key half, kind)`` of the blocks computed at ring step ``step`` (holding the
        keys and values of cp rank ``rank - step``), skipped pairs left out."""
        shard = self.shard
        k_chunks = shard.chunks(shard.owner(step))
        for i, q_chunk in enumerate(shard.chunks()):
            for j, k_chunk in enumerate(k_chunks):
                kind = pair(q_chunk, k_chunk)
                if kind != NONE:
                    yield i, j, kind

    def _mask(self, i: int, j: int, step: int, b: int):
        """The dropout keep-mask of the block (query half i, key half j) at ``step``, (B, H, L, L)
        (None without dropout); drawn at the block's global places, kept for the backward."""
        if self.source is None:
            return None
        key = (i, j, step)
        if key not in self.masks:
            shard, n = self.shard, self.chunk_len
            total = 2 * shard.size * n
            q0 = shard.chunks()[i] * n
            k0 = shard.chunks(shard.owner(step))[j] * n
            src = dataclasses.replace(self.source, spans=((2, total, ((q0, n),)), (3, total, ((k0, n),))))
            self.masks[key] = dropout_mask((b, self.n_head, n, n), self.p, src)
        return self.masks[key]

    def _ring(self, kvb, blocks):
        """Call ``blocks(kv, step)`` for each of the cp ranks' keys and values in turn, the next
        already travelling (sent on to rank + 1, received from rank - 1) while it computes."""
        shard = self.shard
        nxt, prv = shard.neighbours
        # cp - 1 passes bring every rank's keys and values; test-only (mpirt.core.injected): one more, unused
        passes = shard.size - 1 + (shard.size > 1 and injected("cp-ring-extra-pass"))
        for step in range(shard.size):
            moving = []
            if step < passes:
                incoming = B.xp.empty_like(kvb)
                with shard.comm.labelled(RingLabel(shard, "forward", step)):
                    moving = [shard.comm.isend(kvb, nxt, tag=_TAG_KV), shard.comm.irecv(incoming, prv, tag=_TAG_KV)]
            wrong = shard.size > 1 and injected("cp-ring-step")  # test-only (mpirt.core.injected)
            blocks(kvb, (step + 1) % shard.size if wrong else step)
            for h in moving:
                h.wait()
            if moving:
                kvb = incoming

    # --- backward -------------------------------------------------------------------------------
    def backward(self, g):
        xp = B.xp
        q, kv = split_qkv(self.qkv, self.n_head, self.n_kv_head)
        dq = xp.zeros(q.shape, dtype=q.dtype)
        shard = self.shard
        nxt, prv = shard.neighbours
        kvb = xp.ascontiguousarray(kv)                              # (B, T/cp, 2 Ck): travels with its gradient
        dkv = [xp.zeros(kvb.shape, dtype=kvb.dtype)]                # the gradient of the keys and values held

        def blocks(kvb, step):
            for i, j, kind in self._pairs(step):
                rq, rk = self._rows(i), self._rows(j)
                dq_b, dkv_b = block_backward(q[:, rq], self.lse[i], self.out[:, rq], g[:, rq], self.n_head,
                                             self.n_kv_head, kv=kvb[:, rk], causal=kind == DIAGONAL,
                                             mask=self._mask(i, j, step, g.shape[0]), keep_scale=self.keep_scale)
                dq[:, rq] += dq_b
                dkv[0][:, rk] += dkv_b
            back = xp.empty_like(dkv[0])                            # the keys' gradient moves on with them
            with shard.comm.labelled(RingLabel(shard, "backward", step)):
                moving = (shard.comm.isend(dkv[0], nxt, tag=_TAG_DKV), shard.comm.irecv(back, prv, tag=_TAG_DKV))
            for hd in moving:
                hd.wait()
            dkv[0] = back

        self._ring(kvb, blocks)                                     # after cp passes, this rank's own gradient
        return (xp.concatenate([dq, dkv[0]], axis=-1),)


def ring_attention(qkv, n_head, shard: ContextShard, dropout_p=0.0, seed=None, n_kv_head=None):
    """Causal multi-head self-attention of the sequence split by ``shard`` (see the module
    docstring): this rank's fused ``qkv`` (B, T / cp, C + 2 Ck) -> (B, T / cp, C), equal to the
    rows of :func:`mpirt.core.ops.attention.causal_self_attention` on the whole sequence that
    this rank holds. Collective over ``shard.comm`` (forward and backward)."""
    _check_p(dropout_p, "ring_attention", "dropout_p")
    return RingAttention.apply(qkv, n_head=n_head, shard=shard, dropout_p=dropout_p, seed=seed, n_kv_head=n_kv_head)


def parallelize_context(model: Module, shard: ContextShard) -> Module:
    """Split ``model``'s sequences as ``shard`` says, in place: the model and its attention modules
    get it as their ``context`` (the model's position embedding and the rotary tables read the
    chunks' global positions, the attention core becomes :func:`ring_attention`), and every
    Dropout draws its mask at the global token positions it holds. Returns ``model``."""
    for name, m in model.named_modules():
        if hasattr(m, "context"):
            m.context = shard.named(name) if name else shard
    return model
