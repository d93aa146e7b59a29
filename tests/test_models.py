"""Models: GPT-2 names and shapes as Hugging Face, parameter count, registry, gradients, learning,
Hugging Face GPT-2 checkpoint parity in both directions (through safetensors), and the Llama-style
model against Hugging Face's LlamaForCausalLM."""
import dataclasses
import json
import math
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mpirt.core import modeling
from mpirt.core.modeling import build_model, seed_dropouts
from mpirt.core.nn import NotMaterializedError
from mpirt.models import GPT, MLP, GPTConfig, Llama, LlamaConfig
from mpirt.models.gpt import flops_per_token, param_shapes
from mpirt.models.hf import load_hf_gpt2, load_into, save_hf_gpt2
from mpirt.models.mlp import num_parameters as mlp_num_parameters
from mpirt.checkpoint.store import CheckpointError
from mpirt.run.config import ConfigError
from mpirt.core.tensor import Tensor

SMALL = dict(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=101)


def hf_gpt2(**kw):
    """A Hugging Face GPT2LMHeadModel (eager attention, no dropout) of the SMALL architecture."""
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(**{**SMALL, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                        "bos_token_id": None, "eos_token_id": None, **kw})
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg).eval()


def hf_logits(model, idx, labels=None):
    import torch
    with torch.no_grad():
        out = model(torch.as_tensor(idx), labels=None if labels is None else torch.as_tensor(labels))
    return out.logits.numpy(), (None if labels is None else float(out.loss))


def randomize(model, seed, scale=0.3):
    """Spread every mpirt parameter away from its init so that parity and gradient checks see
    O(1) logits and non-trivial LayerNorm gains."""
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        noise = rng.standard_normal(p.shape) * scale
        p.data[...] = (1.0 + noise if name.endswith("ln_1.weight") or name.endswith("ln_2.weight")
                       or name == "ln_f.weight" else noise)


# ------------------------------------------------------------------ structure and bookkeeping

def test_parameter_names_and_shapes_equal_hugging_face():
    hf = hf_gpt2()
    want = {k: tuple(v.shape) for k, v in hf.transformer.state_dict().items()
            if not k.endswith(".attn.bias") and not k.endswith(".attn.masked_bias")}
    model = GPT(GPTConfig(**SMALL))
    got = {name: p.shape for name, p in model.named_parameters()}
    assert got == want
    assert list(got) == list(param_shapes(GPTConfig(**SMALL)))
    assert all(p.name == name for name, p in model.named_parameters())
    assert "lm_head.weight" not in got  # the head is tied to wte


@pytest.mark.parametrize("kw", [SMALL, dict(n_layer=3, n_head=2, n_embd=16, n_positions=8, vocab_size=7,
                                            n_inner=40)])
def test_parameter_count_formula(kw):
    cfg = GPTConfig(**kw)
    model = GPT(cfg)
    n = model.num_parameters()
    assert n == sum(math.prod(s) for s in param_shapes(cfg).values())
    if cfg.n_inner is None:
        c = cfg.n_embd
        assert n == cfg.n_layer * (12 * c * c + 13 * c) + (cfg.vocab_size + cfg.n_positions) * c + 2 * c
        hf = hf_gpt2(**kw)
        assert n == sum(p.numel() for p in hf.parameters())  # tied head counted once there too
    wpe = cfg.n_positions * cfg.n_embd
    assert flops_per_token(cfg, 16) == model.flops_per_token(16) == \
        6 * (n - wpe) + 12 * cfg.n_layer * cfg.n_embd * 16


def test_mlp_parameter_count_and_names():
    cfg = GPTConfig(model_type="mlp", n_layer=2, n_embd=16, n_inner=24, vocab_size=13, n_positions=8)
    model = MLP(cfg)
    names = [n for n, _ in model.named_parameters()]
    assert names[:1] == ["wte.weight"] and "h.1.c_fc.weight" in names and "h.0.ln.bias" in names
    assert "h.1.c_proj.weight" in names and names[-2:] == ["ln_f.weight", "ln_f.bias"]
    assert model.num_parameters() == mlp_num_parameters(cfg)
    assert model.flops_per_token(8) == 6 * mlp_num_parameters(cfg)


