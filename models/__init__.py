"""The bundled models, written against mpirt's model interface (:mod:`mpirt.core.modeling`), and their
presets. Installed as ``mpirt.models`` (the repository folder is ``models/``).

Importing this package registers ``"gpt2"`` -> :class:`GPT`, ``"mlp"`` -> :class:`MLP` and
``"llama"`` -> :class:`Llama`, ``"mixtral"`` -> :class:`Mixtral` in :data:`mpirt.core.modeling.MODELS`; the runtime builds and counts
models through :mod:`mpirt.core.modeling` only.
"""
from __future__ import annotations

from mpirt.models.model_config import GPTConfig
from mpirt.models.gpt import GPT
from mpirt.models.llama import Llama, LlamaConfig
from mpirt.models.mlp import MLP
from mpirt.models.moe import MoEConfig, Mixtral
from mpirt.models import presets  # noqa: F401,E402  (registers the model-config loader: presets, TOML, HF dirs)

__all__ = ["GPT", "MLP", "Llama", "Mixtral", "GPTConfig", "LlamaConfig", "MoEConfig"]
