"""mpirt.comm (Comm collectives and point-to-point, engines, registry) and mpirt.run.distributed.

Multi-rank tests are valid at any world size. Each collects its failures on every rank and the
ranks agree on the verdict (``conftest.agree``), so one rank failing never leaves the others waiting.
Data are small integers stored in each dtype, so every sum is exact in any order.
"""
import ctypes
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest
from mpi4py import MPI

import mpirt.core.backend as B
from mpirt import comm
from mpirt.run import distributed as D
from mpirt.cpu import threads as T
from mpirt.comm import PROC_NULL, Comm, CommError, chunk_bounds
from mpirt.run.config import ConfigError, TrainConfig

from conftest import agree

W = MPI.COMM_WORLD
DTYPES = [np.float32, np.float64, np.int64]
LAYOUTS = ["contig", "strided", "transposed", "flat"]


def make(rank: int, layout: str, dtype, salt: int = 0):
    """Rank ``rank``'s deterministic array in ``layout``: (7, 6) or (13,), maybe a non-contiguous view."""
    rng = np.random.default_rng(1000 * salt + rank)

    def ints(*shape):
        return rng.integers(-20, 20, size=shape).astype(dtype)
    if layout == "contig":
        return ints(7, 6)
    if layout == "strided":
        return ints(7, 12)[:, ::2]
    if layout == "transposed":
        return ints(6, 7).T
    return ints(13)


def reference(arrays, op: str):
    if op == "max":
        return np.maximum.reduce(arrays)
    total = arrays[0].copy()
    for a in arrays[1:]:
        total += a
    if op == "avg":
        total = total // len(arrays) if total.dtype.kind in "iu" else total / np.array(len(arrays), total.dtype)
    return total


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.allclose(a, b, rtol=1e-3 if a.dtype == np.float16 else 1e-6)


# ------------------------------------------------------------------ pure helpers (one process)

def test_chunk_bounds_cover_in_order_and_differ_by_at_most_one():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    for n in range(0, 23):
        for size in range(1, 10):
            b = chunk_bounds(n, size)
            assert len(b) == size and b[0][0] == 0 and b[-1][1] == n
            assert all(b[i][1] == b[i + 1][0] for i in range(size - 1))
            lengths = [stop - start for start, stop in b]
            assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
    with pytest.raises(ValueError):
        chunk_bounds(5, 0)


def test_bad_op_and_unreducible_dtype_are_refused():
    c = comm.world_comm()
    with pytest.raises(ValueError, match="op must be one of"):
        c.allreduce(np.ones(3), op="prod")
    with pytest.raises(TypeError, match="cannot be reduced"):
        c.allreduce(np.ones(3, bool))


def test_select_engine_host_for_numpy_and_staged_for_device_arrays_without_gpu_mpi(monkeypatch):
    assert comm.select_engine(np.ones(3)) == "host"
    assert isinstance(comm.cuda_aware_mpi(), bool) and isinstance(comm.nccl_available(), bool)

    class FakeDevice:
        __cuda_array_interface__ = {}
    monkeypatch.setattr(comm.engines, "nccl_available", lambda: False)
    monkeypatch.setattr(comm.engines, "cuda_aware_mpi", lambda: False)
    assert comm.select_engine(FakeDevice()) == "staged"
    monkeypatch.setattr(comm.engines, "cuda_aware_mpi", lambda: True)
    assert comm.select_engine(FakeDevice()) == "cuda-aware"
    monkeypatch.setattr(comm.engines, "nccl_available", lambda: True)
    assert comm.select_engine(FakeDevice()) == "nccl"
    assert comm.select_engine(FakeDevice(), p2p=True) == "cuda-aware"  # never NCCL for p2p
    monkeypatch.setenv("MPIRT_COMM_ENGINE", "staged")
    assert comm.select_engine(FakeDevice()) == "staged"
    monkeypatch.setattr(comm.engines, "nccl_available", lambda: False)
    monkeypatch.setenv("MPIRT_COMM_ENGINE", "nccl")
    with pytest.raises(RuntimeError, match="nccl"):
        comm.select_engine(FakeDevice())
    monkeypatch.setenv("MPIRT_COMM_ENGINE", "bogus")
    with pytest.raises(ValueError, match="MPIRT_COMM_ENGINE"):
        comm.select_engine(FakeDevice())


