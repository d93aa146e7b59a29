"""Typed settings read from text, TOML or JSON: the one reader of a key's value and the error
that names the key. The training config (:mod:`mpirt.run.config`) and the model configs
(:mod:`mpirt.models.presets`, :mod:`mpirt.models.hf`) read their keys through it. Byte sizes
(``--memory-budget 1.5GiB``) are read and printed here too (:func:`parse_size`,
:func:`format_size`), below the predictor and the config that both use them."""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing

# the words a boolean setting may be written as (any case)
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class ConfigError(ValueError):
    """A bad configuration value or key; the message starts with the offending key."""


def field_types(cls) -> dict[str, object]:
    """Map each field of dataclass ``cls`` to its resolved type annotation."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def convert_value(key: str, value, typ, *, text: bool = False, where: str = ""):
    """Return ``value`` as type ``typ`` (int, float, str, bool, or ``X | None``).

    ``text=True`` parses a command-line string; otherwise ``value`` must already have the type
    (TOML/JSON values; an int is accepted for a float). Raises ConfigError naming ``key``.
    """
    options = typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)
    if type(None) in options and (value is None or text and value.lower() in ("none", "null")):
        return None
    base = next(t for t in options if t is not type(None))
    try:
        if text and base is bool:
            if value.lower() in TRUE_WORDS + FALSE_WORDS:
                return value.lower() in TRUE_WORDS
        elif text:
            out = base(value)
            if base is not float or math.isfinite(out):
                return out
        elif base is float and type(value) in (int, float) and math.isfinite(value):
            return float(value)
        elif type(value) is base:
            return value
    except ValueError:
        pass
    raise ConfigError(f"{key}: expected {base.__name__}, got {value!r}{where}")


def unknown_key_error(key: str, known, where: str = "") -> ConfigError:
    """A ConfigError for an unknown ``key``, suggesting the closest of ``known``."""
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{key}: unknown key{where}{hint} (see --help)")


# --- byte sizes ----------------------------------------------------------------------------------
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


AUTO_BUDGET = "auto"
NO_BUDGET = ("none", "0", "")  # "": what configs written before the default was auto say for none


def explicit_budget(text: str) -> int | None:
    """The bytes of an explicit ``--memory-budget`` size; None for ``auto`` (what the rank can
    have: :mod:`mpirt.plan.budget`), ``none`` or ``0``. ValueError names text that is none of these."""
    t = text.strip().lower()
    if t == AUTO_BUDGET or t in NO_BUDGET:
        return None
    try:
        return parse_size(text)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 1.5GiB, 800MB), auto or none") from None


def format_size(n: float) -> str:
    """``1610612736`` -> ``1.50 GiB``; ``3e6`` -> ``2.9 MiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} GiB" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
