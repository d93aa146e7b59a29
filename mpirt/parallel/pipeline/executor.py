"""The pipeline executor: how one rank runs its schedule's action list, and the point-to-point
traffic around it (activations, gradients, the tied-weight gradient sum, the shared loss).

:class:`PipelineExecutor` is the half of :class:`mpirt.parallel.pipeline.stage.PipelineStage` that talks
to the other pp ranks; the stage supplies the model (``_forward``, ``_params``, ``shell``...) and
the shape agreement (``_prepare`` sets ``act_shape`` and the buffer pool). Receives are posted
ahead (one per neighbour and kind) into preallocated buffers and waited on where the list says
``recv``; sends are non-blocking and driven by ``test`` between computes. Every message is a
``(micro-batch rows, T, n_embd)`` array in the model dtype. A micro-batch's stash keeps its graph
for the backward, not the received input nor the output sent when no op saved them: the input's
buffer goes back to the pool once the forward has run, the output's data once its send completes
(as Megatron-LM and Llama 3's run free them). Per-rank timers, the peak number of stashed
activations and their estimated bytes land in ``stats`` after each step.
"""
from __future__ import annotations

import sys
import time
from typing import NamedTuple

import numpy as np

import mpirt.core.backend as B
from mpirt.core.nn import kept_bytes
from mpirt.parallel.pipeline.schedules import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from mpirt.core.tensor import Tensor

TAG_ACT, TAG_GRAD, TAG_TIED = 11, 12, 13


class WaitLabel(NamedTuple):
    """A send or receive action as the communication watchdog names it, e.g. ``pp rank 2: recv
    grad mb=5 chunk 0 from pp rank 3``; built per action, formatted only in a report."""

    rank: int       # this rank's pp rank
    action: Action

    def __str__(self) -> str:
        a = self.action
        verb, prep = ("send", "to") if a.is_send else ("recv", "from")
        return f"pp rank {self.rank}: {verb} {a.kind} mb={a.mb} chunk {a.chunk} {prep} pp rank {a.peer}"


def _stand_in(a):
    """A read-only array of ``a``'s shape and dtype that holds no memory (a broadcast zero): the
    data of a stashed tensor once nothing reads it again (its shape and dtype still answer)."""
    return B.xp.broadcast_to(B.xp.zeros((), dtype=a.dtype), a.shape)


def _unfinished(sends: list) -> list:
    """The ``(handle, tensor)`` sends still in flight; a finished one's tensor (an activation
    nothing else reads) lets go of its data."""
    out = []
    for h, sent in sends:
        if not h.test():
            out.append((h, sent))
        elif sent is not None:
            sent.data = _stand_in(sent.data)
    return out


