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
from dataclasses import dataclass
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


def _tag(kind: str) -> int:
    """The message tag of an activation (``"act"``) or a gradient."""
    return TAG_ACT if kind == "act" else TAG_GRAD


def _stand_in(a):
    """A read-only array of ``a``'s shape and dtype that holds no memory (a broadcast zero): the
    data of a stashed tensor once nothing reads it again (its shape and dtype still answer)."""
    return B.xp.broadcast_to(B.xp.zeros((), dtype=a.dtype), a.shape)


def _let_go(sent) -> None:
    """A sent activation nothing else reads keeps only its shape once its send completed."""
    if sent is not None:
        sent.data = _stand_in(sent.data)


def _unfinished(sends: list) -> list:
    """The ``(handle, tensor)`` sends still in flight; a finished one's tensor lets go of its data."""
    out = []
    for h, sent in sends:
        if h.test():
            _let_go(sent)
        else:
            out.append((h, sent))
    return out


@dataclass
class _Stashed:
    """A micro-batch's forward kept for its backward: its input and output tensors (the graph),
    the received buffers an op still reads (activation; gradient, from its backward on) and
    whether the output's data is let go of once sent."""

    inp: Tensor | None
    out: Tensor | None
    act_buf: object = None
    grad_buf: object = None
    frees_out: bool = False


class _Receives:
    """A rank's receives, posted ahead into pool buffers, one per (peer, kind) at a time in the
    order of its action list; the next of a kind is posted once the previous one has arrived."""

    def __init__(self, executor: "PipelineExecutor", acts: list[Action]):
        self.executor, self.queues, self.posted = executor, {}, {}
        for a in acts:
            if a.is_recv:
                self.queues.setdefault((a.peer, a.kind), []).append(a)
        self.heads = {k: 0 for k in self.queues}
        for key in self.queues:
            self._post(key)

    def _post(self, key) -> None:
        i = self.heads[key]
        if i < len(self.queues[key]):
            a = self.queues[key][i]
            self.heads[key] = i + 1
            ex = self.executor
            buf = ex._buffer(a.kind)
            with ex.comm.labelled(WaitLabel(ex.rank, a)):
                self.posted[key] = (a, ex.comm.irecv(buf, a.peer, _tag(a.kind)), buf)

    def take(self, a: Action):
        """``(handle, buffer)`` of receive action ``a``; :meth:`post_next` once it has arrived."""
        posted, handle, buf = self.posted.pop((a.peer, a.kind))
        if posted is not a:  # cannot happen: receives are posted in list order per (peer, kind)
            raise RuntimeError(f"pipeline rank {self.executor.rank}: posted {posted}, expected {a}")
        return handle, buf

    def post_next(self, a: Action) -> None:
        self._post((a.peer, a.kind))


