"""Activation recomputation: keep a unit's inputs, drop its activations, rerun it in backward.

:class:`Rerun` (one-off: :func:`checkpoint`) runs a callable (a transformer block, or only its
attention core) without recording a graph and keeps just its Tensor arguments. When the
backward reaches it, the callable runs again with a graph, the gradient flows through that
graph, and the gradients of the arguments and of the declared parameters go back to the
enclosing backward (the inner pass sums leaf gradients into a dict,
``Tensor.backward(leaf_grads=...)``, so gradient hooks, e.g. data parallelism's bucket
allreduces, fire once, from the enclosing pass, as without recomputation).

What stays equal to the run without recomputation:

- randomness: every mask mpirt draws is a pure function of a Dropout module's state (seed, its
  place in the step and batch, or its call count: :meth:`mpirt.core.nn.Dropout.state`); the unit's
  Dropout modules are set back to their forward state for the rerun and forward again after it,
  so the rerun draws the forward's masks (also when other micro-batches ran in between);
- deferred weight gradients (zero-bubble's B/W split): the checkpoint declares the parameters as
  weight inputs; its input-gradient pass reruns the unit and back-propagates with the unit's own
  weight passes deferred, its weight-gradient pass runs them;
- collectives inside the unit (tensor/sequence parallelism) run again in the rerun, on every tp
  rank at the same point of the backward.

ZeRO-3's units are the same mechanism with their weights gathered around the forward and the
rerun and their gradients reduce-scattered after it (:class:`mpirt.parallel.zero3.ShardedUnit`).

:func:`apply` installs it on a model's blocks: ``full`` checkpoints each chosen block (kept: the
block's input), ``selective`` only the attention core the model names
(:attr:`mpirt.core.modeling.CausalLM.attention_core`: scores, softmax, dropout on the probabilities
and their product with v, rerun from the saved q/k/v), after Korthikanti et al. 2022.
"""
from __future__ import annotations

import contextlib

from mpirt.core.nn import Module, dropout_modules, dropout_states, restore_dropout_states
from mpirt.core.tensor import Function, Tensor, enable_grad, is_grad_enabled, no_grad

MODES = ("none", "selective", "full")


class Rerun:
    """A unit whose activations are recomputed in backward: ``rerun(*args, **kwargs)`` runs
    ``call(*args, **kwargs)`` keeping only its Tensor arguments, and :class:`RerunOp`'s backward
    runs it again with a graph.

    ``params``: every trainable leaf the unit uses that is not an argument (the op's weight
    inputs); ``dropouts``: the Dropout modules it may call (replayed in the rerun). The base class
    leaves the weights where they are and hands the inner backward's leaf gradients of ``params``
    to the enclosing backward; ZeRO-3's unit (:class:`mpirt.parallel.zero3.ShardedUnit`) is the
    other kind: its weights exist only while gathered, its ``params`` are the shards, its weight
    gradients the reduce-scattered ones."""

    def __init__(self, call, params=(), dropouts=()):
        self.call, self.params, self.dropouts = call, tuple(params), tuple(dropouts)

    def __call__(self, *args, **kwargs):
        if not is_grad_enabled():
            with self.weights():
                return self.call(*args, **kwargs)
        return RerunOp.apply(*args, *self.params, unit=self, n_args=len(args),
                             tensor_args=tuple(isinstance(a, Tensor) for a in args), kwargs=kwargs)

    def weights(self):
        """Context in which ``call`` can run (forward and rerun): here the weights are always in place."""
        return contextlib.nullcontext()

    def backward_weights(self):
        """Context for one backward of the unit (rerun, input and weight passes); yields the
        dict the inner backward sums its leaf gradients into (:meth:`weight_grads` reads it)."""
        return contextlib.nullcontext({})

    def weight_grads(self, sink: dict) -> tuple:
        """The gradients of ``params`` from the inner backward (called inside :meth:`backward_weights`)."""
        out = tuple(sink.pop(id(p), None) for p in self.params)
        if sink:
            raise RuntimeError(f"recompute: the unit {getattr(self.call, '__qualname__', self.call)} used "
                               f"{len(sink)} trainable tensor(s) that are neither its arguments nor its "
                               "declared parameters; their gradients would be lost")
        return out


