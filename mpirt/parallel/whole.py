"""The local part without a pipeline: the whole model on this rank (tensor parallel by its plan).

:class:`WholeModel` presents the interface :class:`mpirt.parallel.pipeline.stage.PipelineStage`
presents, so the engine holds either without asking which (:class:`mpirt.parallel.engine.Engine`):

    local.model, local.blocks           # the Module and its blocks by layer index (recomputation)
    local.tied_copy, local.held_tied    # tied copies left out of the norm / held for the step
    local.dropout_roots, local.init     # modules whose dropouts are seeded; the store's initialiser
    local.units, local.probe            # ZeRO-3's units and their one-token probe (None: the model's
                                        # embed / blocks / head from token ids)
    local.unit_runs                     # the model chunk of each unit (None: one chunk)
    local.tied_calls()                  # the tied copies' gradient sum's calls in a step (none here)
    local.has_embed                     # whether it looks tokens up (the first stage of a pipeline)
    local.parameters()
    local.train_step(x, y, loss_scale, place, no_sync) -> float   # this replica's mean loss
    local.evaluate(x, y) -> float
    local.stats                         # the last step's timers (one format for both parts)
    local.trace                         # True: stats["trace"] lists each compute span

``stats``: ``t0`` (perf_counter at the start), ``step_s``, ``compute_s``, ``idle_s``, ``bubble``,
``op_s`` and ``op_count`` per action (F, B, W), ``peak_stash_bytes``, with ``trace`` the spans
``(start, end, op, micro-batch or None, chunk)`` relative to ``t0``; the engine adds ``sync_t0`` and
``sync_s`` (its gradient sync).
"""
from __future__ import annotations

import contextlib
import time

import mpirt.core.backend as B
from mpirt.data.tokens import split_microbatches
from mpirt.core.modeling import build_model
from mpirt.core.nn import dropout_modules, place_dropouts, seed_losses
from mpirt.parallel import tensor as TP
from mpirt.parallel.experts import parallelize_experts
from mpirt.parallel.pipeline.schedules import BACKWARD, FORWARD, WEIGHT
from mpirt.core.tensor import no_grad


def parameter_axes(grid) -> tuple[dict, dict]:
    """The axes over which a parameter may be split, with their sizes and this rank's places:
    tp (tensor parallelism) and ep (a mixture of experts' experts)."""
    return {a: grid.sizes[a] for a in ("tp", "ep")}, {a: grid.coords[a] for a in ("tp", "ep")}


def seeded_init(seed: int, axis_sizes: dict, axis_ranks: dict):
    """``init(p, out=None)``: parameter ``p``'s slice of its seeded initial tensor
    (:meth:`mpirt.core.nn.Parameter.init_slice`), written into ``out`` when given (a device array
    through one host slice)."""
    def init(p, out=None):
        if out is not None and B.is_device_array(out):
            out[...] = B.asarray(p.init_slice(seed, axis_sizes, axis_ranks))
            return out
        return p.init_slice(seed, axis_sizes, axis_ranks, out=out)
    return init


class WholeModel:
    """The whole model (``model_cfg``, made tensor parallel over ``grid``'s tp axis as ``layout``
    says, sequence parallel or not; its experts split over ep), its rows split into the layout's
    micro-batches (``grad_accum``) whose gradients accumulate.

    Built lazily (no arrays): every layout starts from the single-rank weights, each parameter's
    slice of its seeded tensor generated straight into the parameter store by :attr:`init`
    (ZeRO-3: one parameter at a time, of which the rank keeps its shard)."""

    tied_copy: tuple = ()
    held_tied: tuple = ()
    has_embed = True   # it looks tokens up (of a pipeline's stages, the first only)
    units = probe = unit_runs = None

    def __init__(self, layout, model_cfg, grid, *, dtype: str, seed: int):
        self.model = build_model(model_cfg, dtype=dtype)
        if layout.tp > 1:
            TP.parallelize(self.model, grid.comm["tp"], sequence_parallel=layout.sequence_parallel)
        parallelize_experts(self.model, grid.comm["ep"])
        self.init = seeded_init(seed, *parameter_axes(grid))
        self.blocks = dict(enumerate(self.model.h))
        self.dropout_roots = (self.model,)
        self._dropouts = list(dropout_modules(self.model).values())
        self.grad_accum = layout.microbatches
        self.trace = False
        self.stats: dict = {}

    def parameters(self) -> list:
        return self.model.parameters()

    @staticmethod
    def tied_calls() -> list:
        """No pipeline, no tied copies to sum."""
        return []

    def train_step(self, x, y, loss_scale: float = 1.0, place: tuple | None = None,
                   no_sync=contextlib.nullcontext) -> float:
        """``grad_accum`` micro-batches of ``(x, y)``, backward seeded with ``loss_scale``; all but the
        last inside ``no_sync()`` (they only accumulate locally). ``place``: (step, global row of
        x's first row) for the dropout masks. Returns the mean loss of these rows."""
        k = self.grad_accum
        seed_losses(self.dropout_roots, loss_scale / k)
        loss_sum = 0.0
        clock = time.perf_counter
        start = clock()
        op_s, trace = {FORWARD: 0.0, BACKWARD: 0.0, WEIGHT: 0.0}, []
        try:
            for i, (xm, ym) in enumerate(split_microbatches(x, y, k)):
                if place is not None:
                    place_dropouts(self._dropouts, place[0], place[1] + i * len(xm))
                with no_sync() if i < k - 1 else contextlib.nullcontext():
                    t0 = clock()
                    _, loss = self.model(B.asarray(xm), B.asarray(ym))
                    B.synchronize()  # the device's forward is timed as forward (no-op on NumPy)
                    t1 = clock()
                    (loss * (loss_scale / k)).backward()
                    t2 = clock()
                loss_sum += loss.item()
                op_s[FORWARD] += t1 - t0
                op_s[BACKWARD] += t2 - t1
                mb = i if k > 1 else None  # one micro-batch: its spans are the step's forward and backward
                trace += [(t0 - start, t1 - start, FORWARD, mb, 0), (t1 - start, t2 - start, BACKWARD, mb, 0)]
        finally:  # a later forward without a step (by hand) counts calls again
            place_dropouts(self._dropouts, None)
        total = clock() - start
        self.stats = {"t0": start, "step_s": total, "compute_s": op_s[FORWARD] + op_s[BACKWARD], "idle_s": 0.0,
                      "bubble": 0.0, "op_s": op_s, "op_count": {FORWARD: k, BACKWARD: k, WEIGHT: 0}, "peak_stash_bytes": 0}
        if self.trace:
            self.stats["trace"] = trace
        return loss_sum / k

    def evaluate(self, x, y) -> float:
        """Mean loss of ``(x, y)`` without gradients, dropout off."""
        self.model.eval()
        try:
            with no_grad():
                return self.model(B.asarray(x), B.asarray(y))[1].item()
        finally:
            self.model.train()
