"""Data parallelism (mpirt.parallel.ddp) against the single-rank run on the same global batch.

Every rank runs the single-rank reference itself on the whole global batch (no communication),
then the data-parallel run on its dp share of that batch; the verdict is reduced over the ranks
(:func:`agree`) so that all ranks pass or fail together. Valid at any world size.
"""
import contextlib

import numpy as np
import pytest
from mpi4py import MPI

from mpirt import comm as C
from mpirt.comm import Comm
from mpirt.data.tokens import split_microbatches
from mpirt.core.optim import AdamW, clip_grad_norm
from mpirt.parallel.ddp import DataParallel

from conftest import agree
from parity import (LR, STEPS, WD, batch, dp_comm, global_loss, make_model, max_rel_err, reference_run, rel_err,
                    within, worst)


# --- data-parallel runs ----------------------------------------------------------------------
def dp_run(dtype, *, overlap=True, progress="test", bucket_bytes=1500, accum=1, clip=None, steps=STEPS):
    comm = dp_comm()
    model = make_model(dtype)
    dp = DataParallel(model, comm, bucket_bytes=bucket_bytes, overlap=overlap, progress=progress)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms, grads = [], [], None
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, comm.rank, comm.size, accum=accum)
        micro = split_microbatches(x, y, accum)
        loss_sum = 0.0
        for k, (xm, ym) in enumerate(micro):
            ctx = dp.no_sync() if k < accum - 1 else contextlib.nullcontext()
            with ctx:
                _, loss = dp(xm, ym)
                (loss * (1.0 / accum)).backward()
            loss_sum += loss.item() / accum
        dp.finish()
        if grads is None:
            grads = {p.name: p.grad.copy() for p in model.parameters()}
        if clip is not None:  # gradients are identical on every dp rank after finish()
            norms.append(clip_grad_norm(model.parameters(), clip))
        losses.append(global_loss(comm, loss_sum))
        opt.step()
    dp.close()
    return np.array(losses), grads, {p.name: p.data.copy() for p in model.parameters()}, norms, dp, opt


def test_close_stops_the_thread_and_frees_its_communicator():
    model = make_model("float64")
    dp = DataParallel(model, dp_comm(), progress="thread")
    thread_comm = dp._thread_comm
    assert thread_comm is not None and thread_comm.mpi != MPI.COMM_WORLD
    dp.close()
    assert dp._thread is None and dp._thread_comm is None and thread_comm.mpi == MPI.COMM_NULL
    dp.close()  # idempotent


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", ["overlap-test", "overlap-thread", "no-overlap"])
def test_dp_matches_single_rank(dtype, mode):
    size = MPI.COMM_WORLD.size
    ref = reference_run(dtype, world=size)
    losses, grads, w, _, dp, opt = dp_run(dtype, overlap=mode != "no-overlap",
                                          progress="thread" if mode == "overlap-thread" else "test")
    errs = {"loss": worst(rel_err(losses, ref.losses)), "grad": worst(max_rel_err(grads, ref.grads)),
            "weights": worst(max_rel_err(w, ref.weights))}
    agree(within(errs, dtype), f"{dtype} {mode}: {errs}")
    # dtypes are kept everywhere (NumPy 2 promotion would silently turn float32 into float64)
    kinds = {str(a.dtype) for p in dp.params for a in (p.data, p.grad)}
    kinds |= {str(a.dtype) for st in opt.state for a in st.values()} | {str(b.flat.dtype) for b in dp.buckets}
    agree(kinds == {dtype}, f"dtypes {kinds}")
    assert len(dp.buckets) > 3  # small buckets: several of them take part


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_grad_accumulation_equals_one_large_batch(dtype):
    size = MPI.COMM_WORLD.size
    ref = reference_run(dtype, world=size, accum=2)
    losses, _, w, _, _, _ = dp_run(dtype, accum=2)
    errs = {"loss": worst(rel_err(losses, ref.losses)), "weights": worst(max_rel_err(w, ref.weights))}
    agree(within(errs, dtype), f"errors {errs}")


