"""ZeRO-2's gradient reduction while backward runs (:class:`GradStream`, the stream of
:class:`mpirt.parallel.zero.Zero12Optimizer` at stage 2 with ``stream_grads``): the full gradient
never exists; each bucket of the parameter store is reduce-scattered into the owners' gradient
shards as soon as backward has finished every gradient in it."""
from __future__ import annotations

import mpirt.core.backend as B
from mpirt.comm import chunk_bounds


class GradStream:
    """The gradients of ``opt``'s store (a stage-2 :class:`~mpirt.parallel.zero.Zero12Optimizer`)
    reduced into its gradient shard while backward runs (:mod:`mpirt.parallel.zero`, stage 2): buckets are
    ranges of at most ``bucket_bytes`` of the parameter store, cut from its end (the order backward
    finishes the gradients) at element granularity, so a large parameter spans several buckets
    and no bucket is larger than the staging buffer. They are reduced in index order (every rank
    issues the same collectives in the same order) once every parameter they touch reported its
    gradient final; a parameter's ``p.grad`` is freed once every bucket it touches took its part
    (the parts taken before are zeroed, so a micro-batch that adds to it before then, as an
    interleaved pipeline's order does, is owed to all of them again). A bucket whose parameters
    finish before its predecessors' waits for them, and :meth:`finish` reduces whatever is left
    (unused parameters never fire their hook: their bucket, and those after it, wait until then, also through the next micro-batches). Every
    micro-batch's backward (gradient accumulation, a pipeline's micro-batches) reduces its
    buckets and the shard sums them. The parameters in ``held`` (a pipeline's tied copies, summed
    over the pipeline ends after the schedule) get buckets of their own, which the stream passes
    over and :meth:`finish` reduces."""

    def __init__(self, opt, bucket_bytes: int, held=()):
        self.opt, store = opt, opt.store
        lo_mine = opt.groups[0].lo
        owners = chunk_bounds(store.numel, opt.size)
        step = max(1, bucket_bytes // store.dtype.itemsize)
        held = {id(p) for p in held}
        # runs of parameters alike (held or not), from the end; each cut into buckets from its end
        runs, bounds = [], []
        for p, (a, b) in zip(store.params, store.offsets):
            if runs and runs[-1][2] == (id(p) in held):
                runs[-1][1] = b
            else:
                runs.append([a, b, id(p) in held])
        for a, b, is_held in reversed(runs):
            bounds += [(max(a, hi - step), hi, is_held) for hi in range(b, a, -step)]
        # (lo, hi, [(param, start, stop, pos)], elements per rank, where this rank's part goes in the shard)
        self.buckets = [(lo, hi, store.segments(lo, hi),
                         [max(0, min(hi, r_hi) - max(lo, r_lo)) for r_lo, r_hi in owners], max(lo, lo_mine) - lo_mine)
                        for lo, hi, _ in bounds]
        self.held = [is_held for *_, is_held in bounds]
        self._buckets_of: dict = {}
        for k, bucket in enumerate(self.buckets):
            for p, *_ in bucket[2]:
                self._buckets_of.setdefault(id(p), []).append(k)
        self._held_ids = held
        self.staging = B.xp.empty(min(step, store.numel), dtype=store.dtype)
        for p in store.params:
            if id(p) not in held:
                p.register_hook(self._ready)
        self.reset()

    def reset(self) -> None:
        self.final = [set() for _ in self.buckets]  # parameters final since the bucket's last reduction
        # per parameter, the buckets its p.grad still owes data: freed when none is left (a
        # gradient made again before all were reduced owes all of them again)
        self.owed = {key: set(ks) for key, ks in self._buckets_of.items() if key in self._held_ids}
        self.next, self.pending = 0, False  # the bucket to reduce next; whether a pass is under way

    def _ready(self, p) -> None:
        self.owed[id(p)] = set(self._buckets_of[id(p)])
        for k in self._buckets_of[id(p)]:
            self.final[k].add(id(p))
        self.pending = True
        while self.pending:
            k = self.next
            if not self.held[k]:
                if len(self.final[k]) < len(self.buckets[k][2]):
                    break
                self._reduce_bucket(k)
            self.next = (k + 1) % len(self.buckets)
            self.pending = self.next != 0  # after the last bucket the next micro-batch starts over

    def _reduce_bucket(self, k: int) -> None:
        """Pack bucket ``k``, reduce-scatter it into the shard. What it took of a gradient is gone
        from ``p.grad`` afterwards (freed once no bucket is owed any of it, zeroed before: a later
        micro-batch adds only its own part)."""
        lo, hi, members, counts, at = self.buckets[k]
        opt = self.opt
        for p, a, b, pos in members:
            part = self.staging[pos:pos + b - a]
            if p.grad is None:
                part.fill(0)
                continue
            if not p.grad.flags.c_contiguous:  # (once: its flat ranges must be views)
                p.grad = B.xp.ascontiguousarray(p.grad)
            flat = p.grad.reshape(-1)
            part[...] = flat[a:b]
            owed = self.owed.get(id(p), set())
            owed.discard(k)
            if owed:
                flat[a:b] = 0
            else:
                p.grad = None
        self.final[k].clear()
        B.synchronize()
        mine = opt.comm.reduce_scatter(self.staging[:hi - lo], op="avg", counts=counts)
        if counts[opt.rank]:
            opt.grad_shard[at:at + counts[opt.rank]] += mine

    def finish(self) -> None:
        """Reduce, in index order, the held buckets and every bucket that got a gradient since
        its last reduction (a waiting bucket of this or an earlier micro-batch: the same ones on
        every rank, whose graphs are alike); then the next backward starts from bucket 0."""
        for k, final in enumerate(self.final):
            if final or self.held[k]:
                self._reduce_bucket(k)
        self.reset()
