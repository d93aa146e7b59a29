"""Views and joins: reshape, transpose, indexing, concat, split."""
from __future__ import annotations

import itertools

import mpirt.core.backend as B
from mpirt.core.precision import compute_dtype, upcast
from mpirt.core.tensor import Function


class Reshape(Function):
    def forward(self, a, shape):
        self.shape = a.shape
        return a.reshape(shape)

    def backward(self, g):
        return (g.reshape(self.shape),)


class Transpose(Function):
    def forward(self, a, axes=None):
        self.axes = tuple(range(a.ndim))[::-1] if axes is None else tuple(ax % a.ndim for ax in axes)
        return a.transpose(self.axes)

    def backward(self, g):
        inverse = [0] * len(self.axes)
        for i, ax in enumerate(self.axes):
            inverse[ax] = i
        return (g.transpose(inverse),)


def _is_advanced(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(hasattr(i, "shape") or isinstance(i, list) for i in items)


class GetItem(Function):
    def forward(self, a, index):
        self.shape, self.dtype, self.index = a.shape, a.dtype, index
        return a[index]

    def backward(self, g):
        grad = B.xp.zeros(self.shape, dtype=self.dtype)
        if _is_advanced(self.index):  # repeated indices must add up (half ones in float32)
            acc = compute_dtype(self.dtype)
            if acc == self.dtype:
                B.xp.add.at(grad, self.index, g)
            else:
                total = B.xp.zeros(self.shape, dtype=acc)
                B.xp.add.at(total, self.index, upcast(g))
                grad[...] = total
        else:
            grad[self.index] = g
        return (grad,)


class Concat(Function):
    def forward(self, *arrays, axis=0):
        self.axis = axis
        self.bounds = list(itertools.accumulate(a.shape[axis] for a in arrays))[:-1]  # host ints (CuPy-safe)
        return B.xp.concatenate(arrays, axis=axis)

    def backward(self, g):
        return tuple(B.xp.split(g, self.bounds, axis=self.axis))


def reshape(a, shape):
    """``a`` viewed with a new shape (one dimension may be -1)."""
    return Reshape.apply(a, shape=tuple(shape) if not isinstance(shape, int) else (shape,))


def transpose(a, axes=None):
    """Permute dimensions (reverse them when ``axes`` is None)."""
    return Transpose.apply(a, axes=axes)


def getitem(a, index):
    """``a[index]`` for basic slicing and integer-array indexing."""
    if hasattr(index, "data") and hasattr(index, "requires_grad"):  # a Tensor of indices
        index = index.data
    return GetItem.apply(a, index=index)


def concat(tensors, axis=0):
    """Join tensors along ``axis``."""
    return Concat.apply(*tensors, axis=axis)


def split(a, sections, axis=-1):
    """Split along ``axis``: an int gives that many equal parts, a sequence gives part sizes."""
    n = a.shape[axis]
    if isinstance(sections, int):
        if n % sections:
            raise ValueError(f"split: size {n} of axis {axis} does not divide into {sections} equal parts")
        sizes = [n // sections] * sections
    else:
        sizes = list(sections)
        if sum(sizes) != n:
            raise ValueError(f"split: sizes {sizes} do not add up to {n} along axis {axis}")
    parts, start = [], 0
    prefix = (slice(None),) * (axis % a.ndim)
    for size in sizes:
        parts.append(getitem(a, prefix + (slice(start, start + size),)))
        start += size
    return parts
