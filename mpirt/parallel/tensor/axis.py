"""Tensor-parallel layout: the ``tp`` axis name, the sizes tp must divide, the padded vocabulary
and the parameters that hold this rank's slice (pure: no communication)."""
from __future__ import annotations

import numpy as np

from mpirt.core.nn import Parameter, ShardSpec

AXIS = "tp"


def pad_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary padded to a multiple of ``tp`` (``tp * ceil(V / tp)``)."""
    return -(-vocab_size // tp) * tp


def check_tp_layout(tp: int, *, n_head: int, n_embd: int, hidden: int, vocab_size: int | None = None,
                    seq_len: int | None = None, sequence_parallel: bool = False, n_kv_head: int | None = None) -> None:
    """Refuse a tensor-parallel size that does not divide the model, naming the numbers.

    tp must divide the attention heads (the key/value heads too: each rank holds whole ones, none
    replicated), the embedding width and the MLP hidden size; the
    vocabulary is padded to a multiple of tp (so it always fits); with sequence parallelism tp must
    divide the sequence length. Pure: call it before any communication (config validation).
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: must be a positive integer, got {tp!r}")
    bad = [f"n_head={n_head}" if n_head % tp else "", f"n_kv_head={n_kv_head}" if n_kv_head and n_kv_head % tp else "",
           f"n_embd={n_embd}" if n_embd % tp else "",
           f"MLP hidden size={hidden}" if hidden % tp else ""]
    if sequence_parallel and seq_len is not None and seq_len % tp:
        bad.append(f"seq_len={seq_len} (sequence parallelism)")
    bad = [b for b in bad if b]
    if bad:
        raise ValueError(f"tensor parallelism: tp={tp} must divide {', '.join(bad)}")
    if vocab_size is not None and pad_vocab(vocab_size, tp) % tp:  # pragma: no cover (always divides)
        raise ValueError(f"tensor parallelism: padded vocabulary {pad_vocab(vocab_size, tp)} not divisible by tp={tp}")


def check_model_tp(model_cfg, tp: int, *, seq_len: int | None = None, sequence_parallel: bool = False) -> None:
    """Refuse (ValueError naming the numbers) a tp > 1 that the model cannot take: a model type
    without a tensor-parallel plan, or sizes tp does not divide (:func:`check_tp_layout`). Pure;
    the training's pre-flight and ``python -m mpirt.slurm`` both ask it."""
    if tp <= 1:
        return
    from mpirt.core.modeling import model_class
    if model_class(model_cfg).tp_plan is None:
        raise ValueError(f"model_type {model_cfg.model_type!r} has no tensor-parallel plan (tp_plan); use --tp 1 "
                         "(data or pipeline parallelism split it instead)")
    check_tp_layout(tp, n_head=model_cfg.n_head, n_embd=model_cfg.n_embd, hidden=model_cfg.hidden,
                    vocab_size=model_cfg.vocab_size, seq_len=seq_len, sequence_parallel=sequence_parallel,
                    n_kv_head=getattr(model_cfg, "n_kv_head", None))


def _local_param(global_shape, spec: ShardSpec, comm, init="normal", std=0.02, dtype="float32", cls=Parameter,
                 **extra):
    """A lazy parameter (no array yet) whose shape is this rank's slice."""
    p = cls(global_shape, init=init, std=std, spec=spec, dtype=dtype, **extra)
    return p.defer(spec.local_shape(global_shape, {AXIS: comm.size}))


class PaddedParameter(Parameter):
    """A parameter whose first dimension is padded (vocabulary to a multiple of tp): the full
    initial value is the unpadded ``logical_shape`` tensor of the same name and seed (hence equal
    to the tp=1 one) followed by zero rows."""

    def __init__(self, shape, logical_shape, **kw):
        super().__init__(shape, **kw)
        self.logical_shape = tuple(logical_shape)

    def _init_shape(self) -> tuple:
        return self.logical_shape

    def full_init(self, seed: int) -> np.ndarray:
        padded, self.global_shape = self.global_shape, self.logical_shape
        try:
            core = super().full_init(seed)
        finally:
            self.global_shape = padded
        return pad_rows(core, padded[0])


def pad_rows(a, rows: int):
    """``a`` with zero rows appended up to ``rows`` (NumPy)."""
    a = np.asarray(a)
    if a.shape[0] == rows:
        return a
    out = np.zeros((rows,) + a.shape[1:], dtype=a.dtype)
    out[:a.shape[0]] = a
    return out