def test_stats_records_are_bounded_but_totals_are_not():
    s = comm.CommStats(max_records=4)
    for i in range(10):
        s.add("allreduce", "dp", 8, 0.5)
    cursor = s.cursor()
    s.add("send", "pp", 3, 0.25)
    s.add("isend", "pp", 3, 0.5, blocked=0.0)
    last = s.records[-2]
    assert len(s.records) <= 4 and last[:5] == ("send", "pp", 3, 0.25, "host") and last.blocked == 0.25
    assert s.records[-1].blocked == 0.0 and s.records[-1].end >= last.end
    # a cursor outlives the trimming: since() gives exactly the calls added after it
    assert [r.op for r in s.since(cursor)] == ["send", "isend"]
    s.add("isend", "pp", 3, 0.5, blocked=0.0)
    assert s.summary()[("isend", "pp")]["calls"] == 2
    assert s.summary() == {("allreduce", "dp"): {"calls": 10, "bytes": 80, "seconds": 5.0},
                           ("send", "pp"): {"calls": 1, "bytes": 3, "seconds": 0.25},
                           ("isend", "pp"): {"calls": 2, "bytes": 6, "seconds": 1.0}}
    assert s.calls("allreduce") == 10 and s.calls(axis="pp") == 3
    s.reset()
    assert s.summary() == {} and s.records == [] and s.since(s.cursor()) == []


def test_derive_seed_is_reproducible_and_distinct():
    seeds = {(r, p): D.derive_seed(7, r, p) for r in range(16) for p in ("init", "data", "dropout")}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds.values())
    assert D.derive_seed(7, 3, "data") == seeds[(3, "data")] != D.derive_seed(8, 3, "data")


def test_plan_blas_threads_takes_a_launcher_binding_as_this_ranks_share():
    """Under ``srun --cpu-bind`` the affinity mask is already this rank's cores: not divided again."""
    code = "from mpirt.run.distributed import plan_blas_threads as p; print(p(None, 2, env={}))"
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "(1, '1 cpus bound to this rank')"


def test_plan_blas_threads():
    assert D.plan_blas_threads(3, 4, env={}) == (3, "threads=3 argument")
    assert D.plan_blas_threads(None, 4, env={}, cpus=16)[0] == 4
    assert D.plan_blas_threads(None, 4, env={}, cpus=2)[0] == 1
    n, note = D.plan_blas_threads(None, 2, env={"OMP_NUM_THREADS": "3"}, cpus=16)
    assert n is None and "OMP_NUM_THREADS=3" in note
    with pytest.raises(ValueError):
        D.plan_blas_threads(0, 1, env={})


def _busy_threads(work) -> int:
    """How many threads of this process used CPU while ``work()`` ran (from /proc/self/task)."""
    def ticks():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[tid] = int(fields[11]) + int(fields[12])
        return out
    before = ticks()
    work()
    after = ticks()
    return sum(1 for t, v in after.items() if v - before.get(t, 0) >= 3)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_set_blas_threads_limits_the_threads_that_run_a_matmul():
    previous = T.blas_threads()
    assert previous is not None, "NumPy's OpenBLAS was not found in /proc/self/maps"
    a = np.random.default_rng(0).random((400, 400))
    try:
        assert T.set_blas_threads(1) == 1
        assert _busy_threads(lambda: [a @ a for _ in range(60)]) == 1
        if len(os.sched_getaffinity(0)) >= 2:
            assert T.set_blas_threads(2) == 2
            assert _busy_threads(lambda: [a @ a for _ in range(60)]) == 2
    finally:
        T.set_blas_threads(previous)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_mapped_libraries_by_substring_or_predicate():
    from mpirt.cpu.sysinfo import mapped_libraries
    blas = mapped_libraries("OpenBLAS")  # case-insensitive: NumPy's libscipy_openblas...so
    assert blas and all(os.path.exists(p) and "openblas" in os.path.basename(p).lower() for p in blas)
    assert len(set(blas)) == len(blas)
    assert mapped_libraries(lambda name: "openblas" in name.lower()) == blas
    assert mapped_libraries("no-such-library-here") == []


# ------------------------------------------------------------------ world and failure handling

@pytest.mark.mpi(min_size=2)
def test_world_matches_mpi():
    info = comm.world()
    assert (info.rank, info.size) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
    # every rank of this single-node job shares one node
    assert (info.local_rank, info.local_size) == (info.rank, info.size)
    assert MPI.COMM_WORLD.allgather(info.local_rank) == list(range(info.size))


def test_one_rank_failing_ends_the_whole_job_quickly(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "from mpi4py import MPI\n"
        "from mpirt import comm\n"
        "comm.install_abort_on_error()\n"
        "if MPI.COMM_WORLD.rank == 1:\n"
        "    raise RuntimeError('rank 1 broke')\n"
        "MPI.COMM_WORLD.Barrier()\n")
    start = time.monotonic()
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(script)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "rank 1 broke" in result.stderr
    assert time.monotonic() - start < 60


