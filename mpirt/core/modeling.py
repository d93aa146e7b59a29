"""The model interface: what mpirt's runtime asks of a model architecture, and the registry.

The runtime (``mpirt/parallel/``, ``mpirt/run/config.py``, ``mpirt/run/train.py``) talks to models only
through this module. A model type is a subclass of :class:`CausalLM` registered with
:func:`register` under its ``model_type``; the bundled ones (``gpt2``, ``mlp``, ``llama``) live in
:mod:`mpirt.models` and are registered when the registry is first read.

A registered class provides:

- ``model_type`` and ``config_class``: a dataclass holding at least ``model_type``, ``n_layer``
  (blocks), ``n_embd`` (width of the activations between blocks), ``n_positions`` (longest
  sequence) and ``vocab_size``; for tensor parallelism also ``n_head`` and ``hidden`` (the MLP
  width). :func:`config_from_dict` rebuilds it from a checkpoint's JSON.
- construction ``cls(cfg, dtype=..., seed=...)``, and as units for pipeline stages: the blocks
  ``model.h[i]`` (each a ``block_class(cfg, dtype)``), ``model.embed(idx)`` (B, T) -> (B, T, C) and
  ``model.head(x)`` (B, T, C) -> logits; ``model.loss_fn(logits, targets)`` (default
  :func:`lm_loss`) and ``model(idx, targets) -> (logits, loss)``.
- ``attention_core`` (optional): the dotted path, inside a block, of the method computing the
  attention core from its Tensor inputs without parameters of its own (``"attn.core"``: scores,
  softmax, dropout, probabilities times v); ``--recompute selective`` reruns it in backward.
- ``tp_plan`` (optional): the tensor-parallel plan, ``(module pattern, kind, {param: ShardSpec})``
  entries read by :func:`mpirt.parallel.tensor.parallelize`.
- from the config alone: ``num_parameters_of(cfg)``, ``flops_per_token_of(cfg, seq_len)``,
  ``layer_costs_of(cfg, seq_len)`` (per-layer :class:`LayerCost` for the pipeline split),
  ``activation_bytes_of(cfg, layout)`` (activations kept per micro-batch: the memory prediction)
  and ``check_config(cfg)``.
- optionally Hugging Face interop: ``read_hf_config(path)`` (a ``config.json`` -> config field
  values), ``load_hf(directory, dtype)`` -> ``(cfg, full weights)`` and ``open_hf(directory,
  dtype)`` -> ``(cfg, reader)``: a reader of boxes with the interface of
  :class:`mpirt.checkpoint.store.CheckpointReader` (``meta``, ``entry``, ``read(..., out=)``), which the
  engines load with ``load_sharded(reader, with_optimizer=False)``, each rank reading its own
  boxes only. Without ``open_hf``, :func:`open_hf` wraps ``load_hf``'s full tensors.

Dropout modules are seeded by name (:func:`seed_dropouts`), so the runtime can reseed any
model's dropouts per rank without knowing where they are.

Over 400 lines: the interface, its registry and the runtime's calls through it are kept together,
so that the one place the runtime meets a model reads as one contract.
"""
from __future__ import annotations

import dataclasses
import json
import typing
import zlib
from dataclasses import dataclass
from pathlib import Path

import mpirt.core.backend as B
from mpirt.core import ops
from mpirt.checkpoint.store import BoxReader
from mpirt.core.nn import Dropout, Module
from mpirt.core.settings import ConfigError
from mpirt.core.tensor import Tensor

MODELS: dict[str, type] = {}


@dataclass(frozen=True)
class LayerCost:
    """Training FLOPs per token (forward + backward) and parameter count of one layer."""

    name: str
    flops: float
    params: int


def as_index_array(idx, name: str = "idx"):
    """``idx`` (Tensor, xp array or nested list) as an integer xp array."""
    a = idx.data if isinstance(idx, Tensor) else B.xp.asarray(idx)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
    return a


def lm_loss(logits, targets):
    """Mean cross-entropy of (B, T, V) logits against (B, T) targets; -100 entries are ignored."""
    t = as_index_array(targets, "targets")
    if tuple(t.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"targets: shape {tuple(t.shape)} does not match logits {tuple(logits.shape[:2])}")
    v = logits.shape[-1]
    return ops.cross_entropy(ops.reshape(logits, (-1, v)), t.reshape(-1), ignore_index=-100)


def seed_dropouts(model: Module, seed: int) -> None:
    """Give every Dropout module of ``model`` its own seed, derived from ``seed`` and its name,
    and restart its call counter (so two layers never draw the same mask)."""
    for name, m in model.named_modules():
        if isinstance(m, Dropout):
            m.seed = zlib.crc32(f"{seed}:{name}".encode())
            m.calls = 0


