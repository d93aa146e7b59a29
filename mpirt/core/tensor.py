"""Tensor and Function: mpirt's reverse-mode autograd.

A :class:`Tensor` wraps one ``xp`` array (NumPy or CuPy). Every differentiable op is a
:class:`Function` subclass whose ``forward`` works on raw arrays and saves what ``backward`` needs.
``Tensor.backward`` walks the graph once in reverse topological order, frees each node's saved
arrays as soon as it has run, accumulates leaf gradients in place and fires gradient hooks the
moment a leaf's gradient is final (data parallelism launches its allreduces from them).

Functions with weights (linear, embedding) split their backward into an input-gradient pass and a
weight-gradient pass, so a zero-bubble pipeline can run the second one later
(``backward(defer_weight_grad=True)``). A weight Function that sets ``adds_weight_grads`` is handed
its leaf weights' existing ``grad`` buffers (``grad_into``) and may add a weight's gradient into
one itself (a GEMM with beta = 1) and return :data:`GRAD_ADDED` for it: no temporary, no second pass.

Over 400 lines: Tensor, Function and the backward walk are one contract (what an op saves, when
it is freed, when a hook fires) that every op and every parallel axis reads.
"""
from __future__ import annotations

import contextlib

import mpirt.core.backend as B
from mpirt.cpu.hostalloc import keep_freed_memory
from mpirt.cpu.threads import LIGHT_BLOCK, for_blocks

keep_freed_memory()  # reuse freed host memory across steps instead of page-faulting it back in

_grad_enabled = True


def is_grad_enabled() -> bool:
    """True unless inside :func:`no_grad` (and not inside a nested :func:`enable_grad`)."""
    return _grad_enabled


@contextlib.contextmanager
def _grad_mode(enabled: bool):
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, enabled
    try:
        yield
    finally:
        _grad_enabled = previous


class no_grad(contextlib.ContextDecorator):
    """Context manager and decorator: ops inside record no graph."""

    def __enter__(self):
        self._ctx = _grad_mode(False)
        self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


class enable_grad(contextlib.ContextDecorator):
    """Context manager and decorator: ops inside record a graph, even within :func:`no_grad`."""

    def __enter__(self):
        self._ctx = _grad_mode(True)
        self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


class _GradAdded:
    """The type of :data:`GRAD_ADDED`."""

    def __repr__(self):
        return "GRAD_ADDED"


# Returned by a Function's backward in place of a leaf weight's gradient that it has already added
# into that leaf's ``grad`` (the buffer the engine handed it in ``grad_into``).
GRAD_ADDED = _GradAdded()


class Function:
    """One differentiable op.

    Subclasses implement ``forward(self, *arrays, **kwargs) -> array`` (inputs arrive as raw arrays;
    save what backward needs on ``self``) and ``backward(self, grad) -> tuple`` with one gradient
    per positional input, ``None`` where not needed. ``self.needs_input_grad[i]`` says whether input
    ``i`` wants a gradient, so work for constant inputs can be skipped.

    Functions with weights set ``weight_inputs`` (positional indices) and implement
    ``backward_input`` (gradients of the other inputs) and ``backward_weight`` (gradients of the
    weights); their ``backward`` runs both.

    With ``adds_weight_grads`` set, the engine puts ``grad_into`` (weight input index -> that
    leaf's current ``grad`` array) on the Function before its weight pass runs; the Function may
    add the gradient into that array in place and return :data:`GRAD_ADDED` instead of it (the
    engine then only counts the edge: hooks fire as usual). The engine hands out no buffers when
    gradients are collected elsewhere (``leaf_grads``) or a leaf has no ``grad`` yet.

    With ``owns_weight_grads`` set, the weight gradients its passes return are new arrays nothing
    else refers to (a GEMM's output): a leaf without a ``grad`` takes one as it is, where any
    other gradient is copied first (it may alias a saved array or another gradient), so a
    parameter's gradient is never held twice (ZeRO-2 makes each ``p.grad`` this way).
    """

    weight_inputs: tuple[int, ...] = ()
    adds_weight_grads: bool = False
    owns_weight_grads: bool = False
    grad_into: dict = {}  # read-only default; the engine sets a dict per Function instance

    @classmethod
    def apply(cls, *inputs, **kwargs) -> "Tensor":
        """Run the op on Tensors (or plain arrays/scalars as constants) and record it."""
        fn = cls()
        arrays = [x.data if isinstance(x, Tensor) else x for x in inputs]
        fn.needs_input_grad = tuple(isinstance(x, Tensor) and x.requires_grad for x in inputs)
        out = fn.forward(*arrays, **kwargs)
        if _grad_enabled and any(fn.needs_input_grad):
            fn.inputs = tuple(_edge(x) for x in inputs)
            return Tensor(out, requires_grad=True, _ctx=fn)
        return Tensor(out)

    def forward(self, *arrays, **kwargs):
        raise NotImplementedError

    def backward(self, grad):
        if not self.weight_inputs:
            raise NotImplementedError(f"{type(self).__name__} has no backward")
        gin, gw = self.backward_input(grad), self.backward_weight(grad)
        return tuple(w if i in self.weight_inputs else x for i, (x, w) in enumerate(zip(gin, gw)))

    def backward_input(self, grad):
        raise NotImplementedError

    def backward_weight(self, grad):
        raise NotImplementedError


