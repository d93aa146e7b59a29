"""Model definitions written against mpirt's public API, and their presets.

``build_model(cfg)`` picks the class from ``cfg.model_type``: ``"gpt2"`` -> :class:`GPT`,
``"mlp"`` -> :class:`MLP`.
"""
from __future__ import annotations

from models import gpt, mlp
from models.config import GPTConfig
from models.gpt import GPT
from models.mlp import MLP

MODELS = {"gpt2": GPT, "mlp": MLP}


def build_model(cfg: GPTConfig, dtype="float32", seed: int | None = None):
    """The model for ``cfg.model_type``; initialized from ``seed`` when given, else zero weights
    (call ``model.initialize(seed, axis_sizes, axis_ranks)`` or load a checkpoint)."""
    try:
        cls = MODELS[cfg.model_type]
    except KeyError:
        raise ValueError(f"model_type: unknown model {cfg.model_type!r}; "
                         f"expected one of {', '.join(sorted(MODELS))}") from None
    return cls(cfg, dtype=dtype, seed=seed)


def _module(cfg: GPTConfig):
    return {"gpt2": gpt, "mlp": mlp}[cfg.model_type]


def num_parameters(cfg: GPTConfig) -> int:
    """Parameters of the full model (tied weights once), computed from the config alone."""
    return _module(cfg).num_parameters(cfg)


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token of the full model (for MFU), computed from the config alone."""
    return _module(cfg).flops_per_token(cfg, seq_len)


__all__ = ["GPT", "MLP", "GPTConfig", "MODELS", "build_model", "num_parameters", "flops_per_token"]
