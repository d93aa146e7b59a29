"""Data parallelism: gradients in flat buckets, averaged over the dp ranks while backward runs.

    dp = DataParallel(model, comm)          # broadcasts rank 0's weights to every dp rank
    for x, y in micro_batches[:-1]:
        with dp.no_sync():                  # accumulate locally, no communication
            dp(x, y)[1].backward()
    dp(x_last, y_last)[1].backward()        # hooks launch each bucket's allreduce as it fills
    dp.finish()                             # wait for all of them; grads are now the dp average
    optimizer.step(); optimizer.zero_grad()

The gradients live in the parameter store (:class:`mpirt.parallel.flat.FlatParams`: every
``p.grad`` is a view into one flat vector); a bucket is a contiguous range of it of ``bucket_bytes``
(4 MiB on the host, 25 MiB on a device), cut from its end, the order in which backward finishes
the gradients (a parameter larger than a bucket spans several, so no bucket, and no MPI
temporary, exceeds the size). The
autograd engine accumulates into ``p.grad`` in place and optimizers zero it in place, so the
views stay valid; nothing may rebind ``p.grad`` (``finish`` checks and says which one was).

A gradient hook on every parameter counts, in each bucket it has elements in, how many of the
bucket's gradients are final; when the count is complete the bucket's non-blocking allreduce
(average) is launched. Buckets are launched strictly in index order (a bucket that fills early
waits for its predecessors) so every rank issues the same collectives in the same order. Unused
parameters never fire their hook: their buckets are launched by ``finish``.

Allreduces in flight. MPICH's non-blocking allreduce of a large bucket holds a temporary of the
bucket's size from its launch to its completion, and a host-staged (GPU) bucket a host copy: with
every bucket launched before the first completes, the end of backward would hold one per bucket,
a second copy of the gradients. At most ``max_in_flight`` (2 by default) MPI allreduces are
outstanding: a full bucket beyond them waits, unlaunched, until a later hook finds one completed
(backward is never held up for it); ``finish`` launches the rest, waiting for the oldest to make
room. NCCL reduces in place on its stream and is not bounded.

MPI progress. MPICH progresses a non-blocking collective only inside MPI calls, so overlap needs
the runtime to drive it. ``progress="test"`` (default) tests the outstanding handles from every
gradient hook; ``progress="thread"`` hands full buckets to a communication thread that runs
blocking allreduces (mpi4py releases the GIL inside MPI). ``bench/dp.py`` measures both.
``overlap=False`` allreduces every bucket after backward, blocking (the baseline).
Measured on 2 CPU cores at dp=2 (each rank computing on one core): hook testing cuts the wait in
``finish`` by about half or more, but the reduction work then runs inside the hooks on the same
core, so the step is not faster; the thread competes with the compute for the core. Overlap pays
where communication does not need the computing core (NCCL on GPUs, spare cores, real networks).
"""
from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
import time

import numpy as np

import mpirt.core.backend as B
from mpirt.parallel.flat import FlatParams


BUCKET_BYTES = 25 * 2**20  # a gradient bucket's size on a device (PyTorch DDP's): NCCL reduces in place
HOST_BUCKET_BYTES = 4 * 2**20  # on the host, where every MPI allreduce in flight holds a temporary of it
MAX_IN_FLIGHT = 2  # MPI allreduces outstanding at once


def broadcast_parameters(params, comm, root: int = 0) -> None:
    """Give every rank of ``comm`` the weights of rank ``root``, in place: a
    :class:`~mpirt.parallel.flat.FlatParams` store's data vector in one broadcast (no copy), or a
    list of parameters grouped by dtype, one flat broadcast per dtype. Collective; nothing to do
    on a single rank."""
    if comm.size == 1:
        return
    if isinstance(params, FlatParams):
        B.synchronize()
        comm.broadcast(params.data, root=root)
        return
    params = list(params)
    for dtype in _dtypes_in_order(params):
        group = [p for p in params if p.dtype == dtype]
        flat = B.xp.concatenate([p.data.reshape(-1) for p in group])
        B.synchronize()
        comm.broadcast(flat, root=root)
        offset = 0
        for p in group:
            p.data[...] = flat[offset:offset + p.size].reshape(p.shape)
            offset += p.size


