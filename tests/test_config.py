"""Run config (mpirt.run.config) and model presets (models.presets): parsing, precedence, errors."""
import dataclasses
import json

import pytest

from mpirt.models.model_config import GPTConfig
from mpirt.models.gpt import num_parameters
from mpirt.models.presets import load_model_config, preset_names
from mpirt.run.config import ConfigError, TrainConfig, config_hash, diff_configs, help_text, parse_args


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- defaults, precedence, forms

def test_defaults_are_valid_and_match_dataclass():
    cfg = parse_args([])
    assert cfg == TrainConfig()
    assert cfg.model == "tiny" and cfg.grad_accum == 1 and cfg.seed == 1337
    assert (cfg.dp, cfg.tp, cfg.pp, cfg.zero, cfg.schedule) == (0, 1, 1, 0, "1f1b")
    assert cfg.model_overrides == {}


def test_every_field_has_a_description():
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("help"), f.name


def test_cli_beats_toml_beats_defaults(tmp_path):
    path = write(tmp_path, "run.toml", 'steps = 50\nlr = 3e-4\nout_dir = "o"\n')
    cfg = parse_args([path, "--steps=7"])
    assert cfg.steps == 7                      # CLI over TOML
    assert cfg.lr == 3e-4 and cfg.out_dir == "o"   # TOML over default
    assert cfg.seed == TrainConfig().seed      # default


def test_both_override_forms_and_dashes():
    a = parse_args(["--batch-size", "16", "--seq-len=64", "--out_dir", "x", "--min-lr", "0"])
    b = parse_args(["--batch_size=16", "--seq_len", "64", "--out-dir=x", "--min_lr=0.0"])
    assert a == b
    assert (a.batch_size, a.seq_len, a.out_dir, a.min_lr) == (16, 64, "x", 0.0)
    assert isinstance(a.min_lr, float)


def test_space_form_takes_negative_values():
    with pytest.raises(ConfigError, match="lr: must be > 0, got -1.0"):
        parse_args(["--lr", "-1"])


def test_last_override_wins():
    assert parse_args(["--steps=3", "--steps", "4"]).steps == 4


@pytest.mark.parametrize("argv, expected", [
    (["--eval-only"], True),
    (["--eval-only", "--steps=2"], True),
    (["--eval_only=true"], True),
    (["--eval-only=false"], False),
    (["--eval-only=0"], False),
    (["--eval-only=no"], False),
    (["--eval-only", "off"], False),
    (["--eval-only", "YES"], True),
])
def test_bool_forms(argv, expected):
    assert parse_args(argv).eval_only is expected


def test_bool_from_toml_and_cli(tmp_path):
    path = write(tmp_path, "run.toml", "progress = false\n")
    assert parse_args([path]).progress is False
    assert parse_args([path, "--progress"]).progress is True


# ---------------------------------------------------------------- errors name the key

@pytest.mark.parametrize("argv, message", [
    (["--steps=abc"], "steps: expected int, got 'abc'"),
    (["--steps", "1.5"], "steps: expected int, got '1.5'"),
    (["--lr=fast"], "lr: expected float, got 'fast'"),
    (["--lr=nan"], "lr: expected float"),
    (["--eval-only=maybe"], "eval_only: expected bool, got 'maybe'"),
    (["--model.n_layer=two"], "model.n_layer: expected int, got 'two'"),
])
def test_cli_type_errors_name_key_and_value(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)


def test_cli_unknown_key_suggests():
    with pytest.raises(ConfigError, match=r"batch_sise: unknown key.*did you mean 'batch_size'"):
        parse_args(["--batch-sise=8"])
    with pytest.raises(ConfigError, match=r"model\.n_lyer: unknown key.*'model\.n_layer'"):
        parse_args(["--model.n_lyer=2"])
    with pytest.raises(ConfigError, match="model_overrides: unknown key"):
        parse_args(["--model_overrides=x"])


def test_cli_malformed_arguments():
    with pytest.raises(ConfigError, match="steps: missing value"):
        parse_args(["--steps"])
    with pytest.raises(ConfigError, match="extra.toml: unexpected argument"):
        parse_args(["--steps=2", "extra.toml"])


def test_toml_type_errors_and_unknown_keys_name_key_and_file(tmp_path):
    bad_type = write(tmp_path, "a.toml", 'steps = "many"\n')
    with pytest.raises(ConfigError, match=r"steps: expected int, got 'many' \(in .*a\.toml\)"):
        parse_args([bad_type])
    as_float = write(tmp_path, "b.toml", "batch_size = 8.0\n")
    with pytest.raises(ConfigError, match=r"batch_size: expected int, got 8\.0"):
        parse_args([as_float])
    unknown = write(tmp_path, "c.toml", "learning_rate = 1e-3\n")
    with pytest.raises(ConfigError, match=r"learning_rate: unknown key \(in .*c\.toml\)"):
        parse_args([unknown])
    as_bool = write(tmp_path, "f.toml", "steps = true\n")
    with pytest.raises(ConfigError, match="steps: expected int, got True"):
        parse_args([as_bool])
    table = write(tmp_path, "d.toml", "[optim]\nlr = 1e-3\n")
    with pytest.raises(ConfigError, match="optim: unknown key"):
        parse_args([table])
    broken = write(tmp_path, "e.toml", "steps = = 3\n")
    with pytest.raises(ConfigError, match=r"config file .*e\.toml"):
        parse_args([broken])
    with pytest.raises(ConfigError, match="config file .*missing.toml"):
        parse_args([str(tmp_path / "missing.toml")])