class PipelineExecutor:
    """Schedule execution and p2p for a pipeline stage (mixed into
    :class:`mpirt.parallel.pipeline.stage.PipelineStage`, which provides ``comm``, ``grid``, ``rank``,
    ``pp``, ``S``, ``m``, ``dtype``, ``act_shape``, ``_pool``, ``_stash_bytes``,
    ``model``, ``tied_names``, ``has_embed``, ``has_head``, ``trace``, ``wait_mode``, ``poll_s``
    and ``_forward``). ``tied_grads``: a callable giving the arrays that hold the tied copies'
    gradients, in the order of ``tied_names`` (ZeRO-3: its store's shards); None: each ``p.grad``."""

    tied_grads = None

    def _buffer(self, kind):
        pool = self._pool[kind]
        return pool.pop() if pool else B.xp.empty(self.act_shape, dtype=self.dtype)

    def _wait(self, handle) -> None:
        if self.wait_mode == "block":
            handle.wait()
        else:
            while not handle.test():
                time.sleep(self.poll_s)

    def _run(self, sched: Schedule, xs, ys, training: bool):
        comm, rank, last = self.comm, self.rank, self.S - 1
        acts = sched.actions[rank]
        split = sched.split_backward
        queues: dict = {}
        for a in acts:
            if a.is_recv:
                queues.setdefault((a.peer, a.kind), []).append(a)
        heads = {k: 0 for k in queues}
        posted: dict = {}

        def post(key):
            i = heads[key]
            if i < len(queues[key]):
                a = queues[key][i]
                heads[key] = i + 1
                buf = self._buffer(a.kind)
                tag = TAG_ACT if a.kind == "act" else TAG_GRAD
                with comm.labelled(WaitLabel(rank, a)):
                    posted[key] = (a, comm.irecv(buf, a.peer, tag), buf)

        stash, inbox, outbox, wpasses, sends = {}, {}, {}, {}, []
        losses = [0.0] * self.m
        op_time = {FORWARD: 0.0, BACKWARD: 0.0, WEIGHT: 0.0}
        op_count = {FORWARD: 0, BACKWARD: 0, WEIGHT: 0}
        recv_wait = 0.0
        trace = [] if self.trace else None
        live = peak = 0
        live_bytes = peak_bytes = 0
        t_start = time.perf_counter()
        for key in queues:
            post(key)

        def release(key):
            nonlocal live, live_bytes
            entry = stash.pop(key)
            for kind, buf in (("act", entry[2]), ("grad", entry[3])):
                if buf is not None:
                    self._pool[kind].append(buf)
            live -= 1
            live_bytes -= self._stash_bytes.get(key[1], 0)

        for a in acts:
            key = (a.mb, a.chunk)
            s = a.chunk * self.pp + rank
            if a.is_recv:
                pk = (a.peer, a.kind)
                pa, handle, buf = posted.pop(pk)
                if pa is not a:  # cannot happen: receives are posted in list order per (peer, kind)
                    raise RuntimeError(f"pipeline rank {rank}: posted {pa}, expected {a}")
                t0 = time.perf_counter()
                self._wait(handle)
                t1 = time.perf_counter()
                recv_wait += t1 - t0
                if trace is not None:
                    trace.append((t0 - t_start, t1 - t_start, "wait", a.mb, a.chunk))
                inbox[(a.kind,) + key] = buf
                post(pk)
            elif a.is_send:
                data = outbox.pop((a.kind,) + key)
                with comm.labelled(WaitLabel(rank, a)):
                    handle = comm.isend(data, a.peer, TAG_ACT if a.kind == "act" else TAG_GRAD)
                # an activation nothing else reads is let go of once sent (the stash keeps its graph)
                entry = stash.get(key) if a.kind == "act" else None
                sends.append((handle, entry[1] if entry and entry[4] else None))
                del data
            else:
                t0 = time.perf_counter()
                if a.op == FORWARD:
                    buf = inbox.pop(("act",) + key) if s > 0 else None
                    inp = Tensor(buf, requires_grad=training) if buf is not None else None
                    held = sys.getrefcount(buf)
                    out, loss = self._forward(a.chunk, a.mb, inp, xs, ys)
                    if loss is not None:
                        losses[a.mb] = loss
                    if training:
                        # what no op saved for backward goes once the forward is done with it: the
                        # received input now (its buffer back to the pool), the output once sent
                        first = a.chunk not in self._stash_bytes
                        kept = kept_bytes(out) if first else 0
                        frees_out = s < last and sys.getrefcount(out.data) == 2
                        if buf is not None and sys.getrefcount(buf) == held:
                            kept -= buf.nbytes
                            inp.data = _stand_in(buf)
                            self._pool["act"].append(buf)
                            buf = None
                        if first:
                            self._stash_bytes[a.chunk] = kept - (out.data.nbytes if frees_out else 0)
                        stash[key] = [inp, out, buf, None, frees_out]
                        live += 1
                        live_bytes += self._stash_bytes[a.chunk]
                        peak, peak_bytes = max(peak, live), max(peak_bytes, live_bytes)
                    elif buf is not None:
                        self._pool["act"].append(buf)
                    if s < last:
                        outbox[("act",) + key] = out.data
                elif a.op == BACKWARD:
                    entry = stash[key]
                    g = inbox.pop(("grad",) + key) if s < last else None
                    entry[3] = g
                    wp = entry[1].backward(g, defer_weight_grad=split)
                    if s > 0:
                        outbox[("grad",) + key] = entry[0].grad
                    entry[0] = entry[1] = None
                    if split:
                        wpasses[key] = wp
                    else:
                        release(key)
                else:  # W
                    wpasses.pop(key).run()
                    release(key)
                t1 = time.perf_counter()
                op_time[a.op] += t1 - t0
                op_count[a.op] += 1
                if trace is not None:
                    trace.append((t0 - t_start, t1 - t_start, a.op, a.mb, a.chunk))
            if sends and a.op in (FORWARD, BACKWARD, WEIGHT):
                sends = _unfinished(sends)  # drives MPI progress of the sends
        t0 = time.perf_counter()
        for h, sent in sends:
            self._wait(h)
            if sent is not None:
                sent.data = _stand_in(sent.data)
        send_wait = time.perf_counter() - t0
        total = time.perf_counter() - t_start
        if stash or wpasses or inbox or outbox:
            raise RuntimeError(f"pipeline rank {rank}: schedule left work behind: stash {sorted(stash)}, "
                               f"W {sorted(wpasses)}, inbox {sorted(inbox)}, outbox {sorted(outbox)}")
        compute = sum(op_time.values())
        self.stats = {"t0": t_start, "step_s": total, "compute_s": compute, "idle_s": total - compute,
                      "bubble": (total - compute) / total if total > 0 else 0.0,
                      "recv_wait_s": recv_wait, "send_wait_s": send_wait,
                      "op_s": dict(op_time), "op_count": dict(op_count),
                      "peak_stash": peak, "peak_stash_bytes": peak_bytes,
                      "stash_bytes_per_mb": dict(self._stash_bytes)}
        if trace is not None:
            self.stats["trace"] = trace
        return sum(losses) / self.m if self.has_head else 0.0

    def tied_calls(self) -> list[tuple[str, str, int, str]]:
        """``(axis, kind, bytes, dtype)`` of the calls :meth:`_sync_tied` makes in a step: a send
        and a receive of each tied copy's gradient (ZeRO-3: its shard) with the other pipeline end."""
        if self.pp == 1 or not self.tied_names or not (self.has_embed or self.has_head):
            return []
        named = dict(self.model.named_parameters())
        arrays = self.tied_grads() if self.tied_grads else [named[name].data for name in self.tied_names]
        return [(self.comm.axis, kind, int(a.nbytes), a.dtype.name) for a in arrays for kind in ("send", "recv")]

    def _sync_tied(self) -> None:
        """Sum the gradients of the tied copies on the first and last pp ranks."""
        if self.pp == 1 or not self.tied_names or not (self.has_embed or self.has_head):
            return
        peer = self.pp - 1 if self.has_embed else 0
        named = dict(self.model.named_parameters())
        grads = self.tied_grads() if self.tied_grads else [named[name].grad for name in self.tied_names]
        for name, g in zip(self.tied_names, grads):
            other = B.xp.empty_like(g)
            with self.comm.labelled(f"pp rank {self.rank}: tied gradient sum of {name} with pp rank {peer}"):
                hs = self.comm.isend(g, peer, TAG_TIED)
                hr = self.comm.irecv(other, peer, TAG_TIED)
            self._wait(hr)
            self._wait(hs)
            g += other  # a + b == b + a exactly: both copies get the same bits

    def _share_loss(self, loss: float) -> float:
        buf = np.array([loss if self.has_head else 0.0], dtype=np.float64)
        if self.pp > 1:
            with self.comm.labelled(f"pp rank {self.rank}: loss from pp rank {self.pp - 1}"):
                self.comm.broadcast(buf, root=self.pp - 1)
        return float(buf[0])