@pytest.mark.mpi(min_size=2)
def test_no_communication_under_no_sync():
    comm = dp_comm()
    model = make_model("float64")
    dp = DataParallel(model, comm, bucket_bytes=1500)
    x, y = batch(0, comm.rank, comm.size)
    calls = C.stats.calls()
    with dp.no_sync():
        dp(x, y)[1].backward()
    local = {p.name: p.grad.copy() for p in model.parameters()}
    quiet = C.stats.calls() == calls and dp.stats["launches"] == 0 and dp.stats["skipped_hooks"] > 0
    # no averaging happened: the local gradients differ between ranks
    g = model.wte.weight.grad
    spread = np.abs(dp_comm().allreduce(g, op="max") - g).max()
    agree(quiet and spread > 0, f"calls {calls} -> {C.stats.calls()}, launches {dp.stats['launches']}, "
                                f"spread {spread}")
    dp(x, y)[1].backward()  # the final micro-batch syncs: its hooks launch what the bound lets them
    in_backward = dp.stats["launches"]
    dp.finish()  # and finish() the rest
    agree(0 < in_backward <= dp.stats["launches"] == len(dp.buckets), f"launches {in_backward}, {dp.stats['launches']}")
    mean = {n: comm.allreduce(2 * local[n], op="avg") for n in local}
    agree(max_rel_err({p.name: p.grad for p in model.parameters()}, mean) < 1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_clipping_matches_unsharded(dtype):
    size = MPI.COMM_WORLD.size
    ref = reference_run(dtype, world=size, clip=0.05)
    losses, _, w, norms, _, _ = dp_run(dtype, clip=0.05)
    errs = {"loss": worst(rel_err(losses, ref.losses)), "weights": worst(max_rel_err(w, ref.weights)),
            "norm": worst(rel_err(norms, ref.norms))}
    agree(min(ref.norms) > 0.05 and within(errs, dtype), f"norms {ref.norms}, errors {errs}")


def _in_order(buckets) -> list[str]:
    """The parameters' names as the buckets list them, a parameter spanning several named once."""
    names = [p.name for b in buckets for p in b.params]
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("max_in_flight", [1, 2, 1000, 0])
def test_buckets_launch_in_order_with_at_most_max_in_flight_outstanding(max_in_flight):
    comm = dp_comm()
    model = make_model("float64")
    names = [p.name for p in model.parameters()]
    dp = DataParallel(model, comm, bucket_bytes=1000, max_in_flight=max_in_flight)
    assert _in_order(dp.buckets) == names[::-1]
    seen = []  # (parameter, buckets launched, allreduces outstanding when its gradient became final)
    for p in model.parameters():  # after DataParallel's own hooks, so they see its launches
        p.register_hook(lambda p: seen.append((p.name, list(dp.launch_log),
                                               sum(b.handle is not None and not b.handle.done for b in dp.buckets))))
    x, y = batch(0, comm.rank, comm.size)
    dp(x, y)[1].backward()
    in_backward = list(dp.launch_log)
    dp.finish()
    n, log, most = len(dp.buckets), list(dp.launch_log), max(k for *_, k in seen)
    waits = dp.stats["in_flight_waits"]
    # launched in bucket order (reverse registration order) from the hooks while there is room, the
    # rest by finish(), which waits for the oldest to make room; without a bound all are launched
    # once the embeddings' gradients are final (used first in forward)
    ok = n > 4 and log == list(range(n)) and in_backward == log[:len(in_backward)] and in_backward
    ok = ok and seen[-1][0] in ("wte.weight", "wpe.weight")
    if max_in_flight in (0, 1000):
        ok = ok and in_backward == log and waits == 0
    else:
        ok = ok and most <= max_in_flight
    agree(ok, f"launched {in_backward} in backward, {log} in all, most outstanding {most}, waits {waits}")
    if max_in_flight == 0:
        assert most > 2  # unbounded, the allreduces do pile up: the bound above is not idle


@pytest.mark.mpi(min_size=2)
def test_buckets_are_ranges_of_the_size_in_reverse_order():
    comm = dp_comm()
    model = make_model("float32")
    dp = DataParallel(model, comm, bucket_bytes=4000)
    order = _in_order(dp.buckets)
    sizes = [b.nbytes for b in dp.buckets]
    ok = order == [p.name for p in model.parameters()][::-1] and all(s == 4000 for s in sizes[:-1])
    ok = ok and 0 < sizes[-1] <= 4000 and max(p.data.nbytes for p in model.parameters()) > 4000
    # every grad is a view into the store's gradient vector, each bucket a contiguous range of it;
    # zeroing through the optimizer keeps the views
    opt = AdamW(model.parameters(), lr=LR)
    opt.zero_grad()
    model.zero_grad()
    ok = ok and all(p.grad.base is dp.store.grad for p in dp.params)
    edges = [(b.lo, b.hi) for b in dp.buckets]
    ok = ok and edges[0][1] == dp.store.numel and edges[-1][0] == 0 and all(
        lo == hi for (lo, _), (_, hi) in zip(edges, edges[1:]))
    agree(ok, f"order {order}, sizes {sizes}")


def test_max_in_flight_must_not_be_negative():
    with pytest.raises(ValueError, match=r"^DataParallel: max_in_flight must be >= 0 \(0: no bound\), got -1$"):
        DataParallel(make_model("float64"), dp_comm(), max_in_flight=-1)


@pytest.mark.mpi(min_size=2)
def test_parameters_broadcast_from_rank0():
    comm = dp_comm()
    model = make_model("float64", seed=100 + comm.rank)  # different weights on every rank
    DataParallel(model, comm)
    rank0 = make_model("float64", seed=100)
    err = max_rel_err({p.name: p.data for p in model.parameters()}, {p.name: p.data for p in rank0.parameters()})
    agree(err == 0.0, f"err {err}")


@pytest.mark.mpi(min_size=2)
def test_replica_check_names_the_diverging_rank():
    comm = dp_comm()
    model = make_model("float64")
    dp = DataParallel(model, comm, check_every=2)
    dp.check_replicas()  # in sync: no error
    bad = comm.size - 1
    if comm.rank == bad:
        model.h[1].mlp.c_fc.weight.data[0, 0] += 1e-12
    messages = []
    for check in (dp.check_replicas, dp.finish, dp.finish):  # check_every=2: the second finish checks
        try:
            check()
            messages.append(None)
        except RuntimeError as e:
            messages.append(str(e))
    ok = (messages[0] is not None and f"dp rank(s) [{bad}]" in messages[0] and "h.1.mlp.c_fc.weight" in messages[0]
          and messages[1] is None and messages[2] == messages[0])
    agree(ok, f"messages {messages}")


@pytest.mark.mpi(min_size=2)
def test_memory_is_16_bytes_per_parameter():
    comm = dp_comm()
    model = make_model("float32")
    dp = DataParallel(model, comm)
    opt = AdamW(model.parameters(), lr=LR)
    mem = dp.memory_bytes(opt)
    n = model.num_parameters()
    agree(mem == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}, f"{mem} for {n} parameters")


def test_single_rank_data_parallel_is_the_plain_model():
    comm = Comm(MPI.COMM_SELF, "dp")
    model, plain = make_model("float64"), make_model("float64")
    dp = DataParallel(model, comm, bucket_bytes=1000)
    x, y = batch(0)
    dp(x, y)[1].backward()
    plain(x, y)[1].backward()
    dp.finish()
    assert max_rel_err({p.name: p.grad for p in model.parameters()},
                       {p.name: p.grad for p in plain.parameters()}) == 0.0
    with pytest.raises(RuntimeError, match="finalised twice"):
        dp(x, y)[1].backward()
        dp(x, y)[1].backward()


def test_rebound_gradient_is_reported():
    model = make_model("float64")
    dp = DataParallel(model, Comm(MPI.COMM_SELF, "dp"))
    model.ln_f.bias.grad = None
    with pytest.raises(RuntimeError, match="ln_f.bias.grad was rebound"):
        dp.finish()
