"""Hugging Face checkpoints in and out, through safetensors only (never pickle): GPT-2 as below;
Llama and Mixtral (tied heads) by mapping tensors (:data:`HF_FAMILIES`; read by
:mod:`mpirt.models.hf_decoder`). Every stored weight is checked when a directory is opened: name,
shape, a floating-point dtype and finite values (:func:`check_stored`, :func:`check_finite`).

Over 400 lines: reading, checking and writing a Hugging Face directory are one format's contract
(the names, the config keys, the shards), kept in one place so that a load and a save cannot drift.

A GPT-2 directory holds ``config.json`` and either ``model.safetensors`` or a sharded checkpoint
(``model.safetensors.index.json`` naming several shard files). Tensor names may carry the
``transformer.`` prefix (``GPT2LMHeadModel``) or not (``GPT2Model``); both load. The attention
mask buffers some files carry (``h.N.attn.bias``, ``h.N.attn.masked_bias``) are ignored. The head
must be tied: an ``lm_head.weight`` that differs from ``wte.weight`` is refused.
:class:`HFReader` serves any box of any weight from the memory-mapped files (the sharded
checkpoint reader's interface), so training initialised from a directory has each rank read its
own slices only; :func:`load_hf_gpt2` reads whole tensors through it.

Config choices (shared with :mod:`models.presets`, which reads the same ``config.json``):

- ``activation_function`` must be ``gelu_new`` or ``gelu_pytorch_tanh`` (the tanh GELU mpirt
  implements). The exact erf ``gelu`` is refused rather than silently approximated: the two differ
  by up to ~1e-3 per activation, enough to move a trained model's logits visibly.
- ``scale_attn_by_inverse_layer_idx``, untied embeddings, cross-attention or unscaled attention
  are refused. ``reorder_and_upcast_attn`` is accepted: it only changes the order and precision of
  the same arithmetic in half precision, and mpirt computes attention in the model's dtype.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from mpirt.models.model_config import GPTConfig
from mpirt.models.gpt import param_shapes
from mpirt.models.presets import _read_hf
from mpirt.checkpoint.store import BoxReader, CheckpointError
from mpirt.core.settings import ConfigError
from mpirt.checkpoint.tensorfile import SafetensorsFile, TensorFileError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PREFIX = "transformer."


def _is_buffer(name: str) -> bool:
    """The causal-mask buffers older GPT-2 files store next to the parameters."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "h" and parts[2] == "attn" and parts[3] in ("bias", "masked_bias")


def read_hf_config(directory) -> GPTConfig:
    """A checked GPTConfig from ``directory/config.json`` (ConfigError names the bad key)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (not a Hugging Face model directory)")
    cfg = GPTConfig(**_read_hf(path))
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"n_head: must divide n_embd={cfg.n_embd}, got {cfg.n_head} (in {path})")
    return cfg


def _safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's files: the single file, or every shard named by the index."""
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}")
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e})") from None
        for key, f in weight_map.items():
            # a shard outside the directory would load whatever file the index points at
            if not isinstance(f, str) or not f or Path(f).is_absolute() or ".." in Path(f).parts:
                raise ValueError(f"{index}: weight_map entry {key!r} -> {f!r} does not name a file "
                                 f"inside {directory}")
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index}: shard files missing: {absent}")
        return files
    found = ", ".join(sorted(p.name for p in directory.glob("*.bin"))) or "none"
    raise FileNotFoundError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (pickled .bin files are "
                            f"not loaded: {found}; convert them to safetensors)")


