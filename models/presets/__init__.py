"""Model presets and model-config loading.

A model is named by a preset (``models/presets/<name>.toml``), a path to a model TOML file (keys =
fields of the config class of its ``model_type``, default ``gpt2``), or a Hugging Face directory
holding ``config.json`` (of a model type that reads them: GPT-2). A preset name wins over a
same-named directory; write ``./gpt2`` to mean the directory.
"""
from __future__ import annotations

import json
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from mpirt.core import modeling
from mpirt.core.modeling import check_model_values
from mpirt.core.settings import ConfigError, convert_value, field_types, unknown_key_error
from mpirt.models.model_config import GPTConfig

PRESET_DIR = Path(__file__).parent
HF_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # the tanh-approximate GELU mpirt implements
# Hugging Face GPT-2 options that change the architecture, with the only value mpirt supports.
HF_FIXED = {"model_type": "gpt2", "tie_word_embeddings": True, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}
_FIELDS = field_types(GPTConfig)


def preset_names() -> list[str]:
    """Names of the bundled presets, sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _fields_of(model_type, where: str = "") -> dict:
    """Field name -> type of the config class of ``model_type`` (ConfigError for an unknown one)."""
    try:
        return field_types(modeling.config_class(model_type))
    except ValueError as err:
        raise ConfigError(f"{err}{where}") from None


def load_model_config(name_or_path: str, overrides: dict | None = None):
    """Resolve a preset name, model TOML file or HF directory to a checked model config (the
    config class of its ``model_type``).

    ``overrides`` (field -> value, e.g. TrainConfig.model_overrides) are applied last; a field the
    model type does not have is refused. Raises ConfigError naming the bad key (and the file it
    came from).
    """
    path = Path(name_or_path)
    if name_or_path in preset_names():
        values = _read_toml(PRESET_DIR / f"{name_or_path}.toml")
    elif (path / "config.json").is_file():
        try:
            values = modeling.hf_model_class(path).read_hf_config(path / "config.json")
        except ValueError as err:
            raise ConfigError(str(err)) from None
    elif path.is_file():
        values = _read_toml(path)
    else:
        raise ConfigError(f"model: {name_or_path!r} is not a preset ({', '.join(preset_names())}),"
                          " a model TOML file or a directory with a config.json")
    overrides = overrides or {}
    fields = _fields_of(overrides.get("model_type", values.get("model_type", "gpt2")), " (model.model_type)")
    for key, value in overrides.items():
        if key not in fields:
            raise unknown_key_error(f"model.{key}", [f"model.{k}" for k in fields],
                                    f" for model_type {values.get('model_type', 'gpt2')!r}")
        values[key] = convert_value(f"model.{key}", value, fields[key])
    check_model_values(overrides, prefix="model.")
    cfg = modeling.config_from_dict(values)
    try:
        modeling.check_config(cfg)
    except ValueError as err:
        raise ConfigError(f"{err} (model {name_or_path!r})") from None
    return cfg


def _read_toml(path: Path) -> dict:
    where = f" (in {path})"
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"model: cannot read {path}: {e}") from None
    fields = _fields_of(data.get("model_type", "gpt2"), where)
    values = {}
    for key, value in data.items():
        if key not in fields:
            raise unknown_key_error(key, fields, where)
        values[key] = convert_value(key, value, fields[key], where=where)
    check_model_values(values, where=where)
    return values


def _read_hf(path: Path) -> dict:
    """GPTConfig fields from a Hugging Face GPT-2 config.json; other HF keys are ignored, but
    keys that would change the architecture away from what mpirt implements are rejected."""
    where = f" (in {path})"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"model: cannot read {path}: {e}") from None
    act = data.get("activation_function", "gelu_new")
    if act not in HF_ACTIVATIONS:
        raise ConfigError(f"activation_function: must be one of {', '.join(HF_ACTIVATIONS)}, "
                          f"got {act!r}{where}")
    for key, want in HF_FIXED.items():
        if data.get(key, want) != want:
            raise ConfigError(f"{key}: mpirt supports only {want!r}, got {data[key]!r}{where}")
    if data.get("n_ctx", data.get("n_positions")) != data.get("n_positions"):
        raise ConfigError(f"n_ctx: must equal n_positions={data.get('n_positions')!r}, "
                          f"got {data['n_ctx']!r}{where}")
    values = {k: convert_value(k, v, _FIELDS[k], where=where)
              for k, v in data.items() if k in _FIELDS}
    check_model_values(values, where=where)
    return values


modeling.register_config_loader(load_model_config)