def test_toml_int_accepted_for_float(tmp_path):
    cfg = parse_args([write(tmp_path, "a.toml", "grad_clip = 2\n")])
    assert cfg.grad_clip == 2.0 and isinstance(cfg.grad_clip, float)


@pytest.mark.parametrize("argv, key", [
    (["--steps=0"], "steps"), (["--batch-size=0"], "batch_size"), (["--seq-len=0"], "seq_len"),
    (["--lr=0"], "lr"), (["--min-lr=1"], "min_lr"), (["--beta1=1"], "beta1"),
    (["--beta2=-0.1"], "beta2"), (["--grad-clip=-1"], "grad_clip"),
    (["--grad-accum=0"], "grad_accum"), (["--batch-size=6", "--grad-accum=4"], "batch_size"),
    (["--dtype=int8"], "dtype"), (["--backend=torch"], "backend"), (["--zero=4"], "zero"),
    (["--schedule=zigzag"], "schedule"), (["--tp=0"], "tp"), (["--pp=0"], "pp"),
    (["--dp=-1"], "dp"), (["--log-interval=0"], "log_interval"),
    (["--model.resid_pdrop=1.0"], "model.resid_pdrop"), (["--model.n_layer=0"], "model.n_layer"),
])
def test_validation_names_key(argv, key):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert str(e.value).startswith(f"{key}: must be")


def test_help_lists_every_key_and_exits_zero(capsys):
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as e:
            parse_args(["--steps=3", flag])
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    for f in dataclasses.fields(TrainConfig):
        if f.name != "model_overrides":
            assert f"--{f.name}" in out and f.metadata["help"] in out
    assert "--model.<field>" in out and "n_layer" in help_text()
    assert "mpirt checkpoint dir or HF GPT-2/Llama/Mixtral dir" in out  # every architecture that loads


# ---------------------------------------------------------------- model overrides

def test_model_table_and_cli_model_overrides(tmp_path):
    path = write(tmp_path, "run.toml", '[model]\nname = "mlp"\nn_layer = 3\nresid_pdrop = 0.1\n')
    cfg = parse_args([path, "--model.n-layer=2", "--model.n_inner", "64"])
    assert cfg.model == "mlp"
    assert cfg.model_overrides == {"n_layer": 2, "resid_pdrop": 0.1, "n_inner": 64}
    model = load_model_config(cfg.model, cfg.model_overrides)
    assert (model.model_type, model.n_layer, model.n_inner, model.resid_pdrop) == \
        ("mlp", 2, 64, 0.1)
    assert parse_args(["--model", "gpt2", "--model.name=tiny"]).model == "tiny"
    assert parse_args(["--model.n_inner=none"]).model_overrides == {"n_inner": None}


def test_toml_model_table_unknown_field(tmp_path):
    path = write(tmp_path, "run.toml", "[model]\nn_embed = 64\n")
    with pytest.raises(ConfigError, match=r"model\.n_embed: unknown key .*'model\.n_embd'"):
        parse_args([path])


# ---------------------------------------------------------------- presets and model loading

