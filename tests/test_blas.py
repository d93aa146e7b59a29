"""mpirt.cpu.blas: every GEMM library gives numpy.matmul's numbers on any layout, and the choice
(override, calibration, cache, degradation) is what the banner says."""
from __future__ import annotations

import platform

import numpy as np
import pytest

import mpirt.cpu.threads as threads
from mpirt.cpu import blas

FOUND, MISSING = blas.available()


@pytest.fixture(autouse=True)
def restore_choice(monkeypatch, tmp_path):
    monkeypatch.setenv("MPIRT_CACHE", str(tmp_path))
    monkeypatch.delenv(blas.ENV, raising=False)
    before = blas._choice
    yield
    blas._choice = before


def test_the_extra_is_installed():
    """The dev extra installs cpu-fast, so CI runs every library's path (MKL: x86-64 only)."""
    wanted = {"blis"} | ({"mkl"} if platform.machine() in ("x86_64", "AMD64") else set())
    assert not wanted & set(MISSING), MISSING


def layouts(a):
    """``a`` as C-ordered, the transpose of a C-ordered array, a row-strided view (leading
    dimension larger than the row), a column-strided view (no unit stride: BLAS cannot read it)
    and a read-only one."""
    m, k = a.shape
    wide = np.zeros((m, k + 3), a.dtype)
    wide[:, :k] = a
    every_other = np.zeros((m, 2 * k), a.dtype)
    every_other[:, ::2] = a
    readonly = a.copy()
    readonly.flags.writeable = False
    return {"C": a.copy(), "F": np.asfortranarray(a), "row-strided": wide[:, :k],
            "col-strided": every_other[:, ::2], "read-only": readonly}


@pytest.mark.parametrize("name", sorted(FOUND))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (7, 5, 3), (1, 9, 1), (33, 1, 17), (65, 66, 67)])
def test_every_library_equals_numpy_on_every_layout(name, dtype, mkn):
    blas.choose(name)
    m, k, n = mkn
    rng = np.random.default_rng(0)
    a0, b0 = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    ref = a0.astype(np.float64) @ b0.astype(np.float64)
    for la, a in layouts(a0).items():
        for lb, b in layouts(b0).items():
            for lo in ("new", "C", "F", "strided"):
                if lo == "new":
                    out = None
                elif lo == "strided":                       # every other column of a wider array
                    out = np.zeros((m, 2 * n), dtype)[:, ::2]
                else:
                    out = np.zeros((m, n), dtype, order=lo)
                got = blas.gemm(a, b, out)
                assert out is None or got is out
                np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * k, err_msg=f"{name} {la} @ {lb} -> {lo}")


@pytest.mark.parametrize("name", sorted(FOUND))
def test_empty_mixed_and_integer_products_fall_back(name):
    blas.choose(name)
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((4, 0)).astype(np.float32), np.zeros((0, 3), np.float32)
    np.testing.assert_array_equal(blas.gemm(a, b), np.zeros((4, 3), np.float32))
    a, b = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal((5, 3))
    got = blas.gemm(a, b)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, a @ b, rtol=1e-12)
    ai, bi = np.arange(20).reshape(4, 5), np.arange(15).reshape(5, 3)
    np.testing.assert_array_equal(blas.gemm(ai, bi), ai @ bi)


@pytest.mark.parametrize("name", sorted(FOUND))
def test_pool_products_on_every_library(name, monkeypatch):
    """threads.matmul's splits (rows, columns, inner dimension, batched, with bias) on each library."""
    blas.choose(name)
    before = threads.num_threads()
    threads.set_num_threads(2)
    monkeypatch.setattr(threads, "_split_gemms", True)
    monkeypatch.setattr(threads, "MIN_SPLIT_MACS", 1)
    try:
        rng = np.random.default_rng(2)
        for (m, k, n) in [(64, 8, 6), (6, 8, 64), (4, 300, 5), (31, 17, 29)]:
            for dtype in (np.float32, np.float64):
                a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
                bias = rng.standard_normal(n).astype(dtype)
                tol = 1e-5 if dtype == np.float32 else 1e-12
                for x, y in ((a, b), (np.asfortranarray(a), b), (a, np.asfortranarray(b))):
                    np.testing.assert_allclose(threads.matmul(x, y), a @ b, rtol=tol, atol=tol * k)
                    np.testing.assert_allclose(threads.matmul(x, y, bias), a @ b + bias, rtol=tol, atol=tol * k)
        a3, b3 = rng.standard_normal((3, 5, 7)), rng.standard_normal((3, 7, 4))
        np.testing.assert_allclose(threads.matmul(a3, b3), a3 @ b3, rtol=1e-12)
        np.testing.assert_allclose(threads.matmul(a3, b3[0]), a3 @ b3[0], rtol=1e-12)
    finally:
        threads.set_num_threads(before)


def test_env_override_and_unknown_name(monkeypatch):
    monkeypatch.setenv(blas.ENV, "openblas")
    c = blas.choose()
    assert (c.library.name, c.how) == ("openblas", blas.ENV)
    assert blas.describe().startswith("openblas (")
    monkeypatch.setenv(blas.ENV, "atlas")
    with pytest.raises(ValueError, match="MPIRT_GEMM: expected one of openblas, blis, mkl, got 'atlas'"):
        blas.choose()


def test_missing_library_degrades_to_openblas_with_a_note(monkeypatch):
    def absent():
        raise ImportError("No module named 'blis'")
    monkeypatch.setitem(blas._LOADERS, "blis", absent)
    blas.available.cache_clear()
    try:
        monkeypatch.setenv(blas.ENV, "blis")
        c = blas.choose()
        assert c.library.name == "openblas"
        assert "blis requested but not available: using openblas" in blas.describe()
        assert "not installed: blis" in blas.describe()
        a = np.ones((3, 4), np.float32)
        np.testing.assert_array_equal(blas.gemm(a, a.T), np.full((3, 3), 4, np.float32))
    finally:
        blas.available.cache_clear()


def test_calibration_picks_the_fastest_and_is_cached(monkeypatch, tmp_path):
    times = {name: 1.0 + i for i, name in enumerate(reversed(sorted(FOUND)))}
    fastest = min(times, key=times.get)
    calls = []

    def fake_calibrate(libraries, rounds=5):
        calls.append(sorted(libraries))
        return {n: times[n] for n in libraries}
    monkeypatch.setattr(blas, "calibrate", fake_calibrate)
    c = blas.choose()
    assert (c.library.name, c.how) == (fastest, "calibrated")
    assert (tmp_path / "gemm.json").is_file()
    c = blas.choose()
    assert (c.library.name, c.how) == (fastest, "cached") and len(calls) == 1
    text = blas.describe()
    assert text.startswith(f"{fastest} (") and "cached" in text and f"{fastest} 1000.0 ms" in text


def test_real_calibration_times_every_library():
    seconds = blas.calibrate(FOUND, rounds=1)
    assert set(seconds) == set(FOUND) and all(s > 0 for s in seconds.values())
