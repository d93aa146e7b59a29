"""Model definitions written against mpirt's public API, and their presets.

``MODELS`` is the one registry of model types: ``"gpt2"`` -> :class:`GPT`, ``"mlp"`` -> :class:`MLP`.
A registered class is built as ``cls(cfg, dtype=..., seed=...)`` and carries what the rest of
mpirt asks of a model type: ``num_parameters_of(cfg)`` and ``flops_per_token_of(cfg, seq_len)``
(from the config alone), ``block_class`` (the class of ``model.h[i]``, built as
``block_class(cfg, dtype)``: pipeline stages build only their own blocks) and, optionally,
``tp_plan`` (tensor parallelism). :func:`build_model`, :func:`num_parameters`,
:func:`flops_per_token` and :func:`block_class` all dispatch through it, and an unknown
``model_type`` is one ValueError naming it and the known ones.
"""
from __future__ import annotations

import dataclasses

from models.config import GPTConfig
from models.gpt import GPT
from models.mlp import MLP

MODELS = {"gpt2": GPT, "mlp": MLP}


def model_class(cfg: GPTConfig) -> type:
    """The registered class of ``cfg.model_type`` (ValueError for an unknown one)."""
    try:
        return MODELS[cfg.model_type]
    except KeyError:
        raise ValueError(f"model_type: unknown model {cfg.model_type!r}; "
                         f"expected one of {', '.join(sorted(MODELS))}") from None


def build_model(cfg: GPTConfig, dtype="float32", seed: int | None = None):
    """The model for ``cfg.model_type``; initialized from ``seed`` when given, else zero weights
    (call ``model.initialize(seed, axis_sizes, axis_ranks)`` or load a checkpoint)."""
    return model_class(cfg)(cfg, dtype=dtype, seed=seed)


def num_parameters(cfg: GPTConfig) -> int:
    """Parameters of the full model (tied weights once), computed from the config alone."""
    return model_class(cfg).num_parameters_of(cfg)


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token of the full model (for MFU), computed from the config alone."""
    return model_class(cfg).flops_per_token_of(cfg, seq_len)


def block_class(cfg: GPTConfig) -> type:
    """The class of the model's blocks (``model.h[i]``); for a registered class without a
    ``block_class`` attribute, found by building a one-block model."""
    cls = model_class(cfg)
    block = getattr(cls, "block_class", None)
    return block if block is not None else type(cls(dataclasses.replace(cfg, n_layer=1)).h[0])


__all__ = ["GPT", "MLP", "GPTConfig", "MODELS", "build_model", "model_class", "block_class",
           "num_parameters", "flops_per_token"]