def given_up(x) -> bool:
    """Whether ``x`` is an op's output recorded for backward (a Tensor with a producer): what an op
    may write its result into when its caller gives ``x`` up. A leaf (a parameter, the data) or a
    tensor made under ``no_grad`` never is."""
    return isinstance(x, Tensor) and x._ctx is not None


def _edge(x):
    """What a Function keeps of an input: a leaf Tensor (it receives the gradient) or a constant
    as it is; of an op's output only its producer (an :class:`Edge`), not its data: what backward
    needs of an input, the Function saved itself, so a tensor no op saved (a residual sum, a
    norm's input) is freed as soon as the forward lets go of it."""
    return Edge(x._ctx) if isinstance(x, Tensor) and x._ctx is not None else x


class SparseGrad:
    """A gradient that is cheaper to add into a buffer than to materialise (e.g. an embedding
    table's, nonzero on a few rows). A Function's backward may return one for a weight input;
    the engine adds it into the leaf's ``grad`` with :meth:`add_to` and densifies it only where
    it must (a first gradient, a non-leaf input). It carries ``shape`` and ``dtype``."""

    shape: tuple
    dtype: object

    def add_to(self, out) -> None:
        """``out += self``, in place."""
        raise NotImplementedError

    def dense(self):
        """The gradient as a fresh array."""
        raise NotImplementedError


class Tensor:
    """An ``xp`` array with an optional gradient and the Function that produced it."""

    __array_priority__ = 1000  # make ndarray + Tensor defer to Tensor.__radd__

    def __init__(self, data, requires_grad: bool = False, _ctx: Function | None = None):
        self.data = data if isinstance(data, B.numpy.ndarray) or B.is_device_array(data) else B.xp.asarray(data)
        self.requires_grad = requires_grad
        self.grad = None
        self._ctx = _ctx
        self._hooks = []

    # --- basic properties -------------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    def numpy(self):
        """The data as a NumPy array (copied from the GPU when needed)."""
        return B.to_host(self.data)

    def item(self) -> float:
        return float(self.data.reshape(-1)[0]) if self.data.size == 1 else float(self.data)

    def detach(self) -> "Tensor":
        """The same data, cut from the graph."""
        return Tensor(self.data)

    def register_hook(self, hook) -> None:
        """Call ``hook(self)`` each time this leaf's gradient is final in a backward pass."""
        self._hooks.append(hook)

    # --- autograd ---------------------------------------------------------------------------
    def backward(self, grad=None, *, defer_weight_grad: bool = False, retain_graph: bool = False,
                 leaf_grads: dict | None = None):
        """Back-propagate from this tensor, seeded with ``grad`` (default 1 for a scalar).

        With ``defer_weight_grad`` the weight-gradient passes of weight Functions are not run;
        the returned :class:`WeightGradPass` runs them later. Otherwise returns ``None``.
        With ``leaf_grads`` (a dict) the leaf gradients are summed into it, ``id(leaf) -> array``,
        instead of into ``leaf.grad``, and no hooks fire: a recomputed sub-graph
        (:mod:`mpirt.core.recompute`) hands its gradients back to the enclosing backward this way.
        """
        if grad is None:
            if self.data.size != 1:
                raise ValueError(f"backward: a seed gradient is required for shape {self.shape}")
            grad = B.xp.ones_like(self.data)
        elif hasattr(grad, "shape") and tuple(grad.shape) != tuple(self.shape):
            raise ValueError(f"backward: seed gradient shape {tuple(grad.shape)} != tensor shape {self.shape}")
        if not self.requires_grad:
            raise RuntimeError("backward: tensor does not require grad")
        engine = _Backward(self, retain_graph, leaf_grads)
        engine.run(grad, defer_weight_grad)
        return WeightGradPass(engine) if defer_weight_grad else None

    # --- operators (implemented in mpirt.core.ops) -------------------------------------------------
    def __add__(self, other): return _ops.add(self, other)
    def __radd__(self, other): return _ops.add(other, self)
    def __sub__(self, other): return _ops.sub(self, other)
    def __rsub__(self, other): return _ops.sub(other, self)
    def __mul__(self, other): return _ops.mul(self, other)
    def __rmul__(self, other): return _ops.mul(other, self)
    def __truediv__(self, other): return _ops.div(self, other)
    def __rtruediv__(self, other): return _ops.div(other, self)
    def __neg__(self): return _ops.neg(self)
    def __pow__(self, exponent): return _ops.pow(self, exponent)
    def __matmul__(self, other): return _ops.matmul(self, other)
    def __rmatmul__(self, other): return _ops.matmul(other, self)
    def __getitem__(self, index): return _ops.getitem(self, index)

    def sum(self, axis=None, keepdims=False): return _ops.sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims=False): return _ops.mean(self, axis, keepdims)
    def max(self, axis=None, keepdims=False): return _ops.max(self, axis, keepdims)
    def reshape(self, *shape): return _ops.reshape(self, shape[0] if len(shape) == 1 else shape)
    def transpose(self, *axes): return _ops.transpose(self, axes[0] if len(axes) == 1 else (axes or None))
    def exp(self): return _ops.exp(self)
    def log(self): return _ops.log(self)
    def tanh(self): return _ops.tanh(self)
    def relu(self): return _ops.relu(self)

    @property
    def T(self):
        return _ops.transpose(self, None)


