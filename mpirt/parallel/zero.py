"""ZeRO: AdamW with its state, gradients and parameters sharded over the data-parallel ranks.

The parameters are laid out as flat vectors ("groups"); each group is cut into ``dp`` contiguous
chunks by :func:`mpirt.comm.chunk_bounds` and dp rank ``r`` owns chunk ``r`` of every group. The
owned chunks, concatenated, form this rank's *shard*: its AdamW state (``exp_avg``,
``exp_avg_sq``) and, from stage 2, its gradients, and at stage 3 its parameters, are flat arrays
over the shard, and the update is one :func:`mpirt.optim.adamw_update` call over it (the same
math as :class:`mpirt.optim.AdamW`; weight decay is applied first, element-wise, on the runs of
the shard that belong to decayed parameters, exactly as AdamW applies it per parameter).

* Stage 1: one group, all parameters. Each ``p.data`` and ``p.grad`` is a view into a full flat
  vector. ``step`` allreduces (averages) the full gradient, updates the owned chunk, allgathers
  the parameters. Per rank: params 4N + grads 4N + state 8N/dp bytes (fp32).
* Stage 2: as stage 1, but ``step`` reduce-scatters the gradient, so only the owned chunk is kept.
  The full gradient exists only between :meth:`zero_grad` and :meth:`step` (backward accumulates
  into it), then it is released (``p.grad`` becomes None). Persistent: 4N + (4 + 8)N/dp.
* Stage 3: the parameters themselves are sharded. Groups follow the model's *units*: for a model
  with the ``embed`` / ``h`` / ``head`` interface of :mod:`models` the units are ``embed``, each
  block and ``head``, and a group is the set of parameters used by the same units (so GPT's tied
  ``wte`` is its own group, gathered by both ``embed`` and ``head``). Each unit's call becomes a
  :class:`_ZeroUnit` Function: its forward all-gathers the unit's groups into temporary full
  arrays, runs the unit without recording a graph and frees them; its backward all-gathers them
  again, recomputes the unit's forward with a graph (dropout replays the same masks), back-propagates
  the incoming gradient, reduce-scatters (averages) the full parameter gradients, frees everything
  and returns the owned gradient chunks as the gradients of the shard tensors (leaves, so the
  engine accumulates micro-batches into the persistent gradient shard). Between units only the
  unit inputs are kept: stage 3 implies activation recomputation per unit (one extra forward).
  Outside a unit ``p.data`` is an empty placeholder. Persistent: 16N/dp.

Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` hold this rank's shard only and must be
loaded on the same dp size; gathering to a layout-independent full state is not implemented
(:meth:`gather_parameters` gives the full weights, not the optimizer state).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

import mpirt.backend as B
from mpirt.comm import chunk_bounds
from mpirt.nn import Dropout, Module, Parameter
from mpirt.optim import adamw_update
from mpirt.tensor import Function, Tensor, _grad_mode, no_grad


class _Group:
    """Parameters laid out back to back in one flat vector, chunked over the dp ranks."""

    def __init__(self, params, shapes, rank: int, size: int):
        self.params = params
        self.shapes = [shapes[id(p)] for p in params]
        self.offsets, n = [], 0
        for s in self.shapes:
            k = math.prod(s)
            self.offsets.append((n, n + k))
            n += k
        self.numel = n
        self.bounds = chunk_bounds(n, size)
        self.lo, self.hi = self.bounds[rank]
        self.shard_offset = 0  # where this group's chunk starts in the rank's concatenated shard
        self.shard = None      # stage 3: a leaf Tensor over the chunk (data: params, grad: grads)

    def views(self, flat):
        """``flat`` (numel,) as one array per parameter."""
        return [flat[a:b].reshape(s) for (a, b), s in zip(self.offsets, self.shapes)]


class ZeroOptimizer:
    """AdamW sharded over the ranks of ``comm`` (a dp :class:`mpirt.comm.Comm`), ZeRO stage 1-3.

    ``model_or_params``: a Module (required for stage 3) or a list of Parameters. ``lr``, ``betas``,
    ``eps``, ``weight_decay`` and ``decay`` (predicate: which parameters are decayed; default
    ``ndim >= 2``) as :class:`mpirt.optim.AdamW`. ``units`` (stage 3 only): a list of
    ``(object, method_name)`` whose calls gather parameters; the default is the model's
    ``embed``, each of ``h`` and ``head``. Parameters are broadcast from dp rank 0 at construction.

    Loop: ``zero_grad()``; forward/backward per micro-batch (scale the loss by 1/K); optionally
    ``clip_grad_norm(max_norm)``; ``step()``. All parameters must share one dtype.
    """

    def __init__(self, model_or_params, comm, stage: int = 1, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, decay=None, units=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroOptimizer: stage must be 1, 2 or 3, got {stage}")
        beta1, beta2 = betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"ZeroOptimizer: betas must be in [0, 1), got {tuple(betas)}")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"ZeroOptimizer: lr ({lr}), eps ({eps}) and weight_decay ({weight_decay}) must be >= 0")
        self.model = model_or_params if isinstance(model_or_params, Module) else None
        params = self.model.parameters() if self.model is not None else list(model_or_params)
        self.params = [p for p in params if p.requires_grad]
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("ZeroOptimizer: a parameter appears twice in params")
        dtypes = sorted({str(p.dtype) for p in self.params})
        if len(dtypes) != 1:
            raise ValueError(f"ZeroOptimizer: all parameters must share one dtype, got {dtypes}")
        if stage == 3 and self.model is None:
            raise ValueError("ZeroOptimizer: stage 3 needs the model (its units gather parameters)")
        self.comm, self.stage = comm, stage
        self.rank, self.size = comm.rank, comm.size
        self.dtype = self.params[0].dtype
        self.lr, self.beta1, self.beta2 = float(lr), float(beta1), float(beta2)
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.step_count = 0
        decay = decay or (lambda p: p.ndim >= 2)
        self._decayed = {id(p): bool(decay(p)) for p in self.params}  # before stage 3 empties p.data
        self._shapes = {id(p): tuple(p.shape) for p in self.params}
        self._broadcast_parameters()

        if stage == 3:
            self.units, groups = self._plan_units(units)
        else:
            groups = [self.params]
        self.groups = [_Group(g, self._shapes, self.rank, self.size) for g in groups]
        self.numel = sum(g.numel for g in self.groups)
        offset = 0
        for g in self.groups:
            g.shard_offset = offset
            offset += g.hi - g.lo
        self.shard_numel = offset
        xp = B.xp
        self.exp_avg = xp.zeros(offset, dtype=self.dtype)
        self.exp_avg_sq = xp.zeros(offset, dtype=self.dtype)
        self._decay_runs = self._decay_runs_of_shard()
        self._reduced = False
        if stage == 3:
            self._shard_parameters()
        else:
            g = self.groups[0]
            self.flat_param = xp.empty(g.numel, dtype=self.dtype)
            for p, v in zip(g.params, g.views(self.flat_param)):
                v[...] = p.data
                p.data = v
            self.param_shard = self.flat_param[g.lo:g.hi]
            self.flat_grad = None
            if stage == 1:
                self.flat_grad = xp.zeros(g.numel, dtype=self.dtype)
                self.grad_shard = self.flat_grad[g.lo:g.hi]
                self._attach_full_grads(self.flat_grad, copy_existing=True)
            else:
                self.grad_shard = xp.zeros(offset, dtype=self.dtype)

    # --- construction -----------------------------------------------------------------------
    def _broadcast_parameters(self) -> None:
        if self.size == 1:
            return
        flat = B.xp.concatenate([p.data.reshape(-1) for p in self.params])
        B.synchronize()
        self.comm.broadcast(flat, root=0)
        offset = 0
        for p in self.params:
            p.data[...] = flat[offset:offset + p.size].reshape(p.shape)
            offset += p.size

    def _decay_runs_of_shard(self) -> list[tuple[int, int]]:
        """Maximal [start, stop) runs of the shard that belong to decayed parameters."""
        runs = []
        for p, a, b, start in self.owned_segments():
            if not self._decayed[id(p)]:
                continue
            stop = start + b - a
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], stop)
            else:
                runs.append((start, stop))
        return runs

    def _attach_full_grads(self, flat, copy_existing: bool) -> None:
        """Make every ``p.grad`` a view into the full flat gradient ``flat`` (stages 1 and 2)."""
        g = self.groups[0]
        for p, v in zip(g.params, g.views(flat)):
            if copy_existing:
                if p.grad is None:
                    v.fill(0)
                else:
                    v[...] = p.grad
            p.grad = v

    # --- stage 3: units, groups and the sharded parameters -------------------------------------
    def _plan_units(self, units):
        """The units whose calls gather parameters, and the parameter groups (one per set of
        units that use the same parameters)."""
        model = self.model
        if units is None:
            if not all(hasattr(model, a) for a in ("embed", "h", "head")):
                raise ValueError("ZeroOptimizer stage 3: the model has no embed/h/head interface; "
                                 "pass units=[(object, method_name), ...]")
            units = [(model, "embed")] + [(blk, "forward") for blk in model.h] + [(model, "head")]
        used = self._discover_unit_params(units)
        param_ids = {id(p) for p in self.params}
        signature = {}
        for k, ps in enumerate(used):
            for p in ps:
                if id(p) in param_ids:
                    signature.setdefault(id(p), []).append(k)
        groups, by_sig = [], {}
        for p in self.params:  # registration order within a group; groups in first-use order
            sig = tuple(signature.get(id(p), ()))
            if sig not in by_sig:
                by_sig[sig] = []
                groups.append((sig, by_sig[sig]))
            by_sig[sig].append(p)
        groups.sort(key=lambda sg: sg[0][0] if sg[0] else len(units))
        plan = []
        for k, (obj, name) in enumerate(units):
            member = [i for i, (sig, _) in enumerate(groups) if k in sig]
            plan.append(_Unit(self, obj, name, member))
        return plan, [ps for _, ps in groups]

    def _discover_unit_params(self, units) -> list[list]:
        """Run the units once on a 1x1 token batch to see which parameters each one uses."""
        if len(units) == 1:
            return [self.params]
        if [name for _, name in units][:1] != ["embed"]:
            raise ValueError("ZeroOptimizer stage 3: pass units whose first is the model's embed "
                             "(parameter discovery runs embed -> ... -> head on one token)")
        saved = _dropout_state(self.model)
        used, x = [], B.xp.zeros((1, 1), dtype=np.int64)
        with _grad_mode(True):
            for k, (obj, name) in enumerate(units):
                inp = x if k == 0 else Tensor(x, requires_grad=True)
                out = getattr(obj, name)(inp)
                used.append(_graph_parameters(out))
                x = out.data
        _restore_dropouts(saved)
        return used

    def _shard_parameters(self) -> None:
        xp = B.xp
        self.param_shard = xp.empty(self.shard_numel, dtype=self.dtype)
        self.grad_shard = xp.zeros(self.shard_numel, dtype=self.dtype)
        self._placeholder = xp.empty(0, dtype=self.dtype)
        for g in self.groups:
            a, b = g.shard_offset, g.shard_offset + g.hi - g.lo
            full = xp.concatenate([p.data.reshape(-1) for p in g.params])
            self.param_shard[a:b] = full[g.lo:g.hi]
            g.shard = Tensor(self.param_shard[a:b], requires_grad=True)
            g.shard.grad = self.grad_shard[a:b]
        for p in self.params:
            p.data, p.grad = self._placeholder, None
        for unit in self.units:
            unit.install()

    @contextlib.contextmanager
    def _gathered(self, group_ids, with_grads: bool = False):
        """Full parameters of the given groups as temporary arrays behind ``p.data`` (and zeroed
        full gradient buffers behind ``p.grad``); yields {group index: full gradient buffer}."""
        grads = {}
        try:
            for i in group_ids:
                g = self.groups[i]
                B.synchronize()
                full = self.comm.allgather_flat(g.shard.data, g.numel)
                for p, v in zip(g.params, g.views(full)):
                    p.data = v
                if with_grads:
                    grads[i] = B.xp.zeros(g.numel, dtype=self.dtype)
                    for p, v in zip(g.params, g.views(grads[i])):
                        p.grad = v
            yield grads
        finally:
            for i in group_ids:
                for p in self.groups[i].params:
                    p.data, p.grad = self._placeholder, None

    def owned_segments(self) -> list[tuple]:
        """Which elements this rank owns: ``(param, start, stop, shard_start)`` means elements
        ``[start, stop)`` of ``param`` (flattened) are ``[shard_start, shard_start + stop - start)``
        of the rank's shard arrays (``param_shard``, ``grad_shard``, ``exp_avg``, ``exp_avg_sq``)."""
        out = []
        for g in self.groups:
            for p, (a, b) in zip(g.params, g.offsets):
                lo, hi = max(a, g.lo), min(b, g.hi)
                if lo < hi:
                    out.append((p, lo - a, hi - a, g.shard_offset + lo - g.lo))
        return out

    def gather_parameters(self) -> dict:
        """Name -> full parameter as a host array (collective at stage 3)."""
        out = {}
        for g in self.groups:
            if self.stage == 3:
                B.synchronize()
                full = B.to_host(self.comm.allgather_flat(g.shard.data, g.numel))
                for p, v in zip(g.params, g.views(full)):
                    out[p.name] = v.copy()
            else:
                for p in g.params:
                    out[p.name] = B.to_host(p.data).copy()
        return out

    # --- the training step --------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the gradients (stage 2: also allocate the transient full gradient for backward)."""
        self._reduced = False
        if self.stage == 1:
            self._attach_full_grads(self.flat_grad, copy_existing=False)
            self.flat_grad.fill(0)
        elif self.stage == 2:
            self.flat_grad = B.xp.zeros(self.groups[0].numel, dtype=self.dtype)
            self._attach_full_grads(self.flat_grad, copy_existing=False)
            self.grad_shard.fill(0)
        else:
            self.grad_shard.fill(0)

    def _full_grad(self):
        """Stages 1-2: the full local gradient as one flat array (backward's accumulation buffer
        when the ``p.grad`` views are intact, else assembled from the ``p.grad``)."""
        g = self.groups[0]
        flat = self.flat_grad
        if flat is not None and all(p.grad is not None and p.grad.base is flat for p in g.params):
            return flat
        if flat is None:
            flat = B.xp.zeros(g.numel, dtype=self.dtype)
        for p, v in zip(g.params, g.views(flat)):
            if p.grad is None:
                v.fill(0)
            elif p.grad is not v:
                v[...] = p.grad
        if self.stage == 1:
            self._attach_full_grads(flat, copy_existing=False)
        return flat

    def reduce_gradients(self) -> None:
        """Average the gradients over the dp ranks into this rank's gradient shard (stage 1:
        allreduce of the full gradient; stage 2: reduce-scatter, then the full gradient is
        released; stage 3: already done during backward). Idempotent until the next step."""
        if self._reduced:
            return
        self._reduced = True
        B.synchronize()
        if self.stage == 1:
            self.flat_grad = self._full_grad()
            self.comm.allreduce(self.flat_grad, op="avg", out=self.flat_grad)
        elif self.stage == 2:
            full = self._full_grad()
            self.comm.reduce_scatter(full, op="avg", out=self.grad_shard)
            self.flat_grad = None
            for p in self.params:
                p.grad = None

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the (dp-averaged) gradient by its global L2 norm, as :func:`mpirt.optim.clip_grad_norm`:
        scale by ``max_norm / (norm + 1e-6)`` when the norm exceeds ``max_norm``. The norm is the
        sum of squares over this rank's shard, allreduced. Returns the norm before clipping."""
        self.reduce_gradients()
        norm = math.sqrt(self.comm.allreduce_scalar(float(B.xp.vdot(self.grad_shard, self.grad_shard)), op="sum"))
        if norm > max_norm:
            coef = float(max_norm) / (norm + 1e-6)
            (self.flat_grad if self.stage == 1 else self.grad_shard).__imul__(coef)
        return norm

    def step(self) -> None:
        """One AdamW update of this rank's shard; stages 1-2 then all-gather the parameters."""
        self.reduce_gradients()
        self.step_count += 1
        if self.weight_decay:
            keep = 1.0 - self.lr * self.weight_decay
            for a, b in self._decay_runs:
                self.param_shard[a:b] *= keep
        adamw_update(self.param_shard, self.grad_shard, self.exp_avg, self.exp_avg_sq, step=self.step_count,
                     lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=0.0)
        if self.stage < 3:
            B.synchronize()
            # the chunk may not alias the output (MPI forbids it): send a copy of the shard
            self.comm.allgather_flat(self.param_shard.copy(), self.groups[0].numel, out=self.flat_param)
        else:
            self.grad_shard.fill(0)  # consumed: the next backward accumulates from zero
        self._reduced = False

    # --- accounting and checkpoints -------------------------------------------------------------
    def memory_bytes(self) -> dict:
        """Bytes this rank holds persistently (between steps): parameters, gradients, AdamW state."""
        params = self.param_shard.nbytes if self.stage == 3 else self.flat_param.nbytes
        grads = self.flat_grad.nbytes if self.stage == 1 else self.grad_shard.nbytes
        return {"params": int(params), "grads": int(grads),
                "optimizer": int(self.exp_avg.nbytes + self.exp_avg_sq.nbytes)}

    def _layout(self) -> dict:
        return {"stage": self.stage, "dp_size": self.size, "dp_rank": self.rank,
                "numel": self.numel, "shard_numel": self.shard_numel}

    def state_dict(self) -> dict:
        """This rank's shard: step, hyperparameters, layout and host copies of the state arrays
        (stage 3: also the parameter shard). Load it on the same dp size and rank."""
        d = {"type": type(self).__name__, "step": self.step_count, "lr": self.lr, "beta1": self.beta1,
             "beta2": self.beta2, "eps": self.eps, "weight_decay": self.weight_decay, **self._layout(),
             "exp_avg": B.to_host(self.exp_avg).copy(), "exp_avg_sq": B.to_host(self.exp_avg_sq).copy()}
        if self.stage == 3:
            d["param_shard"] = B.to_host(self.param_shard).copy()
        return d

    def load_state_dict(self, d: dict) -> None:
        """Restore a :meth:`state_dict` of the same layout; everything is checked first."""
        if d.get("type") != type(self).__name__:
            raise ValueError(f"load_state_dict: state of a {d.get('type')!r}, this is a {type(self).__name__}")
        for k, v in self._layout().items():
            if d.get(k) != v:
                raise ValueError(f"load_state_dict: {k} is {d.get(k)!r} in the state, {v!r} here "
                                 "(resharding ZeRO state is not implemented)")
        arrays = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.stage == 3:
            arrays["param_shard"] = self.param_shard
        for k, a in arrays.items():
            if k not in d or tuple(d[k].shape) != tuple(a.shape):
                raise ValueError(f"load_state_dict: {k} missing or of shape "
                                 f"{getattr(d.get(k), 'shape', None)}, expected {tuple(a.shape)}")
        for k, a in arrays.items():
            a[...] = B.asarray(d[k], dtype=a.dtype)
        self.step_count, self.lr = int(d["step"]), float(d["lr"])
        self.beta1, self.beta2 = float(d["beta1"]), float(d["beta2"])
        self.eps, self.weight_decay = float(d["eps"]), float(d["weight_decay"])