class RerunOp(Function):
    """A :class:`Rerun` unit run without a graph; rerun with one in backward (see the module
    docstring). Without a split, one inner backward computes every gradient, freeing the rerun's
    activations as it goes; split (a zero-bubble schedule), the input-gradient pass reruns the
    unit and back-propagates with the unit's own weight passes deferred, and the weight-gradient
    pass runs them and hands the unit's weight gradients back."""

    def forward(self, *arrays, unit, n_args, tensor_args, kwargs):
        self.unit, self.tensor_args, self.kwargs = unit, tensor_args, kwargs
        self.args = arrays[:n_args]  # the only activations kept: the rerun's inputs
        self.weight_inputs = tuple(range(n_args, len(arrays)))
        self.dropouts = dropout_states(unit.dropouts)
        with unit.weights(), no_grad():
            out = unit.call(*[Tensor(a) if t else a for a, t in zip(self.args, tensor_args)], **kwargs)
        if not isinstance(out, Tensor):
            raise TypeError(f"recompute: the unit {getattr(unit.call, '__qualname__', unit.call)} must return "
                            f"one Tensor, got {type(out).__name__}")
        return out.data

    def backward(self, grad):
        with self.unit.backward_weights() as sink:
            return self._rerun(grad, sink, defer=False) + self.unit.weight_grads(sink)

    def backward_input(self, grad):
        self.open = contextlib.ExitStack()  # closed after the weight pass
        try:
            self.sink = self.open.enter_context(self.unit.backward_weights())
            inputs = self._rerun(grad, self.sink, defer=True)
        except BaseException:
            self.open.close()
            raise
        return inputs + (None,) * (len(self.inputs) - len(self.args))

    def backward_weight(self, grad):
        with self.open:
            self.weight_pass.run()
            out = self.unit.weight_grads(self.sink)
        return (None,) * len(self.args) + out

    def _rerun(self, grad, sink: dict, defer: bool) -> tuple:
        """Run the unit again with a graph (the forward's dropout masks replayed), back-propagate
        ``grad`` summing the leaf gradients into ``sink``; returns the arguments' gradients
        (``defer``: the unit's weight passes wait in ``self.weight_pass``)."""
        ins = [Tensor(a, requires_grad=need) if t else a
               for a, t, need in zip(self.args, self.tensor_args, self.needs_input_grad)]
        after = dropout_states(m for m, _ in self.dropouts)
        restore_dropout_states(self.dropouts)  # replay the forward's masks
        try:
            with enable_grad():
                out = self.unit.call(*ins, **self.kwargs)
        finally:
            restore_dropout_states(after)
        self.weight_pass = out.backward(grad, defer_weight_grad=defer, leaf_grads=sink)
        return tuple(sink.pop(id(x), None) if isinstance(x, Tensor) else None for x in ins)


def checkpoint(call, *args, params=(), dropouts=()):
    """``call(*args)`` whose activations are recomputed in backward instead of kept (a one-off
    :class:`Rerun`). Without a graph being recorded (``no_grad``), it is ``call(*args)``."""
    return Rerun(call, params, dropouts)(*args)


def parse_layers(text: str) -> set[int] | None:
    """``recompute_layers``: ``""`` -> None (every block), else comma-separated block indices and
    inclusive ranges, ``"0-3,8"`` -> {0, 1, 2, 3, 8}. ValueError names a bad item."""
    if not text.strip():
        return None
    out: set[int] = set()
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cannot read {item.strip()!r} as a block index or a range like 2-5") from None
        if a < 0 or b < a:
            raise ValueError(f"{item.strip()!r} is not an index >= 0 or a range lo-hi with lo <= hi")
        out.update(range(a, b + 1))
    return out


def chosen(n_layer: int, mode: str, layers: str) -> list[int]:
    """The global block indices that recompute under ``mode`` and ``layers`` (see :func:`parse_layers`)."""
    if mode == "none":
        return []
    picked = parse_layers(layers)
    return [i for i in range(n_layer) if picked is None or i in picked]


def _wrap(owner: Module, name: str, params: list, dropouts: list) -> None:
    object.__setattr__(owner, name, Rerun(getattr(owner, name), params, dropouts))


def apply(blocks: dict, mode: str, layers: str, attention_core: str = "") -> list[int]:
    """Install recomputation on ``blocks`` (global index -> block Module; a pipeline stage passes
    its own): ``full`` checkpoints each chosen block's ``forward``, ``selective`` the method at the
    dotted path ``attention_core`` inside it (e.g. ``attn.core``). Returns the indices changed."""
    if mode not in MODES:
        raise ValueError(f"recompute: expected one of {', '.join(MODES)}, got {mode!r}")
    if mode == "selective" and not attention_core:
        raise ValueError("recompute: selective needs the model to name its attention core")
    picked = parse_layers(layers)
    done = []
    for i, block in sorted(blocks.items()):
        if mode == "none" or picked is not None and i not in picked:
            continue
        if mode == "full":
            _wrap(block, "forward", block.parameters(), list(dropout_modules(block).values()))
        else:
            path, _, name = attention_core.rpartition(".")
            owner = block
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part)
            _wrap(owner, name, [], list(dropout_modules(owner).values()))
        done.append(i)
    return done