# ------------------------------------------------------------------ collectives

@pytest.mark.mpi(min_size=2)
def test_allreduce_every_dtype_layout_op_and_mode():
    c, fails = comm.world_comm(), []
    for dtype in DTYPES + [np.float16]:
        for layout in LAYOUTS:
            for op in ("sum", "avg", "max"):
                want = reference([make(r, layout, dtype) for r in range(c.size)], op)
                x = make(c.rank, layout, dtype)
                got = c.allreduce(x, op=op)
                if not same(got, want) or not np.array_equal(x, make(c.rank, layout, dtype)):
                    fails.append(f"new {dtype.__name__} {layout} {op}")
                base = x.base if x.base is not None else x
                before = base.copy()
                c.allreduce(x, op=op, out=x)
                outside_ok = layout != "strided" or np.array_equal(base[:, 1::2], before[:, 1::2])
                if not same(x, want) or not outside_ok:
                    fails.append(f"in-place {dtype.__name__} {layout} {op}")
                out = np.zeros(x.shape, dtype)[..., ::-1]  # a non-contiguous out
                if c.allreduce(make(c.rank, layout, dtype), op=op, out=out) is not out or not same(out, want):
                    fails.append(f"out= {dtype.__name__} {layout} {op}")
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_allreduce_scalar():
    c = comm.world_comm()
    agree((c.allreduce_scalar(c.rank + 1), c.allreduce_scalar(0.5, "max")) ==
          (c.size * (c.size + 1) // 2, 0.5), "allreduce_scalar")
    # an integer 0 on rank 0 beside floats elsewhere: every rank sends and reads float64
    mixed = c.allreduce_scalar(0 if c.rank == 0 else 1.5)
    agree(mixed == 1.5 * (c.size - 1) and type(mixed) is float, f"mixed int/float: {mixed!r}")


@pytest.mark.mpi(min_size=2)
def test_iallreduce_completes_through_test_and_wait():
    c, fails, pending = comm.world_comm(), [], []
    for dtype in DTYPES:
        for layout in ("contig", "strided", "flat"):
            for op in ("sum", "avg"):
                x = make(c.rank, layout, dtype, salt=1)
                pending.append((c.iallreduce(x, op=op), x, reference([make(r, layout, dtype, 1)
                                                                       for r in range(c.size)], op)))
    spins = 0
    while not comm.test_all([h for h, _, _ in pending]) and spins < 1_000_000:
        spins += 1
    for h, x, want in pending:
        if not h.done or h.wait() is not x or not same(x, want):
            fails.append(f"iallreduce {x.dtype} {x.shape}")
    h = c.iallreduce(make(c.rank, "contig", np.float32), op="avg")
    if not same(h.wait(), reference([make(r, "contig", np.float32) for r in range(c.size)], "avg")):
        fails.append("wait without test")
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_reduce_scatter_gives_each_rank_its_chunk():
    c, fails = comm.world_comm(), []
    for dtype in DTYPES:
        for layout in LAYOUTS:
            for op in ("sum", "avg", "max"):
                want = reference([make(r, layout, dtype) for r in range(c.size)], op).ravel()
                start, stop = chunk_bounds(want.size, c.size)[c.rank]
                got = c.reduce_scatter(make(c.rank, layout, dtype), op=op)
                if not same(got, want[start:stop]):
                    fails.append(f"{dtype.__name__} {layout} {op}")
                out = np.empty(stop - start, dtype)
                if c.reduce_scatter(make(c.rank, layout, dtype), op=op, out=out) is not out or \
                        not same(out, want[start:stop]):
                    fails.append(f"out= {dtype.__name__} {layout} {op}")
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_reduce_scatter_with_counts_gives_each_rank_its_part():
    """Uneven parts, some empty (ZeRO-2's buckets reduced straight to their owners), in float32
    and bfloat16 (reduced in float32); counts that do not add up name the problem."""
    c, fails = comm.world_comm(), []
    counts = [(3 * r + 1) % 4 for r in range(c.size)]  # 1, 0, 3, 2, ...: zeros included
    n = sum(counts)
    for dtype in (np.float32, "bfloat16"):
        x = (np.arange(n) + c.rank).astype(dtype)
        want = sum((np.arange(n) + r).astype(dtype).astype(np.float64) for r in range(c.size)) / c.size
        start = sum(counts[:c.rank])
        got = c.reduce_scatter(x, op="avg", counts=counts)
        if got.size != counts[c.rank] or not np.allclose(got.astype(np.float64), want[start:start + got.size],
                                                         rtol=1e-2):
            fails.append(f"{dtype}: {got} != {want[start:start + counts[c.rank]]}")
    try:
        c.reduce_scatter(np.zeros(n + 1, np.float32), counts=counts)
        fails.append("counts not adding up accepted")
    except ValueError as err:
        if "summing to" not in str(err):
            fails.append(str(err))
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_reduce_scatter_then_allgather_flat_equals_allreduce():
    c, fails = comm.world_comm(), []
    for n in (1, c.size - 1, c.size, 13, 42, 1000):
        x = np.random.default_rng(c.rank).integers(-9, 9, n).astype(np.float64)
        chunk = c.reduce_scatter(x)
        full = c.allgather_flat(chunk, n)
        out = np.empty(n)
        c.allgather_flat(chunk, n, out=out)
        started = c.iallgather_flat(chunk, n)  # ZeRO-3's prefetch: completes at wait()
        want = c.allreduce(x)                   # another collective on the communicator meanwhile
        if not (np.array_equal(full, want) and np.array_equal(out, want) and np.array_equal(started.wait(), want)):
            fails.append(f"n={n}")
    for gather in (c.allgather_flat, c.iallgather_flat):
        try:
            gather(np.zeros(99), 10)
            fails.append(f"{gather.__name__}: wrong chunk size accepted")
        except ValueError as err:
            if "holds 99 elements" not in str(err):
                fails.append(str(err))
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_alltoallv_sends_each_rank_its_rows_with_counts_exchanged_first():
    """Rank r sends (r + d) % 3 rows to rank d (none to some): every rank receives, in rank order,
    exactly the rows meant for it; a rank with nothing to send or receive still takes part; bad
    counts are refused naming them."""
    c, fails = comm.world_comm(), []
    send = [(c.rank + d) % 3 for d in range(c.size)]
    rows = np.concatenate([np.full((n, 2), 100 * c.rank + d, dtype=np.float64) for d, n in enumerate(send)]
                          or [np.empty((0, 2))]).reshape(-1, 2)
    got, counts = c.alltoallv(rows, send)
    want = [(s + c.rank) % 3 for s in range(c.size)]
    if counts != want or got.shape != (sum(want), 2) or \
            not np.array_equal(got[:, 0], np.concatenate([np.full(n, 100 * s + c.rank) for s, n in enumerate(want)])):
        fails.append(f"rank {c.rank}: counts {counts} want {want}, rows {got[:, 0].tolist()}")
    nothing, counts = c.alltoallv(np.empty((0, 3)), [0] * c.size)
    if nothing.shape != (0, 3) or counts != [0] * c.size:
        fails.append(f"empty: {nothing.shape} {counts}")
    try:
        c.alltoallv(np.zeros((2, 3)), [1] * c.size + [1])
        fails.append("wrong counts accepted")
    except ValueError as err:
        if "do not split the 2 rows" not in str(err):
            fails.append(str(err))
    agree(not fails, fails)


def _rows(rank: int, layout: str, dtype):
    """Rank ``rank``'s block of rank % 3 + 1 rows of 5 values for allgather."""
    m = rank % 3 + 1
    x = make(rank, "flat", dtype, salt=2)
    base = np.resize(x, m * 10).reshape(m, 10).astype(dtype)
    if layout == "strided":
        return base[:, ::2]
    if layout == "transposed":
        return np.ascontiguousarray(base[:, :5]).T.copy().T
    return np.ascontiguousarray(base[:, :5])


@pytest.mark.mpi(min_size=2)
def test_allgather_uneven_rows_any_dtype_and_layout():
    c, fails = comm.world_comm(), []
    counts = [r % 3 + 1 for r in range(c.size)]
    for dtype in DTYPES + [np.float16, np.uint8]:
        for layout in ("contig", "strided", "transposed"):
            want = np.concatenate([_rows(r, layout, dtype) for r in range(c.size)])
            x = _rows(c.rank, layout, dtype)
            if not np.array_equal(c.allgather(x), want) or c.allgather(x).dtype != dtype:
                fails.append(f"{dtype.__name__} {layout}")
            if not np.array_equal(c.allgather(x, counts=counts), want):
                fails.append(f"counts= {dtype.__name__} {layout}")
            out = np.empty_like(want)
            if c.allgather(x, out=out) is not out or not np.array_equal(out, want):
                fails.append(f"out= {dtype.__name__} {layout}")
    same_rows = c.allgather(np.full((2, 3), c.rank, np.int32))
    if not np.array_equal(same_rows, np.repeat(np.arange(c.size, dtype=np.int32), 2)[:, None] * np.ones(3, np.int32)):
        fails.append("equal rows")
    try:  # rank 0 holds rows of another width: every rank must refuse
        c.allgather(np.zeros((1, 4 if c.rank == 0 else 3)))
        fails.append("mismatched trailing shapes accepted")
    except ValueError as err:
        if "different byte sizes" not in str(err):
            fails.append(str(err))
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_broadcast_in_place_from_any_root():
    c, fails = comm.world_comm(), []
    for root in sorted({0, c.size - 1}):
        for dtype in DTYPES + [np.float16, np.uint8]:
            for layout in LAYOUTS:
                x = make(c.rank, layout, dtype, salt=3)
                base = x.base if x.base is not None else x
                before = base.copy()
                if c.broadcast(x, root=root) is not x or not np.array_equal(x, make(root, layout, dtype, 3)):
                    fails.append(f"root {root} {dtype.__name__} {layout}")
                if layout == "strided" and not np.array_equal(base[:, 1::2], before[:, 1::2]):
                    fails.append(f"root {root} {dtype.__name__} strided: wrote outside the view")
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_split_and_barrier():
    c = comm.world_comm()
    half = c.split(c.rank % 2, key=c.rank, axis="half")
    members = list(range(c.rank % 2, c.size, 2))
    ok = (half.axis, half.size, half.rank) == ("half", len(members), members.index(c.rank)) and \
        half.allreduce(np.array([c.rank])).item() == sum(members)
    half.barrier()
    half.free()
    c.barrier()
    agree(ok, "split")


# ------------------------------------------------------------------ point to point

@pytest.mark.mpi(min_size=2)
def test_send_recv_between_pairs_into_non_contiguous_out():
    c, fails = comm.world_comm(), []
    peer = c.rank ^ 1
    if peer < c.size:
        for dtype in (np.float16, np.float32, np.int64):
            mine = make(c.rank, "transposed", dtype, salt=4)
            big = np.full((7, 12), 3, dtype)
            out = big[:, ::2]
            if c.rank % 2 == 0:
                c.send(mine, peer, tag=5)
                c.recv(out, peer, tag=5)
            else:
                c.recv(out, peer, tag=5)
                c.send(mine, peer, tag=5)
            if not np.array_equal(out, make(peer, "transposed", dtype, 4)) or not (big[:, 1::2] == 3).all():
                fails.append(dtype.__name__)
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_isend_irecv_ring_with_preallocated_buffers():
    c, fails = comm.world_comm(), []
    nxt, prv = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    for dtype in (np.float32, np.float16, np.int64):
        outs = [np.empty((7, 6), dtype), np.empty(13, dtype)]
        # post the receives in the opposite order of the sends: the tags pair them
        handles = [c.irecv(outs[1], prv, tag=2), c.irecv(outs[0], prv, tag=1),
                   c.isend(make(c.rank, "strided", dtype), nxt, tag=1),
                   c.isend(make(c.rank, "flat", dtype), nxt, tag=2)]
        results = comm.wait_all(handles)
        if results[0] is not outs[1] or not np.array_equal(outs[0], make(prv, "strided", dtype)) or \
                not np.array_equal(outs[1], make(prv, "flat", dtype)):
            fails.append(dtype.__name__)
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_recv_of_the_wrong_size_names_source_tag_and_sizes():
    c, fails = comm.world_comm(), []
    if c.rank == 0:
        c.send(np.arange(5, dtype=np.float32), 1, tag=3)
        c.send(np.arange(10, dtype=np.float32), 1, tag=4)
        c.send(np.arange(10, dtype=np.float32), 1, tag=6)
    elif c.rank == 1:
        for tag, n, blocking, words in [(3, 10, True, ["source 0", "tag 3", "20 bytes", "holds 10"]),
                                        (4, 5, True, ["source 0", "tag 4", "larger", "5 float32"]),
                                        (6, 5, False, ["source 0", "tag 6", "larger"])]:
            out = np.zeros(n, np.float32)
            try:
                c.recv(out, 0, tag=tag) if blocking else c.irecv(out, 0, tag=tag).wait()
                fails.append(f"tag {tag}: no error")
            except CommError as err:
                if not all(w in str(err) for w in words):
                    fails.append(f"tag {tag}: {err}")
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_proc_null_is_a_no_op():
    c = comm.world_comm()
    comm.stats.reset()
    out = np.full(4, 7.0)
    c.send(np.ones(4), PROC_NULL)
    ok = c.recv(out, PROC_NULL) is out and (out == 7).all()
    h1, h2 = c.isend(np.ones(4), PROC_NULL, tag=9), c.irecv(out, PROC_NULL, tag=9)
    ok = ok and h1.test() and h2.done and h2.wait() is out and (out == 7).all()
    ok = ok and comm.stats.calls("send") == comm.stats.calls("recv") == 0
    agree(ok, "PROC_NULL")


# ------------------------------------------------------------------ registry

@pytest.mark.mpi(min_size=2)
def test_registry_counts_calls_and_bytes_per_op_and_axis():
    c, dp = comm.world_comm(), Comm(W, axis="dp")
    comm.stats.reset()
    x = np.ones(10, np.float32)
    for _ in range(3):
        c.allreduce(x)
    dp.allreduce(np.ones(10, np.float64), out=None)
    c.broadcast(np.ones(6, np.float32))
    c.iallreduce(x).wait()
    chunk = c.reduce_scatter(np.ones(20, np.float32))
    c.allgather_flat(chunk, 20)
    s = comm.stats.summary()
    want = {("allreduce", "world"): (3, 120), ("allreduce", "dp"): (1, 80), ("broadcast", "world"): (1, 24),
            ("iallreduce", "world"): (1, 40), ("reduce_scatter", "world"): (1, 80),
            ("allgather", "world"): (1, 80)}
    got = {k: (v["calls"], v["bytes"]) for k, v in s.items()}
    dtypes = [str(r.dtype) for r in comm.stats.records]
    ok = got == want and all(v["seconds"] > 0 for v in s.values()) and len(comm.stats.records) == 8 and \
        comm.stats.records[0][:5] == ("allreduce", "world", 40, comm.stats.records[0].seconds, "host") and \
        dtypes == ["float32"] * 3 + ["float64"] + ["float32"] * 4
    agree(ok, f"got {got}, dtypes {dtypes}")


@pytest.mark.mpi(min_size=2)
def test_registry_records_each_calls_dtype_and_none_for_objects():
    """The recorded dtype is the array's (point-to-point, non-blocking and the scalar sum's float64
    included); objects and barriers carry none."""
    c = comm.world_comm()
    comm.stats.reset()
    peer = 1 - c.rank if c.rank < 2 else comm.PROC_NULL
    if c.rank < 2:
        h = c.isend(np.arange(3, dtype=np.int32), peer)
        c.recv(np.empty(3, np.int32), peer)
        h.wait()
    c.allreduce_scalar(0)   # an integer value still travels as float64
    c.allgather_object("x")
    c.barrier()
    got = [(r.op, None if r.dtype is None else str(r.dtype)) for r in comm.stats.records]
    want = ([("recv", "int32"), ("isend", "int32")] if c.rank < 2 else []) + \
        [("allreduce", "float64"), ("allgather_object", None), ("barrier", None)]
    agree(got == want, f"rank {c.rank}: {got}")


# ------------------------------------------------------------------ the staged engine, on CPU

class _FakeDevice(np.ndarray):
    """A NumPy array that claims to live on a GPU, to drive the staged engine on the host."""

    @property
    def __cuda_array_interface__(self):
        return {}


@pytest.mark.mpi(min_size=2)
def test_staged_engine_copies_to_host_and_back(monkeypatch):
    monkeypatch.setattr(comm.engines, "nccl_available", lambda: False)
    monkeypatch.setattr(comm.engines, "cuda_aware_mpi", lambda: False)
    monkeypatch.setattr(comm.buffers, "_xp", lambda a: np)
    monkeypatch.setattr(B, "to_host", lambda a: np.array(a))  # a copy, as from a device
    c, fails = comm.world_comm(), []

    def dev(a):
        return np.ascontiguousarray(a).view(_FakeDevice)
    comm.stats.reset()
    want = reference([make(r, "contig", np.float32) for r in range(c.size)], "sum")
    x = dev(make(c.rank, "contig", np.float32))
    if not same(np.asarray(c.allreduce(x)), want):
        fails.append("allreduce")
    c.allreduce(x, out=x)
    if not same(np.asarray(x), want):
        fails.append("allreduce in place")
    y = dev(make(c.rank, "flat", np.float64))
    c.iallreduce(y, op="avg").wait()
    if not same(np.asarray(y), reference([make(r, "flat", np.float64) for r in range(c.size)], "avg")):
        fails.append("iallreduce")
    start, stop = chunk_bounds(want.size, c.size)[c.rank]
    chunk = c.reduce_scatter(dev(make(c.rank, "contig", np.float32)))
    if not same(np.asarray(chunk), want.ravel()[start:stop]):
        fails.append("reduce_scatter")
    if not same(np.asarray(c.allgather_flat(dev(chunk), want.size)), want.ravel()):
        fails.append("allgather_flat")
    b = dev(make(c.rank, "flat", np.float16))
    c.broadcast(b, root=c.size - 1)
    if not np.array_equal(np.asarray(b), make(c.size - 1, "flat", np.float16)):
        fails.append("broadcast")
    nxt, prv = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    out = dev(np.zeros(13, np.int64))
    comm.wait_all([c.irecv(out, prv), c.isend(dev(make(c.rank, "flat", np.int64)), nxt)])
    if not np.array_equal(np.asarray(out), make(prv, "flat", np.int64)):
        fails.append("isend/irecv")
    engines = {r.engine for r in comm.stats.records}
    if engines != {"staged"}:
        fails.append(f"engines {engines}")
    agree(not fails, fails)


# ------------------------------------------------------------------ distributed start-up

@pytest.mark.mpi(min_size=2)
def test_check_same_config_passes_for_identical_configs():
    c = comm.world_comm()
    h = D.check_same_config(c, TrainConfig())
    agree(len(set(W.allgather(h))) == 1, "hashes differ")


@pytest.mark.mpi(min_size=2)
def test_check_same_config_names_the_key_and_the_rank_on_every_rank():
    c, fails = comm.world_comm(), []
    cfg = TrainConfig().to_dict()
    last = c.size - 1
    if c.rank == last:
        cfg["lr"] = 0.5
    try:
        D.check_same_config(c, cfg)
        fails.append("no error")
    except ConfigError as err:
        if f"rank {last} differs from rank 0 in lr" not in str(err):
            fails.append(str(err))
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_init_distributed_context_and_rank_seeds():
    ctx = D.init_distributed(seed=42, config={"seed": 42})
    seeds = W.allgather(ctx.rank_seed("data"))
    ok = (ctx.rank, ctx.size, ctx.backend) == (W.rank, W.size, "numpy") and \
        len(set(seeds)) == W.size and seeds[ctx.rank] == D.derive_seed(42, ctx.rank, "data") and \
        ctx.rank_seed("data") == D.init_distributed(seed=42).rank_seed("data") != ctx.rank_seed("dropout") and \
        ctx.blas_threads is not None and ctx.blas_threads >= 1
    agree(ok, repr(ctx))


@pytest.mark.mpi(min_size=2)
def test_the_thread_counts_reported_are_the_counts_in_force():
    """One owner (mpirt.cpu.threads): the context reports mpirt's pool and OpenBLAS's own count as
    read back after start-up; with the pool splitting the GEMMs OpenBLAS runs one thread each."""
    saved = T.num_threads()
    try:
        ctx = D.init_distributed(seed=1, threads=2)
        ok = (ctx.threads, ctx.blas_threads) == (T.num_threads(), T.blas_threads()) == (2, 1)
        agree(ok, repr(ctx))
    finally:
        T.set_num_threads(saved)


# ------------------------------------------------------------------ the NCCL engine, on CPU

class _Dev(np.ndarray):
    """A host array dressed as a CuPy array: ``__cuda_array_interface__`` and ``.data.ptr``."""

    @property
    def __cuda_array_interface__(self):
        return {}

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _fake_cupy():
    """Modules cupy, cupy.cuda and cupy.cuda.nccl whose NCCL runs on host memory through MPI."""
    def dev(a):
        return np.asarray(a).view(_Dev)
    cp = types.ModuleType("cupy")
    cp.empty = lambda shape, dtype=float: dev(np.empty(shape, dtype))
    cp.zeros = lambda shape, dtype=float: dev(np.zeros(shape, dtype))
    cp.empty_like = lambda a: dev(np.empty_like(np.asarray(a)))
    cp.concatenate = lambda arrays: dev(np.concatenate([np.asarray(a) for a in arrays]))
    cp.ascontiguousarray = lambda a, dtype=None: dev(np.ascontiguousarray(np.asarray(a), dtype=dtype))
    cp.asarray = lambda a, dtype=None: dev(np.asarray(a, dtype))
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = True
    dtypes = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64]
    for code, name in enumerate(["FLOAT16", "FLOAT32", "FLOAT64", "INT8", "UINT8", "INT32", "UINT32",
                                 "INT64", "UINT64"]):
        setattr(nccl, f"NCCL_{name}", code)
    nccl.NCCL_SUM, nccl.NCCL_MAX, nccl.NCCL_MIN = 100, 101, 102
    ops = {100: MPI.SUM, 101: MPI.MAX, 102: MPI.MIN}
    nccl.get_unique_id = lambda: tuple(np.random.default_rng().integers(-128, 128, 128).tolist())

    def arr(ptr, count, code):
        dtype = np.dtype(dtypes[code])
        if count == 0:
            return np.empty(0, dtype)
        return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(ptr), dtype)

    class NcclCommunicator:
        def __init__(self, size, uid, rank):
            assert (size, rank) == (W.size, W.rank) and len(uid) == 128
            assert all(-128 <= v < 128 for v in uid) and len({tuple(u) for u in W.allgather(uid)}) == 1

        def allReduce(self, send, recv, count, code, op, stream):
            r = arr(recv, count, code)
            W.Allreduce(MPI.IN_PLACE if send == recv else arr(send, count, code).copy(), r, ops[op])

        def reduceScatter(self, send, recv, count, code, op, stream):
            W.Reduce_scatter_block(arr(send, count * W.size, code), arr(recv, count, code), ops[op])

        def allGather(self, send, recv, count, code, stream):
            W.Allgather(arr(send, count, code), arr(recv, count * W.size, code))

        def bcast(self, buf, count, code, root, stream):
            W.Bcast(arr(buf, count, code), root)
    nccl.NcclCommunicator = NcclCommunicator
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl, cp.cuda = nccl, cuda
    return {"cupy": cp, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl}, dev


