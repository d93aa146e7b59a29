"""Parameter groups: this rank's parameters as stores, each with the sync and optimizer it needs.

A group is a parameter store, the communicator over which its gradients are averaged (the ranks
that hold the same parameters) and what its gradient norm spans beyond tp and pp. Its *sync* is
chosen once, from the layout's ZeRO stage:

    ZeRO   store                                     sync (its optimizer)
    0      FlatParams                                DataParallelSync: DataParallel's buckets (AdamW)
    1, 2   FlatParams (2: no full gradient kept)     Zero12Optimizer (itself)
    3      ShardedParams (sharded per unit group)    Zero3Optimizer (itself)

The engine (:class:`mpirt.parallel.engine.Engine`) holds ``[dense over dp x cp]`` and, under
expert parallelism, ``[experts over edp]`` (their squares summed over ep for the norm), and loops
over them as Megatron-Core loops over its dense and expert gradient buffers, stepping their
optimizers as one (:class:`ChainedOptimizer`). Every sync presents:

    sync.zero_grad()                     every gradient zeroed (by the engine alone, once a step)
    sync.no_sync()                       context: a non-final micro-batch accumulates locally
    sync.finish()                        after backward: the reductions in flight complete
    sync.sync_partial_grads(tp_comm)     sequence parallelism's partial gradients summed over tp
    sync.norm_parts()                    (counted sum of squares over the sync's ranks, arrays a clip scales)
    sync.step()                          the update (and, under ZeRO-1/2, the parameters' all-gather)
    sync.calls()                         (axis, kind, bytes, dtype) of its fixed calls in a step
    sync.partial_sum_calls(tp_comm)      those of sync_partial_grads
    sync.memory_bytes(), sync.close()
    sync.reruns_units                    whether its units rerun their forward in backward (ZeRO-3)
"""
from __future__ import annotations

import contextlib
import dataclasses

from mpirt.core.optim import AdamW
from mpirt.parallel.ddp import DataParallel
from mpirt.parallel.experts import is_expert
from mpirt.parallel.flat import FlatParams
from mpirt.parallel.zero import Zero12Optimizer
from mpirt.parallel.zero3 import ShardedParams, Zero3Optimizer


class DataParallelSync:
    """ZeRO-0's sync of ``store`` (a :class:`~mpirt.parallel.flat.FlatParams`): its gradients
    averaged over ``comm`` by :class:`~mpirt.parallel.ddp.DataParallel`'s buckets as backward
    runs (none on a single rank), and :attr:`optimizer`, an AdamW (``hyper``) over its parameters."""

    reruns_units = False

    def __init__(self, store: FlatParams, comm, **hyper):
        self.store, self.comm = store, comm
        self.ddp = DataParallel(store, comm) if comm.size > 1 else None
        self.optimizer = AdamW(store.params, **hyper)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def no_sync(self):
        """Inside, backward accumulates without communicating."""
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    def finish(self) -> None:
        """Wait until every bucket holds the average over ``comm``."""
        if self.ddp is not None:
            self.ddp.finish()

    def sync_partial_grads(self, tp_comm) -> None:
        self.store.sync_partial_grads(tp_comm)

    def partial_sum_calls(self, tp_comm) -> list[tuple]:
        return self.store.partial_sum_calls(tp_comm)

    def norm_parts(self) -> tuple:
        """The store's part of the global norm (every replica holds the whole average)."""
        return self.store.norm_parts()

    def step(self) -> None:
        self.optimizer.step()

    def calls(self) -> list[tuple[str, str, int, str]]:
        """DataParallel's average of every bucket (:meth:`~mpirt.parallel.ddp.DataParallel.calls`)."""
        return self.ddp.calls() if self.ddp is not None else []

    def memory_bytes(self) -> dict:
        """Bytes held between steps: the store's parameters and gradients, AdamW's state."""
        return {"params": int(self.store.data.nbytes), "grads": int(self.store.grad.nbytes),
                "optimizer": self.optimizer.memory_bytes()["optimizer"]}

    def close(self) -> None:
        """Stop DataParallel's communication thread, if any."""
        if self.ddp is not None:
            self.ddp.close()


