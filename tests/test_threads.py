"""Tests of mpirt.cpu.threads (blocked passes and split products on the thread pool) and of the ops
that use it: every blocked or split path must give the numbers of the plain one.

The arrays here are small, so the tests shrink the block sizes and thresholds (``blocked``
fixture) to push every op through its blocked, split and threaded code paths.
"""
import numpy as np
import pytest

import mpirt.core.ops.attention as attention
import mpirt.cpu.threads as threads
from mpirt.models import GPT, GPTConfig
from mpirt.core import ops
from mpirt.cpu.hostalloc import keep_freed_memory
from mpirt.core.optim import adamw_update
from mpirt.core.tensor import Tensor


@pytest.fixture
def pool():
    """Two threads with the pool running the products (as with NumPy's OpenBLAS), restored after."""
    before = threads.num_threads()
    threads.set_num_threads(2)
    threads._split_gemms = True  # exercise the split code even where no OpenBLAS is reachable
    yield
    threads.set_num_threads(before)


@pytest.fixture
def blocked(pool, monkeypatch):
    """Tiny blocks and thresholds: every op takes its blocked, split and threaded paths."""
    for name, value in (("BLOCK", 7), ("LIGHT_BLOCK", 7), ("MIN_SPLIT_MACS", 0), ("MAX_TASK_MACS", 1 << 40)):
        monkeypatch.setattr(threads, name, value)
    monkeypatch.setattr(attention, "QUERY_CHUNK", 2)


def test_for_blocks_covers_every_row_once_and_returns_results_in_block_order(pool):
    a = np.arange(40.0).reshape(20, 2)
    out = np.zeros_like(a)

    def kernel(part, dst, none):
        assert none is None
        dst += part + 1
        return part[0, 0]

    firsts = threads.for_blocks(kernel, a, out, None, block=6)
    np.testing.assert_array_equal(out, a + 1)                # every row written exactly once
    assert len(firsts) > 2 and firsts == sorted(firsts)      # block order, whatever thread ran it


def test_for_blocks_runs_whole_arrays_in_one_call_when_small_or_alone():
    calls = []
    threads.for_blocks(lambda part: calls.append(part.shape), np.zeros((4, 3)))
    assert calls == [(4, 3)]


def test_for_blocks_propagates_errors_and_nests_without_deadlock(pool):
    def fail(part):
        if part[0] >= 50:
            raise ValueError("bad block")

    with pytest.raises(ValueError, match="bad block"):
        threads.for_blocks(fail, np.arange(100.0), block=10)

    out = np.zeros(64)

    def outer(part, dst):  # a kernel may itself use blocked passes: inner ones run in its thread
        threads.for_blocks(lambda p, d: np.add(p, 1.0, out=d), part, dst, block=2)

    threads.for_blocks(outer, np.arange(64.0), out, block=8)
    np.testing.assert_array_equal(out, np.arange(64.0) + 1)


@pytest.mark.parametrize("shapes", [((37, 5), (5, 3)),          # rows of a split
                                    ((3, 5), (5, 41)),          # columns of b split (b larger)
                                    ((2, 7, 5), (5, 4)),        # leading dimensions flattened
                                    ((3, 6, 5), (3, 5, 4)),     # batched: the batch split
                                    ((2, 90), (90, 3))])        # long K split, partials added
def test_matmul_split_matches_numpy(blocked, shapes):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(shapes[0]), rng.standard_normal(shapes[1])
    np.testing.assert_allclose(threads.matmul(a, b), a @ b, rtol=1e-13, atol=1e-13)
    if b.ndim == 2:
        bias = rng.standard_normal(b.shape[1])
        np.testing.assert_allclose(threads.matmul(a, b, bias), a @ b + bias, rtol=1e-13, atol=1e-13)
        a2 = a.reshape(-1, a.shape[-1])[::2]                                    # strided rows
        np.testing.assert_allclose(threads.matmul(a2, b), a2 @ b, rtol=1e-13, atol=1e-13)


