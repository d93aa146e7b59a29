"""Hugging Face Llama and Mixtral directories read into mpirt's Llama-style models (tied head).

Everything is checked when the directory is opened, before any training starts, and a problem
is one line naming the file and the key:

- ``config.json``: every field mpirt maps (:data:`FIELDS`, :data:`MOE_FIELDS`) present where
  required, of its type (a string ``vocab_size`` or a text ``rope_theta`` is refused, never
  coerced), in its range (``rms_norm_eps > 0``, ...), and the architecture's own rules
  (``num_key_value_heads`` divides ``num_attention_heads``, ``num_experts_per_tok`` at most
  ``num_local_experts``); options mpirt does not implement (an untied head, biases, rope
  scaling, sliding windows) are refused.
- the tensors: exactly the names the config implies (an older export's rotary ``inv_freq``
  buffers are accepted and ignored: mpirt computes them from ``rope_theta``), each of the shape
  the config gives in Hugging Face's ``(out, in)`` layout (a transposed ``gate_proj`` is refused
  even where it would fit transposed back), a floating-point dtype, and finite values in the
  model's dtype.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from mpirt.checkpoint.store import CheckpointError
from mpirt.core import modeling
from mpirt.core.settings import ConfigError, convert_value, field_types
from mpirt.models.hf import HF_FAMILIES, _open, _safetensors_files, _same, check_finite, check_stored

# Hugging Face config.json key -> mpirt config field
FIELDS = {"vocab_size": "vocab_size", "hidden_size": "n_embd", "intermediate_size": "n_inner",
          "num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head",
          "max_position_embeddings": "n_positions", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
          "attention_dropout": "attn_pdrop", "initializer_range": "initializer_range"}
MOE_FIELDS = {"num_local_experts": "n_expert", "num_experts_per_tok": "top_k", "router_aux_loss_coef": "aux_loss_coef"}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "num_local_experts", "num_experts_per_tok")
# Hugging Face's defaults of the optional keys (num_key_value_heads: one per query head)
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_dropout": 0.0, "initializer_range": 0.02,
            "router_aux_loss_coef": 0.001}
# options that change the architecture, with the only value mpirt implements
FIXED = {"tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
         "rope_scaling": None, "sliding_window": None}
INV_FREQ = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # an older export's buffers
HEAD = "lm_head.weight"


def read_decoder_config(path: Path) -> dict:
    """Config field values (:class:`~mpirt.models.llama.LlamaConfig` or
    :class:`~mpirt.models.moe.MoEConfig`) from a Hugging Face Llama or Mixtral ``config.json``,
    every mapped field checked (ConfigError naming the Hugging Face key and the file)."""
    where = f" (in {path})"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"model: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model: {path} does not hold a JSON object")
    for key, want in FIXED.items():
        if data.get(key, want) != want:
            raise ConfigError(f"{key}: mpirt supports only {want!r}, got {data[key]!r}{where}")
    model_type = data.get("model_type", "llama")
    fields = {**FIELDS, **(MOE_FIELDS if model_type == "mixtral" else {})}
    types = field_types(modeling.config_class(model_type))
    rope = data.get("rope_parameters")
    if "rope_theta" not in data and isinstance(rope, dict) and "rope_theta" in rope:
        data = {**data, "rope_theta": rope["rope_theta"]}  # newer transformers keep it there
    values = {"model_type": model_type}
    for key, field in fields.items():
        if data.get(key) is None and key in REQUIRED:
            raise ConfigError(f"{key}: missing, a {model_type} config.json needs it{where}")
        value = convert_value(key, data.get(key, DEFAULTS.get(key)), types[field], where=where)
        rule = modeling.model_value_rule(field, value)
        if rule is not None:
            raise ConfigError(f"{key}: must be {rule}, got {value!r}{where}")
        values[field] = value
    heads, width = values["n_head"], values["n_embd"]
    if values["n_kv_head"] is None:
        values["n_kv_head"] = heads
    head_dim = data.get("head_dim")
    if head_dim is not None and (type(head_dim) is not int or head_dim * heads != width):
        raise ConfigError(f"head_dim: must be hidden_size / num_attention_heads = {width / heads:g}, "
                          f"got {head_dim!r}{where}")
    try:
        modeling.check_config(modeling.config_from_dict(values))
    except ValueError as err:                 # the architecture's rule, named by the file's key
        field, _, rule = str(err).partition(": ")
        key = next((k for k, f in fields.items() if f == field), field)
        raise ConfigError(f"{key}: {rule}{where}") from None
    return values


def _stored_tensors(directory: Path) -> dict:
    """Hugging Face name -> ``(file, key)`` of every tensor the directory's files hold, the rotary
    ``inv_freq`` buffers left out."""
    where: dict = {}
    for path in _safetensors_files(directory):
        f = _open(path)
        for key in f.keys():
            if INV_FREQ.fullmatch(key):
                continue
            if key in where:
                raise ValueError(f"{path}: tensor {key!r} is also in {where[key][0].path}")
            where[key] = (f, key)
    return where


def load_hf_decoder(directory, dtype="float32") -> tuple:
    """``(config, full weights by mpirt name)`` of a Hugging Face Llama or Mixtral directory (tied
    head), the inverse of :func:`~mpirt.models.hf.llama_hf_tensors` /
    :func:`~mpirt.models.hf.mixtral_hf_tensors`: q, k and v fused into ``c_attn``, matrices back
    to (in, out), the experts' ``w1``, ``w3``, ``w2`` stacked into ``w_gate``, ``w_up``,
    ``w_down``. Every tensor is checked first (see the module's docstring); a stored
    ``lm_head.weight`` must equal the embedding."""
    directory = Path(directory)
    cfg = modeling.config_from_dict(read_decoder_config(directory / "config.json"))
    stored = _stored_tensors(directory)
    expected = {name: shape for name, shape, _ in HF_FAMILIES[cfg.model_type][2](cfg, None)}
    head = stored.pop(HEAD, None)
    implied = f"config.json's {cfg.model_type} with n_layer={cfg.n_layer}" + (
        f", n_expert={cfg.n_expert}" if cfg.model_type == "mixtral" else "")
    unexpected = sorted(set(stored) - set(expected))
    if unexpected:
        f, key = stored[unexpected[0]]
        raise CheckpointError(f"{f.path}: tensor {key!r} is not part of {implied} "
                              f"({len(unexpected)} such tensor(s))")
    missing = [name for name in expected if name not in stored]
    if missing:
        raise CheckpointError(f"{directory}: tensor {missing[0]!r} missing for {implied} "
                              f"({len(missing)} missing)")
    hf = {}
    for name, shape in expected.items():
        f, key = stored[name]
        check_stored(f, key, shape)
        check_finite(f, key, dtype)
        hf[name] = f.read(key, np.empty(shape, dtype=dtype))
    if head is not None:
        check_stored(*head, expected["model.embed_tokens.weight"])
        if not _same(head, stored["model.embed_tokens.weight"]):
            raise ValueError(f"{head[0].path}: {HEAD} differs from the embedding: untied lm_head not supported")
    return cfg, _to_mpirt(cfg, hf)


def _to_mpirt(cfg, hf: dict) -> dict:
    """mpirt's weights (by name) from the checked Hugging Face tensors ``hf`` (emptied)."""
    take = hf.pop
    out = {"wte.weight": take("model.embed_tokens.weight"), "ln_f.weight": take("model.norm.weight")}
    for i in range(cfg.n_layer):
        theirs, mine = f"model.layers.{i}.", f"h.{i}."
        attn = theirs + "self_attn."
        out[mine + "ln_1.weight"] = take(theirs + "input_layernorm.weight")
        out[mine + "ln_2.weight"] = take(theirs + "post_attention_layernorm.weight")
        out[mine + "attn.c_attn.weight"] = np.concatenate([take(attn + f"{x}_proj.weight").T for x in "qkv"], axis=1)
        out[mine + "attn.c_proj.weight"] = np.ascontiguousarray(take(attn + "o_proj.weight").T)
        if cfg.model_type == "mixtral":                                     # the Hub's per-expert w1, w3, w2
            moe = theirs + "block_sparse_moe."
            out[mine + "mlp.gate.weight"] = np.ascontiguousarray(take(moe + "gate.weight").T)
            for ours, w in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
                out[mine + f"mlp.{ours}"] = np.stack([take(moe + f"experts.{j}.{w}.weight").T
                                                      for j in range(cfg.n_expert)])
        else:
            for x in ("gate_proj", "up_proj", "down_proj"):
                out[mine + f"mlp.{x}.weight"] = np.ascontiguousarray(take(theirs + f"mlp.{x}.weight").T)
    return out