def test_build_model_registry():
    gpt = build_model(GPTConfig(**SMALL), seed=1)
    mlp = build_model(GPTConfig(model_type="mlp", n_layer=1, n_embd=8, vocab_size=5), dtype="float64")
    assert type(gpt) is GPT and type(mlp) is MLP
    assert gpt.wte.weight.dtype == np.float32 and mlp.wte.weight.dtype == np.float64
    assert not mlp.wte.weight.materialized  # no seed: lazy, nothing allocated, and reading it says so
    with pytest.raises(NotMaterializedError, match="wte.weight .* has no value yet"):
        mlp.wte.weight.data
    with pytest.raises(ValueError, match="'rnn'"):
        build_model(GPTConfig(model_type="rnn"))
    again = build_model(GPTConfig(**SMALL), seed=1)
    for (name, a), (_, b) in zip(gpt.named_parameters(), again.named_parameters()):
        assert np.array_equal(a.data, b.data), name
    other = build_model(GPTConfig(**SMALL), seed=2)
    assert not np.array_equal(gpt.wte.weight.data, other.wte.weight.data)


def test_registry_dispatches_counts_and_blocks_by_model_type():
    """mpirt.core.modeling.num_parameters / flops_per_token / block_class go through MODELS; an unknown
    model_type is one ValueError naming it, whichever entry point meets it."""
    from mpirt.core.modeling import block_class, flops_per_token as model_flops, num_parameters as model_params
    from mpirt.models.gpt import Block
    from mpirt.models.mlp import MLPBlock
    gpt_cfg = GPTConfig(**SMALL)
    mlp_cfg = GPTConfig(model_type="mlp", n_layer=2, n_embd=16, n_inner=24, vocab_size=13, n_positions=8)
    assert model_params(gpt_cfg) == GPT(gpt_cfg).num_parameters()
    assert model_flops(gpt_cfg, 16) == flops_per_token(gpt_cfg, 16)
    assert model_params(mlp_cfg) == mlp_num_parameters(mlp_cfg) == MLP(mlp_cfg).num_parameters()
    assert model_flops(mlp_cfg, 8) == 6 * mlp_num_parameters(mlp_cfg)
    assert block_class(gpt_cfg) is Block and block_class(mlp_cfg) is MLPBlock
    bad = GPTConfig(model_type="rnn")
    for fn in (build_model, model_params, block_class, lambda c: model_flops(c, 8)):
        with pytest.raises(ValueError, match="model_type: unknown model .rnn.; expected one of gpt2, llama, mixtral, "
                                             "mlp"):
            fn(bad)


def test_graph_parameters_finds_the_leaves_once():
    """The Parameters a Tensor was computed from, each once (wte is used by embed and head)."""
    from mpirt.core.nn import graph_parameters
    from mpirt.core.tensor import no_grad
    model = GPT(GPTConfig(**SMALL), dtype="float64", seed=0)
    x = np.zeros((1, 2), dtype=np.int64)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in graph_parameters(model.embed(x))) == ["wpe.weight", "wte.weight"]
    head = graph_parameters(model.head(Tensor(np.zeros((1, 2, SMALL["n_embd"])))))
    assert sorted(names[id(p)] for p in head) == ["ln_f.bias", "ln_f.weight", "wte.weight"]
    everything = graph_parameters(model(x))
    assert len(everything) == len({id(p) for p in everything}) == len(model.parameters())
    assert graph_parameters(model.wte.weight) == []
    with no_grad():
        assert graph_parameters(model(x)) == []