def test_run_tasks_returns_results_in_order(blocked):
    a = np.arange(12.0).reshape(6, 2)
    got = threads.run_tasks(lambda: threads.sum_rows(a), lambda: threads.matmul(a.T, a), lambda: "third")
    np.testing.assert_array_equal(got[0], a.sum(axis=0))
    np.testing.assert_array_equal(got[1], a.T @ a)
    assert got[2] == "third"
    assert threads.run_tasks(lambda: 1, lambda: 2, macs=1 << 41) == [1, 2]  # large: one after the other


def test_sum_rows_fill_zero_and_set_num_threads(blocked):
    a = np.random.default_rng(1).standard_normal((50, 3))
    np.testing.assert_allclose(threads.sum_rows(a), a.sum(axis=0), rtol=1e-13)
    threads.fill_zero(a)
    assert not a.any()
    with pytest.raises(ValueError, match="n >= 1"):
        threads.set_num_threads(0)


def _gpt_step(seed=0):
    """Loss and every gradient of one float64 GPT step, with attention long enough to chunk."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=8, n_positions=16, vocab_size=11)
    model = GPT(cfg, dtype="float64", seed=seed)
    rng = np.random.default_rng(seed)
    idx, targets = rng.integers(0, 11, (3, 9)), rng.integers(0, 11, (3, 9))
    targets[0, 2] = -100
    model.zero_grad()
    _, loss = model(idx, targets)
    loss.backward()
    return loss.item(), {name: p.grad.copy() for name, p in model.named_parameters()}


def test_gpt_step_blocked_equals_plain(monkeypatch):
    loss, grads = _gpt_step()
    with monkeypatch.context() as m:
        for name, value in (("BLOCK", 7), ("LIGHT_BLOCK", 7), ("MIN_SPLIT_MACS", 0), ("MAX_TASK_MACS", 1 << 40)):
            m.setattr(threads, name, value)
        m.setattr(attention, "QUERY_CHUNK", 2)
        m.setattr(threads, "_split_gemms", True)
        m.setattr(threads, "_num_threads", 2)
        blocked_loss, blocked_grads = _gpt_step()
    assert blocked_loss == pytest.approx(loss, rel=1e-13)
    for name, g in grads.items():
        np.testing.assert_allclose(blocked_grads[name], g, rtol=1e-10, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_attention_query_chunks_match_one_chunk(monkeypatch, dropout_p):
    qkv, g = np.random.default_rng(2).standard_normal((2, 7, 12)), np.random.default_rng(3).standard_normal((2, 7, 4))

    def run():
        x = Tensor(qkv.copy(), requires_grad=True)
        y = ops.causal_self_attention(x, 2, dropout_p=dropout_p, seed=5)
        y.backward(g)
        return y.data, x.grad

    want = run()
    monkeypatch.setattr(attention, "QUERY_CHUNK", 2)  # chunks [0,2) [2,4) [4,7): three key ranges
    got = run()
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_adamw_blocked_is_identical(blocked):
    rng = np.random.default_rng(4)
    p, g, m, v = (rng.standard_normal(1000).astype(np.float32) for _ in range(4))
    v = np.abs(v)
    strided = [np.empty((1000, 2), np.float32)[:, 0] for _ in range(4)]  # not contiguous: one pass
    for dst, src in zip(strided, (p, g, m, v)):
        dst[...] = src
    kw = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    adamw_update(p, g, m, v, **kw)                                   # contiguous: blocked
    adamw_update(*strided, **kw)
    for a, b in zip((p, m, v), (strided[0], strided[2], strided[3])):
        np.testing.assert_array_equal(a, b)


def test_keep_freed_memory_is_idempotent():
    first = keep_freed_memory()
    assert isinstance(first, bool) and keep_freed_memory() is first


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_blocked_passes_work_in_a_forked_child(pool):
    import os
    a = np.arange(64.0)
    threads.for_blocks(lambda part: None, a, block=8)          # the parent's pool is running
    pid = os.fork()
    if pid == 0:  # child: must not wait for the parent's (absent) threads
        out = np.zeros_like(a)
        threads.for_blocks(lambda p, o: np.add(p, 1.0, out=o), a, out, block=8)
        os._exit(0 if np.array_equal(out, a + 1) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
