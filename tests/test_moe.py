"""The Mixtral-style mixture of experts (mpirt.models.moe, mpirt.core.ops.moe) on one rank: the
grouped experts against a loop, the gradients (the load-balancing loss's included) against finite
differences, the logits and the load-balancing loss against Hugging Face's MixtralForCausalLM and
``load_balancing_loss_func``, capacity drops and an expert without tokens. The layouts are launch
tests in test_train_parallel.py."""
import numpy as np
import pytest

from mpirt.core.ops.moe import grouped_swiglu
from mpirt.core.tensor import Tensor
from mpirt.models import Mixtral, MoEConfig
from mpirt.parallel.layout import Layout

CFG = MoEConfig(n_layer=2, n_head=4, n_embd=32, n_positions=16, vocab_size=64, n_inner=48, n_kv_head=2,
                n_expert=4, top_k=2, aux_loss_coef=0.02)


def tokens(seed, rows=3, t=16):
    return np.random.default_rng(seed).integers(0, 64, (rows, t))


def test_grouped_experts_equal_one_product_per_expert():
    """Rows grouped by expert (one expert empty) through each expert's SwiGLU, forward and backward."""
    rng = np.random.default_rng(0)
    e, c, f, counts = 4, 8, 12, [3, 0, 5, 2]
    x = Tensor(rng.standard_normal((10, c)), requires_grad=True)
    ws = [Tensor(rng.standard_normal(s), requires_grad=True) for s in ((e, c, f), (e, c, f), (e, f, c))]
    y = grouped_swiglu(x, *ws, counts)
    g = rng.standard_normal(y.shape)
    y.backward(g)
    import torch
    tx, (tg, tu, td) = torch.tensor(x.data, requires_grad=True), [torch.tensor(w.data, requires_grad=True) for w in ws]
    bounds = np.cumsum([0] + counts)
    parts = [torch.nn.functional.silu(tx[lo:hi] @ tg[k]) * (tx[lo:hi] @ tu[k]) @ td[k]
             for k, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    want = torch.cat(parts)
    want.backward(torch.tensor(g))
    np.testing.assert_allclose(y.data, want.detach().numpy(), rtol=1e-12, atol=1e-12)
    for ours, theirs in zip((x, *ws), (tx, tg, tu, td)):
        np.testing.assert_allclose(ours.grad, theirs.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert not ws[0].grad[1].any() and not ws[2].grad[1].any()  # the empty expert


@pytest.mark.parametrize("defer", [False, True], ids=["joint", "deferred-weight-pass"])
def test_grouped_experts_add_their_weight_gradients_into_grad_in_place(defer):
    """Weights that already hold a gradient (a second micro-batch): each expert's products are
    added into the same buffers (never rebound), scaled by weight_grad_scale, equal to the fresh
    gradient plus the old; a zero-bubble schedule's deferred weight pass gives the same."""
    rng = np.random.default_rng(1)
    e, c, f, counts = 3, 6, 10, [4, 0, 3]
    x = rng.standard_normal((7, c))
    ws = [Tensor(rng.standard_normal(s), requires_grad=True) for s in ((e, c, f), (e, c, f), (e, f, c))]
    g = rng.standard_normal((7, c))
    grouped_swiglu(Tensor(x, requires_grad=True), *ws, counts).backward(g)
    fresh = [w.grad.copy() for w in ws]
    buffers = [w.grad for w in ws]
    y = grouped_swiglu(Tensor(x, requires_grad=True), *ws, counts, weight_grad_scale=0.5)
    if defer:
        weight_pass = y.backward(g, defer_weight_grad=True)
        np.testing.assert_array_equal(ws[0].grad, fresh[0])  # not yet: the W pass adds it
        weight_pass.run()
    else:
        y.backward(g)
    for w, b, once in zip(ws, buffers, fresh):
        assert w.grad is b
        np.testing.assert_allclose(w.grad, 1.5 * once, rtol=1e-13, atol=1e-14)


def total_loss(model, x, y):
    """The cross-entropy plus the load-balancing loss the layers add to the gradient."""
    logits, loss = model(x, y)
    return loss, loss.item() + CFG.aux_loss_coef * np.mean([blk.mlp.stats["aux_loss"] for blk in model.h])


def test_gradients_include_the_load_balancing_loss():
    """Central differences of cross-entropy + aux_loss_coef x the mean load-balancing loss (float64):
    the router's, the experts' and the attention's gradients agree."""
    model = Mixtral(CFG, dtype="float64", seed=1)
    x, y = tokens(0), tokens(1)
    loss, _ = total_loss(model, x, y)
    loss.backward()
    params = dict(model.named_parameters())
    rng = np.random.default_rng(2)
    for name in ("h.0.mlp.gate.weight", "h.1.mlp.w_gate", "h.0.mlp.w_up", "h.0.mlp.w_down", "h.1.attn.c_attn.weight"):
        p = params[name]
        for idx in (tuple(int(rng.integers(0, s)) for s in p.shape) for _ in range(3)):
            old, eps = p.data[idx], 1e-6
            p.data[idx] = old + eps
            up = total_loss(model, x, y)[1]
            p.data[idx] = old - eps
            down = total_loss(model, x, y)[1]
            p.data[idx] = old
            assert p.grad[idx] == pytest.approx((up - down) / (2 * eps), rel=1e-4, abs=1e-9), (name, idx)


def hf_from_export(model, directory):
    """transformers' MixtralForCausalLM (float64, eager, router logits out) read from the files
    mpirt's export mapping writes (:func:`mpirt.models.hf.mixtral_hf_tensors`, the Hub's layout)."""
    import json

    from safetensors.numpy import save_file
    from transformers import MixtralForCausalLM

    from mpirt.models.hf import mixtral_config_dict, mixtral_hf_tensors
    weights = {n: q.data for n, q in model.named_parameters()}
    directory.mkdir()
    save_file({name: read() for name, _, read in mixtral_hf_tensors(model.config, weights.__getitem__)},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(mixtral_config_dict(model.config, "float64")))
    hf = MixtralForCausalLM.from_pretrained(directory, output_router_logits=True, attn_implementation="eager",
                                            experts_implementation="eager").double().eval()
    return hf


def test_logits_and_load_balancing_loss_equal_hugging_face_mixtral(tmp_path):
    """mpirt's export tensors in transformers' MixtralForCausalLM give mpirt's logits (Hugging
    Face's router runs in float32: ~1e-7), and each layer's load-balancing loss per sequence is
    ``load_balancing_loss_func`` of that layer's router logits of that sequence."""
    torch = pytest.importorskip("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = Mixtral(CFG, dtype="float64", seed=1)
    x = tokens(0)
    logits = model(x)
    hf = hf_from_export(model, tmp_path / "hf")
    with torch.no_grad():
        out = hf(torch.from_numpy(x))
    np.testing.assert_allclose(logits.data, out.logits.numpy(), rtol=0, atol=1e-6)
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())
    for blk, router in zip(model.h, out.router_logits):
        per_seq = router.reshape(3, 16, CFG.n_expert)
        want = np.mean([float(load_balancing_loss_func((per_seq[s],), CFG.n_expert, CFG.top_k)) for s in range(3)])
        assert blk.mlp.stats["aux_loss"] == pytest.approx(want, rel=1e-6)


def test_capacity_drops_the_assignments_over_it_in_token_order():
    """Capacity 1.0 with 16 tokens x top-2 over 4 experts: 8 per expert and sequence. A router that
    prefers two experts for every token fills them and drops the rest; dropless keeps all."""
    import dataclasses
    cfg = dataclasses.replace(CFG, capacity_factor=1.0)
    model = Mixtral(cfg, dtype="float64", seed=1)
    mlp = model.h[0].mlp
    p = np.zeros((3 * 16, 4))
    p[:, 0], p[:, 1], p[:, 2:] = 0.5, 0.3, 0.1               # every token: experts 0 then 1
    choice, kept = mlp.route(p, rows=3)
    assert (choice == [0, 1]).all()
    per_seq = kept.reshape(3, 16, 2)
    assert per_seq[:, :8].all() and not per_seq[:, 8:].any()  # the first 8 tokens of each sequence fit
    dropless = Mixtral(CFG, dtype="float64", seed=1).h[0].mlp
    assert dropless.route(p, rows=3)[1].all()
    x, y = tokens(0), tokens(1)
    _, loss = model(x, y)
    loss.backward()
    stats = [blk.mlp.stats for blk in model.h]
    assert all(s["dropped"] + s["tokens_per_expert"].sum() == 3 * 16 * 2 for s in stats)
    assert all(s["tokens_per_expert"].max() <= 3 * 8 for s in stats)


def test_an_expert_without_tokens_trains_and_gets_no_gradient():
    """Positive inputs and a router column of -1 for expert 3 (+1 for the others): no token picks
    it; the forward and backward run, expert 3 does no work and its weights get zero gradients."""
    mlp = Mixtral(CFG, dtype="float64", seed=1).h[0].mlp
    gate = mlp.gate.weight.data
    gate[...] = np.random.default_rng(4).uniform(0.5, 1.0, gate.shape)
    gate[:, 3] = -1.0
    x = Tensor(np.random.default_rng(5).uniform(0.1, 1.0, (2, 16, CFG.n_embd)), requires_grad=True)
    out = mlp(x)
    out.backward(np.ones(out.shape))
    assert mlp.stats["tokens_per_expert"][3] == 0 and mlp.stats["tokens_per_expert"].sum() == 2 * 16 * 2
    assert not mlp.w_gate.grad[3].any() and not mlp.w_up.grad[3].any() and not mlp.w_down.grad[3].any()
    assert mlp.w_gate.grad[:3].any() and np.isfinite(x.grad).all()


def test_a_hugging_face_mixtral_directory_loads_with_its_logits(tmp_path):
    """A MixtralForCausalLM saved by transformers (safetensors, tied head) is read back through
    :func:`mpirt.core.modeling.load_hf` (config.json's fields, q | k | v fused, the experts'
    gate_up_proj split): the same logits; a untied head is refused naming the key."""
    torch = pytest.importorskip("torch")
    from transformers import MixtralConfig, MixtralForCausalLM

    from mpirt.core.modeling import build_model, load_hf
    from mpirt.core.settings import ConfigError
    hc = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
                       tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = MixtralForCausalLM(hc).eval()
    hf.save_pretrained(tmp_path / "hf")
    cfg, weights = load_hf(tmp_path / "hf")
    assert (cfg.model_type, cfg.n_expert, cfg.top_k, cfg.n_kv_head, cfg.hidden) == ("mixtral", 4, 2, 2, 48)
    model = build_model(cfg)
    model.load_state_dict(weights)
    idx = tokens(3, rows=2)
    with torch.no_grad():
        want = hf(torch.from_numpy(idx)).logits.numpy()
    np.testing.assert_allclose(model(idx).data, want, rtol=0, atol=1e-5)
    config = (tmp_path / "hf" / "config.json")
    config.write_text(config.read_text().replace('"tie_word_embeddings": true', '"tie_word_embeddings": false'))
    with pytest.raises(ConfigError, match="tie_word_embeddings: mpirt supports only True"):
        load_hf(tmp_path / "hf")


def test_kept_activations_match_the_formula():
    """What the graph keeps (kept_bytes, the grouped op's per-expert arrays included) against
    Mixtral.activation_bytes_of: embed + head + a block per layer of the tiny preset, within 3%
    (the routing's index arrays, 8 bytes a row beside a row's 4 C, are not in the formula)."""
    from mpirt.core.modeling import load_model_config
    from mpirt.core.nn import kept_bytes

    cfg = load_model_config("mixtral-tiny", {})
    model = Mixtral(cfg, dtype="float32", seed=1)
    x = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 64))
    _, loss = model(x, x)
    a = Mixtral.activation_bytes_of(cfg, Layout.micro_batch(2, 64))
    assert kept_bytes(loss) == pytest.approx(a["embed"] + a["head"] + cfg.n_layer * a["block"], rel=0.03)
