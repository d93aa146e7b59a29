"""Tests of mpirt.core.optim against torch.optim: SGD, AdamW, cosine_lr, gradient clipping, state."""
import math

import numpy as np
import pytest
import torch

from mpirt.core.nn import Parameter
from mpirt.core.optim import SGD, AdamW, adamw_update, clip_grad_norm, cosine_lr, global_grad_norm

SHAPES = {"w1": (5, 4), "b1": (4,), "w2": (3, 2, 2), "g": (7,)}
STEPS = 6


def make_params(dtype, seed=0):
    rng = np.random.default_rng(seed)
    params = []
    for name, shape in SHAPES.items():
        p = Parameter(shape, dtype=dtype)
        p.data = rng.standard_normal(shape).astype(dtype)
        p.name = name
        params.append(p)
    return params


def grads_for(step, dtype):
    rng = np.random.default_rng(1000 + step)
    return [rng.standard_normal(shape).astype(dtype) for shape in SHAPES.values()]


def torch_params(params):
    return [torch.tensor(p.data.copy(), requires_grad=True) for p in params]


def run_both(make_ours, make_torch, dtype, steps=STEPS):
    ours = make_params(dtype)
    theirs = torch_params(ours)
    opt, topt = make_ours(ours), make_torch(theirs)
    for t in range(steps):
        opt.lr = topt.param_groups[0]["lr"] = 0.01 * (1 + t) / steps  # a schedule, set every step
        for g in topt.param_groups:
            g["lr"] = opt.lr
        for p, q, g in zip(ours, theirs, grads_for(t, dtype)):
            p.grad = g.copy()
            q.grad = torch.tensor(g)
        opt.step()
        topt.step()
    return ours, theirs, opt, topt


def check_close(ours, theirs, dtype):
    rtol, atol = (1e-12, 1e-15) if dtype == "float64" else (1e-6, 1e-7)
    for p, q in zip(ours, theirs):
        assert p.data.dtype == np.dtype(dtype) and p.grad.dtype == np.dtype(dtype)
        np.testing.assert_allclose(p.data, q.detach().numpy(), rtol=rtol, atol=atol, err_msg=p.name)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("momentum,nesterov,wd", [(0.0, False, 0.0), (0.0, False, 0.1), (0.9, False, 0.0),
                                                   (0.9, True, 0.0), (0.8, True, 0.05), (0.9, False, 0.05)])
def test_sgd_matches_torch(dtype, momentum, nesterov, wd):
    ours, theirs, opt, topt = run_both(
        lambda ps: SGD(ps, lr=0.1, momentum=momentum, weight_decay=wd, nesterov=nesterov),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=momentum, weight_decay=wd, nesterov=nesterov), dtype)
    check_close(ours, theirs, dtype)
    if momentum:
        for p, q, st in zip(ours, theirs, opt.state):
            assert st["momentum_buffer"].dtype == np.dtype(dtype)
            np.testing.assert_allclose(st["momentum_buffer"], topt.state[q]["momentum_buffer"].numpy(),
                                       rtol=1e-12 if dtype == "float64" else 1e-6, atol=1e-7)


def torch_adamw(ps, decayed, wd, **kw):
    groups = [{"params": [q for q, d in zip(ps, decayed) if d], "weight_decay": wd},
              {"params": [q for q, d in zip(ps, decayed) if not d], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=0.01, **kw)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("wd,decay", [(0.0, None), (0.1, None), (0.1, "custom"), (0.01, "all")])
def test_adamw_matches_torch(dtype, wd, decay):
    pred = {None: None, "custom": lambda p: p.name in ("b1", "w2"), "all": lambda p: True}[decay]
    expect = {None: lambda p: p.ndim >= 2, "custom": pred, "all": pred}[decay]
    decayed = [expect(p) for p in make_params(dtype)]
    kw = dict(betas=(0.8, 0.99), eps=1e-6)
    ours, theirs, opt, topt = run_both(lambda ps: AdamW(ps, lr=0.01, weight_decay=wd, decay=pred, **kw),
                                       lambda ps: torch_adamw(ps, decayed, wd, **kw), dtype)
    assert opt.decayed == decayed
    check_close(ours, theirs, dtype)
    rtol, atol = (1e-12, 1e-15) if dtype == "float64" else (1e-6, 1e-7)
    for p, q, st in zip(ours, theirs, opt.state):
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].dtype == np.dtype(dtype), k
            np.testing.assert_allclose(st[k], topt.state[q][k].numpy(), rtol=rtol, atol=atol, err_msg=f"{p.name}.{k}")


