"""Modules and parameters.

Every :class:`Parameter` knows its dotted name, its global shape and how it is split over the
process grid (:class:`ShardSpec`). Initialisation builds the full tensor from a seed derived from
the name and keeps this rank's slice, so every parallel layout starts from identical weights.
Checkpointing, clipping and ZeRO are written against this metadata, not per layer.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

import mpirt.backend as B
from mpirt import ops
from mpirt.tensor import Tensor
from mpirt.threads import fill_zero


@dataclass(frozen=True)
class ShardSpec:
    """For each dimension of a parameter, the grid axis it is split over (``"tp"``, ...) or None.

    ``blocks`` (optional, one int per dimension, default all 1) describes fused parameters: a
    dimension with ``blocks[d] = k`` is ``k`` equal contiguous blocks, *each* split over
    ``dims[d]``, and a rank's shard is the concatenation of its piece of every block. GPT-2's fused
    ``c_attn`` weight (C, 3C) is ``ShardSpec((None, "tp"), blocks=(1, 3))``: q, k and v are each
    split by heads, so at tp=2 rank 0 holds ``[q0 | k0 | v0]`` (columns ``0:C/2``, ``C:3C/2`` and
    ``2C:5C/2``), never the contiguous first half of 3C. Such a shard is not a box of the full tensor:
    use :meth:`local_index` / :meth:`shard` / :meth:`place` (``local_slices`` refuses it).
    """

    dims: tuple
    blocks: tuple = ()

    def __post_init__(self):
        if self.blocks:
            if len(self.blocks) != len(self.dims):
                raise ValueError(f"ShardSpec: blocks {self.blocks} must give one entry per dimension of {self.dims}")
            for d, (k, axis) in enumerate(zip(self.blocks, self.dims)):
                if not isinstance(k, int) or k < 1:
                    raise ValueError(f"ShardSpec: blocks[{d}] must be a positive integer, got {k!r}")
                if k > 1 and axis is None:
                    raise ValueError(f"ShardSpec: dimension {d} has {k} blocks but is not split over any axis")

    @classmethod
    def replicated(cls, ndim: int) -> "ShardSpec":
        return cls((None,) * ndim)

    def _blocks(self) -> tuple:
        return self.blocks or (1,) * len(self.dims)

    @property
    def is_blocked(self) -> bool:
        """True when some dimension is split block-wise (its shard is not one contiguous range)."""
        return any(k > 1 for k in self._blocks())

    def local_shape(self, global_shape, axis_sizes: dict) -> tuple:
        """Shape of one rank's shard given the size of each grid axis."""
        if len(self.dims) != len(global_shape):
            raise ValueError(f"ShardSpec {self.dims} has {len(self.dims)} dims for shape {tuple(global_shape)}")
        shape = []
        for dim, (n, axis, k) in enumerate(zip(global_shape, self.dims, self._blocks())):
            parts = axis_sizes.get(axis, 1) if axis else 1
            if n % (parts * k):
                what = f"{k} blocks each split over {axis}={parts}" if k > 1 else f"{axis}={parts}"
                raise ValueError(f"dimension {dim} of size {n} does not split evenly into {what}")
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
        axis, k = self.dims[d], self._blocks()[d]
        if not axis:
            return slice(None)
        parts, r = axis_sizes.get(axis, 1), axis_ranks.get(axis, 0)
        if n % (parts * k):
            raise ValueError(f"dimension {d} of size {n} does not split evenly into {k} block(s) over {axis}={parts}")
        piece = n // (parts * k)
        if k == 1:
            return slice(r * piece, (r + 1) * piece)
        block = n // k
        return (np.arange(k)[:, None] * block + r * piece + np.arange(piece)).reshape(-1)

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


class Parameter(Tensor):
    """A trainable leaf Tensor with a name, a global shape, a ShardSpec and an init rule.

    ``init`` is ``"normal"`` (mean 0, standard deviation ``std``), ``"zeros"`` or ``"ones"``.
    The name is assigned by the owning module tree (``Module.named_parameters``).
    """

    def __init__(self, shape, init: str = "normal", std: float = 0.02, spec: ShardSpec | None = None,
                 dtype="float32"):
        shape = tuple(shape)
        super().__init__(B.xp.zeros(shape, dtype=dtype), requires_grad=True)
        if init not in ("normal", "zeros", "ones"):
            raise ValueError(f"Parameter init: expected normal, zeros or ones, got {init!r}")
        self.name = ""
        self.global_shape = shape
        self.spec = spec or ShardSpec.replicated(len(shape))
        self.init, self.std = init, std

    def full_init(self, seed: int) -> np.ndarray:
        """The full (unsharded) initial value, a pure function of ``seed`` and the name, float64."""
        if self.init == "zeros":
            return np.zeros(self.global_shape)
        if self.init == "ones":
            return np.ones(self.global_shape)
        rng = np.random.default_rng([seed, zlib.crc32(self.name.encode())])
        return rng.standard_normal(self.global_shape) * self.std

    def __repr__(self):
        return f"Parameter({self.name!r}, shape={self.shape}, global_shape={self.global_shape}, dtype={self.dtype})"


def graph_parameters(root: Tensor) -> list:
    """The Parameters that ``root`` was computed from (the Parameter leaves of its autograd graph),
    each once, in the order a depth-first walk from ``root`` first meets them. Linear in the size
    of the graph. Empty for a leaf or for a Tensor computed without a graph (``no_grad``)."""
    found: dict[int, Parameter] = {}
    seen: set[int] = set()
    stack = [root._ctx] if root._ctx is not None else []
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for x in getattr(fn, "inputs", ()):
            if isinstance(x, Parameter):
                found.setdefault(id(x), x)
            elif isinstance(x, Tensor) and x._ctx is not None:
                stack.append(x._ctx)
    return list(found.values())


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
        """
        axis_sizes, axis_ranks = axis_sizes or {}, axis_ranks or {}
        for name, p in self.named_parameters():
            p.name = name
            full = p.spec.shard(p.full_init(seed), axis_sizes, axis_ranks)
            p.data = B.asarray(full, dtype=p.dtype)
            p.grad = None
        return self

    def zero_grad(self) -> None:
        """Zero every gradient buffer in place (allocating it on first use)."""
        for p in self.parameters():
            if p.grad is None:
                p.grad = B.xp.zeros_like(p.data)
            else:
                fill_zero(p.grad)

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
        """Copy arrays into the parameters, checking names and shapes; dtypes are converted."""
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
                params[name].data[...] = B.asarray(value, dtype=params[name].dtype)

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
    """Inverted dropout whose masks are reproducible: call ``n`` of a run uses seed (seed, n).

    ``seed`` is set by the owner (the training script derives it from the run seed and rank).
    """

    def __init__(self, p: float = 0.0, seed: int = 0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p, self.seed, self.calls = p, seed, 0

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        self.calls += 1
        return ops.dropout(x, self.p, seed=(self.seed, self.calls))


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