def test_gpt2_initialization():
    cfg = GPTConfig(n_layer=8, n_head=4, n_embd=64, n_positions=32, vocab_size=500)
    model = GPT(cfg, seed=0)
    p = dict(model.named_parameters())
    assert abs(p["wte.weight"].data.std() - 0.02) < 0.002
    assert abs(p["h.3.attn.c_attn.weight"].data.std() - 0.02) < 0.002
    for name in ("h.3.attn.c_proj.weight", "h.3.mlp.c_proj.weight"):
        assert abs(p[name].data.std() - 0.02 / math.sqrt(16)) < 0.001, name
    assert not p["h.0.mlp.c_fc.bias"].data.any() and not p["ln_f.bias"].data.any()
    assert (p["h.2.ln_1.weight"].data == 1).all()
    # Every parameter gets its own stream: no two weight matrices are equal.
    assert not np.array_equal(p["h.0.attn.c_proj.weight"].data, p["h.1.attn.c_proj.weight"].data)


def test_forward_shapes_and_sequence_limit():
    model = GPT(GPTConfig(**{**SMALL, "n_positions": 8}), seed=0)
    idx = np.arange(12).reshape(2, 6)
    logits = model(idx)
    assert logits.shape == (2, 6, 101) and logits.dtype == np.float32
    logits2, loss = model(Tensor(idx), targets=idx)  # Tensor input gives the same result
    assert np.array_equal(logits.data, logits2.data) and loss.shape in ((), (1,))
    assert loss.dtype == np.float32
    loss.backward()
    assert all(p.grad.dtype == np.float32 for p in model.parameters())
    with pytest.raises(ValueError, match=r"9.*n_positions=8"):
        model(np.zeros((1, 9), dtype=np.int64))
    with pytest.raises(ValueError, match=r"9.*n_positions=8"):
        MLP(GPTConfig(model_type="mlp", n_layer=1, n_embd=8, vocab_size=5, n_positions=8))(
            np.zeros((1, 9), dtype=np.int64))


def test_ignore_index_targets():
    model = GPT(GPTConfig(**SMALL), seed=0)
    randomize(model, 0)
    idx = np.random.default_rng(0).integers(0, 101, (2, 6))
    targets = idx.copy()
    targets[:, 3:] = -100
    logits, loss = model(idx, targets)
    z = logits.data.astype(np.float64)[:, :3]
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, idx[:, :3, None], -1).mean()
    assert abs(loss.item() - want) < 1e-5


# ------------------------------------------------------------------ gradients and learning

TINY = {"gpt2": GPTConfig(n_layer=1, n_head=2, n_embd=8, n_positions=6, vocab_size=11),
        "llama": LlamaConfig(n_layer=1, n_head=2, n_embd=8, n_positions=6, vocab_size=11, n_inner=12)}


@pytest.mark.parametrize("model_type", TINY)
def test_gradients_match_finite_differences(model_type):
    model = build_model(TINY[model_type], dtype="float64", seed=3)
    randomize(model, 3)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 11, (2, 4))
    targets = rng.integers(0, 11, (2, 4))
    targets[1, 2] = -100
    model.zero_grad()
    _, loss = model(idx, targets)
    loss.backward()
    eps = 1e-6
    for name, p in model.named_parameters():
        picks = [tuple(rng.integers(0, n) for n in p.shape) for _ in range(2)]
        if name == "wte.weight":  # a row used by both the embedding and the head, and a head-only row
            unused = sorted(set(range(11)) - set(idx.ravel().tolist()))
            picks += [(int(idx[0, 0]), 1), (unused[0], 2)]
        for index in picks:
            saved = p.data[index]
            p.data[index] = saved + eps
            plus = model(idx, targets)[1].item()
            p.data[index] = saved - eps
            minus = model(idx, targets)[1].item()
            p.data[index] = saved
            numeric = (plus - minus) / (2 * eps)
            assert abs(p.grad[index] - numeric) <= 1e-7 + 1e-5 * abs(numeric), (name, index, p.grad[index], numeric)