@dataclasses.dataclass
class ParamGroup:
    """One group: ``name`` ("dense" or "experts"), its ``store``, its ``sync`` over the
    communicator ``comm``, the ``optimizer`` the training loop steps (the sync itself under
    ZeRO) and ``norm_span``: the communicators over which its squares are summed before tp's
    and pp's (the experts': ep, whose ranks hold different experts)."""

    name: str
    store: object
    comm: object
    sync: object
    optimizer: object
    norm_span: tuple = ()

    def norm_parts(self) -> tuple:
        """``(the group's counted sum of squares over its sync's ranks and its norm span; the
        arrays a clip scales)``. Collective over them."""
        sq, arrays = self.sync.norm_parts()
        for comm in self.norm_span:
            sq = comm.allreduce_scalar(sq)
        return sq, arrays


def parameter_groups(local, grid, zero: int, counted, norm_comms, hyper: dict, probe_len: int) -> list[ParamGroup]:
    """The groups of ``local``'s parameters (the engine's local part, :mod:`mpirt.parallel.whole`)
    under ZeRO stage ``zero``: the dense ones over ``grid.comm["dp_cp"]`` and, when it holds any,
    the experts split over ep over ``grid.comm["edp"]``. ``counted``: the norm's count-once
    predicate; ``norm_comms``: tp and pp (a ZeRO optimizer's own clip); ``hyper``: AdamW's
    ``lr``, ``betas``, ``weight_decay``; ``probe_len``: the tokens of ZeRO-3's one-row discovery
    run (sequence parallelism needs a multiple of tp, context parallelism two per chunk pair).
    ZeRO-3 (refused with ep by the layout) has one group, whose store gives a pipeline's tied
    copies their gradient shards (``local.tied_grads``)."""
    dense_comm = grid.comm["dp_cp"]
    if zero == 3:
        store = ShardedParams(local.model, dense_comm, counted, init=local.init, units=local.units,
                              probe_len=probe_len, probe=local.probe, dropout_roots=local.dropout_roots,
                              alone=local.held_tied, runs=local.unit_runs)
        if local.held_tied:  # a pipeline's tied copies: summed over its ends as gradient shards
            local.tied_grads = store.alone_grads
        sync = Zero3Optimizer(store, dense_comm, norm_comms=norm_comms, **hyper)
        return [ParamGroup("dense", store, dense_comm, sync, sync)]
    params = local.parameters()
    parts = [("dense", [p for p in params if not is_expert(p)], dense_comm, (), local.held_tied),
             ("experts", [p for p in params if is_expert(p)], grid.comm["edp"], (grid.comm["ep"],), ())]
    groups = []
    for name, members, comm, span, held in parts:
        if not members and name == "experts":
            continue
        store = FlatParams(members, counted, init=local.init, grads=zero != 2)  # ZeRO-2: a shard only
        if zero:  # stage 2 reduces buckets during backward; a pipeline's tied copies wait for the step
            sync = optimizer = Zero12Optimizer(store, comm, stage=zero, norm_comms=norm_comms, stream_grads=True,
                                               held=held, **hyper)
        else:
            sync = DataParallelSync(store, comm, **hyper)
            optimizer = sync.optimizer
        groups.append(ParamGroup(name, store, comm, sync, optimizer, span))
    return groups


def finish_backward(groups, tp_comm) -> None:
    """After backward: every group's reductions in flight completed, then every group's sequence
    parallelism's partial gradients summed over ``tp_comm`` (the experts' as well as the dense
    ones). Collective over each group's ranks and over tp."""
    for g in groups:
        g.sync.finish()
    for g in groups:
        g.sync.sync_partial_grads(tp_comm)


class ChainedOptimizer:
    """The groups' optimizers as one to the training loop: ``lr`` and ``grad_scale`` are set on
    every one, ``step`` runs each; the step count and the scalars (equal in all) are the first's."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)

    def _set_on_all(name: str):
        """A property read from the first optimizer and set on every one."""
        def set_all(self, value) -> None:
            for opt in self.optimizers:
                setattr(opt, name, value)
        return property(lambda self: getattr(self.optimizers[0], name), set_all)

    lr = _set_on_all("lr")
    grad_scale = _set_on_all("grad_scale")  # 1 / the loss scale
    del _set_on_all

    @property
    def step_count(self) -> int:
        return self.optimizers[0].step_count

    def scalars(self) -> dict:
        return self.optimizers[0].scalars()

    def load_scalars(self, d: dict) -> None:
        for opt in self.optimizers:
            opt.load_scalars(d)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def memory_bytes(self) -> dict:
        """Every optimizer's persistent bytes, per category."""
        held = [opt.memory_bytes() for opt in self.optimizers]
        return {k: sum(h[k] for h in held) for k in held[0]}