def test_adamw_default_decay_skips_vectors():
    ps = make_params("float64")
    opt = AdamW(ps, lr=1.0, weight_decay=0.5)
    assert opt.decayed == [True, False, True, False]


def test_update_is_in_place_and_float32_stays_float32():
    ps = make_params("float32")
    opt = AdamW(ps, lr=1e-3)
    data, state = [p.data for p in ps], [dict(s) for s in opt.state]
    opt.zero_grad()
    grads = [p.grad for p in ps]
    for t in range(3):
        opt.lr = np.float64(1e-3) * (t + 1)  # a NumPy float64 scalar must not promote anything
        for p, g in zip(ps, grads_for(t, "float32")):
            p.grad[...] = g
        opt.step()
    for p, d, g, s, s0 in zip(ps, data, grads, opt.state, state):
        assert p.data is d and p.grad is g and p.data.dtype == np.float32
        assert all(s[k] is s0[k] and s[k].dtype == np.float32 for k in s)
    assert all(b.dtype == np.float32 for b in opt._scratch.values())


def test_adamw_update_on_flat_arrays_matches_class():
    """The raw update (what a ZeRO shard calls) equals the class on one parameter."""
    (p,) = make_params("float64")[:1]
    flat = p.data.reshape(-1).copy()
    m, v = np.zeros_like(flat), np.zeros_like(flat)
    opt = AdamW([p], lr=0.01, weight_decay=0.1)
    for t in range(3):
        g = grads_for(t, "float64")[0]
        p.grad = g
        opt.step()
        adamw_update(flat, g.reshape(-1), m, v, step=t + 1, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.1)
    np.testing.assert_array_equal(flat, p.data.reshape(-1))


def test_step_skips_params_without_grad():
    ps = make_params("float64")
    before = ps[1].data.copy()
    opt = SGD(ps, lr=0.1, momentum=0.9)
    for p, g in zip(ps, grads_for(0, "float64")):
        p.grad = g
    ps[1].grad = None
    opt.step()
    np.testing.assert_array_equal(ps[1].data, before)
    assert not np.array_equal(ps[0].data, make_params("float64")[0].data)


def test_zero_grad_allocates_once_and_keeps_buffers():
    ps = make_params("float32")
    opt = SGD(ps, lr=0.1)
    opt.zero_grad()
    bufs = [p.grad for p in ps]
    assert all(b.dtype == np.float32 and not b.any() for b in bufs)
    for b in bufs:
        b += 3.0
    opt.zero_grad()
    assert all(p.grad is b and not b.any() for p, b in zip(ps, bufs))


def test_state_dict_round_trip_continues_identically():
    def train(opt, params, steps):
        for t in steps:
            for p, g in zip(params, grads_for(t, "float64")):
                p.grad = g
            opt.step()

    a = make_params("float64")
    opt_a = AdamW(a, lr=0.01, weight_decay=0.1)
    train(opt_a, a, range(3))
    sd = opt_a.state_dict()
    assert sd["step"] == 3 and sd["type"] == "AdamW" and sd["beta2"] == 0.999
    assert set(k for k in sd if "." in k) == {f"{n}.{s}" for n in SHAPES for s in ("exp_avg", "exp_avg_sq")}
    b = make_params("float64")
    for p, q in zip(a, b):
        q.data[...] = p.data
    opt_b = AdamW(b, lr=0.5, weight_decay=0.0)
    opt_b.load_state_dict(sd)
    assert opt_b.step_count == 3 and opt_b.weight_decay == 0.1 and opt_b.lr == opt_a.lr
    sd["w1.exp_avg"][...] = 123.0  # the state dict holds copies, not views of the live state
    assert not (opt_a.state[0]["exp_avg"] == 123.0).any() and not (opt_b.state[0]["exp_avg"] == 123.0).any()
    train(opt_a, a, range(3, 5))
    train(opt_b, b, range(3, 5))
    for p, q in zip(a, b):
        np.testing.assert_array_equal(p.data, q.data)