@pytest.mark.mpi(min_size=2)
def test_nccl_engine_pads_compacts_and_matches_the_host_results(monkeypatch):
    modules, dev = _fake_cupy()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(comm.engines, "nccl_available", lambda: True)
    monkeypatch.setattr(B, "current_stream_ptr", lambda: 0)
    c, fails = comm.world_comm(), []
    comm.stats.reset()
    for dtype in (np.float32, np.int64):
        for layout in LAYOUTS:
            for op in ("sum", "avg", "max"):
                want = reference([make(r, layout, dtype) for r in range(c.size)], op)
                x = dev(make(c.rank, "flat", dtype))  # device arrays: contiguous copies, then views
                if layout != "flat":
                    x = dev(make(c.rank, layout, dtype).base if layout == "strided" else
                            make(c.rank, layout, dtype).T)
                    x = x[:, ::2] if layout == "strided" else x.T
                if not same(np.asarray(c.allreduce(x, op=op)), want):
                    fails.append(f"allreduce {dtype.__name__} {layout} {op}")
                start, stop = chunk_bounds(want.size, c.size)[c.rank]
                chunk = c.reduce_scatter(x, op=op)
                if not same(np.asarray(chunk), want.ravel()[start:stop]):
                    fails.append(f"reduce_scatter {dtype.__name__} {layout} {op}")
                if op == "sum" and not same(np.asarray(c.allgather_flat(chunk, want.size)), want.ravel()):
                    fails.append(f"allgather_flat {dtype.__name__} {layout}")
                c.iallreduce(x, op=op).wait()
                if not same(np.asarray(x), want):
                    fails.append(f"iallreduce in place {dtype.__name__} {layout} {op}")
    rows = dev(_rows(c.rank, "contig", np.float16))
    if not np.array_equal(np.asarray(c.allgather(rows)),
                          np.concatenate([_rows(r, "contig", np.float16) for r in range(c.size)])):
        fails.append("allgather uneven rows")
    b = dev(make(c.rank, "contig", np.float16, salt=3))[:, ::2]
    c.broadcast(b, root=c.size - 1)
    if not np.array_equal(np.asarray(b), make(c.size - 1, "contig", np.float16, 3)[:, ::2]):
        fails.append("broadcast")
    out = dev(np.zeros(13, np.int64))  # point-to-point never goes through NCCL
    comm.wait_all([c.irecv(out, (c.rank - 1) % c.size), c.isend(dev(make(c.rank, "flat", np.int64)),
                                                                (c.rank + 1) % c.size)])
    if not np.array_equal(np.asarray(out), make((c.rank - 1) % c.size, "flat", np.int64)):
        fails.append("p2p")
    engines = {(r.op, r.engine) for r in comm.stats.records}
    if {e for op, e in engines if op in ("isend", "irecv")} != {"staged"} or \
            {e for op, e in engines if op not in ("isend", "irecv")} != {"nccl"}:
        fails.append(f"engines {engines}")
    agree(not fails, fails)