class Edge(Tensor):
    """An op's output as the graph remembers it: the Function that produced it, no data."""

    def __init__(self, ctx: Function):
        self.data, self.requires_grad, self.grad, self._ctx, self._hooks = None, True, None, ctx, []


def graph_functions(root: Tensor) -> list[Function]:
    """The Functions of the autograd graph behind ``root``, each once, each after every Function
    feeding it (backward runs them in reverse). Empty for a leaf or a Tensor computed without a
    graph (``no_grad``). The one walker of the graph: what a graph keeps alive
    (:func:`mpirt.core.nn.kept_bytes`) and which Parameters it reads (:func:`mpirt.core.nn.graph_parameters`)
    are read from its list."""
    order, seen, stack = [], set(), [(root._ctx, False)] if root._ctx is not None else []
    while stack:
        fn, expanded = stack.pop()
        if expanded:
            order.append(fn)
            continue
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        stack.append((fn, True))
        for x in fn.inputs:
            if isinstance(x, Tensor) and x._ctx is not None and id(x._ctx) not in seen:
                stack.append((x._ctx, False))
    return order


class _Backward:
    """One reverse pass over the graph rooted at a tensor."""

    def __init__(self, root: Tensor, retain_graph: bool, leaf_grads: dict | None = None):
        self.root, self.retain_graph, self.leaf_grads = root, retain_graph, leaf_grads
        self.order = graph_functions(root)
        # Leaf -> number of graph edges into it that have not delivered their gradient yet.
        self.leaf_pending: dict[int, int] = {}
        for fn in self.order:
            for i, x in enumerate(fn.inputs):
                if isinstance(x, Tensor) and x._ctx is None and fn.needs_input_grad[i]:
                    self.leaf_pending[id(x)] = self.leaf_pending.get(id(x), 0) + 1
        self.deferred: list[tuple[Function, object]] = []

    def run(self, grad, defer_weight_grad: bool) -> None:
        if self.root._ctx is None:  # backward on a leaf: its gradient is the seed itself
            self._deliver(self.root, grad)
            return
        pending = {id(self.root._ctx): grad}  # Function -> gradient of its output
        for fn in reversed(self.order):
            g = pending.pop(id(fn), None)
            if g is None:  # nothing flowed here; still count its leaf edges as done
                self._deliver_all(fn, (None,) * len(fn.inputs))
                continue
            # Only leaf weights can be deferred: a computed weight needs its gradient now.
            defer = defer_weight_grad and bool(fn.weight_inputs) and all(
                not isinstance(fn.inputs[i], Tensor) or fn.inputs[i]._ctx is None
                for i in fn.weight_inputs if i < len(fn.inputs))
            if defer:
                grads = fn.backward_input(g)
                self.deferred.append((fn, g))
            else:
                self._hand_grad_buffers(fn)
                grads = fn.backward(g)
            for x, gx, needed in zip(fn.inputs, grads, fn.needs_input_grad):
                if needed and gx is not None and gx is not GRAD_ADDED and x._ctx is not None:
                    if isinstance(gx, SparseGrad):
                        gx = gx.dense()
                    key = id(x._ctx)
                    pending[key] = gx if key not in pending else pending[key] + gx
            self._deliver_all(fn, grads, skip=fn.weight_inputs if defer else ())
            if not (self.retain_graph or defer):
                fn.__dict__.clear()  # drop saved activations as early as possible
            # delivered: a rerun block's fresh weight gradients must not stay alive through the
            # next Function's backward (the next block's rerun and backward)
            grads = gx = g = None

    def run_deferred(self) -> None:
        for fn, g in self.deferred:
            others = tuple(i for i in range(len(fn.inputs)) if i not in fn.weight_inputs)
            self._hand_grad_buffers(fn)
            self._deliver_all(fn, fn.backward_weight(g), skip=others)
            if not self.retain_graph:
                fn.__dict__.clear()
        self.deferred.clear()

    def _hand_grad_buffers(self, fn: Function) -> None:
        """Give a Function with ``adds_weight_grads`` the ``grad`` arrays of its leaf weights."""
        if not fn.adds_weight_grads or self.leaf_grads is not None:
            return
        into = {}
        for i in fn.weight_inputs:
            x = fn.inputs[i] if i < len(fn.inputs) else None
            if isinstance(x, Tensor) and x._ctx is None and fn.needs_input_grad[i] and x.grad is not None:
                into[i] = x.grad
        fn.grad_into = into

    def _deliver_all(self, fn: Function, grads, skip=()) -> None:
        """Deliver ``grads`` to the leaf inputs of ``fn`` whose positions are not in ``skip``."""
        for i, (x, gx) in enumerate(zip(fn.inputs, grads)):
            if i not in skip and isinstance(x, Tensor) and x._ctx is None and fn.needs_input_grad[i]:
                self._deliver(x, gx, owned=fn.owns_weight_grads and i in fn.weight_inputs)

    def _deliver(self, leaf: Tensor, g, owned: bool = False) -> None:
        """Accumulate ``g`` into ``leaf.grad`` in place (``owned``: ``g`` is a new array no one
        else refers to, kept as the first gradient without a copy); fire hooks once all edges
        delivered."""
        if self.leaf_grads is not None:
            if g is not None:
                g = g.dense() if isinstance(g, SparseGrad) else g
                key = id(leaf)
                self.leaf_grads[key] = g if key not in self.leaf_grads else self.leaf_grads[key] + g
            return
        if g is not None and g is not GRAD_ADDED:  # GRAD_ADDED: the Function added it already
            if leaf.grad is None:  # a copy (unless owned): g may alias a saved array or another gradient
                leaf.grad = g.dense().astype(leaf.dtype, copy=False) if isinstance(g, SparseGrad) \
                    else g.astype(leaf.dtype, copy=False) if owned else B.xp.array(g, dtype=leaf.dtype, copy=True)
            elif isinstance(g, SparseGrad):
                g.add_to(leaf.grad)
            else:
                _accumulate(leaf.grad, g)
        remaining = self.leaf_pending.get(id(leaf), 1) - 1
        self.leaf_pending[id(leaf)] = remaining
        if remaining == 0:
            for hook in leaf._hooks:
                hook(leaf)


def _accumulate(dst, g) -> None:
    """``dst += g`` on all threads when both are contiguous arrays of one shape, else plainly
    (``g`` may be a broadcast view or of another dtype)."""
    if g.shape == dst.shape and g.flags.c_contiguous and dst.flags.c_contiguous:
        for_blocks(B.xp.add, dst.reshape(-1), g.reshape(-1), dst.reshape(-1), block=LIGHT_BLOCK)
    else:
        dst += g


class WeightGradPass:
    """The deferred weight-gradient passes of one backward; call :meth:`run` exactly once."""

    def __init__(self, engine: _Backward):
        self._engine = engine

    def run(self) -> None:
        self._engine.run_deferred()


def tensor(data, requires_grad: bool = False, dtype=None) -> Tensor:
    """Build a Tensor from an array-like on the active backend."""
    return Tensor(B.xp.asarray(data, dtype=dtype), requires_grad=requires_grad)


from mpirt.core import ops as _ops  # noqa: E402  (ops needs Tensor and Function defined above)
