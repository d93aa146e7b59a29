"""Mixed precision: the compute dtypes, float32 compute inside fused ops, dynamic loss scaling and
the bytes a parameter costs.

``--dtype float32|bfloat16|float16|float64`` is the dtype of the parameters, their gradients and
the activations. With a 2-byte dtype ("half" below) the optimizer keeps a float32 master copy of
every parameter and float32 moments (:mod:`mpirt.core.optim`, :mod:`mpirt.parallel.zero`), and every
reduction accumulates in float32: matrix products (:func:`mpirt.cpu.threads.matmul` upcasts on NumPy,
which has no half GEMM), the fused ops marked :func:`float32_compute` (layer/RMS norm statistics,
softmax, cross-entropy, attention, GELU), the gradient collectives (:mod:`mpirt.comm` reduces
2-byte floats in float32) and the global gradient norm. The rounding points are those of a GPU
kernel: half operands in, float32 arithmetic, one rounding of each result to half.

bfloat16 on NumPy is ``ml_dtypes.bfloat16`` (importing this module registers the name, so
``np.dtype("bfloat16")`` works). float16 needs loss scaling (:class:`LossScaler`): its smallest
normal number is 6e-5, and small gradients would flush to zero without it.
"""
from __future__ import annotations

import ml_dtypes  # noqa: F401  (registers np.dtype("bfloat16"))
import numpy as np

DTYPES = ("float32", "bfloat16", "float16", "float64")
FLOAT32 = np.dtype(np.float32)


def is_half(dtype) -> bool:
    """True for the 2-byte float dtypes (float16, bfloat16; ml_dtypes' bfloat16 is of kind 'V')."""
    if dtype is None:
        return False
    dtype = np.dtype(dtype)
    return dtype.itemsize == 2 and (dtype.kind == "f" or dtype.name == "bfloat16")


def compute_dtype(dtype) -> np.dtype:
    """The dtype arithmetic and reductions run in: float32 for half dtypes, else ``dtype`` itself."""
    return FLOAT32 if is_half(dtype) else np.dtype(dtype)


def upcast(a):
    """``a`` as float32 when it is a half array (a copy), else ``a`` itself (anything else passes)."""
    return a.astype(FLOAT32) if is_half(getattr(a, "dtype", None)) else a


def float32_compute(cls=None, *, keep_output: bool = False):
    """Class decorator for a fused :class:`~mpirt.core.tensor.Function`: with half inputs, ``forward``
    and the backward passes run on float32 copies of the array arguments and their results are
    rounded once to the half dtype (``keep_output=True`` leaves the forward's result in float32:
    a loss). With no half input the op runs unchanged, so float32/float64 numbers are untouched.

    What the forward saves for backward stays half, as a half-storing GPU kernel keeps it
    (:func:`_keep_half`): a saved float32 copy of a half argument is the argument itself, the
    saved output is the rounded output, and any other saved float32 array the size of an argument
    or of the output (a derivative, a normalised input) is rounded to the half dtype; smaller
    ones (per-row statistics) stay float32, and so does what a loss saves (``keep_output``:
    probabilities near 1 would round to 1). The backward passes see them in float32 again.

    A class whose fused kernel takes half arrays itself (the CUDA kernels, :mod:`mpirt.gpu.cuda`)
    defines ``runs_half(self, *args, **kwargs) -> bool``: where it says True, forward and backward
    get the half arrays untouched and keep half activations."""
    def wrap(cls):
        forward = cls.forward
        runs_half = getattr(cls, "runs_half", None)

        def fwd(self, *args, **kwargs):
            self._half = next((a.dtype for a in args if is_half(getattr(a, "dtype", None))), None)
            if self._half is not None and runs_half is not None and runs_half(self, *args, **kwargs):
                self._half = None                       # the kernel's own half path, both passes
            if self._half is None:
                return forward(self, *args, **kwargs)
            self._in_dtypes = [getattr(a, "dtype", None) for a in args]
            wide = [upcast(a) for a in args]
            out = forward(self, *wide, **kwargs)
            self._kept_half = []
            if keep_output:  # a loss: its saved probabilities stay float32 (p near 1 rounds to 1 in half)
                return out
            result = out.astype(self._half)
            from mpirt.core.tensor import is_grad_enabled  # (mpirt.core.tensor imports this module)
            if is_grad_enabled():  # no backward follows a forward without a graph
                _keep_half(self, args, wide, out, result)
            return result
        cls.forward = fwd
        for name in ("backward", "backward_input", "backward_weight"):
            if name in cls.__dict__:
                setattr(cls, name, _wrap_backward(cls.__dict__[name]))
        return cls
    return wrap if cls is None else wrap(cls)


