"""Model configuration of GPT-2 and the MLP model (``model_type`` "gpt2" or "mlp").

Field names follow Hugging Face GPT-2's ``config.json`` so that a GPT-2 directory's config maps onto
this dataclass key for key.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GPTConfig:
    """Architecture of a GPT-2 style decoder (pre-LayerNorm, learned positions, tied head)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_positions: int = 256
    vocab_size: int = 256
    n_inner: int | None = None          # MLP hidden size; None means 4 * n_embd
    layer_norm_epsilon: float = 1e-5
    embd_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    initializer_range: float = 0.02
    model_type: str = "gpt2"            # "gpt2" or "mlp"

    @property
    def hidden(self) -> int:
        """Hidden size of the MLP block."""
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd
