"""Typed settings read from text, TOML or JSON: the one reader of a key's value and the error
that names the key. The training config (:mod:`mpirt.run.config`) and the model configs
(:mod:`mpirt.models.presets`, :mod:`mpirt.models.hf`) read their keys through it."""
from __future__ import annotations

import dataclasses
import difflib
import math
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
