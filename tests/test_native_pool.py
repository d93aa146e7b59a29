"""mpirt's native thread pool (mpirt/cpu/kernels/kernels_pool.h, :func:`mpirt.cpu.kernels.run_calls`): every
call of a run is done once, with the bits of a plain call; back-to-back runs, two Python threads
calling at once, a changed thread count and a forked child all work; idle workers go to sleep; a
signal still reaches Python's handler while the workers exist. The processes that could hang run
in subprocesses with a timeout.
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from mpirt.cpu import blas, kernels, threads


@pytest.fixture
def two_threads():
    before = threads.num_threads()
    threads.set_num_threads(2)
    yield
    threads.set_num_threads(before)


def gelu_calls(x, y, parts):
    cut = np.linspace(0, x.size, parts + 1).astype(int)
    return [("gelu", x.dtype, x[lo:hi], y[lo:hi], None, hi - lo) for lo, hi in zip(cut, cut[1:])]


def test_a_run_does_every_call_once_with_the_bits_of_plain_calls(two_threads):
    x = np.random.default_rng(0).standard_normal(100_003).astype(np.float32)
    pooled, plain = np.full_like(x, np.nan), np.full_like(x, np.nan)
    kernels.run_calls(gelu_calls(x, pooled, 7), workers=1)
    for name, dtype, *args in gelu_calls(x, plain, 7):
        kernels.call(name, dtype, *args)
    np.testing.assert_array_equal(pooled, plain)


def test_gemm_calls_match_numpy(two_threads):
    if blas.gemm_call(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), np.empty((2, 2), np.float32)) is None:
        pytest.skip(f"{blas.describe()}: no cblas_sgemm to call")
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((64, 48)).astype(np.float32), rng.standard_normal((48, 80)).astype(np.float32)
    bias = rng.standard_normal(80).astype(np.float32)
    out, acc = np.empty((64, 80), np.float32), np.ones((64, 80), np.float32)
    kernels.run_calls([blas.gemm_call(a[:30], b, out[:30], bias=bias), blas.gemm_call(a[30:], b, out[30:], bias=bias),
                       blas.gemm_call(a, b, acc, accumulate=True)], workers=1)
    np.testing.assert_allclose(out, a @ b + bias, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(acc, a @ b + 1, rtol=1e-5, atol=1e-5)


def test_thousands_of_runs_back_to_back_and_from_two_threads_at_once(two_threads):
    """The hand-over between runs (workers still spinning from the last one, late ones) and a
    second caller while a run is going (it runs its calls itself) lose or repeat nothing."""
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(999).astype(np.float32) for _ in range(2)]
    wants = []
    for x in xs:
        want = np.empty_like(x)
        kernels.call("gelu", np.float32, x, want, None, x.size)
        wants.append(want)
    errors = []

    def hammer(i):
        try:
            for _ in range(1500):
                y = np.full_like(xs[i], np.nan)
                kernels.run_calls(gelu_calls(xs[i], y, 5), workers=1)
                if not np.array_equal(y, wants[i]):
                    errors.append(f"caller {i}: a run left elements unset or wrong")
                    return
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))
    callers = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=120)
    assert not any(c.is_alive() for c in callers), "a run never finished"
    assert not errors, errors


def test_the_worker_count_follows_the_thread_count():
    before = threads.num_threads()
    x = np.random.default_rng(3).standard_normal(10_000).astype(np.float32)
    try:
        for n in (3, 1, 2, 4):
            threads.set_num_threads(n)
            y = np.full_like(x, np.nan)
            kernels.run_calls(gelu_calls(x, y, 6), workers=n - 1)
            assert kernels._pool_workers == n - 1
            assert not np.isnan(y).any()
    finally:
        threads.set_num_threads(before)


def test_an_unknown_kernel_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="no pool entry for nope_f32"):
        kernels.run_calls([("nope", np.float32, None)], workers=1)


def run_child(code: str, timeout: float = 60) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


POOL_STARTED = """
    import numpy as np
    from mpirt.cpu import kernels
    x = np.random.default_rng(0).standard_normal(50_000).astype(np.float32)
    y = np.empty_like(x)
    calls = [("gelu", np.float32, x[:25_000], y[:25_000], None, 25_000),
             ("gelu", np.float32, x[25_000:], y[25_000:], None, 25_000)]
    kernels.run_calls(calls, workers=1)
