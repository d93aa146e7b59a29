"""The parameter store: a rank's parameters back to back in flat arrays.

Every parallel strategy keeps its parameters and gradients here, so the layout is written once:

    store = FlatParams(params, count_once(tp_rank, tied_copy), init)  # p.data / p.grad are views
    DataParallel(store, dp_comm)         # buckets: ranges of store.grad, allreduced over dp
    ZeroOptimizer(store, dp_comm, 1|2)   # dp chunk r of the flat vector: this rank's shard
    store.sync_partial_grads(tp_comm)    # sequence-parallel partial gradients, summed over tp
    store.clip(max_norm, [tp, pp])       # the one global-norm clip (clip_flat; ZeRO: over its shard)

:class:`FlatLayout` is the arithmetic only (offsets, per-parameter views, dp chunks, which
elements of a range belong to which parameter); :class:`ShardedLayout` adds the chunk a dp rank
owns (ZeRO's shards; ZeRO-3's store, :class:`mpirt.parallel.zero3.ShardedParams`, has one per
unit group).
:class:`FlatParams` allocates the data and gradient vectors and binds every ``p.data`` and
``p.grad`` to its view. The autograd accumulates into ``p.grad`` in place and optimizers zero it
in place, so the views stay valid; nothing may rebind them (:meth:`FlatParams.check_views`).

Counting each element once: the global gradient norm sums squares over the ranks that hold
different pieces of the model. A parameter replicated over tp counts on tp rank 0 only, the tied
embedding's second copy (the last pipeline stage's) not at all (:func:`count_once`).
"""
from __future__ import annotations

import math

import mpirt.core.backend as B
from mpirt.core.injected import injected
from mpirt.comm import chunk_bounds
from mpirt.cpu.hostalloc import release_freed_memory
from mpirt.core.optim import clip_coefficient
from mpirt.core.precision import upcast


_TRIM_EVERY = 8 << 20  # bytes moved into the store between two releases of the freed copies


class FlatLayout:
    """``params`` laid out back to back in one flat vector of ``numel`` elements.

    ``shapes``: {id(param): shape} when the parameters' arrays no longer show their shape (ZeRO-3
    placeholders); default ``p.shape``. Allocates nothing."""

    def __init__(self, params, shapes: dict | None = None):
        self.params = list(params)
        self.shapes = [tuple(shapes[id(p)]) if shapes else tuple(p.shape) for p in self.params]
        self.offsets, n = [], 0
        for s in self.shapes:
            k = math.prod(s)
            self.offsets.append((n, n + k))
            n += k
        self.numel = n

    def views(self, flat) -> list:
        """``flat`` (numel,) as one array per parameter."""
        return [flat[a:b].reshape(s) for (a, b), s in zip(self.offsets, self.shapes)]

    def chunk(self, rank: int, size: int) -> tuple[int, int]:
        """``[lo, hi)``: the contiguous part of the vector dp rank ``rank`` of ``size`` owns."""
        return chunk_bounds(self.numel, size)[rank]

    def segments(self, lo: int, hi: int) -> list[tuple]:
        """``(param, start, stop, pos)``: elements ``[start, stop)`` of ``param`` (flattened) are
        elements ``[pos, pos + stop - start)`` of the range ``[lo, hi)`` of the vector."""
        out = []
        for p, (a, b) in zip(self.params, self.offsets):
            s, e = max(a, lo), min(b, hi)
            if s < e:
                out.append((p, s - a, e - a, s - lo))
        return out

    def buckets(self, bucket_bytes: int, itemsize: int) -> list[tuple[int, int, list]]:
        """``(lo, hi, params)``: the vector cut from its end into ranges of ``bucket_bytes``
        (``itemsize`` bytes per element, at least one element; the range at 0 may be shorter), the
        order backward finishes the gradients; ``params``: those with elements in the range, in
        reverse order. A parameter larger than a bucket spans several, so no range exceeds the size."""
        step = max(1, bucket_bytes // itemsize)
        return [(lo, hi, [p for p, *_ in reversed(self.segments(lo, hi))])
                for hi in range(self.numel, 0, -step) for lo in [max(0, hi - step)]]

    def runs(self, lo: int, hi: int, select) -> list[tuple[int, int]]:
        """Maximal ``[start, stop)`` runs, relative to ``lo``, of the range ``[lo, hi)`` that belong to
        parameters for which ``select(p)`` holds."""
        out = []
        for p, a, b, pos in self.segments(lo, hi):
            if not select(p):
                continue
            if out and out[-1][1] == pos:
                out[-1] = (out[-1][0], pos + b - a)
            else:
                out.append((pos, pos + b - a))
        return out


class ShardedLayout(FlatLayout):
    """A :class:`FlatLayout` chunked over ``size`` dp ranks: rank ``rank`` owns ``[lo, hi)``, which
    sits at ``shard_offset`` in the rank's shard (its owned chunks of several layouts back to
    back: :func:`place_shards`)."""

    def __init__(self, params, shapes, rank: int, size: int):
        super().__init__(params, shapes)
        self.lo, self.hi = self.chunk(rank, size)
        self.shard_offset = 0
        self.shard = None      # ZeRO-3: a leaf Tensor over the owned chunk (data: params, grad: grads)

    @property
    def in_shard(self) -> slice:
        """Where the owned chunk sits in the rank's shard."""
        return slice(self.shard_offset, self.shard_offset + self.hi - self.lo)

    def shard_runs(self, select) -> list[tuple[int, int]]:
        """:meth:`FlatLayout.runs` of the owned chunk, as positions in the rank's shard."""
        return [(a + self.shard_offset, b + self.shard_offset) for a, b in self.runs(self.lo, self.hi, select)]

    def gather(self, comm, shard):
        """The full flat vector, all-gathered over ``comm`` (dp) from every rank's chunk of it in
        its ``shard`` (parameters, or optimizer state laid out alike). Collective."""
        B.synchronize()
        return comm.allgather_flat(shard[self.in_shard], self.numel)


def place_shards(layouts) -> int:
    """Lay the owned chunks of ``layouts`` (:class:`ShardedLayout`) back to back in one shard,
    setting each one's ``shard_offset``; returns the shard's length."""
    offset = 0
    for g in layouts:
        g.shard_offset = offset
        offset += g.hi - g.lo
    return offset


def trainable(params, who: str, allow_empty: bool = True) -> list:
    """The parameters of ``params`` that require gradients, refused (ValueError naming ``who``)
    when one appears twice, their dtypes differ (one store holds one dtype) or, unless
    ``allow_empty``, there are none."""
    params = [p for p in params if p.requires_grad]
    if not params and not allow_empty:
        raise ValueError(f"{who}: no parameter requires a gradient")
    if len({id(p) for p in params}) != len(params):
        raise ValueError(f"{who}: a parameter appears twice")
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) > 1:
        raise ValueError(f"{who}: all parameters must share one dtype, got {dtypes}")
    return params