@pytest.mark.parametrize("model_type", TINY)
def test_deferred_weight_gradients_equal_immediate(model_type):
    """A zero-bubble schedule defers weight gradients; the tied head must not lose its share."""
    cfg = dataclasses.replace(TINY[model_type], n_layer=2, n_positions=8)
    model = build_model(cfg, dtype="float64", seed=0)
    randomize(model, 0)
    idx = np.random.default_rng(0).integers(0, 11, (2, 5))
    model.zero_grad()
    model(idx, idx)[1].backward()
    want = {name: p.grad.copy() for name, p in model.named_parameters()}
    model.zero_grad()
    model(idx, idx)[1].backward(defer_weight_grad=True).run()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, want[name], rtol=1e-12, atol=1e-14, err_msg=name)


def _sgd_run(model, idx, targets, steps, lr):
    losses = []
    for _ in range(steps):
        model.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        for p in model.parameters():
            p.data -= lr * p.grad
        losses.append(loss.item())
    return losses


def test_mlp_learns_a_fixed_batch():
    cfg = GPTConfig(model_type="mlp", n_layer=2, n_embd=32, n_inner=64, vocab_size=16, n_positions=16)
    model = build_model(cfg, seed=0)
    start = np.random.default_rng(0).integers(0, 16, (4, 1))
    seq = (start * 5 + 3 * np.arange(17)) % 16  # next token is a function of the current one
    losses = _sgd_run(model, seq[:, :-1], seq[:, 1:], steps=30, lr=1.0)
    assert losses[0] > 2.0 and losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("config, lr", [(GPTConfig, 1.0), (LlamaConfig, 0.3)], ids=["gpt2", "llama"])
def test_attention_model_learns_a_fixed_batch(config, lr):
    """(Llama's RMSNorm rescales the 0.02-std embeddings to unit size: plain SGD needs a smaller lr.)"""
    model = build_model(config(n_layer=1, n_head=2, n_embd=16, n_positions=16, vocab_size=16), seed=0)
    seq = np.random.default_rng(1).integers(0, 16, (2, 13))
    losses = _sgd_run(model, seq[:, :-1], seq[:, 1:], steps=30, lr=lr)
    assert losses[-1] < 0.7 * losses[0], losses


def test_dropout_modules_seeded_and_off_in_eval():
    cfg = GPTConfig(**{**SMALL, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1})
    model = GPT(cfg, seed=0)
    plain = GPT(GPTConfig(**SMALL), seed=0)
    idx = np.random.default_rng(0).integers(0, 101, (2, 8))
    seeds = [m.seed for name, m in model.named_modules() if "drop" in name]
    assert len(seeds) == 1 + 3 * cfg.n_layer and len(set(seeds)) == len(seeds)
    model.eval()
    np.testing.assert_array_equal(model(idx).data, plain(idx).data)
    model.train()
    a, b = model(idx).data, model(idx).data
    assert not np.allclose(a, plain(idx).data) and not np.allclose(a, b)
    seed_dropouts(model, 0)  # same seed, counters restarted: the same masks again
    np.testing.assert_array_equal(model(idx).data, a)


def test_dropout_masks_depend_on_the_global_place_not_the_shard():
    """A shard of the batch draws its part of the whole batch's mask: rows placed by ``row0``,
    dimension 1 split over tp (heads, or tokens under sequence parallelism). P(keep) = 1 - p,
    neighbours and steps independent; a module placed in the batch draws the shard's mask, and
    its saved state draws it again (recomputation)."""
    from mpirt.core.nn import Dropout
    from mpirt.core.ops.dropout import MaskSource, dropout_mask

    whole = dropout_mask((8, 4, 16, 16), 0.25, MaskSource((3, 7)))
    for row0, rank in ((0, 0), (2, 1), (6, 3)):
        part = dropout_mask((2, 1, 16, 16), 0.25, MaskSource((3, 7), row0=row0, split=(rank, 4)))
        np.testing.assert_array_equal(part, whole[row0:row0 + 2, rank:rank + 1])
    big = dropout_mask((64, 256, 64), 0.1, MaskSource((1, 1))).astype(np.float64)
    assert abs(big.mean() - 0.9) < 0.002
    assert abs(np.corrcoef(big[..., 1:].ravel(), big[..., :-1].ravel())[0, 1]) < 0.01
    next_step = dropout_mask((64, 256, 64), 0.1, MaskSource((1, 2)))
    assert abs((big == next_step).mean() - (0.9 ** 2 + 0.1 ** 2)) < 0.002
    m = Dropout(0.5, seed=3)
    m.place, x = (7, 4), Tensor(np.ones((2, 4, 8)))
    state = m.state()
    y = m(x).data
    np.testing.assert_array_equal(y != 0, dropout_mask((6, 4, 8), 0.5, MaskSource((3, 7)))[4:])
    m.set_state(state)
    np.testing.assert_array_equal(m(x).data, y)