def _open(path: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile(path)
    except TensorFileError as err:
        raise ValueError(str(err)) from None


FLOAT_CODES = ("F32", "BF16", "F16", "F64")   # the stored dtypes weights may have
FINITE_CHUNK = 1 << 20                         # values converted and checked at a time


def check_stored(f: SafetensorsFile, key: str, shape: tuple) -> None:
    """A stored weight of ``shape`` and a floating-point dtype (integers would load as truncated
    floats), ValueError naming the file and the key otherwise (reads the header only)."""
    code = f.dtype_code(key)
    if code not in FLOAT_CODES:
        raise ValueError(f"{f.path}: tensor {key!r} is stored as {code}; weights must be floating point "
                         f"({', '.join(FLOAT_CODES)})")
    if f.shape(key) != tuple(shape):
        raise ValueError(f"{f.path}: tensor {key!r} has shape {f.shape(key)}, expected {tuple(shape)} from config.json")


def check_finite(f: SafetensorsFile, key: str, dtype=None) -> None:
    """ValueError naming the file and the key when the stored tensor holds NaN or infinity, or
    values beyond the range of ``dtype`` (the model's, when given). Reads the tensor a slab of
    rows at a time (about :data:`FINITE_CHUNK` values), never whole."""
    shape = f.shape(key)
    rows = max(1, FINITE_CHUNK // max(1, int(np.prod(shape[1:], dtype=np.int64))))
    stored = converted = 0
    for start in range(0, shape[0], rows) if shape else [None]:
        part = f.read(key, box=None if start is None else (slice(start, start + rows),))
        finite = np.isfinite(part)
        stored += part.size - int(np.count_nonzero(finite))
        if dtype is not None and not stored:
            with np.errstate(over="ignore"):   # the overflow counted here is the finding, not a warning
                converted += part.size - int(np.count_nonzero(np.isfinite(part.astype(dtype))))
    if stored:
        raise ValueError(f"{f.path}: tensor {key!r} holds {stored} NaN or infinite value(s)")
    if converted:
        raise ValueError(f"{f.path}: tensor {key!r} holds {converted} value(s) beyond the range of {np.dtype(dtype)}, "
                         f"the model's dtype")


class HFReader(BoxReader):
    """A Hugging Face GPT-2 directory as a reader of boxes, by mpirt parameter names: the interface
    of :class:`mpirt.checkpoint.store.CheckpointReader` that :func:`mpirt.parallel.shards.load_shards`
    uses (``meta``, ``entry``, ``read``), so ``engine.load_sharded(HFReader(d), with_optimizer=False)``
    has each rank read only its own boxes (tp slices, its pipeline stage), never a full tensor.

    Opening it checks the config, every file of the index, names (the ``transformer.`` prefix
    dropped, mask buffers skipped), shapes and dtypes against the config, scans every tensor for
    NaN and infinity (a slab at a time, :func:`check_finite`), and a stored ``lm_head.weight``
    must equal ``wte.weight`` (compared a few rows at a time; a file holding only the head gives
    the table). GPT-2's Conv1D weights are stored (in,
    out) as mpirt's Linear, so nothing is transposed; the vocabulary padding tp adds is never
    read (``load_shards`` asks for the unpadded table). ``dtype`` (the model's): values are
    rounded to it on the way, also when read into float32 master weights, as a full tensor
    converted to the model dtype would be.
    """

    KINDS = ("params",)
    MISSING_HINT = " (a Hugging Face directory holds weights only)"

    def __init__(self, directory, dtype=None):
        self.path = Path(directory)
        self.config = read_hf_config(self.path)
        self.dtype = None if dtype is None else np.dtype(dtype)
        where: dict = {}
        for path in _safetensors_files(self.path):
            f = _open(path)
            for key in f.keys():
                name = key[len(PREFIX):] if key.startswith(PREFIX) else key
                if _is_buffer(name):
                    continue
                if name in where:
                    raise ValueError(f"{path}: tensor {name!r} appears twice (with and without {PREFIX!r})")
                where[name] = (f, key)
        head = where.pop("lm_head.weight", None)
        if head is not None:
            if "wte.weight" not in where:  # a file that stored the tied table only under the head
                where["wte.weight"] = head
            elif not _same(head, where["wte.weight"]):
                raise ValueError(f"{self.path}: lm_head.weight differs from wte.weight: untied lm_head not supported")
        expected = param_shapes(self.config)
        missing, unexpected = sorted(set(expected) - set(where)), sorted(set(where) - set(expected))
        if missing or unexpected:
            raise CheckpointError(f"{self.path}: checkpoint does not match the config: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
        for name, shape in expected.items():
            f, key = where[name]
            check_stored(f, key, shape)
            check_finite(f, key, self.dtype)
        self._where = {name: where[name] for name in expected}
        self.meta = {"path": str(self.path), "format": "huggingface", "step": 0, "optimizer": None,
                     "optimizer_state": {}, "extra": {},
                     "params": {name: {"shape": list(shape), "dtype": str(where[name][0].dtype(where[name][1]))}
                                for name, shape in expected.items()}}

    def read(self, kind: str, name: str, start=None, shape=None, out=None) -> np.ndarray:
        """The box of ``name`` at ``start`` of ``shape`` (default: the whole tensor) written into
        ``out`` (NumPy, any dtype) and returned; a new array (of ``dtype``, else the stored one)
        when ``out`` is None."""
        full = tuple(self.entry(kind, name)["shape"])
        start = tuple(start) if start is not None else (0,) * len(full)
        shape = tuple(shape) if shape is not None else full
        if len(start) != len(full) or any(s < 0 or n < 0 or s + n > g for s, n, g in zip(start, shape, full)):
            raise ValueError(f"{self.path}: the box {start} + {shape} is outside {name} of shape {full}")
        f, key = self._where[name]
        box = tuple(slice(s, s + n) for s, n in zip(start, shape))
        if out is None:
            out = np.empty(shape, dtype=self.dtype or f.dtype(key))
        elif tuple(out.shape) != shape:
            raise ValueError(f"HFReader.read: out has shape {tuple(out.shape)}, the box {shape}")
        if self.dtype is not None and out.dtype != self.dtype and f.dtype(key) != self.dtype:
            out[...] = f.read(key, np.empty(shape, dtype=self.dtype), box)  # rounded to the model dtype first
        else:
            f.read(key, out, box)
        return out


def _same(a: tuple, b: tuple, rows: int = 4096) -> bool:
    """Whether two stored tensors (``(file, key)``) hold equal values, compared ``rows`` at a time."""
    (fa, ka), (fb, kb) = a, b
    if fa.shape(ka) != fb.shape(kb):
        return False
    x, y = fa.array(ka), fb.array(kb)
    if x.ndim == 0:
        return bool(x == y)
    return all(np.array_equal(x[i:i + rows], y[i:i + rows]) for i in range(0, x.shape[0], rows))


def load_hf_gpt2(directory, dtype="float32") -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """Read a Hugging Face GPT-2 directory: ``(config, {mpirt parameter name: array})``, full
    tensors (:class:`HFReader` reads boxes instead).

    Names and shapes are checked against the config; errors name the missing, unexpected or
    misshapen keys. Arrays are converted to ``dtype``.
    """
    reader = HFReader(directory, dtype)
    return reader.config, {name: reader.read("params", name) for name in reader.meta["params"]}


def load_into(model, directory) -> GPTConfig:
    """Load a Hugging Face GPT-2 directory into ``model`` (same architecture); returns its config."""
    cfg, state = load_hf_gpt2(directory, dtype=model.wte.weight.dtype)
    mine = getattr(model, "config", None)
    if mine is not None:
        keys = ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size", "hidden", "layer_norm_epsilon")
        diff = [f"{k}: model {getattr(mine, k)} vs checkpoint {getattr(cfg, k)}"
                for k in keys if getattr(mine, k) != getattr(cfg, k)]
        if diff:
            raise ValueError(f"{directory}: checkpoint architecture differs from the model: {'; '.join(diff)}")
    model.load_state_dict(state)
    return cfg


def hf_config_dict(cfg: GPTConfig, dtype: str = "float32") -> dict:
    """``config.json`` contents for ``GPT2LMHeadModel`` with the architecture of ``cfg``."""
    if cfg.model_type != "gpt2":
        raise ValueError(f"export: GPT-2, Llama- and Mixtral-style models can be exported, got model_type {cfg.model_type!r}")
    token = 50256 if cfg.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, when it exists
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.n_positions, "n_ctx": cfg.n_positions,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.n_inner,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "resid_pdrop": cfg.resid_pdrop, "embd_pdrop": cfg.embd_pdrop, "attn_pdrop": cfg.attn_pdrop,
        "initializer_range": cfg.initializer_range, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "add_cross_attention": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": token, "eos_token_id": token, "torch_dtype": dtype,
    }


def llama_config_dict(cfg, dtype: str = "float32") -> dict:
    """``config.json`` contents for ``LlamaForCausalLM`` with the architecture of a Llama-style
    ``cfg`` (``num_key_value_heads``: its key/value heads; the head tied to the table)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd, "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head or cfg.n_head, "head_dim": cfg.n_embd // cfg.n_head,
        "max_position_embeddings": cfg.n_positions, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "attention_dropout": cfg.attn_pdrop, "initializer_range": cfg.initializer_range, "tie_word_embeddings": True,
        "use_cache": True, "torch_dtype": dtype,
    }


def _kv_width(cfg) -> int:
    """``Ck``: the key (= value) columns of a Llama-style ``c_attn``, ``n_kv_head`` heads."""
    return (cfg.n_kv_head or cfg.n_head) * (cfg.n_embd // cfg.n_head)


def llama_param_shapes(cfg) -> dict:
    """mpirt's parameter names and shapes of a Llama-style model (what an export reads)."""
    c, h, ck = cfg.n_embd, cfg.hidden, _kv_width(cfg)
    shapes = {"wte.weight": (cfg.vocab_size, c), "ln_f.weight": (c,)}
    for i in range(cfg.n_layer):
        shapes.update({f"h.{i}.ln_1.weight": (c,), f"h.{i}.attn.c_attn.weight": (c, c + 2 * ck),
                       f"h.{i}.attn.c_proj.weight": (c, c), f"h.{i}.ln_2.weight": (c,),
                       f"h.{i}.mlp.gate_proj.weight": (c, h), f"h.{i}.mlp.up_proj.weight": (c, h),
                       f"h.{i}.mlp.down_proj.weight": (h, c)})
    return shapes


def llama_hf_tensors(cfg, read) -> list:
    """``(hf name, shape, read)`` of every tensor of a Llama-style model in ``LlamaForCausalLM``'s
    names and layout, each ``read()`` built from ``read(mpirt name)``: mpirt keeps ``(in, out)``
    matrices (HF ``(out, in)``) and one fused ``c_attn`` whose q | k | v column blocks (C, Ck, Ck
    columns) become ``q_proj``, ``k_proj``, ``v_proj``. The rotary layout (rotate half) is the
    same in both."""
    c, h, ck = cfg.n_embd, cfg.hidden, _kv_width(cfg)
    qkv_cols = {"q": (0, c), "k": (c, c + ck), "v": (c + ck, c + 2 * ck)}

    def part(name, lo=None, hi=None):
        return lambda: np.ascontiguousarray(read(name)[:, lo:hi].T)

    items = [("model.embed_tokens.weight", (cfg.vocab_size, c), lambda: read("wte.weight"))]
    for i in range(cfg.n_layer):
        mine, theirs = f"h.{i}.", f"model.layers.{i}."
        items += [(theirs + "input_layernorm.weight", (c,), lambda n=mine + "ln_1.weight": read(n)),
                  *((theirs + f"self_attn.{x}_proj.weight", (hi - lo, c), part(mine + "attn.c_attn.weight", lo, hi))
                    for x, (lo, hi) in qkv_cols.items()),
                  (theirs + "self_attn.o_proj.weight", (c, c), part(mine + "attn.c_proj.weight")),
                  (theirs + "post_attention_layernorm.weight", (c,), lambda n=mine + "ln_2.weight": read(n)),
                  (theirs + "mlp.gate_proj.weight", (h, c), part(mine + "mlp.gate_proj.weight")),
                  (theirs + "mlp.up_proj.weight", (h, c), part(mine + "mlp.up_proj.weight")),
                  (theirs + "mlp.down_proj.weight", (c, h), part(mine + "mlp.down_proj.weight"))]
    return items + [("model.norm.weight", (c,), lambda: read("ln_f.weight"))]


def mixtral_config_dict(cfg, dtype: str = "float32") -> dict:
    """``config.json`` contents for ``MixtralForCausalLM`` with the architecture of a Mixtral-style
    ``cfg`` (:mod:`mpirt.models.moe`: tied head, dropless routing as Hugging Face's)."""
    out = {k: v for k, v in llama_config_dict(cfg, dtype).items() if k not in ("attention_bias", "mlp_bias")}
    return {**out, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": cfg.n_expert, "num_experts_per_tok": cfg.top_k,
            "router_aux_loss_coef": cfg.aux_loss_coef, "output_router_logits": False}


def mixtral_param_shapes(cfg) -> dict:
    """mpirt's parameter names and shapes of a Mixtral-style model (what an export reads)."""
    c, f, e = cfg.n_embd, cfg.hidden, cfg.n_expert
    shapes = {n: s for n, s in llama_param_shapes(cfg).items() if ".mlp." not in n}
    for i in range(cfg.n_layer):
        shapes.update({f"h.{i}.mlp.gate.weight": (c, e), f"h.{i}.mlp.w_gate": (e, c, f), f"h.{i}.mlp.w_up": (e, c, f),
                       f"h.{i}.mlp.w_down": (e, f, c)})
    return shapes


def mixtral_hf_tensors(cfg, read) -> list:
    """``(hf name, shape, read)`` of every tensor of a Mixtral-style model in the Hugging Face
    Hub's Mixtral files (what ``save_pretrained`` writes and ``from_pretrained`` reads): the
    attention and norms as :func:`llama_hf_tensors`, under ``block_sparse_moe.`` the router
    ``gate.weight`` (E, C) and per expert ``j`` its ``w1`` (gate), ``w3`` (up), both (F, C), and
    ``w2`` (down, (C, F)): mpirt's stacked (in, out) matrices transposed."""
    c, f, e = cfg.n_embd, cfg.hidden, cfg.n_expert

    def expert(i, name, j):
        return lambda: np.ascontiguousarray(read(f"h.{i}.mlp.{name}")[j].T)

    items = [item for item in llama_hf_tensors(cfg, read) if ".mlp." not in item[0]]
    for i in range(cfg.n_layer):
        theirs = f"model.layers.{i}.block_sparse_moe."
        items.append((theirs + "gate.weight", (e, c), lambda i=i: np.ascontiguousarray(read(f"h.{i}.mlp.gate.weight").T)))
        for j in range(e):
            items += [(theirs + f"experts.{j}.w1.weight", (f, c), expert(i, "w_gate", j)),
                      (theirs + f"experts.{j}.w3.weight", (f, c), expert(i, "w_up", j)),
                      (theirs + f"experts.{j}.w2.weight", (c, f), expert(i, "w_down", j))]
    return items


# the Hugging Face families an export writes by mapping tensors: model_type -> (config.json,
# mpirt's names and shapes, the tensors under Hugging Face's names)
HF_FAMILIES = {"llama": (llama_config_dict, llama_param_shapes, llama_hf_tensors),
               "mixtral": (mixtral_config_dict, mixtral_param_shapes, mixtral_hf_tensors)}


def _write_files(directory: Path, cfg: GPTConfig, tensors: dict, dtype: str) -> None:
    path = directory / SINGLE_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2) + "\n")
    for name in (SINGLE_FILE, "config.json"):
        with open(directory / name, "rb") as f:
            os.fsync(f.fileno())


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte ``b``'s printable stand-in (printable Latin-1 bytes stand
    for themselves, the others for 256, 257, ... in order), so any byte string is a token string."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def save_hf_tokenizer(dataset_dir, directory, max_length: int) -> str:
    """Write the tokenizer a model was trained with beside its exported weights (``tokenizer.json``
    and ``tokenizer_config.json``), so that ``AutoTokenizer.from_pretrained(directory)`` encodes
    text as training did: the dataset's byte tokenizer (id = byte value, as a byte-level BPE
    without merges) or the ``tokenizers`` JSON it was prepared with. Returns what was written,
    in words; ValueError when the dataset says nothing of its tokenizer."""
    from mpirt.data.tokens import BYTE_EOS, read_meta
    dataset_dir, directory = Path(dataset_dir), Path(directory)
    meta = read_meta(dataset_dir / "meta.json") if (dataset_dir / "meta.json").exists() else {}
    kind = meta.get("tokenizer")
    if kind == "bytes":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        chars = _byte_chars()
        tokenizer = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(chars)}, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.save(str(directory / "tokenizer.json"))
        eos, what = chars[BYTE_EOS], "the byte tokenizer (byte-level, id = byte value)"
    elif kind:
        from tokenizers import Tokenizer
        shutil.copyfile(dataset_dir / kind, directory / "tokenizer.json")
        eos_id = meta.get("eos_id")
        eos = Tokenizer.from_file(str(dataset_dir / kind)).id_to_token(eos_id) if eos_id is not None else None
        what = f"the dataset's tokenizer {kind}"
    else:
        raise ValueError(f"{dataset_dir}: its meta.json names no tokenizer; the export would load with none")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              **({"eos_token": eos, "bos_token": eos} if eos is not None else {})}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return what