class _Unit:
    """One stage-3 unit: ``obj.<name>`` replaced by a call through :class:`_ZeroUnit`."""

    def __init__(self, opt: ZeroOptimizer, obj, name: str, group_ids: list[int]):
        self.opt, self.obj, self.name, self.group_ids = opt, obj, name, group_ids
        self.original = getattr(obj, name)  # the bound method

    def install(self) -> None:
        def call(*args, **kwargs):
            shards = [self.opt.groups[i].shard for i in self.group_ids]
            return _ZeroUnit.apply(*args, *shards, unit=self, n_args=len(args),
                                   tensor_args=tuple(isinstance(a, Tensor) for a in args), kwargs=kwargs)
        object.__setattr__(self.obj, self.name, call)


class _ZeroUnit(Function):
    """Gather a unit's parameters, run it, free them; in backward gather, recompute, reduce-scatter."""

    def forward(self, *arrays, unit, n_args, tensor_args, kwargs):
        self.unit, self.kwargs, self.tensor_args = unit, kwargs, tensor_args
        self.args = arrays[:n_args]
        self.dropouts = _dropout_state(unit.opt.model)
        with unit.opt._gathered(unit.group_ids), no_grad():
            out = unit.original(*[Tensor(a) if t else a for a, t in zip(self.args, tensor_args)], **kwargs)
        if not isinstance(out, Tensor):
            raise TypeError(f"ZeRO-3 unit {unit.name}: must return one Tensor, got {type(out).__name__}")
        return out.data

    def backward(self, grad):
        unit, opt = self.unit, self.unit.opt
        after = _dropout_state(opt.model)
        _restore_dropouts(self.dropouts)  # replay the forward's dropout masks
        ins = [Tensor(a, requires_grad=need) if t else a
               for a, t, need in zip(self.args, self.tensor_args, self.needs_input_grad)]
        with opt._gathered(unit.group_ids, with_grads=True) as full_grads:
            with _grad_mode(True):
                out = unit.original(*ins, **self.kwargs)
            out.backward(grad)
            B.synchronize()
            shard_grads = [opt.comm.reduce_scatter(full_grads[i], op="avg") for i in unit.group_ids]
        _restore_dropouts(after)
        arg_grads = [x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in ins]
        return (*arg_grads, *shard_grads)


def _graph_parameters(out: Tensor) -> list:
    """The Parameters that are leaves of the graph ending at ``out``."""
    found, seen, stack = [], set(), [out._ctx] if out._ctx is not None else []
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for x in fn.inputs:
            if isinstance(x, Parameter) and id(x) not in {id(q) for q in found}:
                found.append(x)
            elif isinstance(x, Tensor) and x._ctx is not None:
                stack.append(x._ctx)
    return found


def _dropout_state(model) -> list:
    return [(m, m.calls) for _, m in model.named_modules() if isinstance(m, Dropout)]


def _restore_dropouts(state) -> None:
    for m, calls in state:
        m.calls = calls