class FlatParams(FlatLayout):
    """This rank's parameters in one flat data vector and one flat gradient vector (one dtype).

    ``counted(p) -> bool``: whether ``p``'s gradient counts in the global norm on this rank
    (:func:`count_once`; default every parameter). Every ``p.data`` becomes a view into
    :attr:`data` (values kept) and every ``p.grad`` a view into :attr:`grad` (zeroed). A lazy
    parameter (no array yet) is materialised in its view by ``init(p, out=view)`` (e.g.
    :meth:`mpirt.core.nn.Parameter.init_slice`), so its values are never held twice. ``grads=False``
    leaves the gradient vector unallocated until :meth:`alloc_grads` (ZeRO-2 keeps only its shard:
    a full vector made and dropped at start-up would set the run's peak)."""

    def __init__(self, params, counted=None, init=None, grads: bool = True):
        params = trainable(params, "FlatParams")
        super().__init__(params)
        self.dtype = params[0].dtype if params else B.xp.dtype("float32")
        self.counted = counted or (lambda p: True)
        self._counted_runs = self.runs(0, self.numel, self.counted)
        self.data = B.xp.empty(self.numel, dtype=self.dtype)
        moved = 0
        for p, v in zip(self.params, self.views(self.data)):
            if p.materialized or init is None:
                v[...] = p.data
            else:
                init(p, out=v)
            p.data = v
            moved += v.nbytes
            if moved >= _TRIM_EVERY:  # the freed copies would stay resident beside the store
                release_freed_memory()
                moved = 0
        release_freed_memory()
        self.grad = None
        if grads:
            self.alloc_grads()

    def alloc_grads(self) -> None:
        """A zeroed gradient vector behind every ``p.grad`` (after :meth:`release_grads`: a new one)."""
        if self.grad is None:
            self.grad = B.xp.zeros(self.numel, dtype=self.dtype)
        else:
            self.grad.fill(0)
        for p, v in zip(self.params, self.views(self.grad)):
            p.grad = v

    def release_grads(self) -> None:
        """Free the gradient vector (ZeRO-2 keeps only its shard between steps); ``p.grad`` is None."""
        self.grad = None
        for p in self.params:
            p.grad = None

    def zero_grad(self) -> None:
        """Zero the gradients in place (allocating the vector if it was released)."""
        self.alloc_grads()

    def check_views(self, who: str) -> None:
        """Raise naming the parameter whose ``.grad`` no longer is its view into :attr:`grad`."""
        for p in self.params:
            if p.grad is None or p.grad.base is not self.grad:
                raise RuntimeError(f"{who}: {p.name or 'a parameter'}.grad was rebound; gradients must stay "
                                   "views into the flat store (zero them in place, never set None)")

    def clip(self, max_norm: float | None, comms=()) -> float:
        """:func:`clip_flat` of the whole gradient vector: the counted elements' squares summed over
        ``comms`` (the axes over which ranks hold different parameters: tp, pp). Returns the norm."""
        return clip_flat(*self.norm_parts(), comms, max_norm)

    def norm_parts(self) -> tuple:
        """``(this rank's counted sum of squares; the arrays a clip scales)``: the store's part of a
        global norm (:func:`clip_flat`)."""
        return sum_squares(self.grad, self._counted_runs), [self.grad]

    def sync_partial_grads(self, tp_comm) -> None:
        """Sum over tp the gradients of parameters that saw only this rank's sequence chunk
        (sequence parallelism, :func:`is_partial`), packed into one allreduce. Every tp rank holds
        the same layout, so the runs agree. Collective over tp."""
        allreduce_runs(tp_comm, self.grad, self.runs(0, self.numel, is_partial))

    def partial_sum_calls(self, tp_comm) -> list[tuple]:
        """The calls of :meth:`sync_partial_grads` (:func:`runs_calls`)."""
        return runs_calls(tp_comm, self.grad, self.runs(0, self.numel, is_partial))