# ------------------------------------------------------------------ Hugging Face interop

IDX = np.random.default_rng(7).integers(0, 101, (2, 16))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A randomly initialised HF GPT-2 (weights spread to O(1) logits) saved with safetensors."""
    import torch
    torch.manual_seed(0)
    hf = hf_gpt2()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if ".ln_" in name and name.endswith("weight") else 0.0))
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def copy_dir(src, dst, *, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config is not None:
        data = json.loads((dst / "config.json").read_text())
        data.update(config)
        (dst / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def mpirt_from(directory):
    cfg, state = load_hf_gpt2(directory)
    model = build_model(cfg)
    model.load_state_dict(state)
    return model


def shifted(idx):
    targets = np.full_like(idx, -100)
    targets[:, :-1] = idx[:, 1:]
    return targets


def test_hf_to_mpirt_logits_and_loss(hf_dir):
    path, hf = hf_dir
    assert "transformer.wte.weight" in load_file(str(path / "model.safetensors"))
    want, want_loss = hf_logits(hf, IDX, labels=IDX)  # HF shifts the labels internally
    assert np.abs(want).max() > 1.0  # a parity check on near-zero logits would prove little
    logits, loss = mpirt_from(path)(IDX, shifted(IDX))
    err = np.abs(logits.data - want).max()
    assert err < 1e-5 * max(1.0, np.abs(want).max()), err
    assert abs(loss.item() - want_loss) < 1e-5, (loss.item(), want_loss)


def test_hf_without_prefix_and_with_buffers_and_tied_head(hf_dir, tmp_path):
    path, hf = hf_dir
    raw = load_file(str(path / "model.safetensors"))
    plain = {k.removeprefix("transformer."): v for k, v in raw.items()}
    plain["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))  # older files carry these
    plain["h.1.attn.masked_bias"] = np.array(-1e4, np.float32)
    plain["lm_head.weight"] = plain["wte.weight"].copy()  # stored tied head: allowed when equal
    d = copy_dir(path, tmp_path / "plain", tensors=plain)
    want, _ = hf_logits(hf, IDX)
    assert np.abs(mpirt_from(d)(IDX).data - want).max() < 1e-5 * max(1.0, np.abs(want).max())


def test_hf_sharded_checkpoint(hf_dir, tmp_path):
    path, hf = hf_dir
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    cfg, state = load_hf_gpt2(tmp_path / "sharded", dtype="float64")
    _, single = load_hf_gpt2(path)
    assert state["wte.weight"].dtype == np.float64
    for name in single:
        np.testing.assert_array_equal(state[name], single[name])


def test_mpirt_to_hf_roundtrip(tmp_path):
    from transformers import GPT2LMHeadModel
    model = build_model(GPTConfig(**SMALL), seed=5)
    randomize(model, 5)
    want = model(IDX).data
    out = save_hf_gpt2(model, model.config, tmp_path / "export")
    assert not [p for p in tmp_path.iterdir() if p.name != "export"]  # no temp dir left behind
    data = json.loads((out / "config.json").read_text())
    assert data["model_type"] == "gpt2" and data["architectures"] == ["GPT2LMHeadModel"]
    assert data["n_ctx"] == 64 and data["activation_function"] == "gelu_new" and data["tie_word_embeddings"]
    raw = load_file(str(out / "model.safetensors"))
    assert all(k.startswith("transformer.") for k in raw) and "lm_head.weight" not in raw
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}

    hf = GPT2LMHeadModel.from_pretrained(out, attn_implementation="eager").eval()
    got, _ = hf_logits(hf, IDX)
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())

    # Without the prefix (a GPT2Model-style file), Hugging Face and mpirt both still load it.
    d = copy_dir(out, tmp_path / "plain", tensors={k.removeprefix("transformer."): v for k, v in raw.items()})
    hf2 = GPT2LMHeadModel.from_pretrained(d, attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(hf2, IDX)[0], got, rtol=0, atol=1e-6)

    # And back into mpirt, with load_into.
    back = GPT(GPTConfig(**SMALL))
    assert load_into(back, d) == GPTConfig(**SMALL)
    np.testing.assert_array_equal(back(IDX).data, want)


def test_save_into_existing_directory_keeps_other_files(tmp_path):
    model = build_model(GPTConfig(**SMALL), seed=1)
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": "old-1.safetensors"}}))
    (d / "old-1.safetensors").write_bytes(b"stale")
    save_hf_gpt2(model, model.config, d)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    _, state = load_hf_gpt2(d)
    np.testing.assert_array_equal(state["h.1.mlp.c_fc.weight"], model.h[1].mlp.c_fc.weight.data)


@pytest.mark.parametrize("shard", ["/abs/outside.safetensors", "../outside.safetensors", "sub/../../outside.safetensors"])
def test_index_pointing_outside_the_directory_is_refused(tmp_path, shard):
    model = build_model(GPTConfig(**SMALL), seed=1)
    d = save_hf_gpt2(model, model.config, tmp_path / "hf")
    (d / "model.safetensors").rename(tmp_path / "outside.safetensors")  # loadable, were it followed
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": shard}}))
    with pytest.raises(ValueError, match=rf"weight_map entry 'wte.weight' -> '{shard}' does not name a file inside"):
        load_hf_gpt2(d)


def test_bf16_checkpoint_loads_as_float32(hf_dir, tmp_path):
    import torch
    from safetensors.torch import save_file as save_torch
    path, _ = hf_dir
    raw = load_file(str(path / "model.safetensors"))
    d = tmp_path / "bf16"
    shutil.copytree(path, d)
    save_torch({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in raw.items()}, str(d / "model.safetensors"))
    _, state = load_hf_gpt2(d)
    want = torch.from_numpy(raw["transformer.h.0.attn.c_attn.weight"]).to(torch.bfloat16).float().numpy()
    assert state["h.0.attn.c_attn.weight"].dtype == np.float32
    np.testing.assert_array_equal(state["h.0.attn.c_attn.weight"], want)


@pytest.mark.parametrize("change, match", [
    ({"activation_function": "relu"}, "activation_function"),
    ({"activation_function": "gelu"}, "activation_function"),   # exact erf GELU: not the tanh form
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"n_layer": 0}, "n_layer"),
    ({"n_embd": "32"}, "n_embd"),
    ({"n_head": 5}, "n_head"),
    ({"model_type": "llama"}, "model_type"),
])
def test_hf_bad_config_values(hf_dir, tmp_path, change, match):
    d = copy_dir(hf_dir[0], tmp_path / "bad", config=change)
    with pytest.raises(ConfigError, match=match):
        load_hf_gpt2(d)


def test_hf_reorder_and_upcast_attn_accepted(hf_dir, tmp_path):
    d = copy_dir(hf_dir[0], tmp_path / "reorder", config={"reorder_and_upcast_attn": True})
    cfg, _ = load_hf_gpt2(d)
    assert cfg.n_layer == 2


def test_hf_checkpoint_errors(hf_dir, tmp_path):
    path, _ = hf_dir
    raw = load_file(str(path / "model.safetensors"))

    missing = {k: v for k, v in raw.items() if k != "transformer.h.1.ln_2.bias"}
    with pytest.raises(CheckpointError, match=r"missing keys \['h.1.ln_2.bias'\]"):
        load_hf_gpt2(copy_dir(path, tmp_path / "missing", tensors=missing))

    extra = {**raw, "transformer.h.2.ln_1.weight": np.ones(32, np.float32)}
    with pytest.raises(CheckpointError, match=r"unexpected keys \['h.2.ln_1.weight'\]"):
        load_hf_gpt2(copy_dir(path, tmp_path / "extra", tensors=extra))

    shape = {**raw, "transformer.wpe.weight": raw["transformer.wpe.weight"][:63]}
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'transformer.wpe.weight' has shape \(63, 32\), expected \(64, 32\)"):
        load_hf_gpt2(copy_dir(path, tmp_path / "shape", tensors=shape))

    untied = {**raw, "lm_head.weight": raw["transformer.wte.weight"] + 1}
    with pytest.raises(ValueError, match="untied lm_head not supported"):
        load_hf_gpt2(copy_dir(path, tmp_path / "untied", tensors=untied))

    d = copy_dir(path, tmp_path / "pickle")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        load_hf_gpt2(d)

    small = GPT(GPTConfig(**{**SMALL, "n_layer": 1}))
    with pytest.raises(ValueError, match="n_layer: model 1 vs checkpoint 2"):
        load_into(small, path)


# ------------------------------------------------------------------ the Llama-style model

def hf_llama(cfg: LlamaConfig):
    """A Hugging Face LlamaForCausalLM (float64, eager attention) of ``cfg``'s architecture."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM
    hf = HFLlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.hidden,
                       num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                       num_key_value_heads=cfg.n_kv_head or cfg.n_head,
                       max_position_embeddings=cfg.n_positions, rms_norm_eps=cfg.rms_norm_eps,
                       rope_theta=cfg.rope_theta, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf._attn_implementation = "eager"
    return LlamaForCausalLM(hf).double().eval()