class _Bucket:
    """A range ``[lo, hi)`` of the store's flat gradient and the parameters with elements in it
    (a parameter larger than a bucket is in several)."""

    def __init__(self, index: int, params: list, store, lo: int, hi: int):
        self.index, self.params, self.lo, self.hi = index, params, lo, hi
        self.flat = store.grad[lo:hi]  # the store keeps its gradient vector while DataParallel runs
        self.reset()

    def reset(self) -> None:
        self.pending = len(self.params)  # gradients not final yet in this backward
        self.launched = False
        self.handle = None

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)


class DataParallel:
    """Replicate a model over the ranks of ``comm`` and average gradients over them.

    ``model``: a Module (its parameters go into a new :class:`~mpirt.parallel.flat.FlatParams`)
    or a store that already holds them (a pipeline stage's). ``bucket_bytes``: the size of one
    gradient bucket (the last, at the vector's start, may be smaller; None: :data:`HOST_BUCKET_BYTES`
    for host arrays, :data:`BUCKET_BYTES` for device ones).
    ``overlap``: launch each bucket's allreduce from the gradient hooks during backward (True) or
    allreduce all buckets in :meth:`finish` (False). ``progress``: how MPI is progressed during
    backward with overlap, ``"test"`` or ``"thread"`` (see the module docstring). ``check_every``:
    run :meth:`check_replicas` on every ``check_every``-th :meth:`finish` (0: never); it checks the
    weights of the previous step. ``max_in_flight``: MPI allreduces outstanding at once (0: no
    bound; see the module docstring).
    """

    def __init__(self, model, comm, bucket_bytes: int | None = None, overlap: bool = True,
                 progress: str = "test", check_every: int = 0, max_in_flight: int = MAX_IN_FLIGHT):
        if progress not in ("test", "thread"):
            raise ValueError(f"DataParallel: progress must be 'test' or 'thread', got {progress!r}")
        if bucket_bytes is not None and bucket_bytes < 1:
            raise ValueError(f"DataParallel: bucket_bytes must be >= 1, got {bucket_bytes}")
        if max_in_flight < 0:
            raise ValueError(f"DataParallel: max_in_flight must be >= 0 (0: no bound), got {max_in_flight}")
        self.max_in_flight = int(max_in_flight)
        self.store = model if isinstance(model, FlatParams) else FlatParams(model.parameters())
        self.module, self.comm = (None if model is self.store else model), comm
        self.overlap, self.progress, self.check_every = bool(overlap), progress, int(check_every)
        self.params = self.store.params
        self.names = [getattr(p, "name", "") or f"param{i}" for i, p in enumerate(self.params)]
        broadcast_parameters(self.store, comm)
        if bucket_bytes is None:
            bucket_bytes = BUCKET_BYTES if B.is_device_array(self.store.grad) else HOST_BUCKET_BYTES
        self.buckets = [_Bucket(k, params, self.store, lo, hi) for k, (lo, hi, params)
                        in enumerate(self.store.buckets(int(bucket_bytes), self.store.grad.itemsize))]
        self._buckets_of: dict[int, list[_Bucket]] = {}
        for b in self.buckets:
            for p in b.params:
                self._buckets_of.setdefault(id(p), []).append(b)
        self._fired: set[int] = set()   # params whose hook fired since the last finish
        self._next_launch = 0           # buckets are launched strictly in index order
        self._outstanding: list = []    # the handles launched and not seen complete, oldest first
        self._sync = True               # False inside no_sync()
        self._dirty = False             # a backward ran since the last finish
        self._finishes = 0
        self._thread = None
        # the communication thread gets its own communicator, so its collectives can never
        # interleave with the main thread's on the same one
        self._thread_comm = comm.split(0, comm.rank) if (self.overlap and progress == "thread") else None
        self.launch_log: list[int] = []  # bucket indices in launch order, latest backward (overlap)
        self.stats = {"launches": 0, "finishes": 0, "wait_s": 0.0, "last_wait_s": 0.0,
                      "hook_test_s": 0.0, "in_flight_wait_s": 0.0, "in_flight_waits": 0,
                      "skipped_hooks": 0}
        for p in self.params:
            p.register_hook(self._hook)

    def calls(self) -> list[tuple[str, str, int, str]]:
        """``(axis, kind, bytes, dtype)`` of the calls one step's sync makes: an average of every
        bucket (launched from the hooks or in :meth:`finish`, "allreduce" either way)."""
        return [(self.comm.axis, "allreduce", b.nbytes, b.flat.dtype.name) for b in self.buckets]

    # --- construction -----------------------------------------------------------------------
    # --- the module interface -----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def parameters(self):
        return list(self.params)

    def named_parameters(self):
        return [(p.name, p) for p in self.params]

    def zero_grad(self) -> None:
        """Zero the gradients in place."""
        self.store.zero_grad()

    # --- hooks and synchronisation ----------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward accumulates gradients locally without any communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _hook(self, p) -> None:
        self._dirty = True
        if not self._sync:
            self.stats["skipped_hooks"] += 1
            return
        if id(p) in self._fired:
            raise RuntimeError(f"DataParallel: the gradient of {p.name or 'a parameter'} was finalised twice "
                               "without finish(); run the non-final micro-batches under no_sync()")
        self._fired.add(id(p))
        if not self.overlap:
            return
        for bucket in self._buckets_of.get(id(p), ()):  # a parameter without elements is in none
            bucket.pending -= 1
        if self.progress == "test":
            self._test_outstanding()
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, in index order, every bucket whose gradients are all final while there is room
        for its allreduce."""
        while (self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0
               and self._room(wait=False)):
            self._launch(self.buckets[self._next_launch])

    def _room(self, wait: bool) -> bool:
        """Whether fewer than ``max_in_flight`` MPI allreduces are outstanding; ``wait``: wait for
        the oldest until they are (True)."""
        outstanding = [h for h in self._outstanding if not h.done and h.engine != "nccl"]
        over = len(outstanding) - self.max_in_flight + 1
        if not self.max_in_flight or over <= 0:
            return True
        if not wait:
            return False
        t0 = time.perf_counter()
        for handle in outstanding[:over]:
            handle.wait()
        self.stats["in_flight_wait_s"] += time.perf_counter() - t0
        self.stats["in_flight_waits"] += over
        return True

    def _launch(self, bucket: _Bucket) -> None:
        B.synchronize()  # the device must have finished writing the gradients MPI is about to read
        bucket.launched = True
        self._next_launch = bucket.index + 1
        if bucket.index == 0:
            self.launch_log.clear()
        self.launch_log.append(bucket.index)
        self.stats["launches"] += 1
        if self.comm.size == 1:
            return
        if self.progress == "thread":  # one blocking allreduce at a time
            self._comm_thread().put(bucket)
        else:
            bucket.handle = self.comm.iallreduce(bucket.flat, op="avg")
            self._outstanding.append(bucket.handle)

    def _test_outstanding(self) -> None:
        t0 = time.perf_counter()
        self._outstanding = [h for h in self._outstanding if not h.test()]
        self.stats["hook_test_s"] += time.perf_counter() - t0

    def finish(self) -> None:
        """Wait until every bucket holds the dp average of the gradients (launching those not
        launched yet); call after the last backward and before clipping and the optimizer step."""
        t0 = time.perf_counter()
        self._check_views()
        if self._dirty or self._next_launch:
            if self.overlap:
                for b in self.buckets[self._next_launch:]:
                    self._room(wait=True)
                    self._launch(b)
                if self._thread is not None:
                    self._thread.join()
                for b in self.buckets:
                    if b.handle is not None:
                        b.handle.wait()
            elif self.comm.size > 1:
                B.synchronize()
                for b in self.buckets:
                    self.comm.allreduce(b.flat, op="avg", out=b.flat)
                self.stats["launches"] += len(self.buckets)
        for b in self.buckets:
            b.reset()
        self._fired.clear()
        self._next_launch, self._dirty, self._outstanding = 0, False, []
        dt = time.perf_counter() - t0
        self.stats["wait_s"] += dt
        self.stats["last_wait_s"] = dt
        self.stats["finishes"] += 1
        self._finishes += 1
        if self.check_every and self._finishes % self.check_every == 0:
            self.check_replicas()

    sync_gradients = finish

    def _check_views(self) -> None:
        self.store.check_views("DataParallel")

    def _comm_thread(self) -> "_CommThread":
        if self._thread is None:
            self._thread = _CommThread(self._thread_comm)
        return self._thread

    def close(self) -> None:
        """Stop the communication thread, if any, and free its communicator (the thread is a
        daemon: optional at exit, but a closed DataParallel can no longer use progress="thread")."""
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        if self._thread_comm is not None:
            self._thread_comm.free()
            self._thread_comm = None

    # --- replica consistency and accounting ---------------------------------------------------
    def check_replicas(self) -> None:
        """Raise RuntimeError naming the dp ranks whose weights differ from the majority's
        (from dp rank 0's on a tie) and the parameters that differ. Collective."""
        local = np.array([_digest(p.data) for p in self.params], dtype=np.float64)  # exact: 48-bit ints
        gathered = B.to_host(self.comm.allgather(B.asarray(local))).reshape(self.comm.size, -1)
        rows = [tuple(r) for r in gathered]
        counts = {r: rows.count(r) for r in rows}
        best = max(counts.values())
        reference = next(r for r in rows if counts[r] == best)  # the lowest rank among the most common
        bad = [rank for rank, r in enumerate(rows) if r != reference]
        if bad:
            ref_rank = rows.index(reference)
            differing = [self.names[j] for j in range(len(self.params))
                         if any(gathered[r, j] != gathered[ref_rank, j] for r in bad)]
            raise RuntimeError(f"replica check: weights on dp rank(s) {bad} differ from dp rank {ref_rank} "
                               f"(and {best - 1} other(s)) in {len(differing)} parameter(s): "
                               f"{', '.join(differing[:8])}{' ...' if len(differing) > 8 else ''}")

    def memory_bytes(self, optimizer=None) -> dict:
        """Bytes this rank holds persistently: parameters, gradient buckets and (when given) the
        optimizer's state (:meth:`mpirt.core.optim.Optimizer.memory_bytes`: moments and masters)."""
        opt = optimizer.memory_bytes()["optimizer"] if optimizer is not None else 0
        return {"params": int(self.store.data.nbytes), "grads": int(self.store.grad.nbytes), "optimizer": opt}


class _CommThread:
    """A daemon thread that allreduces (average, blocking) the buckets put on its queue, in order."""

    def __init__(self, comm):
        self.comm = comm
        self.queue: queue.Queue = queue.Queue()
        self.error = None
        self.thread = threading.Thread(target=self._run, name="mpirt-dp-comm", daemon=True)
        self.thread.start()

    def put(self, bucket) -> None:
        self.queue.put(bucket)

    def _run(self) -> None:
        while True:
            bucket = self.queue.get()
            try:
                if bucket is None:
                    return
                if self.error is None:
                    self.comm.allreduce(bucket.flat, op="avg", out=bucket.flat)
            except BaseException as e:  # reported by join() on the main thread
                self.error = e
            finally:
                self.queue.task_done()

    def join(self) -> None:
        self.queue.join()
        if self.error is not None:
            raise RuntimeError(f"DataParallel communication thread failed: {self.error!r}") from self.error

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join()


def _dtypes_in_order(params) -> list:
    seen = []
    for p in params:
        if p.dtype not in seen:
            seen.append(p.dtype)
    return seen


def _digest(a) -> int:
    """A 48-bit hash of an array's bytes (fits a float64 exactly)."""
    h = hashlib.blake2b(np.ascontiguousarray(B.to_host(a)).tobytes(), digest_size=6).digest()
    return int.from_bytes(h, "little")