def runs_calls(comm, flat, runs) -> list[tuple[str, str, int, str]]:
    """``(axis, kind, bytes, dtype)`` of :func:`allreduce_runs` of ``runs`` of ``flat`` over ``comm``."""
    if comm is None or comm.size == 1 or not runs:
        return []
    return [(comm.axis, "allreduce", sum(b - a for a, b in runs) * flat.itemsize, flat.dtype.name)]


def is_partial(p) -> bool:
    """Whether ``p``'s gradient is a partial sum over tp (sequence parallelism's replicated weights)."""
    return bool(getattr(p, "tp_partial_grad", False))


def allreduce_runs(comm, flat, runs) -> None:
    """Sum ``flat[a:b]`` for every ``(a, b)`` in ``runs`` over ``comm``, in place: the runs packed
    into one allreduce. Collective (every rank passes runs of the same lengths)."""
    if comm is None or comm.size == 1 or not runs:
        return
    packed = B.xp.concatenate([flat[a:b] for a, b in runs])
    comm.allreduce(packed, out=packed)
    pos = 0
    for a, b in runs:
        flat[a:b] = packed[pos:pos + b - a]
        pos += b - a


def count_once(tp_rank: int, tied_copy=()) -> "callable":
    """The ``counted`` predicate of a rank: a parameter replicated over tp counts on tp rank 0
    only; a name in ``tied_copy`` (the tied embedding on the last pipeline stage, whose twin on the
    first stage counts) never."""
    tied_copy = set(tied_copy)

    def counted(p) -> bool:
        return p.name not in tied_copy and not (tp_rank and "tp" not in p.spec.dims)
    return counted


def sum_squares(flat, runs) -> float:
    """Sum of squares of ``flat`` over ``runs`` (``[start, stop)`` pairs) as a float, 0.0 for no
    runs; half sums in float32."""
    start = 0 if injected("scalar-dtype-from-value") else 0.0  # test-only (mpirt.core.injected)
    return sum((float(B.xp.vdot(v, v)) for v in (upcast(flat[a:b]) for a, b in runs)), start)


def clip_flat(local_sq: float, grads, comms, max_norm: float | None) -> float:
    """The one global-norm clip of every layout: ``local_sq`` (this rank's counted sum of squares)
    summed over ``comms`` (the axes over which ranks hold different gradient elements), and when the
    norm exceeds ``max_norm`` every array in ``grads`` scaled by ``max_norm / (norm + 1e-6)``
    (:func:`mpirt.core.optim.clip_coefficient`; nothing for a non-finite norm). Returns the norm."""
    for c in comms:
        if c is not None and c.size > 1:
            local_sq = c.allreduce_scalar(local_sq)
    norm = math.sqrt(local_sq)
    coef = clip_coefficient(norm, max_norm) if max_norm is not None else None
    if coef is not None:
        for g in grads:
            g *= coef
    return norm
