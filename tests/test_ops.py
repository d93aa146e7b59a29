"""Single-process tests of every op in mpirt.core.ops: finite differences, PyTorch parity, dtypes,
deferred weight gradients, hooks and graph recording."""
import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mpirt
from mpirt.cpu import kernels
from mpirt.core import ops
from mpirt.core.ops.rotary import rotary_tables
from mpirt.core.ops.fused import scatter_add_rows
from mpirt.core.tensor import Tensor, no_grad
from mpirt.core.testing import gradcheck, normal, op_cases


# ------------------------------------------------------------------------------------------
# One table drives both the float64 gradient check and the float32 dtype check.
# Each case: (op name from ops.__all__, function of Tensors, list of input arrays).
# Integer arrays are constants; every function calls exactly one op (split returns a list).
# ------------------------------------------------------------------------------------------
CASES = op_cases()


def test_cases_cover_every_exported_op():
    assert set(ops.__all__) <= {op for op, _, _ in CASES.values()}


def _as_tensor_output(out):
    return ops.concat([p.reshape(-1) for p in out], axis=0) if isinstance(out, list) else out


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck(name):
    _, f, inputs = CASES[name]
    gradcheck(lambda *ts: _as_tensor_output(f(*ts)), *inputs)


@pytest.mark.parametrize("name", list(CASES))
def test_float32_outputs_and_gradients(name):
    """Every output and every gradient a Function returns keeps float32 (checked on the Function's
    own backward, since leaf accumulation would cast and hide a promotion). The seed gradient is
    read-only: no backward may write into its incoming gradient."""
    _, f, inputs = CASES[name]
    arrays = [a.astype(np.float32) if a.dtype.kind == "f" else a for a in inputs]
    tensors = [Tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    outs = f(*tensors)
    for out in outs if isinstance(outs, list) else [outs]:
        assert out.dtype == np.float32, f"{name}: output is {out.dtype}"
        g = np.random.default_rng(5).standard_normal(out.shape).astype(np.float32)
        g.flags.writeable = False
        fn = out._ctx
        grads = fn.backward(g)
        assert len(grads) >= len(fn.inputs)
        for x, gx, need in zip(fn.inputs, grads, fn.needs_input_grad):
            if need:
                assert gx is not None
                assert gx.dtype == np.float32, f"{name}: gradient is {gx.dtype}"
                assert tuple(gx.shape) == tuple(x.shape)
    # and through the engine end to end
    total = _as_tensor_output(f(*tensors))
    total.backward(np.ones(total.shape, np.float32))
    for t in tensors:
        if t.requires_grad:
            assert t.grad.dtype == np.float32 and np.isfinite(t.grad).all()


# ------------------------------------------------------------------------------------------
# Forward values and gradients against PyTorch (float64)
# ------------------------------------------------------------------------------------------
def _torch(a, grad=False):
    return torch.tensor(a, dtype=torch.float64, requires_grad=grad)


def test_gelu_matches_torch_tanh_gelu():
    x = 3 * normal(4, 7)
    np.testing.assert_allclose(ops.gelu(Tensor(x)).data, F.gelu(_torch(x), approximate="tanh").numpy(), rtol=1e-12, atol=1e-14)


def test_softmax_and_log_softmax_match_torch():
    x = 10 * normal(3, 4, 6)
    for axis in (-1, 1):
        np.testing.assert_allclose(ops.softmax(Tensor(x), axis).data, torch.softmax(_torch(x), axis).numpy(), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(ops.log_softmax(Tensor(x), axis).data, torch.log_softmax(_torch(x), axis).numpy(), rtol=1e-12, atol=1e-12)


def test_softmax_is_stable_for_large_inputs():
    x = np.array([[1000.0, 1001.0, -1000.0]], dtype=np.float32)
    y = ops.softmax(Tensor(x)).data
    ls = ops.log_softmax(Tensor(x)).data
    assert np.isfinite(y).all() and np.isfinite(ls).all()
    np.testing.assert_allclose(y.sum(), 1.0, rtol=1e-6)


def test_layer_norm_matches_torch():
    x, w, b = normal(2, 3, 8), normal(8, seed=1), normal(8, seed=2)
    got = ops.layer_norm(Tensor(x), Tensor(w), Tensor(b), eps=1e-5).data
    want = F.layer_norm(_torch(x), (8,), _torch(w), _torch(b), eps=1e-5).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_rms_norm_and_swiglu_match_torch():
    x, w = normal(2, 3, 8), normal(8, seed=1)
    got = ops.rms_norm(Tensor(x), Tensor(w), eps=1e-5).data
    np.testing.assert_allclose(got, F.rms_norm(_torch(x), (8,), _torch(w), eps=1e-5).numpy(), rtol=1e-12)
    a, b = 4 * normal(3, 5, seed=2), normal(3, 5, seed=3)
    np.testing.assert_allclose(ops.swiglu(Tensor(a), Tensor(b)).data, (F.silu(_torch(a)) * _torch(b)).numpy(),
                               rtol=1e-12)


def _in_place_cases():
    """Each op that can write into the input it is given up: name -> op(input, into)."""
    t, d = 6, 4
    cos, sin = rotary_tables(t, d, 500.0, np.float32)
    return {
        "add": (lambda x, into: ops.add(x, Tensor(normal(2, t, 20, seed=5).astype(np.float32)), into_first=into)),
        "gelu": (lambda x, into: ops.gelu(x, into_input=into)),
        "rotary_embedding": (lambda x, into: ops.rotary_embedding(x, cos, sin, n_kv_head=1, into_input=into)),
    }


@pytest.mark.parametrize("numpy_forms", [False, True], ids=["kernels", "numpy"])
@pytest.mark.parametrize("name", ["add", "gelu", "rotary_embedding"])
def test_ops_written_into_a_given_up_input_equal_the_copying_form(name, numpy_forms):
    """``into_first`` / ``into_input``: the result is the input's buffer (nothing freed between
    the kept activations) and equal to the copying form to the bit, forward and backward, with
    the C kernels and in their NumPy forms; a read-only input is not written."""
    with kernels.numpy_forms() if numpy_forms else contextlib.nullcontext():
        _check_written_into_input(_in_place_cases()[name])


def _check_written_into_input(op):
    x0 = normal(2, 6, 20, seed=4).astype(np.float32)               # (B, T, (3 + 2) heads x 4) for rotary
    dy = normal(2, 6, 20, seed=6).astype(np.float32)
    results = {}
    for into in (False, True):
        x = Tensor(x0.copy(), requires_grad=True)
        lead = ops.mul(x, 1.0)                                     # an op's output, as in a model
        buf = lead.data
        y = op(lead, into)
        assert (y.data is buf) == into
        y.backward(dy)
        results[into] = (y.data.copy(), x.grad.copy())
    for copying, written in zip(results[False], results[True]):
        np.testing.assert_array_equal(copying, written)
    leaf = Tensor(x0.copy(), requires_grad=True)                   # a parameter's data is never written
    assert not np.shares_memory(op(leaf, True).data, leaf.data)
    with no_grad():                                                # nor what evaluation makes
        made = ops.mul(Tensor(x0.copy()), 1.0)
        assert not np.shares_memory(op(made, True).data, made.data)


def test_gelu_into_a_strided_input_copies():
    """A transposed (not C-contiguous) input is not written into: GELU's result and gradient
    equal the copying form's."""
    x = Tensor(normal(4, 6, seed=1).astype(np.float32), requires_grad=True)
    outs = []
    for into in (False, True):
        x.grad = None
        lead = ops.mul(x, 1.0).T                                   # an op's output, strided
        y = ops.gelu(lead, into_input=into)
        assert not np.shares_memory(y.data, lead.data)
        y.backward(np.ones(y.shape, dtype=np.float32))
        outs.append((y.data.copy(), x.grad.copy()))
    for copying, written in zip(*outs):
        np.testing.assert_array_equal(copying, written)


def _torch_rotate(x, cos, sin):
    """Hugging Face Llama's ``apply_rotary_pos_emb`` on (B, H, T, D) with (T, D/2) tables."""
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("h, hk", [(3, 3), (4, 2), (4, 1)])
def test_rotary_attention_matches_torch_reference(h, hk):
    """Rotary q and k, then mpirt's fused causal attention, against HF Llama's rotation and
    PyTorch's SDPA: outputs and the gradient of the fused qkv; with hk < h key/value heads
    (grouped-query attention) too."""
    b, t, d = 2, 7, 4
    qkv, dy = normal(b, t, (h + 2 * hk) * d), normal(b, t, h * d, seed=1)
    cos, sin = rotary_tables(t, d, 500.0, np.float64)
    x = Tensor(qkv.copy(), requires_grad=True)
    y = ops.causal_self_attention(ops.rotary_embedding(x, cos, sin, n_kv_head=hk), n_head=h, n_kv_head=hk)
    y.backward(dy)
    tx = _torch(qkv, grad=True)
    q, k, v = tx.split([h * d, hk * d, hk * d], dim=-1)
    q, k, v = (part.reshape(b, t, -1, d).transpose(1, 2) for part in (q, k, v))
    tc, ts = torch.from_numpy(cos), torch.from_numpy(sin)
    k, v = (z.repeat_interleave(h // hk, dim=1) for z in (_torch_rotate(k, tc, ts), v))
    ty = F.scaled_dot_product_attention(_torch_rotate(q, tc, ts), k, v, is_causal=True)
    ty = ty.transpose(1, 2).reshape(b, t, h * d)
    ty.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(y.data, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(x.grad, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="does not fit tables"):
        ops.rotary_embedding(Tensor(qkv), *rotary_tables(t, 3 * h * d, 500.0, np.float64))
    with pytest.raises(ValueError, match="must be even"):
        rotary_tables(t, 5, 500.0, np.float64)


def test_cross_entropy_matches_torch_value_and_gradient():
    logits = 3 * normal(2, 5, 7)
    targets = np.random.default_rng(1).integers(0, 7, (2, 5))
    targets[0, 1] = targets[1, 4] = -100
    for reduction in ("mean", "sum"):
        x = Tensor(logits.copy(), requires_grad=True)
        loss = ops.cross_entropy(x, targets, ignore_index=-100, reduction=reduction)
        loss.backward()
        tx = _torch(logits, grad=True)
        want = F.cross_entropy(tx.reshape(-1, 7), torch.tensor(targets.reshape(-1)), ignore_index=-100, reduction=reduction)
        want.backward()
        assert loss.shape == ()
        np.testing.assert_allclose(loss.item(), want.item(), rtol=1e-12)
        np.testing.assert_allclose(x.grad, tx.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_cross_entropy_chunked_forward_matches_torch(monkeypatch):
    """The forward runs a few rows at a time; force uneven blocks of 2 rows at this tiny size."""
    import mpirt.cpu.threads as threads
    monkeypatch.setattr(threads, "BLOCK", 2 * 9)
    logits, targets = 4 * normal(7, 9), np.random.default_rng(2).integers(0, 9, 7)
    targets[3] = -100
    x = Tensor(logits.copy(), requires_grad=True)
    loss = ops.cross_entropy(x, targets)
    loss.backward()
    tx = _torch(logits, grad=True)
    want = F.cross_entropy(tx, torch.tensor(targets), ignore_index=-100)
    want.backward()
    np.testing.assert_allclose(loss.item(), want.item(), rtol=1e-12)
    np.testing.assert_allclose(x.grad, tx.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_cross_entropy_all_ignored_is_zero_with_zero_gradient():
    x = Tensor(normal(4, 3).astype(np.float32), requires_grad=True)
    loss = ops.cross_entropy(x, np.full(4, -100))
    loss.backward()
    assert loss.item() == 0.0 and loss.dtype == np.float32
    assert np.all(x.grad == 0) and np.isfinite(x.grad).all()


def test_cross_entropy_extreme_logits_stay_finite():
    logits = np.array([[1e4, -1e4, 0.0], [-3e4, 3e4, 2.9e4]], dtype=np.float32)
    x = Tensor(logits, requires_grad=True)
    loss = ops.cross_entropy(x, np.array([0, 2]))
    loss.backward()
    np.testing.assert_allclose(loss.item(), 1e3 / 2, rtol=1e-5)
    assert np.isfinite(x.grad).all()


def test_cross_entropy_rejects_bad_targets():
    with pytest.raises(IndexError, match="cross_entropy"):
        ops.cross_entropy(Tensor(normal(2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="targets shape"):
        ops.cross_entropy(Tensor(normal(2, 3)), np.array([0, 1, 2]))
    with pytest.raises(TypeError, match="integers"):
        ops.cross_entropy(Tensor(normal(2, 3)), np.array([0.0, 1.0]))


def _torch_causal_attention(qkv, n_head, n_kv_head=None):
    """PyTorch's SDPA on a fused (B, T, C + 2 Ck) qkv; fewer key/value heads are repeated over
    their group of query heads (Hugging Face Llama's ``repeat_kv``)."""
    kv = n_kv_head or n_head
    b, t, w = qkv.shape
    d = w // (n_head + 2 * kv)
    q, k, v = qkv.split([n_head * d, kv * d, kv * d], dim=-1)
    heads = lambda z, n: z.reshape(b, t, n, d).transpose(1, 2)  # noqa: E731
    k, v = (heads(z, kv).repeat_interleave(n_head // kv, dim=1) for z in (k, v))
    out = F.scaled_dot_product_attention(heads(q, n_head), k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, t, n_head * d)


@pytest.mark.parametrize("shape,n_head,n_kv_head", [((2, 5, 24), 2, None), ((2, 1, 24), 2, None), ((3, 7, 36), 3, None),
                                                    ((1, 6, 12), 1, None), ((2, 9, 32), 6, 1), ((3, 70, 40), 6, 2),
                                                    ((2, 7, 48), 4, 4)])
def test_attention_matches_torch_sdpa(shape, n_head, n_kv_head):
    """Multi-head and grouped-query attention (n_kv_head key/value heads): outputs and the fused
    qkv's gradient, the key/value columns summed over each group's query heads."""
    qkv = normal(*shape)
    x = Tensor(qkv.copy(), requires_grad=True)
    out = ops.causal_self_attention(x, n_head, n_kv_head=n_kv_head)
    g = normal(*out.shape, seed=3)
    out.backward(g)
    tx = _torch(qkv, grad=True)
    want = _torch_causal_attention(tx, n_head, n_kv_head)
    want.backward(torch.tensor(g))
    np.testing.assert_allclose(out.data, want.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(x.grad, tx.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_grouped_query_attention_refuses_heads_that_do_not_group():
    with pytest.raises(ValueError, match="n_kv_head=4 key and value heads"):
        ops.causal_self_attention(Tensor(normal(1, 3, 6 * 14)), 6, n_kv_head=4)   # 4 does not divide 6
    with pytest.raises(ValueError, match="n_kv_head=2"):
        ops.causal_self_attention(Tensor(normal(1, 3, 50)), 4, n_kv_head=2)       # 50 is not 8 heads


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_attention_saves_no_score_sized_float_array(dropout_p):
    """The backward computes the scores again: what the forward keeps of size (B, H, T, T) is at
    most the dropout mask (bool); per query it keeps the log-sum-exp of the scores."""
    for dtype in (np.float32, np.float64):
        qkv = Tensor(normal(2, 6, 12).astype(dtype), requires_grad=True)
        out = ops.causal_self_attention(qkv, 2, dropout_p=dropout_p, seed=0)
        saved = [a for a in vars(out._ctx).values() if hasattr(a, "shape") and a.shape == (2, 2, 6, 6)]
        assert [a.dtype.kind for a in saved] == ([] if dropout_p == 0 else ["b"])
        assert out._ctx.lse.shape == (2, 2, 6, 1) and out._ctx.lse.dtype == dtype
        assert (out._ctx.mask is None) == (dropout_p == 0)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_float32_attention_multiplies_in_float32(dropout_p, monkeypatch):
    """Every product of a float32 attention, forward and backward (the NumPy form, dropout
    included), takes float32 operands: a bool mask times a Python float would be float64."""
    dtypes = set()
    matmul = np.matmul

    def recording(a, b, *args, **kwargs):
        dtypes.update({a.dtype, b.dtype})
        return matmul(a, b, *args, **kwargs)
    monkeypatch.setattr(np, "matmul", recording)
    qkv = Tensor(normal(2, 70, 24).astype(np.float32), requires_grad=True)
    with kernels.numpy_forms():
        out = ops.causal_self_attention(qkv, 2, dropout_p=dropout_p, seed=0)
        out.backward(np.ones(out.shape, dtype=np.float32))
    assert dtypes == {np.dtype(np.float32)} and qkv.grad.dtype == np.float32


def test_attention_is_causal():
    qkv = normal(1, 6, 12)
    out = ops.causal_self_attention(Tensor(qkv), 2).data
    changed = qkv.copy()
    changed[:, 4:] += 5.0  # the future must not leak into positions 0..3
    out2 = ops.causal_self_attention(Tensor(changed), 2).data
    np.testing.assert_allclose(out[:, :4], out2[:, :4], rtol=1e-12)
    assert not np.allclose(out[:, 4:], out2[:, 4:])


def test_attention_dropout_seeded_and_validated():
    qkv = Tensor(normal(2, 4, 12))
    a = ops.causal_self_attention(qkv, 2, dropout_p=0.5, seed=1).data
    b = ops.causal_self_attention(qkv, 2, dropout_p=0.5, seed=1).data
    c = ops.causal_self_attention(qkv, 2, dropout_p=0.5, seed=2).data
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    with pytest.raises(ValueError, match="dropout_p"):
        ops.causal_self_attention(qkv, 2, dropout_p=1.0, seed=1)
    with pytest.raises(ValueError, match="seed"):
        ops.causal_self_attention(qkv, 2, dropout_p=0.1)
    with pytest.raises(ValueError, match="n_head"):
        ops.causal_self_attention(qkv, 3)


# ------------------------------------------------------------------------------------------
# dropout and embedding specifics
# ------------------------------------------------------------------------------------------
def test_dropout_mask_is_seeded_scaled_and_has_rate_p():
    x = Tensor(np.ones((200, 100), np.float32), requires_grad=True)
    y = ops.dropout(x, 0.25, seed=11)
    assert y.dtype == np.float32
    vals = np.unique(y.data)
    np.testing.assert_allclose(vals, [0.0, 1 / 0.75], rtol=1e-6)
    assert abs((y.data == 0).mean() - 0.25) < 0.02
    np.testing.assert_array_equal(y.data, ops.dropout(x, 0.25, seed=11).data)
    assert not np.array_equal(y.data, ops.dropout(x, 0.25, seed=12).data)
    y.backward(np.ones(y.shape, np.float32))
    np.testing.assert_array_equal(x.grad, y.data)  # gradient uses the same mask and scale


def test_dropout_identity_when_off_and_validates_p():
    x = Tensor(normal(3, 4), requires_grad=True)
    assert ops.dropout(x, 0.0, seed=1) is x
    assert ops.dropout(x, 0.5, seed=1, training=False) is x
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="p"):
            ops.dropout(x, p, seed=1)


@pytest.mark.parametrize("vocab,n", [(7, 50), (1000, 300), (5, 1)])
def test_scatter_add_rows_matches_add_at(vocab, n):
    ids = np.random.default_rng(3).integers(0, vocab, n)
    rows = np.random.default_rng(4).standard_normal((n, 6)).astype(np.float32)
    want = np.zeros((vocab, 6), np.float32)
    np.add.at(want, ids, rows)
    got = scatter_add_rows(ids, rows, vocab)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    base = np.random.default_rng(5).standard_normal((vocab, 6)).astype(np.float32)  # adds into an existing buffer
    out = base.copy()
    assert scatter_add_rows(ids, rows, out=out) is out
    np.testing.assert_allclose(out, base + want, rtol=1e-5, atol=1e-6)


def test_embedding_forward_and_validation():
    w = normal(6, 3)
    ids = np.array([[5, 0], [0, 2]])
    np.testing.assert_array_equal(ops.embedding(ids, Tensor(w)).data, w[ids])
    with pytest.raises(IndexError):
        ops.embedding(np.array([6]), Tensor(w))
    with pytest.raises(TypeError):
        ops.embedding(np.array([0.0]), Tensor(w))


# ------------------------------------------------------------------------------------------
# Engine behaviour: deferred weight gradients, hooks, no_grad, seeds
# ------------------------------------------------------------------------------------------
def _reference_grads(build, arrays):
    ts = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    build(*ts).sum().backward()
    return [t.grad for t in ts]


@pytest.mark.parametrize("kind", ["linear", "embedding", "layer_norm", "rms_norm"])
def test_deferred_weight_gradient(kind):
    if kind == "linear":
        arrays = [normal(2, 3, 4), normal(4, 5, seed=1), normal(5, seed=2)]
        build = lambda x, w, b: ops.linear(x, w, b)  # noqa: E731
    elif kind == "embedding":
        ids = np.array([[0, 2, 2], [3, 0, 1]])
        arrays = [normal(2, 3, 3), normal(4, 3, seed=1)]
        build = lambda x, w: ops.embedding(ids, w) * x  # noqa: E731  (x: an input that is not a weight)
    elif kind == "layer_norm":
        arrays = [normal(3, 6), normal(6, seed=1), normal(6, seed=2)]
        build = lambda x, w, b: ops.layer_norm(x, w, b) * x  # noqa: E731
    else:
        arrays = [normal(3, 6), normal(6, seed=1)]
        build = lambda x, w: ops.rms_norm(x, w) * x  # noqa: E731
    want = _reference_grads(build, arrays)
    ts = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    fired = []
    for t in ts[1:]:
        t.register_hook(lambda leaf: fired.append(id(leaf)))
    pending = build(*ts).sum().backward(defer_weight_grad=True)
    np.testing.assert_allclose(ts[0].grad, want[0], rtol=1e-12)
    assert all(t.grad is None for t in ts[1:]) and fired == []
    pending.run()
    for t, w in zip(ts[1:], want[1:]):
        np.testing.assert_allclose(t.grad, w, rtol=1e-12)
    assert sorted(fired) == sorted(id(t) for t in ts[1:])


def test_hook_fires_once_after_grad_is_complete():
    x = Tensor(normal(3), requires_grad=True)
    seen = []
    x.register_hook(lambda leaf: seen.append(leaf.grad.copy()))
    y = (x * x).sum() + (x * 2.0).sum()   # x reaches the loss along three edges
    y.backward()
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], 2 * x.data + 2.0)
    np.testing.assert_allclose(x.grad, seen[0])


def test_no_grad_records_no_graph():
    x = Tensor(normal(2, 3), requires_grad=True)
    with no_grad():
        y = ops.gelu(x * 2.0)
        z = ops.cross_entropy(y, np.array([0, 1]))
    assert y._ctx is None and not y.requires_grad and z._ctx is None
    assert mpirt.is_grad_enabled()
    assert ops.gelu(x)._ctx is not None


def test_backward_seed_must_match_shape():
    x = Tensor(normal(2, 3), requires_grad=True)
    y = ops.gelu(x)
    with pytest.raises(ValueError, match="seed gradient shape"):
        y.backward(np.ones((3, 2)))
    with pytest.raises(ValueError, match="seed gradient is required"):
        y.backward()
    y.backward(np.ones((2, 3)))
    assert x.grad.shape == (2, 3)


def test_max_ties_share_gradient():
    x = Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]], np.float32), requires_grad=True)
    x.max(axis=1).sum().backward()
    np.testing.assert_allclose(x.grad, [[0, 0.5, 0.5], [1, 0, 0]])
    assert x.grad.dtype == np.float32


def test_retain_graph_runs_fused_ops_twice_except_cross_entropy():
    qkv = Tensor(normal(1, 4, 12), requires_grad=True)
    w, b = Tensor(normal(4, seed=1), requires_grad=True), Tensor(normal(4, seed=2), requires_grad=True)
    h = ops.causal_self_attention(qkv, 2)
    y = ops.softmax(ops.gelu(ops.layer_norm(h, w, b)) * 2.0).sum() + ops.log_softmax(h).sum()
    y.backward(retain_graph=True)
    first = [t.grad.copy() for t in (qkv, w, b)]
    y.backward(retain_graph=True)
    for t, g1 in zip((qkv, w, b), first):
        np.testing.assert_allclose(t.grad, 2 * g1, rtol=1e-12, atol=1e-15)
    loss = ops.cross_entropy(Tensor(normal(3, 4), requires_grad=True), np.array([0, 1, 2]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cross_entropy: backward ran twice"):
        loss.backward(retain_graph=True)
