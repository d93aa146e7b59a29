"""Hugging Face Llama, Mixtral and GPT-2 directories are checked when opened: every config.json
field and every tensor (name, shape, dtype, finite values), one line naming the file and the key,
before anything is built; and ``--model.*`` overrides that would change the loaded shapes are
refused with ``--init-from``. Directories are written tiny, straight as safetensors, through
mpirt's own export mapping (the Hub's names and layout, which the transformers tests check)."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mpirt.core.modeling import build_model, load_hf
from mpirt.core.settings import ConfigError
from mpirt.models.hf import HF_FAMILIES, load_hf_gpt2, save_hf_gpt2
from mpirt.models.llama import LlamaConfig
from mpirt.models.model_config import GPTConfig
from mpirt.models.moe import MoEConfig
from mpirt.run.config import parse_args
from mpirt.run.train import resolve_model

SHAPE = dict(n_layer=1, n_head=4, n_kv_head=2, n_embd=32, n_inner=48, n_positions=16, vocab_size=64)
CONFIGS = {"llama": LlamaConfig(**SHAPE), "mixtral": MoEConfig(**SHAPE, n_expert=4, top_k=2)}
L0 = "model.layers.0."


def write_hf(directory, family, config=None, tensors=None):
    """A Hugging Face ``family`` directory of the tiny model, ``config`` (key -> value, ``...``:
    drop the key) merged into its config.json, ``tensors`` (dict -> dict) applied to its weights."""
    cfg = CONFIGS[family]
    config_dict, _, hf_tensors = HF_FAMILIES[family]
    weights = {n: p.data for n, p in build_model(cfg, seed=0).named_parameters()}
    stored = {name: read() for name, _, read in hf_tensors(cfg, weights.__getitem__)}
    save_file(tensors(stored) if tensors else stored, str(directory / "model.safetensors"))
    data = config_dict(cfg)
    for key, value in (config or {}).items():
        data.pop(key) if value is ... else data.__setitem__(key, value)
    (directory / "config.json").write_text(json.dumps(data))
    return directory


def edit(name, change):
    """A change of the tensor ``name``."""
    return lambda t: {**t, name: change(t[name])}


def with_nan(a):
    a = a.copy()
    a.flat[5] = np.nan
    return a


@pytest.mark.parametrize("family, config, tensors, match", [
    ("llama", None, edit(L0 + "mlp.gate_proj.weight", lambda a: np.ascontiguousarray(a.T)),
     r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape \(32, 48\), expected \(48, 32\)"),
    ("mixtral", None, edit(L0 + "block_sparse_moe.experts.0.w1.weight", lambda a: np.ascontiguousarray(a.T)),
     r"model.safetensors: tensor '.*experts.0.w1.weight' has shape \(32, 48\), expected \(48, 32\)"),
    ("llama", None, edit(L0 + "self_attn.k_proj.weight", lambda a: np.concatenate([a, a])),
     r"model.safetensors: tensor '.*k_proj.weight' has shape \(32, 32\), expected \(16, 32\)"),
    ("llama", None, edit("model.embed_tokens.weight", lambda a: np.concatenate([a, a])),
     r"model.safetensors: tensor 'model.embed_tokens.weight' has shape \(128, 32\)"),
    ("llama", None, edit(L0 + "mlp.up_proj.weight", with_nan),
     r"model.safetensors: tensor '.*up_proj.weight' holds 1 NaN or infinite value"),
    ("llama", None, lambda t: {k: (v * 100).astype(np.int32) for k, v in t.items()},
     r"model.safetensors: tensor '.*' is stored as I32; weights must be floating point"),
    ("mixtral", None, lambda t: {**t, L0 + "block_sparse_moe.experts.4.w1.weight": np.ones((48, 32), np.float32)},
     r"model.safetensors: tensor '.*experts.4.w1.weight' is not part of config.json's mixtral with n_layer=1, "
     r"n_expert=4"),
    ("llama", None, lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"},
     r"tensor 'model.norm.weight' missing for config.json's llama"),
    ("llama", {"num_attention_heads": ...}, None, r"num_attention_heads: missing, a llama config.json needs it \(in .*config.json\)"),
    ("llama", {"vocab_size": ...}, None, r"vocab_size: missing.*config.json"),
    ("mixtral", {"num_local_experts": ...}, None, r"num_local_experts: missing, a mixtral config.json needs it"),
    ("llama", {"vocab_size": "64"}, None, r"vocab_size: expected int, got '64' \(in .*config.json\)"),
    ("llama", {"num_key_value_heads": 3}, None, r"num_key_value_heads: must divide n_head=4 .* got 3 \(in .*config.json\)"),
    ("mixtral", {"num_experts_per_tok": 5}, None, r"num_experts_per_tok: must be in 1..n_expert=4, got 5 \(in "),
    ("llama", {"rope_theta": "10000"}, None, r"rope_theta: expected float, got '10000' \(in .*config.json\)"),
    ("llama", {"rms_norm_eps": -1}, None, r"rms_norm_eps: must be > 0, got -1.0 \(in .*config.json\)"),
    ("llama", {"head_dim": 16}, None, r"head_dim: must be hidden_size / num_attention_heads = 8, got 16"),
])
def test_a_bad_llama_or_mixtral_directory_is_one_line_naming_file_and_key(tmp_path, family, config, tensors, match):
    directory = write_hf(tmp_path, family, config, tensors)
    with pytest.raises(ValueError, match=match) as err:          # ConfigError and CheckpointError are ValueErrors
        resolve_model(parse_args([f"--init-from={directory}"]))
    assert "\n" not in str(err.value)


def test_a_sound_directory_loads_and_inv_freq_buffers_are_ignored(tmp_path):
    plain = write_hf(tmp_path, "llama")
    (tmp_path / "old").mkdir()
    old = write_hf(tmp_path / "old", "llama", tensors=lambda t: {**t, L0 + "self_attn.rotary_emb.inv_freq":
                                                                 np.ones(4, np.float32)})
    (_, want), (cfg, got) = load_hf(plain), load_hf(old)
    assert (cfg.n_kv_head, cfg.hidden) == (2, 48) and sorted(got) == sorted(want)
    assert all(np.array_equal(got[n], want[n]) for n in want)


def test_float16_range_is_checked_in_the_model_dtype(tmp_path):
    big = write_hf(tmp_path, "llama", tensors=edit("model.norm.weight", lambda a: a * 1e5))
    assert load_hf(big)[1]["ln_f.weight"].max() == 1e5        # float32 holds it
    with pytest.raises(ValueError, match=r"'model.norm.weight' holds 32 value\(s\) beyond the range of float16"):
        load_hf(big, dtype="float16")


def test_overrides_that_change_loaded_shapes_are_refused(tmp_path):
    directory = write_hf(tmp_path, "mixtral")
    for arg, match in (("--model.n_expert=8", "model.n_expert: .* holds n_expert=4, the override asks for 8"),
                       ("--model.n_kv_head=4", "model.n_kv_head: .* holds n_kv_head=2, the override asks for 4"),
                       ("--model.top_k=5", r"model.top_k: must be in 1..n_expert=4, got 5")):
        with pytest.raises(ConfigError, match=match):
            resolve_model(parse_args([f"--init-from={directory}", arg]))
    cfg, _, _ = resolve_model(parse_args([f"--init-from={directory}", "--model.top_k=1", "--model.n_kv_head=2"]))
    assert (cfg.top_k, cfg.n_kv_head) == (1, 2)


def test_gpt2_tensors_are_checked_for_dtype_and_finiteness(tmp_path):
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=64)
    directory = save_hf_gpt2(build_model(cfg, seed=0), cfg, tmp_path / "gpt2")
    raw = load_file(str(directory / "model.safetensors"))
    for change, match in ((with_nan, "holds 1 NaN or infinite value"), (lambda a: a.astype(np.int32), "is stored as I32")):
        save_file({**raw, "transformer.h.0.mlp.c_fc.weight": change(raw["transformer.h.0.mlp.c_fc.weight"])},
                  str(directory / "model.safetensors"))
        with pytest.raises(ValueError, match=rf"model.safetensors: tensor 'transformer.h.0.mlp.c_fc.weight' {match}"):
            load_hf_gpt2(directory)