def test_preset_names():
    assert set(preset_names()) >= {"tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "mlp"}


@pytest.mark.parametrize("name, layers, heads, embd, params", [
    ("gpt2", 12, 12, 768, 124_439_808),
    ("gpt2-medium", 24, 16, 1024, 354_823_168),
    ("gpt2-large", 36, 20, 1280, 774_030_080),
    ("gpt2-xl", 48, 25, 1600, 1_557_611_200),
])
def test_gpt2_presets_sizes(name, layers, heads, embd, params):
    cfg = load_model_config(name)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (layers, heads, embd)
    assert (cfg.n_positions, cfg.vocab_size, cfg.model_type) == (1024, 50257, "gpt2")
    assert num_parameters(cfg) == params


def test_param_count_formula():
    """The model's count against the closed form: a block of 12 C^2 + 13 C with n_inner = 4C."""
    c = 768
    assert num_parameters(load_model_config("gpt2")) == \
        12 * (12 * c**2 + 13 * c) + 50257 * c + 1024 * c + 2 * c
    # n_inner changes only the two MLP matrices and the first MLP bias.
    wide = GPTConfig(n_layer=1, n_head=1, n_embd=4, n_positions=2, vocab_size=3, n_inner=10)
    block = 2 * 4 + (3 * 16 + 12) + (16 + 4) + 2 * 4 + (40 + 10) + (40 + 4)
    assert num_parameters(wide) == block + 3 * 4 + 2 * 4 + 2 * 4


def test_tiny_and_mlp_presets():
    tiny = load_model_config("tiny")
    assert (tiny.vocab_size, tiny.n_layer, tiny.n_head, tiny.n_embd, tiny.n_positions) == \
        (256, 4, 4, 128, 256)
    assert TrainConfig().seq_len <= tiny.n_positions
    mlp = load_model_config("mlp")
    assert (mlp.model_type, mlp.n_layer, mlp.n_embd, mlp.vocab_size) == ("mlp", 2, 128, 256)


def test_model_toml_file_and_errors(tmp_path):
    ok = write(tmp_path, "m.toml", "n_layer = 2\nn_head = 2\nn_embd = 32\n")
    cfg = load_model_config(ok, {"n_positions": 64})
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_positions) == (2, 2, 32, 64)
    bad_key = write(tmp_path, "k.toml", "n_layers = 2\n")
    with pytest.raises(ConfigError, match=r"n_layers: unknown key \(in .*k\.toml\).*'n_layer'"):
        load_model_config(bad_key)
    bad_type = write(tmp_path, "t.toml", 'n_embd = "big"\n')
    with pytest.raises(ConfigError, match=r"n_embd: expected int, got 'big' \(in .*t\.toml\)"):
        load_model_config(bad_type)
    bad_heads = write(tmp_path, "h.toml", "n_head = 3\nn_embd = 32\n")
    with pytest.raises(ConfigError, match="n_head: must divide n_embd=32"):
        load_model_config(bad_heads)
    with pytest.raises(ConfigError, match=r"model\.n_lyer: unknown key"):
        load_model_config("tiny", {"n_lyer": 1})
    with pytest.raises(ConfigError, match=r"model: 'nope' is not a preset"):
        load_model_config("nope")


HF_GPT2 = {  # config.json of Hugging Face "gpt2"
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
    "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768,
    "n_head": 12, "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1,
    "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
    "summary_type": "cls_index", "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}


def hf_dir(tmp_path, **changes):
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**HF_GPT2, **changes}))
    return str(d)


def test_hf_config_dir_maps_fields(tmp_path):
    cfg = load_model_config(hf_dir(tmp_path), {"resid_pdrop": 0.0})
    assert cfg == GPTConfig(n_layer=12, n_head=12, n_embd=768, n_positions=1024,
                            vocab_size=50257, n_inner=None, embd_pdrop=0.1, attn_pdrop=0.1,
                            resid_pdrop=0.0, model_type="gpt2")
    assert num_parameters(cfg) == 124_439_808
    assert load_model_config(hf_dir(tmp_path, n_inner=1024)).hidden == 1024
    assert load_model_config(hf_dir(tmp_path, activation_function="gelu_pytorch_tanh")).n_layer == 12


@pytest.mark.parametrize("changes, message", [
    ({"activation_function": "relu"}, "activation_function: must be one of gelu_new"),
    ({"n_ctx": 512}, "n_ctx: must equal n_positions=1024"),
    ({"n_inner": "wide"}, "n_inner: expected int, got 'wide'"),
    ({"n_inner": 0}, "n_inner: must be >= 1"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings: mpirt supports only True"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"model_type": "gpt_neo"}, "model_type: mpirt supports only 'gpt2'"),
])
def test_hf_config_rejections(tmp_path, changes, message):
    with pytest.raises(ConfigError) as e:
        load_model_config(hf_dir(tmp_path, **changes))
    assert message in str(e.value) and "config.json" in str(e.value)


# ---------------------------------------------------------------- hashing and diffs

def test_to_dict_is_json_and_round_trips():
    cfg = parse_args(["--model.n_layer=2", "--lr=0.01"])
    d = json.loads(json.dumps(cfg.to_dict()))
    assert TrainConfig(**d) == cfg


def test_config_hash_stable_and_sensitive():
    a, b = parse_args(["--steps=5"]), parse_args(["--steps", "5"])
    assert config_hash(a) == config_hash(b) == config_hash(a.to_dict())
    assert len(config_hash(a)) == 64
    assert config_hash(a) != config_hash(parse_args(["--steps=6"]))
    assert config_hash(a) != config_hash(parse_args(["--steps=5", "--model.n_layer=2"]))
    # independent of key order
    assert config_hash(dict(reversed(list(a.to_dict().items())))) == config_hash(a)


def test_diff_configs():
    a = parse_args(["--model.n_layer=2"]).to_dict()
    b = parse_args(["--lr=0.01", "--model.n_layer=3", "--model.n_head=2"]).to_dict()
    assert diff_configs(a, a) == []
    assert diff_configs(a, b) == ["lr", "model_overrides.n_head", "model_overrides.n_layer"]
    assert diff_configs({"x": 1}, {"x": 1.0}) == ["x"]