class CausalLM(Module):
    """Base class of every model type: ``embed`` -> the blocks ``h`` -> ``head`` -> ``loss_fn``.

    Subclasses set the class attributes and implement ``embed``, ``head`` and the ``*_of``
    class methods (see the module docstring). ``loss_fn`` (and a subclass's ``head_fn``) are
    swappable per instance: tensor parallelism installs vocabulary-parallel ones.
    """

    model_type: typing.ClassVar[str] = ""
    config_class: typing.ClassVar[type] = type(None)
    block_class: typing.ClassVar[type] = Module
    tp_plan: typing.ClassVar[tuple | None] = None
    attention_core: typing.ClassVar[str] = ""
    # True when a block treats a sequence's tokens together beyond attention (a mixture of
    # experts' capacity and load-balancing loss per sequence): no layout may split a sequence
    routes_per_sequence: typing.ClassVar[bool] = False
    loss_fn = staticmethod(lm_loss)

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse a config this architecture cannot be built from (ValueError naming the field)."""

    @classmethod
    def num_parameters_of(cls, cfg) -> int:
        """Parameters of the full model (tied weights once), from the config alone."""
        raise NotImplementedError

    @classmethod
    def flops_per_token_of(cls, cfg, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at ``seq_len``, for MFU."""
        raise NotImplementedError

    @classmethod
    def layer_costs_of(cls, cfg, seq_len: int) -> list:
        """:class:`LayerCost` of ``[embed, h.0 .. h.{L-1}, head]`` (the pipeline's balance)."""
        raise NotImplementedError

    @classmethod
    def activation_bytes_of(cls, cfg, layout, *, itemsize: int = 4) -> dict:
        """Bytes of activations one micro-batch of ``layout`` (a
        :class:`mpirt.parallel.layout.Layout`: its ``rows`` sequences of ``tokens``, a
        context-parallel rank's share, split by its tp and sequence parallelism, experts over its
        ep) keeps alive for backward, per rank, at ``itemsize`` bytes an element: ``{"block": per block without recomputation, "core": what selective recomputation
        of one block drops, "rerun": what its rerun makes again while its backward runs,
        "input": what full recomputation keeps of a block, "embed", "head", "weight_pass", "embed_weight_pass", "head_weight_pass": what a block, the embedding and
        the head hold from their input-gradient pass to their deferred weight pass, "widened":
        the largest float32 transient of a half-precision backward, "backward": the gradients
        alive at once inside a block's backward}`` (the memory prediction,
        :mod:`mpirt.plan.memory`; :func:`mpirt.models.lm.activation_bytes` has the formulas)."""
        raise NotImplementedError

    def embed(self, idx):
        """(B, T) token ids -> (B, T, C) activations."""
        raise NotImplementedError

    def head(self, x):
        """(B, T, C) activations -> (B, T, V) logits."""
        raise NotImplementedError

    def forward(self, idx, targets=None):
        """Logits (B, T, V) for token ids ``idx`` (B, T); with ``targets`` (B, T), also the mean
        cross-entropy over the targets that are not -100: returns ``(logits, loss)``."""
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return logits, self.loss_fn(logits, targets)


def register(cls: type) -> type:
    """Class decorator: make ``cls`` (a :class:`CausalLM`) the model of ``cls.model_type``."""
    if not (isinstance(cls, type) and issubclass(cls, CausalLM) and cls.model_type):
        raise TypeError(f"register: {cls!r} is not a CausalLM subclass with a model_type")
    MODELS[cls.model_type] = cls
    return cls


def _bundled() -> None:
    """Import the bundled models, which register their classes and config loader here. mpirt/__init__.py
    does it, but a process whose working directory holds a folder named ``mpirt`` (a clone's
    parent) imports that folder as the namespace ``mpirt`` and never runs it; the submodules still
    resolve through the installed package."""
    if not MODELS or not _CONFIG_LOADERS:
        import mpirt.models  # noqa: F401  (models import this module: a cycle at module level)


def _registry() -> dict[str, type]:
    """:data:`MODELS`, the bundled models' included (:func:`_bundled`)."""
    _bundled()
    return MODELS


def model_types() -> list[str]:
    """The registered ``model_type`` names, sorted."""
    return sorted(_registry())


def model_class(cfg_or_type) -> type:
    """The registered class of a config's ``model_type`` (or of a name); ValueError naming the
    unknown type and the known ones."""
    name = cfg_or_type if isinstance(cfg_or_type, str) else cfg_or_type.model_type
    try:
        return _registry()[name]
    except KeyError:
        raise ValueError(f"model_type: unknown model {name!r}; expected one of {', '.join(model_types())}") from None


