"""Modules and parameters.

Every :class:`Parameter` knows its dotted name, its global shape and how it is split over the
process grid (:class:`ShardSpec`). Parameters are created lazy (a shape, no array), so building a
model allocates nothing; initialisation generates this rank's slice of the full tensor seeded by
the name (chunk by chunk, never the whole tensor), so every parallel layout starts from identical
weights.
Checkpointing, clipping and ZeRO are written against this metadata, not per layer.

Over 400 lines: the module system and its parameters (Module, Parameter, ShardSpec, the layers) are one contract that every other floor reads.
"""
from __future__ import annotations

import contextlib
import zlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator

import numpy as np

import mpirt.core.backend as B
from mpirt.core import ops
from mpirt.core.ops.dropout import MaskSource
from mpirt.core.tensor import Tensor, graph_functions
from mpirt.cpu.threads import fill_zero


@dataclass(frozen=True)
class ShardSpec:
    """For each dimension of a parameter, the grid axis it is split over (``"tp"``, ...) or None.

    ``blocks`` (optional, one entry per dimension, default all 1) describes fused parameters: a
    dimension with ``blocks[d] = k`` is ``k`` equal contiguous blocks, *each* split over
    ``dims[d]``, and a rank's shard is the concatenation of its piece of every block. GPT-2's fused
    ``c_attn`` weight (C, 3C) is ``ShardSpec((None, "tp"), blocks=(1, 3))``: q, k and v are each
    split by heads, so at tp=2 rank 0 holds ``[q0 | k0 | v0]`` (columns ``0:C/2``, ``C:3C/2`` and
    ``2C:5C/2``), never the contiguous first half of 3C. An entry may also be a tuple of block
    weights, for blocks of unequal sizes in those proportions: grouped-query attention's
    ``c_attn`` (C, C + 2 Ck) with 8 query heads per key/value head is ``blocks=(1, (8, 1, 1))``
    (equal weights are stored as their count). Such a shard is not a box of the full tensor:
    use :meth:`local_index` / :meth:`shard` / :meth:`place` (``local_slices`` refuses it).
    """

    dims: tuple
    blocks: tuple = ()

    def __post_init__(self):
        if not self.blocks:
            return
        if len(self.blocks) != len(self.dims):
            raise ValueError(f"ShardSpec: blocks {self.blocks} must give one entry per dimension of {self.dims}")
        canonical = []
        for d, (k, axis) in enumerate(zip(self.blocks, self.dims)):
            weights = tuple(k) if isinstance(k, (tuple, list)) else (k,)
            if not all(isinstance(w, int) and w >= 1 for w in weights) or (len(weights) == 1 and weights != (k,)):
                raise ValueError(f"ShardSpec: blocks[{d}] must be a positive integer or a tuple of them, got {k!r}")
            k = k if isinstance(k, int) else len(weights) if len(set(weights)) == 1 else weights
            if k != 1 and axis is None:
                raise ValueError(f"ShardSpec: dimension {d} has {k} blocks but is not split over any axis")
            canonical.append(k)
        object.__setattr__(self, "blocks", tuple(canonical))

    @classmethod
    def replicated(cls, ndim: int) -> "ShardSpec":
        return cls((None,) * ndim)

    def _blocks(self) -> tuple:
        return self.blocks or (1,) * len(self.dims)

    @property
    def is_blocked(self) -> bool:
        """True when some dimension is split block-wise (its shard is not one contiguous range)."""
        return any(k != 1 for k in self._blocks())

    def block_sizes(self, d: int, n: int, parts: int = 1) -> list:
        """Sizes of the blocks of dimension ``d`` (global size ``n``), each of which must split into
        ``parts`` equal pieces (ValueError naming the sizes otherwise)."""
        k = self._blocks()[d]
        weights = (1,) * k if isinstance(k, int) else k
        unit, rest = divmod(n, sum(weights))
        sizes = [w * unit for w in weights]
        if rest or any(m % parts for m in sizes):
            axis = self.dims[d]
            count = len(weights) if len(set(weights)) == 1 else f"{len(weights)} ({':'.join(map(str, weights))})"
            what = f"{count} blocks each split over {axis}={parts}" if len(weights) > 1 else f"{axis}={parts}"
            raise ValueError(f"dimension {d} of size {n} does not split evenly into {what}")
        return sizes

    def local_shape(self, global_shape, axis_sizes: dict) -> tuple:
        """Shape of one rank's shard given the size of each grid axis."""
        if len(self.dims) != len(global_shape):
            raise ValueError(f"ShardSpec {self.dims} has {len(self.dims)} dims for shape {tuple(global_shape)}")
        shape = []
        for dim, (n, axis) in enumerate(zip(global_shape, self.dims)):
            parts = axis_sizes.get(axis, 1) if axis else 1
            self.block_sizes(dim, n, parts)
            shape.append(n // parts)
        return tuple(shape)

    def local_slices(self, global_shape, axis_sizes: dict, axis_ranks: dict) -> tuple:
        """The slice of the full tensor held by the rank at ``axis_ranks`` (axis -> index).

        Only for specs without blocks (a blocked shard is not a box): see :meth:`local_index`."""
        if self.is_blocked:
            raise ValueError(f"ShardSpec {self.dims} with blocks {self.blocks}: a rank's shard is not one "
                             "slice of the full tensor; use local_index/shard/place")
        local = self.local_shape(global_shape, axis_sizes)
        return tuple(slice(axis_ranks.get(axis, 0) * m, (axis_ranks.get(axis, 0) + 1) * m) if axis else slice(None)
                     for m, axis in zip(local, self.dims))

    def dim_index(self, d: int, n: int, axis_sizes: dict, axis_ranks: dict):
        """Positions (a slice, or a NumPy int array for a blocked dimension) that this rank holds
        along dimension ``d`` of global size ``n``, in shard order."""
        axis = self.dims[d]
        if not axis:
            return slice(None)
        parts, r = axis_sizes.get(axis, 1), axis_ranks.get(axis, 0)
        sizes = self.block_sizes(d, n, parts)
        if len(sizes) == 1:
            piece = n // parts
            return slice(r * piece, (r + 1) * piece)
        starts = np.cumsum([0, *sizes[:-1]])
        return np.concatenate([start + r * (m // parts) + np.arange(m // parts) for start, m in zip(starts, sizes)])

    def local_index(self, global_shape, axis_sizes: dict, axis_ranks: dict) -> tuple:
        """An index such that ``full[index]`` is this rank's shard (and ``full[index] = shard``
        writes it back): slices, or for blocked specs open-mesh integer arrays (``np.ix_`` style)."""
        self.local_shape(global_shape, axis_sizes)  # validates
        idx = [self.dim_index(d, n, axis_sizes, axis_ranks) for d, n in enumerate(global_shape)]
        if not self.is_blocked:
            return tuple(idx)
        return np.ix_(*[np.arange(n)[i] if isinstance(i, slice) else i for i, n in zip(idx, global_shape)])

    def shard(self, full, axis_sizes: dict, axis_ranks: dict):
        """This rank's shard of the full array ``full`` (a copy for blocked specs, else a view)."""
        return full[self.local_index(full.shape, axis_sizes, axis_ranks)]

    def place(self, full, local, axis_sizes: dict, axis_ranks: dict) -> None:
        """Write the shard ``local`` of the rank at ``axis_ranks`` into the full array, in place."""
        full[self.local_index(full.shape, axis_sizes, axis_ranks)] = local


class NotMaterializedError(RuntimeError):
    """A lazy :class:`Parameter` was read before it was given a value (initialised or loaded)."""


# elements of the seeded full tensor generated at a time (float64: 4 MiB): the most a
# parameter's initialisation holds beyond its own slice, however large the full tensor is
INIT_CHUNK = 1 << 19


class Parameter(Tensor):
    """A trainable leaf Tensor with a name, a global shape, a ShardSpec and an init rule.

    ``init`` is ``"normal"`` (mean 0, standard deviation ``std``), ``"zeros"`` or ``"ones"``.
    The name is assigned by the owning module tree (``Module.named_parameters``).

    A Parameter is created *lazy*: it knows its shape and dtype but holds no array, so building a
    model allocates nothing. It is materialised by :meth:`Module.initialize` (its slice of the
    seeded full tensor, :meth:`init_slice`), by tensor parallelism's ``parallelize``, by
    ``load_state_dict`` or by assigning ``data``. Reading ``data`` before that raises
    :class:`NotMaterializedError`; ``shape``/``dtype``/``size``/``ndim`` always work (the local
    shape the rank will hold).
    """

    def __init__(self, shape, init: str = "normal", std: float = 0.02, spec: ShardSpec | None = None,
                 dtype="float32"):
        shape = tuple(shape)
        if init not in ("normal", "zeros", "ones"):
            raise ValueError(f"Parameter init: expected normal, zeros or ones, got {init!r}")
        super().__init__(B.numpy.empty(0, dtype=dtype), requires_grad=True)
        self.name = ""
        self.global_shape = shape
        self.spec = spec or ShardSpec.replicated(len(shape))
        self.init, self.std = init, std
        self.defer(shape)

    # --- lazy storage -----------------------------------------------------------------------
    def _get_data(self):
        data = self._data
        if data is None:
            raise NotMaterializedError(
                f"parameter {self.name or '(unnamed)'} {self._lazy_shape} {self._lazy_dtype} has no value yet: "
                "the model was built lazily; initialise it (a seed, Module.initialize, parallelize(seed=...)) "
                "or load weights (load_state_dict, a checkpoint) before reading it")
        return data

    def _set_data(self, value):
        self._data = value

    data = property(_get_data, _set_data)
    shape = property(lambda self: self._lazy_shape if self._data is None else self._data.shape)
    dtype = property(lambda self: self._lazy_dtype if self._data is None else self._data.dtype)
    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))

    @property
    def materialized(self) -> bool:
        """True once the parameter holds an array."""
        return self._data is not None

    def defer(self, shape=None, dtype=None) -> "Parameter":
        """Drop the array (if any) and keep only a local ``shape`` (default: the current one) and
        ``dtype``: the parameter is lazy again until it is materialised."""
        self._lazy_shape = tuple(self.shape if shape is None else shape)
        self._lazy_dtype = np.dtype(self.dtype if dtype is None else dtype)
        self._data = None
        return self

    # --- initial values ---------------------------------------------------------------------
    def _init_shape(self) -> tuple:
        """The shape of the seeded tensor (rows of ``global_shape`` beyond it are zero padding)."""
        return self.global_shape

    def full_init(self, seed: int) -> np.ndarray:
        """The full (unsharded) initial value, a pure function of ``seed`` and the name, float64."""
        if self.init == "zeros":
            return np.zeros(self.global_shape)
        if self.init == "ones":
            return np.ones(self.global_shape)
        rng = np.random.default_rng([seed, zlib.crc32(self.name.encode())])
        full = rng.standard_normal(self.global_shape)
        full *= self.std  # in place: the same products as ``* std`` without a second full array
        return full

    def init_slice(self, seed: int, axis_sizes: dict | None = None, axis_ranks: dict | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
        """This rank's slice (NumPy, in the parameter's dtype) of :meth:`full_init`, equal to
        ``spec.shard(full_init(seed))`` rounded to the dtype, without building the full tensor:
        the normal draws are generated in order, :data:`INIT_CHUNK` at a time along the first
        dimension (the generator's stream does not depend on how it is cut), and each chunk's part
        in the slice is kept. Holds at most one chunk beyond the slice. ``out``: a NumPy array of
        the slice's shape (any dtype, e.g. a view into a flat parameter store) to fill instead."""
        sizes, ranks = axis_sizes or {}, axis_ranks or {}
        shape, gen = self.global_shape, self._init_shape()
        local = self.spec.local_shape(shape, sizes)
        if out is None:
            out = np.zeros(local, dtype=self.dtype)
        elif tuple(out.shape) != local:
            raise ValueError(f"init_slice: out has shape {tuple(out.shape)}, {self.name}'s slice {local}")
        else:
            out[...] = 0
        if self.init == "zeros":
            return out
        if not shape:
            out[...] = self.full_init(seed)
            return out
        idx = [self.spec.dim_index(d, n, sizes, ranks) for d, n in enumerate(shape)]
        rows0 = np.arange(shape[0])[idx[0]]  # global rows held, in local order
        if self.init == "ones":
            out[np.flatnonzero(rows0 < gen[0])] = 1
            return out
        rest = tuple(idx[1:])
        mesh = None
        if any(not isinstance(i, slice) for i in rest):  # a blocked trailing dimension: index arrays
            mesh = [np.arange(n)[i] for i, n in zip(rest, gen[1:])]
        step = max(1, INIT_CHUNK // max(1, int(np.prod(gen[1:], dtype=np.int64))))
        rng = np.random.default_rng([seed, zlib.crc32(self.name.encode())])
        last = min(gen[0], int(rows0.max()) + 1 if rows0.size else 0)  # rows after it are never kept
        for r0 in range(0, last, step):
            r1 = min(r0 + step, gen[0])
            chunk = rng.standard_normal((r1 - r0,) + tuple(gen[1:]))
            chunk *= self.std  # as full_init: the same float64 products, then rounded to the dtype
            dst = np.flatnonzero((rows0 >= r0) & (rows0 < r1))
            if not dst.size:
                continue
            src = rows0[dst] - r0
            if isinstance(idx[0], slice):  # contiguous rows: views, no index arrays
                dst, src = slice(int(dst[0]), int(dst[-1]) + 1), slice(int(src[0]), int(src[-1]) + 1)
            picked = chunk[src]
            if mesh is not None:
                picked = picked[np.ix_(np.arange(picked.shape[0]), *mesh)]
            elif rest:
                picked = picked[(slice(None),) + rest]
            out[dst] = picked
        return out

    def __repr__(self):
        return f"Parameter({self.name!r}, shape={self.shape}, global_shape={self.global_shape}, dtype={self.dtype})"


@contextlib.contextmanager
def stand_ins(params):
    """Give every lazy parameter of ``params`` a read-only stand-in of its shape for the duration:
    zeros that take no memory (one element broadcast), enough to run a module on a dummy input to
    see which parameters it uses. Parameters that hold arrays are left alone."""
    lazy = [p for p in params if not p.materialized]
    try:
        for p in lazy:
            p.data = B.xp.broadcast_to(B.xp.zeros((), dtype=p.dtype), p.shape)
        yield
    finally:
        for p in lazy:
            p._data = None


def zero_grads(params, allocate: bool = True) -> None:
    """Zero each parameter's ``.grad`` in place (never rebinds: views into a parameter store stay
    views); one without a gradient gets a zero buffer, or with ``allocate=False`` stays without
    (ZeRO-2 streaming: backward makes each and frees it once reduced)."""
    for p in params:
        if p.grad is not None:
            fill_zero(p.grad)
        elif allocate:
            p.grad = B.xp.zeros_like(p.data)


def graph_parameters(root: Tensor) -> list:
    """The Parameters that ``root`` was computed from (the Parameter leaves of its autograd graph),
    each once, in the order of :func:`mpirt.core.tensor.graph_functions`. Linear in the size of the
    graph. Empty for a leaf or for a Tensor computed without a graph (``no_grad``)."""
    found: dict[int, Parameter] = {}
    for fn in graph_functions(root):
        for x in fn.inputs:
            if isinstance(x, Parameter):
                found.setdefault(id(x), x)
    return list(found.values())


def _array_base(a):
    """The array that owns ``a``'s memory (a view's base, followed to the end)."""
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def _arrays_in(value):
    """The NumPy/CuPy arrays in ``value``: itself, or inside (nested) tuples, lists and dict values
    (a grouped op keeps its experts' arrays by expert)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _arrays_in(v)
    elif isinstance(value, np.ndarray) or B.is_device_array(value):
        yield value


def kept_bytes(root) -> int:
    """Bytes of the activations the graph behind the Tensor ``root`` keeps alive until backward:
    arrays its Functions saved, the data of leaf Tensors that are inputs of one of them (an op's
    output is held only as its producer, :class:`mpirt.core.tensor.Edge`) and ``root``'s own, each
    buffer once; parameters are left out.
    Call before backward: this is what a pipeline stash or a step's forward holds per micro-batch."""
    found: dict[int, int] = {}
    params: set[int] = set()

    def add(a):
        base = _array_base(a)
        found[id(base)] = int(base.nbytes)

    add(root.data)
    for fn in graph_functions(root):
        for key, value in vars(fn).items():
            if key not in ("inputs", "needs_input_grad"):
                for a in _arrays_in(value):
                    add(a)
        for x in fn.inputs:
            if isinstance(x, Parameter):
                params.add(id(_array_base(x.data)))
            elif isinstance(x, Tensor) and x._ctx is None:
                add(x.data)
    return sum(n for k, n in found.items() if k not in params)


class Module:
    """Base class: attributes that are Parameters or Modules are registered in order."""

    def __init__(self):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, Parameter) pairs; a Parameter shared by two modules appears once."""
        seen = set()
        for prefix, module in self.named_modules():
            for name, p in module._parameters.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{prefix}.{name}" if prefix else name), p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def initialize(self, seed: int, axis_sizes: dict | None = None, axis_ranks: dict | None = None) -> "Module":
        """Name every parameter and give it its slice of the seeded full initial tensor.

        ``axis_sizes``/``axis_ranks`` (grid axis -> size / this rank's index) select the shard;
        a parameter's data becomes its local shard, so call this before building an optimizer.
        Builds no full tensor: each parameter generates its slice (:meth:`Parameter.init_slice`),
        one at a time, so the peak is this rank's slices plus one chunk of draws.
        """
        axis_sizes, axis_ranks = axis_sizes or {}, axis_ranks or {}
        for name, p in self.named_parameters():
            p.name = name
            p.defer()  # the old array (if any) goes before the new slice is made
            p.data = B.asarray(p.init_slice(seed, axis_sizes, axis_ranks), dtype=p.dtype)
            p.grad = None
        return self

    def zero_grad(self) -> None:
        """Zero every gradient buffer in place (allocating it on first use)."""
        zero_grads(self.parameters())

    def train(self, mode: bool = True) -> "Module":
        for _, m in self.named_modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def state_dict(self) -> dict:
        """Name -> NumPy array (a host copy of this rank's data)."""
        return {name: B.to_host(p.data).copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy arrays into the parameters, checking names and shapes; dtypes are converted. Lazy
        parameters are materialised with the loaded values."""
        params = dict(self.named_parameters())
        if strict:
            missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
            if missing or unexpected:
                raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, value in state.items():  # validate everything before changing anything
            if name in params and tuple(value.shape) != tuple(params[name].shape):
                raise ValueError(f"load_state_dict: {name} has shape {tuple(value.shape)}, "
                                 f"expected {params[name].shape}")
        for name, value in state.items():
            if name in params:
                p = params[name]
                if not p.materialized:  # a lazy parameter: loading gives it its value
                    p.data = B.xp.empty(p.shape, dtype=p.dtype)
                p.data[...] = B.asarray(value, dtype=p.dtype)

    def num_parameters(self) -> int:
        """Number of elements over all (global) parameters, tied ones counted once."""
        return sum(int(np.prod(p.global_shape)) for p in self.parameters())


class Linear(Module):
    """``y = x @ weight + bias`` with ``weight`` of shape (in_features, out_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02,
                 dtype="float32"):
        super().__init__()
        self.weight = Parameter((in_features, out_features), std=std, dtype=dtype)
        self.bias = Parameter((out_features,), init="zeros", dtype=dtype) if bias else None

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias)


class Embedding(Module):
    """Lookup table of shape (num_embeddings, dim)."""

    def __init__(self, num_embeddings: int, dim: int, std: float = 0.02, dtype="float32"):
        super().__init__()
        self.weight = Parameter((num_embeddings, dim), std=std, dtype=dtype)

    def forward(self, ids):
        return ops.embedding(ids, self.weight)


class LayerNorm(Module):
    """Layer normalisation over the last dimension, with weight and bias."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype="float32"):
        super().__init__()
        self.eps = eps
        self.weight = Parameter((dim,), init="ones", dtype=dtype)
        self.bias = Parameter((dim,), init="zeros", dtype=dtype)

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(Module):
    """RMS normalisation over the last dimension, with a weight (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype="float32"):
        super().__init__()
        self.eps = eps
        self.weight = Parameter((dim,), init="ones", dtype=dtype)

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class Dropout(Module):
    """Inverted dropout with masks that depend on where an element is, not on who holds it
    (:func:`mpirt.core.ops.dropout.dropout_mask`): the mask key is (``seed``, step) and the rows are
    placed in the global batch.

    ``seed``: set by the owner from the run seed and the module's name (the same on every rank).
    ``place``: ``(step, first global row)`` of the micro-batch about to run, set by the engine
    before each forward; without one (a model driven by hand) the call count stands in for the
    step, so each call draws a new mask. ``split``: ``(rank, size)`` when this module's input has
    dimension 1 split over tp (set by tensor parallelism). ``context``: the
    :class:`~mpirt.parallel.context.ContextShard` when dimension 1 holds a context-parallel
    rank's chunks of the sequence (set by context parallelism)."""

    context = None

    def __init__(self, p: float = 0.0, seed: int = 0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p, self.seed, self.calls = p, seed, 0
        self.place: tuple[int, int] | None = None
        self.split: tuple[int, int] | None = None

    def next_source(self) -> MaskSource:
        """The mask source of the next call (counted)."""
        self.calls += 1
        step, row0 = self.place if self.place is not None else (self.calls, 0)
        return MaskSource((self.seed, step), row0, self.split)

    def state(self) -> tuple:
        """What the next mask depends on: set it back with :meth:`set_state` to draw a call's
        mask again (recomputation)."""
        return self.calls, self.place

    def set_state(self, state: tuple) -> None:
        self.calls, self.place = state

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        source = self.next_source()
        if self.context is not None:  # the tokens held are runs of the whole sequence
            total, runs = self.context.runs(x.shape[1] * (self.split[1] if self.split else 1))
            source = dataclasses.replace(source, spans=((1, total, runs),))
        return ops.dropout(x, self.p, seed=source)


def dropout_modules(*roots) -> dict:
    """Every :class:`Dropout` under the ``roots`` (None skipped), by module name (a module under
    two roots once)."""
    return {name: m for root in roots if root is not None
            for name, m in root.named_modules() if isinstance(m, Dropout)}


def dropout_states(dropouts) -> list:
    """``[(module, state)]`` of ``dropouts``: set them back with :func:`restore_dropout_states` to
    draw the same masks again (recomputation)."""
    return [(m, m.state()) for m in dropouts]


def restore_dropout_states(saved: list) -> None:
    for m, state in saved:
        m.set_state(state)


def seed_losses(roots, seed: float) -> None:
    """Give every module under ``roots`` (None skipped) that adds a loss term of its own inside
    the model (a ``loss_seed`` attribute: a mixture of experts' load-balancing loss) the backward
    seed of the model's loss, the loss scale over the micro-batches, which its term's gradient
    follows."""
    for root in roots:
        for _, m in (root.named_modules() if root is not None else ()):
            if hasattr(m, "loss_seed"):
                m.loss_seed = seed


def place_dropouts(dropouts, step: int | None, row0: int = 0) -> None:
    """The next forward of ``dropouts`` runs step ``step``'s micro-batch whose first row is row
    ``row0`` of the global batch (see :class:`Dropout`); ``step=None``: no place (call counts)."""
    for m in dropouts:
        m.place = None if step is None else (step, row0)


class ModuleList(Module):
    """A list of modules registered as children ``0``, ``1``, ..."""

    def __init__(self, modules=()):
        super().__init__()
        self._items = []
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> None:
        self._modules[str(len(self._items))] = module
        self._items.append(module)

    def __getitem__(self, i):
        return self._items[i]

    def __len__(self):
        return len(self._items)

    def __iter__(self):
        return iter(self._items)


class Sequential(ModuleList):
    """Modules applied one after the other."""

    def __init__(self, *modules):
        super().__init__(modules)

    def forward(self, x):
        for m in self._items:
            x = m(x)
        return x