def save_hf_gpt2(model, cfg: GPTConfig, directory, dtype: str = "float32") -> Path:
    """Write ``model`` as a Hugging Face GPT-2 directory (``config.json`` + ``model.safetensors``
    with ``transformer.``-prefixed names, stored as ``dtype``), loadable by
    ``GPT2LMHeadModel.from_pretrained``.

    A new directory appears complete or not at all (written beside it, then renamed). Into an
    existing directory (which may hold tokenizer files) the two files are each replaced
    atomically, and a stale sharded checkpoint there is removed.
    """
    directory = Path(directory)
    state = model.state_dict()
    expected = param_shapes(cfg)
    if set(state) != set(expected):
        raise KeyError(f"save_hf_gpt2: model parameters do not match the config: missing "
                       f"{sorted(set(expected) - set(state))}, unexpected {sorted(set(state) - set(expected))}")
    tensors = {}
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"save_hf_gpt2: {name} has shape {tuple(state[name].shape)}, expected {shape}"
                             " (gather sharded parameters before exporting)")
        tensors[PREFIX + name] = np.ascontiguousarray(state[name], dtype=dtype)
    directory.parent.mkdir(parents=True, exist_ok=True)
    exists = directory.is_dir()
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory if exists else directory.parent))
    try:
        _write_files(tmp, cfg, tensors, dtype)
        if not exists:
            os.rename(tmp, directory)
            return directory
        for name in (SINGLE_FILE, "config.json"):
            os.replace(tmp / name, directory / name)
        index = directory / INDEX_FILE
        if index.is_file():  # a stale sharded checkpoint; the single file already wins over it
            try:
                shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
            except (ValueError, AttributeError):
                shards = set()
            index.unlink()
            for shard in shards:
                if shard != SINGLE_FILE and Path(shard).name == shard:  # never outside the directory
                    (directory / shard).unlink(missing_ok=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory
