"""Per-rank memory: sizes, what a graph keeps alive, and the peak predicted from the config."""
from __future__ import annotations

import re

import numpy as np

import mpirt.backend as B

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int | None:
    """Bytes in ``'1.5GiB'``, ``'800MB'``, ``'512 MiB'``, ``'2e9'`` (KB/MB/GB decimal, KiB/MiB/GiB
    binary, case-insensitive); ``''`` -> None (no budget). ValueError names the text."""
    t = text.strip()
    if not t:
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", t.lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 1.5GiB, 800MB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def format_size(n: float) -> str:
    """``1610612736`` -> ``1.50 GiB``; ``3e6`` -> ``2.9 MiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} GiB" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _base(a):
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def _arrays(value):
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _arrays(v)
    elif isinstance(value, np.ndarray) or B.is_device_array(value):
        yield value


def kept_bytes(root) -> int:
    """Bytes of the activations the graph behind the Tensor ``root`` keeps alive until backward:
    arrays its Functions saved, the data of every Tensor that is an input of one of them (the
    autograd holds its inputs) and ``root``'s own, each buffer once; parameters are left out.
    Call before backward: this is what a pipeline stash or a step's forward holds per micro-batch."""
    from mpirt.nn import Parameter
    from mpirt.tensor import Tensor

    found: dict[int, int] = {}
    params: set[int] = set()
    seen, stack = set(), [root._ctx] if root._ctx is not None else []

    def add(a):
        base = _base(a)
        found[id(base)] = int(base.nbytes)

    add(root.data)
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for key, value in vars(fn).items():
            if key not in ("inputs", "needs_input_grad"):
                for a in _arrays(value):
                    add(a)
        for x in fn.inputs:
            if isinstance(x, Parameter):
                params.add(id(_base(x.data)))
            elif isinstance(x, Tensor):
                add(x.data)
                if x._ctx is not None:
                    stack.append(x._ctx)
    return sum(n for k, n in found.items() if k not in params)