def config_class(model_type: str) -> type:
    """The config dataclass of ``model_type``."""
    return model_class(model_type).config_class


def config_fields() -> dict[str, object]:
    """Every config field any registered model has, name -> type (the ``--model.<field>`` keys)."""
    out: dict[str, object] = {}
    for cls in _registry().values():
        hints = typing.get_type_hints(cls.config_class)
        out.update({f.name: hints[f.name] for f in dataclasses.fields(cls.config_class)})
    return out


def config_from_dict(values: dict):
    """The config of ``values["model_type"]`` (default ``gpt2``) built from ``values`` (e.g. a
    checkpoint's ``model_config``); TypeError for a field the type does not have."""
    return config_class(values.get("model_type", "gpt2"))(**values)


def build_model(cfg, dtype="float32", seed: int | None = None):
    """The model for ``cfg.model_type``; initialized from ``seed`` when given, else lazy: its
    parameters hold no arrays yet (call ``model.initialize(seed, axis_sizes, axis_ranks)``, make it
    tensor parallel with ``parallelize(seed=...)``, or load weights)."""
    return model_class(cfg)(cfg, dtype=dtype, seed=seed)


def block_class(cfg) -> type:
    """The class of the model's blocks (``model.h[i]``), built as ``block_class(cfg, dtype)``."""
    return model_class(cfg).block_class


def check_config(cfg) -> None:
    """The architecture's own checks of ``cfg`` (ValueError naming the field)."""
    model_class(cfg).check_config(cfg)