"""


def test_a_forked_child_runs_its_own_pool():
    out = run_child(POOL_STARTED + """
    import os
    pid = os.fork()
    if pid == 0:
        y[:] = np.nan
        kernels.run_calls(calls, workers=1)
        os._exit(0 if not np.isnan(y).any() else 3)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status))
    """)
    assert out.strip() == "0"


def test_idle_workers_sleep():
    """After a run the workers spin for a few milliseconds, then sleep: an idle process takes
    (almost) no CPU time."""
    out = run_child("""
    import os
    import numpy as np
    from mpirt.cpu import kernels
    before = set(os.listdir("/proc/self/task"))
    """ + POOL_STARTED + """
    import time

    def asleep(tid):  # blocked (state S): a spinning worker only yields, so it shows R
        return open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0] == "S"
    workers = set(os.listdir("/proc/self/task")) - before   # the threads the run started
    deadline = time.monotonic() + 30
    while not all(asleep(tid) for tid in workers):
        if time.monotonic() > deadline:
            raise SystemExit(f"the pool's threads {sorted(workers)} were not all asleep within 30 s of the run")
        time.sleep(0.001)
    t0, c0 = time.monotonic(), time.process_time()
    time.sleep(1.0)   # the measured idle time
    print((time.process_time() - c0) / (time.monotonic() - t0))
    """)
    assert float(out) < 0.05, f"an idle process used {float(out):.0%} of a core"


def test_a_signal_reaches_the_python_handler_while_the_workers_exist():
    out = run_child(POOL_STARTED + """
    import os, signal, time
    got = []
    signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    for _ in range(50):                     # workers spinning, then asleep
        os.kill(os.getpid(), signal.SIGUSR1)
        kernels.run_calls(calls, workers=1)
    deadline = time.monotonic() + 10         # until the last signal's handler ran (or 10 s)
    while len(got) < 50 and time.monotonic() < deadline:
        time.sleep(0.001)
    print(len(got))
    """)
    assert out.strip() == "50"


def test_adamw_updates_every_parameter_in_one_run(two_threads, monkeypatch):
    """AdamW.step collects the C updates of all parameters (large ones in blocks) into one run of
    the pool: the same bits as the NumPy forms, one run per step."""
    from mpirt.core.optim import AdamW
    from mpirt.core.nn import Parameter
    rng = np.random.default_rng(4)
    shapes = [(3,), (70, 5), (600_001,), (128, 512), (1,), (300_000,)]
    start = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    runs, real = [], kernels.run_calls
    monkeypatch.setattr(kernels, "run_calls", lambda calls, workers: (runs.append(len(calls)), real(calls, workers)))
    finals = []
    for context in (kernels.numpy_forms, None):
        params = []
        for a in start:
            params.append(Parameter(a.shape))
            params[-1].data = a.copy()
        opt = AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.copy()
            if context is None:
                opt.step()
            else:
                with context():
                    opt.step()
        finals.append([p.data for p in params])
    assert runs == [len(shapes) + 2 + 1] * 3    # the two large ones in 3 and 2 blocks
    for a, b in zip(*finals):
        np.testing.assert_array_equal(a, b)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_two_threads_starting_the_pool_at_once_start_it_once():
    """The first pooled calls of two threads at once (or right after set_num_threads) start the
    workers once: two, not three or four, and none joined twice."""
    lib = kernels.library()
    lib.pool_stop()
    kernels._pool_workers = 0
    before = os_threads()
    x = np.random.default_rng(5).standard_normal(20_000).astype(np.float32)
    barrier, errors = threading.Barrier(2), []

    def first_run():
        try:
            y = np.empty_like(x)
            barrier.wait()
            kernels.run_calls(gelu_calls(x, y, 4), workers=2)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))
    callers = [threading.Thread(target=first_run) for _ in range(2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=60)
    assert not errors, errors
    deadline = time.monotonic() + 10   # a joined thread can linger in /proc for a moment after join
    while os_threads() - before > 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os_threads() - before == 2
    lib.pool_stop()
    kernels._pool_workers = 0


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_norm_gradients_do_not_depend_on_the_thread_count(norm):
    """Weight and bias gradients are sums of per-block partial sums: the blocks are the same at
    any thread count, so are the bits."""
    from mpirt.core import ops
    from mpirt.core.tensor import Tensor
    rng = np.random.default_rng(6)
    x, g = (rng.standard_normal((1024, 768)).astype(np.float32) for _ in range(2))
    w, b = rng.standard_normal(768).astype(np.float32), rng.standard_normal(768).astype(np.float32)
    before, runs = threads.num_threads(), []
    try:
        for n in (1, 2):
            threads.set_num_threads(n)
            ts = [Tensor(a, requires_grad=True) for a in (x, w, b)]
            out = ops.layer_norm(*ts) if norm == "layer_norm" else ops.rms_norm(ts[0], ts[1])
            out.backward(g)
            runs.append([t.grad for t in ts if t.grad is not None])
    finally:
        threads.set_num_threads(before)
    for a, want in zip(*runs):
        np.testing.assert_array_equal(a, want)


def test_array_subclasses_go_through_pooled_products(two_threads, tmp_path):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((512, 256)).astype(np.float32)
    b = np.memmap(tmp_path / "b", dtype=np.float32, mode="w+", shape=(256, 256))
    b[...] = rng.standard_normal((256, 256))
    np.testing.assert_allclose(threads.matmul(a, b), a @ np.asarray(b), rtol=1e-5, atol=1e-4)


def test_a_call_with_missing_arguments_is_refused():
    with pytest.raises(TypeError, match="gelu takes 4 arguments, got 3"):
        kernels.run_calls([("gelu", np.float32, None, None, None)], workers=1)
