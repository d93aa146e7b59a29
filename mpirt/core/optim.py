"""Optimizers (SGD, AdamW), the cosine learning-rate schedule and clipping by global gradient norm.

The update math lives in plain functions over raw arrays (:func:`sgd_update`, :func:`adamw_update`)
so that a sharded (ZeRO) optimizer can run it on flat shards; the classes only hold the state and
loop over parameters. Updates are in place, through one scratch buffer per dtype that is reused by
every parameter, and use Python-float constants only: NumPy 2 would turn a float32 model float64
on meeting a NumPy float64 scalar. The step counter is global: a parameter whose ``grad`` is None
is skipped, but the counter (AdamW's bias correction) still advances.

Mixed precision (:mod:`mpirt.core.precision`): a parameter of a half dtype gets a float32 master copy
and float32 state; the update runs on the master with the gradient converted to float32 (times
``grad_scale``, which undoes a loss scale), then the parameter is refreshed from the master
(rounded to nearest even). ``with opt.full_parameters():`` shows the model its masters, so a
checkpoint holds the float32 weights.

Over 400 lines: the optimizers' update math and their float32 masters are one contract.
"""
from __future__ import annotations

import contextlib
import math

import mpirt.core.backend as B
from mpirt.cpu import kernels
from mpirt.gpu import cuda
from mpirt.core.nn import zero_grads
from mpirt.core.precision import compute_dtype, is_half, upcast
from mpirt.cpu.threads import c_blocks, for_blocks, one_run


def sgd_update(param, grad, momentum_buffer, *, lr, momentum=0.0, weight_decay=0.0, nesterov=False,
               scratch=None) -> None:
    """One SGD step in place on raw arrays, as ``torch.optim.SGD`` without dampening.

    ``d = grad + weight_decay * param``; ``buf = momentum * buf + d`` (``buf`` starts at zero, so
    the first step stores ``d`` as torch does); ``param -= lr * (d + momentum * buf)`` with Nesterov,
    ``lr * buf`` with momentum, else ``lr * d``. ``momentum_buffer`` may be None without momentum.
    ``scratch`` is an array shaped like ``param`` (allocated when None); ``grad`` is not modified.
    """
    xp = B.xp
    lr, momentum, weight_decay = float(lr), float(momentum), float(weight_decay)
    s = xp.empty_like(param) if scratch is None else scratch
    d = grad
    if weight_decay:
        xp.multiply(param, weight_decay, out=s)
        s += grad
        d = s
    if momentum:
        momentum_buffer *= momentum
        momentum_buffer += d
        if nesterov:
            xp.multiply(d, lr, out=s)
            param -= s
            d, lr = momentum_buffer, lr * momentum
        else:
            d = momentum_buffer
    xp.multiply(d, lr, out=s)
    param -= s


def adamw_update(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
                 scratch=None) -> None:
    """One AdamW step in place on raw arrays, as ``torch.optim.AdamW`` (``step`` counts from 1).

    ``param *= 1 - lr*weight_decay`` (decoupled decay); ``m = beta1*m + (1-beta1)*g``;
    ``v = beta2*v + (1-beta2)*g*g``; ``param -= lr/(1-beta1^t) * m / (sqrt(v/(1-beta2^t)) + eps)``,
    computed as ``m * (lr*c2/c1) / (sqrt(v) + eps*c2)`` with ``c1 = 1-beta1^t``, ``c2 = sqrt(1-beta2^t)``.
    ``scratch`` is an array shaped like ``param`` (allocated when None); ``grad`` is not modified.

    With the C kernels (:mod:`mpirt.cpu.kernels`) and contiguous NumPy arrays it is one pass (no
    scratch), in the same order of operations. Otherwise the dozen NumPy passes run block by block
    (:func:`~mpirt.cpu.threads.for_blocks`) when all five arrays are contiguous: each block of the four
    arrays is read from memory once and the blocks run on all threads.
    """
    xp = B.xp
    step, lr, beta1, beta2 = int(step), float(lr), float(beta1), float(beta2)
    eps, weight_decay = float(eps), float(weight_decay)
    c1, c2 = 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step)

    def block(p, g, m, v, s):
        if weight_decay:
            p *= 1.0 - lr * weight_decay
        xp.multiply(g, 1.0 - beta1, out=s)
        m *= beta1
        m += s
        xp.multiply(g, g, out=s)
        s *= 1.0 - beta2
        v *= beta2
        v += s
        xp.sqrt(v, out=s)
        s += eps * c2
        xp.divide(m, s, out=s)
        s *= lr * c2 / c1
        p -= s

    state = (param, exp_avg, exp_avg_sq)
    if (kernels.usable(grad, *state) and grad.shape == param.shape
            and all(a.shape == param.shape and a.flags.writeable for a in state)):  # one C pass, no scratch
        c_blocks("adamw", param.dtype, lambda p, g, m, v: (p, g, m, v, p.size, 1.0 - lr * weight_decay, beta1,
                                                            beta2, eps * c2, lr * c2 / c1),
                 *(a.reshape(-1) for a in (param, grad, exp_avg, exp_avg_sq)))
        return
    s = xp.empty_like(param) if scratch is None else scratch
    arrays = (param, grad, exp_avg, exp_avg_sq, s)
    if all(a.flags.c_contiguous for a in arrays):
        for_blocks(block, *(a.reshape(-1) for a in arrays))
    else:
        block(*arrays)