def test_load_state_dict_errors_name_the_key():
    ps = make_params("float64")
    opt = AdamW(ps, lr=0.01)
    sd = opt.state_dict()
    bad = dict(sd)
    del bad["b1.exp_avg_sq"]
    with pytest.raises(KeyError, match=r"b1\.exp_avg_sq"):
        opt.load_state_dict(bad)
    bad = dict(sd, **{"w2.exp_avg": np.zeros((3, 4))})
    with pytest.raises(ValueError, match=r"w2\.exp_avg has shape \(3, 4\), expected \(3, 2, 2\)"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="AdamW"):
        SGD(ps, lr=0.1).load_state_dict(sd)
    unnamed = Parameter((2,))
    unnamed.data = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="no name"):
        SGD([unnamed], lr=0.1).state_dict()
    with pytest.raises(ValueError, match="twice"):
        SGD([ps[0], ps[0]], lr=0.1)


def test_cosine_lr_closed_form():
    kw = dict(lr=6e-4, min_lr=6e-5, warmup_steps=10, total_steps=110)
    assert cosine_lr(0, **kw) == pytest.approx(6e-4 / 10, rel=1e-15)
    assert cosine_lr(4, **kw) == pytest.approx(6e-4 * 5 / 10, rel=1e-15)
    assert cosine_lr(9, **kw) == pytest.approx(6e-4, rel=1e-15)
    assert cosine_lr(10, **kw) == pytest.approx(6e-4, rel=1e-15)  # peak: start of the decay
    assert cosine_lr(60, **kw) == pytest.approx((6e-4 + 6e-5) / 2, rel=1e-14)  # midpoint
    assert cosine_lr(35, **kw) == pytest.approx(6e-5 + 0.5 * (1 + math.cos(math.pi / 4)) * 5.4e-4, rel=1e-14)
    assert cosine_lr(110, **kw) == pytest.approx(6e-5, rel=1e-14)
    assert cosine_lr(500, **kw) == 6e-5
    lrs = [cosine_lr(t, **kw) for t in range(10, 111)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))
    assert cosine_lr(0, lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=4) == 1.0
    assert isinstance(cosine_lr(3, **kw), float)
    with pytest.raises(ValueError, match="warmup_steps"):
        cosine_lr(0, lr=1.0, min_lr=0.0, warmup_steps=5, total_steps=4)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch(dtype, max_norm):
    ours = make_params(dtype)
    theirs = torch_params(ours)
    for p, q, g in zip(ours, theirs, grads_for(0, dtype)):
        p.grad, q.grad = g.copy(), torch.tensor(g)
    original = [p.grad.copy() for p in ours]
    norm = clip_grad_norm(ours, max_norm)
    tnorm = float(torch.nn.utils.clip_grad_norm_(theirs, max_norm))
    rtol = 1e-12 if dtype == "float64" else 1e-6
    assert isinstance(norm, float) and norm == pytest.approx(tnorm, rel=rtol)
    for p, q, g0 in zip(ours, theirs, original):
        assert p.grad.dtype == np.dtype(dtype)
        np.testing.assert_allclose(p.grad, q.grad.numpy(), rtol=rtol, atol=1e-7 if dtype == "float32" else 0)
        if max_norm > norm:
            np.testing.assert_array_equal(p.grad, g0)  # no clipping: untouched
    if max_norm < norm:
        assert global_grad_norm(ours) == pytest.approx(max_norm, rel=1e-5)


def test_allreduce_sq_is_used_for_the_global_norm():
    ps = make_params("float64")
    for p, g in zip(ps, grads_for(0, "float64")):
        p.grad = g
    local = math.sqrt(sum(float((p.grad ** 2).sum()) for p in ps))
    calls = []

    def allreduce_sq(x):  # as if three ranks held equal shards
        calls.append(x)
        return 3.0 * x

    assert global_grad_norm(ps, allreduce_sq) == pytest.approx(math.sqrt(3) * local, rel=1e-12)
    assert calls == [pytest.approx(local ** 2, rel=1e-12)]
    g0 = ps[0].grad.copy()
    norm = clip_grad_norm(ps, local, allreduce_sq=allreduce_sq)  # locally fine, globally too big
    assert norm == pytest.approx(math.sqrt(3) * local) and len(calls) == 2
    np.testing.assert_allclose(ps[0].grad, g0 * local / (norm + 1e-6), rtol=1e-12)
    ps[0].grad = None  # parameters without gradient are ignored
    assert global_grad_norm(ps) < local