def to_hf_llama(model) -> dict:
    """mpirt Llama weights under Hugging Face names, through the export's own mapping
    (:func:`mpirt.models.hf.llama_hf_tensors`)."""
    import torch
    from mpirt.models.hf import llama_hf_tensors
    p = {n: q.data for n, q in model.named_parameters()}
    return {name: torch.from_numpy(read()) for name, _, read in llama_hf_tensors(model.config, p.__getitem__)}


def test_a_hugging_face_llama_directory_loads_with_its_logits(tmp_path):
    """A LlamaForCausalLM saved by transformers (safetensors, tied head, grouped-query attention)
    is read back through :func:`mpirt.core.modeling.load_hf`: the same logits."""
    torch = pytest.importorskip("torch")
    from mpirt.core.modeling import build_model, load_hf
    cfg = LlamaConfig(n_layer=2, n_head=4, n_embd=32, n_positions=16, vocab_size=37, n_inner=48, rope_theta=500.0,
                      n_kv_head=2)
    torch.manual_seed(0)
    hf = hf_llama(cfg)
    hf.save_pretrained(tmp_path / "hf")
    loaded, weights = load_hf(tmp_path / "hf")
    assert (loaded.model_type, loaded.n_kv_head, loaded.hidden, loaded.rope_theta) == ("llama", 2, 48, 500.0)
    model = build_model(loaded, dtype="float64")
    model.load_state_dict(weights)
    idx = np.random.default_rng(2).integers(0, 37, (2, 16))
    with torch.no_grad():
        want = hf(torch.from_numpy(idx)).logits.numpy()
    np.testing.assert_allclose(model(idx).data, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("n_kv_head", [None, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_llama_logits_equal_hugging_face_llama(n_kv_head):
    """Same weights, same logits as transformers' LlamaForCausalLM (tied head, no biases, rotary
    "rotate half", SwiGLU), with as many key/value heads as query heads, grouped-query attention
    (num_key_value_heads 2 of 4) and multi-query (1); the weight gradients of a loss too.
    Hugging Face builds its rotary tables in float32: agreement ~1e-6."""
    import torch
    cfg = LlamaConfig(n_layer=2, n_head=4, n_embd=32, n_positions=16, vocab_size=37, n_inner=48, rope_theta=500.0,
                      n_kv_head=n_kv_head)
    model = Llama(cfg, dtype="float64", seed=0)
    randomize(model, 1)
    hf = hf_llama(cfg)
    result = hf.load_state_dict(to_hf_llama(model), strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied to embed_tokens
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    idx = np.random.default_rng(2).integers(0, 37, (2, 16))
    want = hf(torch.from_numpy(idx)).logits
    np.testing.assert_allclose(model(idx).data, want.detach().numpy(), rtol=0, atol=2e-5 * want.abs().max().item())
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())
    targets = np.random.default_rng(3).integers(0, 37, (2, 16))
    model(idx, targets)[1].backward()
    torch.nn.functional.cross_entropy(want.reshape(-1, 37), torch.from_numpy(targets).reshape(-1)).backward()
    attn = hf.model.layers[1].self_attn
    ck = (n_kv_head or 4) * 8
    grad = model.h[1].attn.c_attn.weight.grad                                # (C, C + 2 Ck): q | k | v
    for mine, theirs in ((grad[:, :32], attn.q_proj), (grad[:, 32:32 + ck], attn.k_proj),
                         (grad[:, 32 + ck:], attn.v_proj)):
        np.testing.assert_allclose(mine, theirs.weight.grad.numpy().T, rtol=0, atol=1e-5 * np.abs(mine).max())


def test_llama_structure_count_registry_and_preset():
    cfg = LlamaConfig(n_layer=3, n_head=4, n_embd=32, n_positions=16, vocab_size=37)
    model = build_model(cfg, seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert type(model) is Llama and not [n for n in names if n.endswith(".bias")]
    assert names[:3] == ["wte.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight"] and names[-1] == "ln_f.weight"
    assert cfg.hidden == 128 and LlamaConfig(n_embd=128).hidden == 384  # 8/3 C rounded up to 64
    n = model.num_parameters()
    assert n == Llama.num_parameters_of(cfg) == 37 * 32 + 3 * (4 * 32 * 32 + 3 * 32 * 128 + 2 * 32) + 32
    assert modeling.flops_per_token(cfg, 16) == 6 * n + 12 * 3 * 32 * 16
    costs = modeling.layer_costs(cfg, 16)
    assert [c.name for c in costs] == ["embed", "h.0", "h.1", "h.2", "head"]
    assert sum(c.params for c in costs) == n + 37 * 32  # the head holds its own copy of wte
    assert modeling.block_class(cfg) is type(model.h[0])
    p = dict(model.named_parameters())
    assert (p["h.1.ln_2.weight"].data == 1).all()
    assert abs(p["h.2.mlp.down_proj.weight"].data.std() - 0.02 / math.sqrt(6)) < 0.002
    preset = modeling.load_model_config("llama-tiny", {"n_layer": 2})
    assert (preset.model_type, preset.n_layer, preset.n_embd) == ("llama", 2, 128)
    assert modeling.config_from_dict(dataclasses.asdict(preset)) == preset
    with pytest.raises(ConfigError, match=r"model\.layer_norm_epsilon: unknown key for model_type 'llama'.*rms_norm_eps"):
        modeling.load_model_config("llama-tiny", {"layer_norm_epsilon": 1e-5})
    with pytest.raises(ConfigError, match="n_head: must divide n_embd=32 into heads of an even size"):
        modeling.load_model_config("llama-tiny", {"n_embd": 32, "n_head": 32})
    gqa = dataclasses.replace(cfg, n_kv_head=2)                      # 2 key/value heads of 8 columns
    assert build_model(gqa, seed=0).num_parameters() == Llama.num_parameters_of(gqa) == n - 3 * 2 * 32 * 16
    assert dict(build_model(gqa).named_parameters())["h.0.attn.c_attn.weight"].shape == (32, 32 + 2 * 16)
    assert sum(c.params for c in modeling.layer_costs(gqa, 16)) == Llama.num_parameters_of(gqa) + 37 * 32
    with pytest.raises(ConfigError, match="n_kv_head: must divide n_head=4 into equal groups of query heads, got 3"):
        modeling.load_model_config("llama-tiny", {"n_kv_head": 3})