class Scalars:
    """The scalars a checkpoint records beside an optimizer's arrays: the step, the learning rate
    and the ``hyper_names`` hyperparameters (shared by :class:`Optimizer` and
    :class:`mpirt.parallel.zero.ZeroOptimizer`)."""

    hyper_names: tuple = ()

    def scalars(self) -> dict:
        """Step, learning rate and hyperparameters (what a checkpoint records beside the arrays)."""
        return {"step": self.step_count, "lr": self.lr, **{k: getattr(self, k) for k in self.hyper_names}}

    def load_scalars(self, d: dict) -> None:
        """Restore :meth:`scalars` (a missing hyperparameter raises KeyError naming it)."""
        missing = [k for k in ("step", *self.hyper_names) if k not in d]
        if missing:
            raise KeyError(f"load_scalars: missing keys {missing}")
        self.step_count = int(d["step"])
        self.lr = float(d.get("lr", self.lr))
        for k in self.hyper_names:
            setattr(self, k, type(getattr(self, k))(d[k]))


class Optimizer(Scalars):
    """Base class: a list of named Parameters, per-parameter state arrays and a global step.

    Subclasses set ``state_names`` (per-parameter arrays, allocated once here, in the parameter's
    compute dtype: float32 for half parameters) and ``hyper_names`` (scalar hyperparameters saved
    in :meth:`state_dict`). Half parameters get float32 masters (``master[i]``, else None).
    ``grad_scale`` multiplies every gradient as the update reads it (1/loss scale; default 1).
    """

    state_names: tuple = ()

    def __init__(self, params, lr: float):
        self.params = list(params)
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError(f"{type(self).__name__}: a parameter appears twice in params")
        for i, p in enumerate(self.params):
            if not hasattr(p, "data") or not hasattr(p, "grad"):
                raise TypeError(f"{type(self).__name__}: params[{i}] is {type(p).__name__}, not a Parameter")
        if lr < 0:
            raise ValueError(f"{type(self).__name__}: lr must be >= 0, got {lr}")
        self.lr = float(lr)
        self.step_count = 0
        self.grad_scale = 1.0
        self.master = [upcast(p.data) if is_half(p.dtype) else None for p in self.params]
        self.state = [{k: B.xp.zeros(p.shape, dtype=compute_dtype(p.dtype)) for k in self.state_names}
                      for p in self.params]
        self._scratch: dict = {}  # (use, dtype) -> flat buffer as large as the largest parameter using it
        # Sizes and compute dtypes once: local shapes are fixed, and a Parameter's size property
        # costs a NumPy call (~5 us; twice per parameter per step added up to ~0.3 ms on the tiny GPT).
        self._sizes = [math.prod(p.shape) for p in self.params]
        self._dtypes = [compute_dtype(p.dtype) for p in self.params]

    def _scratch_for(self, i: int, use: str = "update"):
        """A scratch array shaped like parameter ``i`` in its compute dtype (``use`` keeps two apart)."""
        dtype = self._dtypes[i]
        buf = self._scratch.get((use, dtype))
        if buf is None:
            size = max(n for n, d in zip(self._sizes, self._dtypes) if d == dtype)
            buf = self._scratch[use, dtype] = B.xp.empty(size, dtype=dtype)
        return buf[:self._sizes[i]].reshape(self.params[i].shape)

    def zero_grad(self) -> None:
        """Zero every gradient in place; allocate a zero buffer where ``grad`` is None (never rebinds)."""
        zero_grads(self.params)

    def step(self) -> None:
        """Apply one update from each parameter's ``.grad`` (parameters without one are skipped);
        half parameters are updated through their float32 masters."""
        self.step_count += 1
        scale = float(self.grad_scale)
        # without half masters (copied back right after each update) the updates that run as C
        # kernels are independent: one run of the native pool for all of them
        with one_run("adamw") if all(m is None for m in self.master) else contextlib.nullcontext():
            self._update_all(scale)

    def _update_all(self, scale: float) -> None:
        for i, (p, state) in enumerate(zip(self.params, self.state)):
            if p.grad is None:
                continue
            master = self.master[i]
            if self._fused_update(i, p, master, state, scale):
                continue
            if master is None:
                if scale != 1.0:
                    p.grad *= scale
                self._update(i, p.data, p.grad, state, self._scratch_for(i))
            else:
                grad = self._scratch_for(i, "grad")
                B.xp.multiply(p.grad, scale, out=grad, dtype=grad.dtype)  # in float32: no underflow
                self._update(i, master, grad, state, self._scratch_for(i))
                p.data[...] = master                    # rounded to nearest even

    def _update(self, i: int, param, grad, state, scratch) -> None:
        """Update the array ``param`` in place from ``grad`` (``scratch``: a buffer shaped like it)."""
        raise NotImplementedError

    def _fused_update(self, i: int, p, master, state, scale: float) -> bool:
        """Update parameter ``p`` (its master, its state, its data) in one kernel from ``p.grad``
        times ``scale`` where a subclass has one for these arrays; False: not done here."""
        return False

    @contextlib.contextmanager
    def full_parameters(self):
        """Context: inside, the ``p.data`` of half parameters are their float32 masters, so
        ``model.state_dict()`` saves and ``model.load_state_dict()`` restores the masters; on exit
        the half parameters are refreshed from them. Nothing changes without half parameters."""
        swapped = [(p, p.data, m) for p, m in zip(self.params, self.master) if m is not None]
        for p, _, m in swapped:
            p.data = m
        try:
            yield
        finally:
            for p, half, m in swapped:
                if p.data is not m:  # rebound inside: take the new values
                    m[...] = p.data
                half[...] = m
                p.data = half

    def memory_bytes(self) -> dict:
        """Bytes held persistently: parameters, gradients and optimizer state (masters included)."""
        return {"params": sum(int(p.data.nbytes) for p in self.params),
                "grads": sum(int(p.grad.nbytes) for p in self.params if p.grad is not None),
                "optimizer": sum(int(a.nbytes) for st in self.state for a in st.values())
                + sum(int(m.nbytes) for m in self.master if m is not None)}

    def _keys(self) -> list[str]:
        names = [getattr(p, "name", "") for p in self.params]
        for i, n in enumerate(names):
            if not n:
                raise ValueError(f"{type(self).__name__}: params[{i}] has no name (call Module.initialize first)")
        if len(set(names)) != len(names):
            raise ValueError(f"{type(self).__name__}: duplicate parameter names {sorted(names)}")
        return names

    def state_dict(self) -> dict:
        """``{"type", "step", hyperparameters..., "<param name>.<state>": host array copy}``."""
        d = {"type": type(self).__name__, **self.scalars()}
        for name, state in zip(self._keys(), self.state):
            d.update({f"{name}.{k}": B.to_host(a).copy() for k, a in state.items()})
        return d

    def load_state_dict(self, d: dict) -> None:
        """Restore step, hyperparameters and state arrays (copied in place, converted to each
        parameter's dtype). Everything is checked before anything changes; errors name the key."""
        if d.get("type", type(self).__name__) != type(self).__name__:
            raise ValueError(f"load_state_dict: state of a {d['type']} optimizer, this is a {type(self).__name__}")
        arrays = {f"{n}.{k}": a for n, st in zip(self._keys(), self.state) for k, a in st.items()}
        check_state_keys(d, arrays, self.hyper_names)
        for k, a in arrays.items():
            if tuple(d[k].shape) != tuple(a.shape):
                raise ValueError(f"load_state_dict: {k} has shape {tuple(d[k].shape)}, expected {tuple(a.shape)}")
        for k, a in arrays.items():
            a[...] = B.asarray(d[k], dtype=a.dtype)
        self.load_scalars(d)


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, Nesterov and L2 weight decay (torch's
    ``SGD`` without dampening). State: ``momentum_buffer`` per parameter when ``momentum > 0``."""

    hyper_names = ("momentum", "weight_decay", "nesterov")

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False):
        if momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: momentum ({momentum}) and weight_decay ({weight_decay}) must be >= 0")
        if nesterov and momentum == 0:
            raise ValueError("SGD: nesterov needs momentum > 0")
        self.state_names = ("momentum_buffer",) if momentum else ()
        super().__init__(params, lr)
        self.momentum, self.weight_decay, self.nesterov = float(momentum), float(weight_decay), bool(nesterov)

    def _update(self, i, param, grad, state, scratch) -> None:
        sgd_update(param, grad, state.get("momentum_buffer"), lr=self.lr, momentum=self.momentum,
                   weight_decay=self.weight_decay, nesterov=self.nesterov, scratch=scratch)


def check_state_keys(d: dict, arrays, hyper_names) -> None:
    """KeyError naming the keys an optimizer state dict ``d`` lacks or has beyond ``arrays`` (the
    state arrays' keys), ``step`` and ``hyper_names``."""
    given = {k for k, v in d.items() if hasattr(v, "shape")}
    missing = sorted(set(arrays) - given) + [k for k in ("step", *hyper_names) if k not in d]
    unexpected = sorted(given - set(arrays))
    if missing or unexpected:
        raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")


class AdamW(Optimizer):
    """Adam with decoupled weight decay (torch's ``AdamW``). State: ``exp_avg``, ``exp_avg_sq``.

    ``decay(p) -> bool`` picks the parameters that get weight decay; by default those with
    ``ndim >= 2`` (the GPT convention: no decay on biases and LayerNorm parameters).
    """

    state_names = ("exp_avg", "exp_avg_sq")
    hyper_names = ("beta1", "beta2", "eps", "weight_decay")

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 decay=None):
        beta1, beta2 = betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"AdamW: betas must be in [0, 1), got {tuple(betas)}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"AdamW: eps ({eps}) and weight_decay ({weight_decay}) must be >= 0")
        super().__init__(params, lr)
        self.beta1, self.beta2, self.eps, self.weight_decay = float(beta1), float(beta2), float(eps), float(weight_decay)
        decay = decay or (lambda p: p.ndim >= 2)
        self.decayed = [bool(decay(p)) for p in self.params]

    def _fused_update(self, i, p, master, state, scale) -> bool:
        """The CUDA kernel: the gradient read once (scaled on the fly), the float32 master (or the
        float32 parameter), both moments and the rounded parameter written in one pass."""
        weights = p.data if master is None else master
        if not (cuda.takes(p.data, p.grad) and cuda.takes(weights, state["exp_avg"], state["exp_avg_sq"])
                and str(weights.dtype) == "float32" and p.grad.shape == p.data.shape == weights.shape):
            return False
        step = self.step_count
        c1, c2 = 1.0 - self.beta1 ** step, math.sqrt(1.0 - self.beta2 ** step)
        decay = 1.0 - self.lr * (self.weight_decay if self.decayed[i] else 0.0)
        cuda.adamw(p.data, weights, p.grad, state["exp_avg"], state["exp_avg_sq"], grad_scale=scale, decay=decay,
                   beta1=self.beta1, beta2=self.beta2, eps_c2=self.eps * c2, step_size=self.lr * c2 / c1)
        return True

    def _update(self, i, param, grad, state, scratch) -> None:
        adamw_update(param, grad, state["exp_avg"], state["exp_avg_sq"], step=self.step_count, lr=self.lr,
                     beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                     weight_decay=self.weight_decay if self.decayed[i] else 0.0, scratch=scratch)