class _Step:
    """One step's state on a rank: the stash, what arrived and what waits to be sent, the
    deferred weight passes, the sends in flight, the losses, and the stash's size (now, peak)."""

    def __init__(self, m: int):
        self.stash: dict = {}
        self.inbox: dict = {}
        self.outbox: dict = {}
        self.wpasses: dict = {}
        self.sends: list = []
        self.losses = [0.0] * m
        self.live = self.peak = self.live_bytes = self.peak_bytes = 0


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
        acts = sched.actions[self.rank]
        step = _Step(self.m)
        op_time = {FORWARD: 0.0, BACKWARD: 0.0, WEIGHT: 0.0}
        op_count = {FORWARD: 0, BACKWARD: 0, WEIGHT: 0}
        recv_wait = 0.0
        trace = [] if self.trace else None
        t_start = time.perf_counter()
        receives = _Receives(self, acts)
        for a in acts:
            key = (a.mb, a.chunk)
            if a.is_recv:
                handle, step.inbox[(a.kind,) + key] = receives.take(a)
                t0 = time.perf_counter()
                self._wait(handle)
                t1 = time.perf_counter()
                recv_wait += t1 - t0
                if trace is not None:
                    trace.append((t0 - t_start, t1 - t_start, "wait", a.mb, a.chunk))
                receives.post_next(a)
                continue
            if a.is_send:
                self._send(a, step)
                continue
            t0 = time.perf_counter()
            if a.op == FORWARD:
                self._forward_action(a, step, xs, ys, training)
            elif a.op == BACKWARD:
                self._backward_action(a, step, sched.split_backward)
            else:
                step.wpasses.pop(key).run()
                self._release(step, key)
            t1 = time.perf_counter()
            op_time[a.op] += t1 - t0
            op_count[a.op] += 1
            if trace is not None:
                trace.append((t0 - t_start, t1 - t_start, a.op, a.mb, a.chunk))
            if step.sends:
                step.sends = _unfinished(step.sends)  # drives MPI progress of the sends
        t0 = time.perf_counter()
        for h, sent in step.sends:
            self._wait(h)
            _let_go(sent)
        send_wait = time.perf_counter() - t0
        total = time.perf_counter() - t_start
        if step.stash or step.wpasses or step.inbox or step.outbox:
            raise RuntimeError(f"pipeline rank {self.rank}: schedule left work behind: stash {sorted(step.stash)}, "
                               f"W {sorted(step.wpasses)}, inbox {sorted(step.inbox)}, outbox {sorted(step.outbox)}")
        compute = sum(op_time.values())
        self.stats = {"t0": t_start, "step_s": total, "compute_s": compute, "idle_s": total - compute,
                      "bubble": (total - compute) / total if total > 0 else 0.0,
                      "recv_wait_s": recv_wait, "send_wait_s": send_wait,
                      "op_s": dict(op_time), "op_count": dict(op_count),
                      "peak_stash": step.peak, "peak_stash_bytes": step.peak_bytes,
                      "stash_bytes_per_mb": dict(self._stash_bytes)}
        if trace is not None:
            self.stats["trace"] = trace
        return sum(step.losses) / self.m if self.has_head else 0.0

    def _send(self, a: Action, step: _Step) -> None:
        """Post send action ``a``; an activation nothing else reads is let go of once sent (the
        stash keeps its graph)."""
        data = step.outbox.pop((a.kind, a.mb, a.chunk))
        with self.comm.labelled(WaitLabel(self.rank, a)):
            handle = self.comm.isend(data, a.peer, _tag(a.kind))
        entry = step.stash.get((a.mb, a.chunk)) if a.kind == "act" else None
        step.sends.append((handle, entry.out if entry and entry.frees_out else None))

    def _forward_action(self, a: Action, step: _Step, xs, ys, training: bool) -> None:
        """Run micro-batch ``a.mb``'s forward through chunk ``a.chunk``; in training, stash it for
        its backward less what no op saved: the received input goes now (its buffer back to the
        pool), the output's data once sent."""
        key, s = (a.mb, a.chunk), a.chunk * self.pp + self.rank
        buf = step.inbox.pop(("act",) + key) if s > 0 else None
        inp = Tensor(buf, requires_grad=training) if buf is not None else None
        held = sys.getrefcount(buf) if buf is not None else 0  # the references before the forward
        out, loss = self._forward(a.chunk, a.mb, inp, xs, ys)
        if loss is not None:
            step.losses[a.mb] = loss
        if s < self.S - 1:
            step.outbox[("act",) + key] = out.data
        if not training:
            if buf is not None:
                self._pool["act"].append(buf)
            return
        first = a.chunk not in self._stash_bytes
        kept = kept_bytes(out) if first else 0
        frees_out = s < self.S - 1 and sys.getrefcount(out.data) == 3  # the Tensor's, the outbox's, the call's
        if buf is not None and sys.getrefcount(buf) == held:  # no op saved the input
            kept -= buf.nbytes
            inp.data = _stand_in(buf)
            self._pool["act"].append(buf)
            buf = None
        if first:
            self._stash_bytes[a.chunk] = kept - (out.data.nbytes if frees_out else 0)
        step.stash[key] = _Stashed(inp, out, act_buf=buf, frees_out=frees_out)
        step.live += 1
        step.live_bytes += self._stash_bytes[a.chunk]
        step.peak, step.peak_bytes = max(step.peak, step.live), max(step.peak_bytes, step.live_bytes)

    def _backward_action(self, a: Action, step: _Step, split: bool) -> None:
        """Run micro-batch ``a.mb``'s backward through chunk ``a.chunk`` from the gradient received
        (the loss on the last stage); its weight pass waits for W under a split schedule."""
        key, s = (a.mb, a.chunk), a.chunk * self.pp + self.rank
        entry = step.stash[key]
        entry.grad_buf = step.inbox.pop(("grad",) + key) if s < self.S - 1 else None
        wp = entry.out.backward(entry.grad_buf, defer_weight_grad=split)
        if s > 0:
            step.outbox[("grad",) + key] = entry.inp.grad
        entry.inp = entry.out = None
        if split:
            step.wpasses[key] = wp
        else:
            self._release(step, key)

    def _release(self, step: _Step, key) -> None:
        """A micro-batch's backward is complete: its received buffers go back to the pool."""
        entry = step.stash.pop(key)
        for kind, buf in (("act", entry.act_buf), ("grad", entry.grad_buf)):
            if buf is not None:
                self._pool[kind].append(buf)
        step.live -= 1
        step.live_bytes -= self._stash_bytes.get(key[1], 0)

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