def num_parameters(cfg) -> int:
    """Parameters of the full model (tied weights once), computed from the config alone."""
    return _of_config("num_parameters_of", cfg)


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token of the full model (for MFU), computed from the config alone."""
    return model_class(cfg).flops_per_token_of(cfg, seq_len)


def layer_costs(cfg, seq_len: int | None = None) -> list:
    """Costs of ``[embed, h.0, ..., h.{L-1}, head]`` at ``seq_len`` (default n_positions)."""
    return list(_of_config("layer_costs_of", cfg, seq_len or cfg.n_positions))


_OF_CONFIG: dict = {}  # answers of the model classes' pure functions of a config (see _of_config)


def config_key(cfg) -> tuple:
    """A hashable key of a model config's every field (a config changed in place is another key),
    cheap enough to compute thousands of times; the ``repr`` where a field is unhashable."""
    try:
        key = (type(cfg).__name__, tuple(vars(cfg).items()))
        hash(key)
        return key
    except TypeError:
        return (type(cfg).__name__, repr(cfg))


def _of_config(method: str, cfg, *args):
    """``model_class(cfg).method(cfg, *args)``, remembered: the planner and the memory prediction
    ask thousands of times for the same model (keyed by :func:`config_key`); lists come back as
    tuples."""
    key = (method, config_key(cfg), args)
    if key not in _OF_CONFIG:
        if len(_OF_CONFIG) >= 1024:
            _OF_CONFIG.clear()
        value = getattr(model_class(cfg), method)(cfg, *args)
        _OF_CONFIG[key] = tuple(value) if isinstance(value, list) else value
    return _OF_CONFIG[key]


def hf_model_class(directory) -> type:
    """The registered class a Hugging Face ``directory/config.json`` names (``model_type``, default
    gpt2), if it can read Hugging Face files; ValueError otherwise."""
    path = Path(directory) / "config.json"
    try:
        name = json.loads(path.read_text()).get("model_type", "gpt2")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"model: cannot read {path}: {e}") from None
    cls = _registry().get(name)
    if cls is None or not hasattr(cls, "load_hf"):
        readers = sorted(n for n, c in _registry().items() if hasattr(c, "load_hf"))
        raise ValueError(f"model_type: mpirt supports only {' or '.join(map(repr, readers))}, got {name!r} "
                         f"(in {path})")
    return cls


def load_hf(directory, dtype="float32"):
    """``(config, full weights by mpirt name)`` from a Hugging Face model directory."""
    return hf_model_class(directory).load_hf(directory, dtype=dtype)


def open_hf(directory, dtype="float32"):
    """``(config, reader)`` of a Hugging Face model directory: the reader serves any box of any
    weight (``engine.load_sharded(reader, with_optimizer=False)``); the model class's ``open_hf``
    reads boxes from the files, else its ``load_hf`` tensors are read whole and served from memory."""
    cls = hf_model_class(directory)
    if hasattr(cls, "open_hf"):
        return cls.open_hf(directory, dtype=dtype)
    cfg, weights = cls.load_hf(directory, dtype=dtype)
    return cfg, FullWeightsReader(weights, str(directory))


class FullWeightsReader(BoxReader):
    """Full weights in memory (name -> array) behind the box-reader interface of
    :class:`mpirt.checkpoint.store.CheckpointReader` (weights only)."""

    KINDS = ("params",)

    def __init__(self, weights: dict, path: str = "<memory>"):
        self.weights, self.path = weights, path
        self.meta = {"path": path, "step": 0, "optimizer": None, "optimizer_state": {}, "extra": {},
                     "params": {n: {"shape": list(a.shape), "dtype": str(a.dtype)} for n, a in weights.items()}}

    def read(self, kind: str, name: str, start=None, shape=None, out=None):
        self.entry(kind, name)
        a = self.weights[name]
        start = tuple(start) if start is not None else (0,) * a.ndim
        shape = tuple(shape) if shape is not None else a.shape
        box = a[tuple(slice(s, s + n) for s, n in zip(start, shape))]
        if out is None:
            return box.copy()
        out[...] = box
        return out


_CONFIG_LOADERS: list = []   # the model-config loader the bundled presets register (register_config_loader)


def register_config_loader(load) -> None:
    """Make ``load(name_or_path, overrides)`` what :func:`load_model_config` calls
    (:mod:`mpirt.models.presets` registers its own when imported)."""
    _CONFIG_LOADERS[:] = [load]


def load_model_config(name_or_path: str, overrides: dict | None = None):
    """A preset name, a model TOML file or a Hugging Face directory -> a checked config, with
    ``overrides`` (field -> value) applied last (see :mod:`mpirt.models.presets`)."""
    _bundled()
    return _CONFIG_LOADERS[0](name_or_path, overrides)


def model_label(model: str, source: str | None, model_type: str) -> str:
    """How the banner and ``checkpoint info`` name a run's model: ``model`` (the ``--model``
    preset, file or directory) when it built the model, else the architecture and the weights it
    started from (``source``: a checkpoint's ``model_source``, ``"init_from PATH"``), e.g.
    ``llama from /data/hf-llama``: an imported Llama is not the ``tiny`` that ``--model`` defaults to."""
    if not source or source == model or not source.startswith("init_from "):
        return source or model
    return f"{model_type} from {source[len('init_from '):]}"


def missing_model_file(name_or_path: str) -> bool:
    """Whether ``--model`` names a file or directory (a path or a ``.toml``) that is not here: one
    that only another machine (a cluster's) holds, so its checks are left to where it exists."""
    return ("/" in name_or_path or name_or_path.endswith(".toml")) and not Path(name_or_path).exists()


def apply_overrides(cfg, overrides: dict):
    """``cfg`` with ``overrides`` (field -> value) replaced; ValueError naming a field its
    architecture does not have."""
    known = {f.name for f in dataclasses.fields(cfg)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"model.{bad[0]}: model_type {cfg.model_type!r} has no field {bad[0]!r}")
    return dataclasses.replace(cfg, **overrides)


def model_value_rule(key: str, value) -> str | None:
    """The rule a model config field's ``value`` breaks (``">= 1"``, ...), None when it keeps it
    (or ``key`` has no range rule)."""
    if key in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size", "n_inner"):
        ok, rule = (value >= 1 if value is not None else key == "n_inner"), ">= 1"
    elif key.endswith("_pdrop"):
        ok, rule = 0 <= value < 1, "in [0, 1)"
    elif key in ("layer_norm_epsilon", "rms_norm_eps", "rope_theta"):
        ok, rule = value > 0, "> 0"
    elif key == "initializer_range":
        ok, rule = value >= 0, ">= 0"
    elif key == "model_type":
        ok, rule = value in model_types(), "one of " + ", ".join(model_types())
    else:
        return None
    return None if ok else rule


def check_model_values(values: dict, prefix: str = "", where: str = "") -> None:
    """Range-check the model config fields present in ``values``; errors name ``prefix + key``."""
    for key, v in values.items():
        rule = model_value_rule(key, v)
        if rule is not None:
            raise ConfigError(f"{prefix}{key}: must be {rule}, got {v!r}{where}")


def attention_core(cfg) -> str:
    """Path inside a block of the model's attention core (``""``: none; see :class:`CausalLM`)."""
    return model_class(cfg).attention_core


def activation_bytes(cfg, layout, **kwargs) -> dict:
    """Activations one micro-batch of ``layout`` keeps, per rank (:meth:`CausalLM.activation_bytes_of`)."""
    return model_class(cfg).activation_bytes_of(cfg, layout, **kwargs)