def _keep_half(fn, args, wide, out, result) -> None:
    """Store ``fn``'s saved float32 activations in the half dtype (see :func:`float32_compute`);
    ``fn._kept_half`` names them, for the backward passes to widen."""
    argument_of = {id(w): a for a, w in zip(args, wide) if w is not a}
    # activation-sized: as many elements as an argument or the output, and its rows as wide (a
    # (rows, 1) statistic never passes, whatever the rows: a norm's weight has C elements)
    shapes = {(a.size, a.shape[-1]) for a in (*args, out) if getattr(a, "ndim", 0) >= 1}
    kept = []
    for name, value in list(vars(fn).items()):
        if getattr(value, "dtype", None) != "float32" or name.startswith("_"):
            continue
        if id(value) in argument_of:
            setattr(fn, name, argument_of[id(value)])
        elif value is out:
            setattr(fn, name, result)
        elif value.ndim >= 1 and (value.size, value.shape[-1]) in shapes:
            setattr(fn, name, value.astype(fn._half))
        else:
            continue
        kept.append(name)
    fn._kept_half = kept


def _wrap_backward(method):
    def bwd(self, g):
        if getattr(self, "_half", None) is None:
            return method(self, g)
        half = {name: getattr(self, name) for name in self._kept_half}
        for name, value in half.items():  # widened for this pass only: between passes they stay half
            setattr(self, name, upcast(value))
        try:
            grads = method(self, upcast(g))
        finally:
            for name, value in half.items():
                setattr(self, name, value)
        return tuple(gx.astype(dt) if gx is not None and is_half(dt) else gx
                     for gx, dt in zip(grads, self._in_dtypes))
    bwd.__name__, bwd.__doc__ = method.__name__, method.__doc__
    return bwd


class LossScaler:
    """Dynamic loss scaling for float16: the loss seed is multiplied by ``scale``, the optimizer
    divides it out of the gradients as it converts them to float32. A step whose gradient norm is
    not finite (an overflow) is skipped and the scale multiplied by ``backoff`` (not below
    ``min_scale``); after ``window`` clean steps in a row it is multiplied by ``growth``. The
    verdict comes from the global gradient norm, reduced over every rank, so all ranks skip alike.
    """

    def __init__(self, scale: float = 2.0 ** 16, window: int = 2000, growth: float = 2.0, backoff: float = 0.5,
                 min_scale: float = 1.0):
        if scale <= 0 or window < 1 or growth <= 1 or not 0 < backoff < 1 or min_scale <= 0:
            raise ValueError(f"LossScaler: need scale > 0, window >= 1, growth > 1, 0 < backoff < 1, "
                             f"min_scale > 0; got {scale}, {window}, {growth}, {backoff}, {min_scale}")
        self.scale, self.window, self.growth, self.backoff = float(scale), int(window), float(growth), float(backoff)
        self.min_scale = float(min_scale)
        self.good_steps = 0   # clean steps since the last change of scale
        self.overflows = 0    # steps skipped for overflow, in all

    def update(self, overflow: bool) -> None:
        """Record one step: back off on an overflow, grow after ``window`` clean steps."""
        if overflow:
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.good_steps = 0
            self.overflows += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict:
        """Scalars for a checkpoint (kept beside the optimizer state)."""
        return {"loss_scale": self.scale, "loss_scale_good_steps": self.good_steps,
                "loss_scale_overflows": self.overflows}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict`'s scalars; a checkpoint without them keeps the current state."""
        if "loss_scale" in d:
            self.scale = float(d["loss_scale"])
            self.good_steps = int(d.get("loss_scale_good_steps", 0))
            self.overflows = int(d.get("loss_scale_overflows", 0))


def bytes_per_parameter(dtype, dp: int = 1, zero: int = 0) -> dict:
    """Persistent bytes per parameter of AdamW training on one rank: ``{"params", "grads", "optimizer"}``.

    Weights and gradients take the dtype's size; AdamW keeps two moments in the compute dtype and,
    for a half dtype, a float32 master copy: bf16 AdamW is 2 + 2 + 12. ZeRO shards the optimizer
    state over dp (stage 1), the gradients too (stage 2) and the weights too (stage 3)."""
    size = np.dtype(dtype).itemsize
    state = 2 * compute_dtype(dtype).itemsize + (4 if is_half(dtype) else 0)
    return {"params": size / (dp if zero >= 3 else 1), "grads": size / (dp if zero >= 2 else 1),
            "optimizer": state / (dp if zero >= 1 else 1)}