def cosine_lr(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate at optimizer step ``step`` (counted from 0), nanoGPT's schedule.

    * ``step < warmup_steps``: linear warmup ``lr * (step + 1) / warmup_steps`` (step 0 gets
      ``lr / warmup_steps``, step ``warmup_steps - 1`` reaches ``lr``);
    * ``warmup_steps <= step <= total_steps``: cosine decay
      ``min_lr + 0.5 * (1 + cos(pi * r)) * (lr - min_lr)`` with
      ``r = (step - warmup_steps) / (total_steps - warmup_steps)``: ``lr`` at ``r = 0``,
      ``(lr + min_lr) / 2`` halfway, ``min_lr`` at ``total_steps``;
    * ``step > total_steps``: ``min_lr``.
    """
    if step < 0 or warmup_steps < 0 or total_steps < warmup_steps:
        raise ValueError(f"cosine_lr: need 0 <= step and 0 <= warmup_steps <= total_steps, got step={step}, "
                         f"warmup_steps={warmup_steps}, total_steps={total_steps}")
    if step < warmup_steps:
        return float(lr) * (step + 1) / warmup_steps
    if step >= total_steps:
        return float(min_lr)
    r = (step - warmup_steps) / (total_steps - warmup_steps)
    return float(min_lr) + 0.5 * (1.0 + math.cos(math.pi * r)) * (float(lr) - float(min_lr))


def global_grad_norm(params, allreduce_sq=None) -> float:
    """L2 norm of all gradients together (parameters whose ``grad`` is None are ignored).

    ``allreduce_sq(x: float) -> float`` sums this rank's sum of squares over the ranks that hold
    different pieces of the model (TP/PP/ZeRO shards). The caller must count every element once:
    pass only the shards this rank owns, and replicated parameters on one rank of their group.
    Half gradients are summed in float32.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if cuda.takes(*grads):                          # one device total, one read
        sq = float(cuda.sum_squares(grads)[0])
    else:
        sq = sum(float(B.xp.vdot(g, g)) for g in (upcast(g).reshape(-1) for g in grads))
    if allreduce_sq is not None:
        sq = float(allreduce_sq(sq))
    return math.sqrt(sq)


def clip_coefficient(norm: float, max_norm: float) -> float | None:
    """The clipping rule, in one place: the factor ``max_norm / (norm + 1e-6)`` to scale every
    gradient by when the global ``norm`` exceeds ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``),
    else None: nothing to scale, also for a non-finite norm (scaling by 0 would turn infinite
    gradients into NaN; the caller can skip the step). :func:`clip_grad_norm` and the parameter
    store's clip (:func:`mpirt.parallel.flat.clip_flat`, every parallel layout) apply it."""
    return float(max_norm) / (norm + 1e-6) if math.isfinite(norm) and norm > max_norm else None


def scale_grads(params, norm: float, max_norm: float) -> float:
    """Clip the gradients of ``params`` in place, given their precomputed global ``norm``
    (:func:`clip_coefficient`); parameters whose ``grad`` is None are skipped. Returns ``norm``."""
    coef = clip_coefficient(norm, max_norm)
    if coef is not None:
        for p in params:
            if p.grad is not None:
                p.grad *= coef
    return norm


def clip_grad_norm(params, max_norm: float, allreduce_sq=None) -> float:
    """Scale gradients in place by ``max_norm / (norm + 1e-6)`` when the global norm exceeds
    ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``); returns the norm before clipping.

    A non-finite norm is returned unchanged and nothing is scaled: the caller should skip the step.
    See :func:`global_grad_norm` for ``allreduce_sq``.
    """
    params = list(params)
    return scale_grads(params, global_grad_norm(params, allreduce_sq), max_norm)
