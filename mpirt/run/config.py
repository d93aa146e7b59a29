"""Run configuration: one dataclass, loaded from a TOML file, overridden from the command line.

    python -m mpirt.train [CONFIG.toml] [--key=value | --key value | --flag] ...

Precedence: command line > CONFIG.toml > dataclass defaults. Keys are the ``TrainConfig`` field
names; on the command line dashes and underscores are alike (``--batch-size 8`` ==
``--batch_size=8``). The architecture comes from ``model`` (a preset name, a model TOML file or a
Hugging Face GPT-2, Llama or Mixtral directory) plus per-field overrides of its model config (the fields of the
registered model types, :func:`mpirt.core.modeling.config_fields`): a ``[model]``
table in the TOML file or ``--model.n_layer=2`` on the command line. Since TOML cannot hold both
``model = "gpt2"`` and a ``[model]`` table, ``name = "gpt2"`` inside the table sets ``model`` too.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import textwrap
from dataclasses import dataclass, field

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from mpirt.core import modeling
from mpirt.core.modeling import check_model_values
from mpirt.core.precision import DTYPES
from mpirt.core.settings import FALSE_WORDS, TRUE_WORDS, ConfigError, convert_value, explicit_budget, field_types, \
    unknown_key_error

BACKENDS = ("auto", "numpy", "cupy")
# Pipeline schedule names are those of mpirt.parallel.pipeline.schedules (canonical names plus aliases), so
# `mpirt.train --schedule` and `python -m mpirt.schedule` accept the same set.
from mpirt.parallel.pipeline.schedules import SCHEDULES, ScheduleError, canonical_name as _canonical_schedule  # noqa: E402
RESUME = ("", "auto")
from mpirt.core.recompute import MODES as RECOMPUTE, parse_layers  # noqa: E402
NAN_POLICIES = ("skip", "stop")


def _opt(default, doc: str):
    return field(default=default, metadata={"help": doc})


@dataclass
class TrainConfig:
    """Everything one training run needs. Every rank must hold an identical copy."""

    model: str = _opt("tiny", "preset name (models/presets), model TOML file or Hugging Face GPT-2/Llama/Mixtral dir")
    data: str = _opt("", "dataset directory (train.bin, val.bin, meta.json); empty = built-in default corpus")
    steps: int = _opt(300, "optimizer steps to train")
    batch_size: int = _opt(8, "GLOBAL batch: sequences per optimizer step, over all ranks")
    seq_len: int = _opt(128, "tokens per sequence (<= the model's n_positions)")
    lr: float = _opt(1e-3, "peak learning rate (after warmup, cosine decay to min_lr)")
    min_lr: float = _opt(1e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _opt(20, "linear warmup steps (capped at steps)")
    weight_decay: float = _opt(0.1, "AdamW decoupled weight decay")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    grad_clip: float = _opt(1.0, "clip gradients to this global norm; 0 = off")
    grad_accum: int = _opt(1, "gradient accumulation micro-steps per optimizer step")
    seed: int = _opt(1337, "random seed (init, data order, dropout)")
    out_dir: str = _opt("out", "directory for checkpoints, metrics and summary.json")
    init_from: str = _opt("", "start from an mpirt checkpoint dir or HF GPT-2/Llama/Mixtral dir; empty = scratch")
    eval_only: bool = _opt(False, "evaluate the initial model and exit")
    eval_batches: int = _opt(8, "batches per evaluation")
    eval_interval: int = _opt(100, "evaluate every N steps; 0 = only at the end")
    log_interval: int = _opt(10, "log metrics every N steps")
    ckpt_interval: int = _opt(0, "also checkpoint every N steps; 0 = only by time and at the end")
    ckpt_minutes: float = _opt(30.0, "also checkpoint when this many minutes passed since the last save; 0 = off")
    keep_checkpoints: int = _opt(2, "checkpoint versions kept in OUT_DIR/ckpt (the newest K)")
    resume: str = _opt("", "'auto' = continue from OUT_DIR/ckpt when it holds a checkpoint, else start "
                           "fresh; empty = never (an OUT_DIR holding another run is refused)")
    overwrite: bool = _opt(False, "start afresh in an OUT_DIR that holds an earlier run (its files are removed)")
    stop_after: int = _opt(0, "end this run (with a checkpoint) after step N, as a job time limit "
                              "would; the LR schedule still spans --steps; 0 = run to --steps")
    steps_per_job: int = _opt(0, "train at most N steps in this job, counted from where it resumed; 0 = no limit")
    time_limit: str = _opt("", "stop with a checkpoint before this wall time ('3h50m', '90m', '1:30:00'; "
                               "'slurm' = the SLURM job's end time); empty = none")
    nan_policy: str = _opt("skip", "non-finite loss or gradient norm: " + "|".join(("skip", "stop")) +
                           " (skip = drop the update, warn, stop after max_skips in a row)")
    max_skips: int = _opt(10, "consecutive skipped steps after which the run stops (exit 3)")
    comm_timeout: float = _opt(-1.0, "seconds a collective or p2p may wait before the job is ended naming "
                                     "the operation; -1 = auto (300 s plus writing a checkpoint at 50 MB/s); "
                                     "0 = no timeout (a rank exiting alone still ends the job)")
    dtype: str = _opt("float32", "parameter, gradient and activation dtype: " + "|".join(DTYPES) + " (bfloat16, "
                                 "float16: float32 master weights, moments and reductions)")
    initial_loss_scale: float = _opt(65536.0, "float16: the dynamic loss scale's start (halved and the step "
                                              "skipped on an overflow)")
    loss_scale_window: int = _opt(2000, "float16: clean steps after which the loss scale doubles")
    backend: str = _opt("auto", "array backend: " + "|".join(BACKENDS) + " (auto = cupy if a GPU)")
    verify: bool = _opt(False, "before training, hold the layout to one rank on a few blocks of the model, as "
                               "python -m mpirt.verify does, and refuse to train (exit 2) when it differs")
    progress: bool = _opt(True, "show a progress bar on rank 0")
    monitor: bool = _opt(True, "per-step breakdown (compute, comm per axis, bubble, memory), stragglers, trace, "
                               "GPU sampling, TensorBoard; false = loss, time and MFU only")
    trace_steps: int = _opt(4, "steps written to OUT_DIR/trace.json (Chrome/Perfetto), from the run's second; 0 = none")
    peak_flops: float = _opt(0.0, "peak FLOP/s per rank for MFU; 0 = auto (GPU data sheet, CPU vendor-style, else "
                                  "measured on the training's GEMM path)")
    dp: int = _opt(0, "data-parallel size; 0 = world size / (tp * pp * cp)")
    tp: int = _opt(1, "tensor-parallel size")
    pp: int = _opt(1, "pipeline-parallel size")
    cp: int = _opt(1, "context-parallel size: each sequence split over cp ranks (2 chunks each, ring attention)")
    ep: int = _opt(1, "expert-parallel size (mixture of experts): the experts split over ep of the dp ranks, "
                      "tokens sent to them by all-to-all; divides dp and n_expert")
    sequence_parallel: bool = _opt(False, "with tp > 1: split LayerNorm/dropout regions along the sequence")
    zero: int = _opt(0, "ZeRO stage 0-3 (shard optimizer state / gradients / parameters)")
    microbatches: int = _opt(0, "pipeline microbatches per step; 0 = derive from pp")
    chunks: int = _opt(2, "virtual pipeline stages per rank for the interleaved schedule")
    schedule: str = _opt("1f1b", "pipeline schedule: " + "|".join(SCHEDULES))
    recompute: str = _opt("none", "activation recomputation: " + "|".join(RECOMPUTE) + " (full: each block's "
                                  "forward again in backward; selective: only its attention core), on the "
                                  "pipeline stages where it lowers the predicted peak")
    recompute_layers: str = _opt("", "blocks that recompute: global indices and ranges ('0-3,8'; a pipeline "
                                     "stage takes those it holds), whether or not it lowers the peak; empty = "
                                     "every block of the stages where it does")
    moe_imbalance: float = _opt(2.0, "mixture of experts under ep, dropless routing: the rows the busiest rank's "
                                     "experts run over the even share, as the memory prediction and --memory-budget "
                                     "plan for them (a capacity_factor bounds them instead)")
    memory_budget: str = _opt("auto", "per-rank memory budget ('1.5GiB', '800MB'): refuse a layout predicted not "
                                      "to fit, stop (exit 5) when a rank's measured peak exceeds it; auto = what the "
                                      "rank can have (the GPU's memory, else the node's available memory over its "
                                      "ranks), checked before training only; none (or 0) = no check")
    model_overrides: dict = field(default_factory=dict, metadata={
        "help": "model config fields overriding the model, from [model] / --model.<field>=value"})

    def to_dict(self) -> dict:
        """A JSON-able copy (for summary.json, checkpoint metadata and config_hash)."""
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Check value ranges and choices; raise ConfigError naming the first bad key."""
        def need(key: str, ok: bool, rule: str) -> None:
            if not ok:
                raise ConfigError(f"{key}: must be {rule}, got {getattr(self, key)!r}")

        need("steps", self.steps >= 1, ">= 1")
        need("batch_size", self.batch_size >= 1, ">= 1")
        need("seq_len", self.seq_len >= 1, ">= 1")
        need("lr", self.lr > 0, "> 0")
        need("min_lr", 0 <= self.min_lr <= self.lr, f"in [0, lr={self.lr}]")
        need("warmup_steps", self.warmup_steps >= 0, ">= 0")
        need("weight_decay", self.weight_decay >= 0, ">= 0")
        need("beta1", 0 <= self.beta1 < 1, "in [0, 1)")
        need("beta2", 0 <= self.beta2 < 1, "in [0, 1)")
        need("grad_clip", self.grad_clip >= 0, ">= 0 (0 = off)")
        need("grad_accum", self.grad_accum >= 1, ">= 1")
        need("batch_size", self.batch_size % self.grad_accum == 0,
             f"a multiple of grad_accum={self.grad_accum}")
        need("seed", self.seed >= 0, ">= 0")
        need("eval_batches", self.eval_batches >= 1, ">= 1")
        need("eval_interval", self.eval_interval >= 0, ">= 0 (0 = only at the end)")
        need("log_interval", self.log_interval >= 1, ">= 1")
        need("trace_steps", self.trace_steps >= 0, ">= 0 (0 = no trace)")
        need("peak_flops", self.peak_flops >= 0, ">= 0 (0 = auto)")
        need("ckpt_interval", self.ckpt_interval >= 0, ">= 0 (0 = only at the end)")
        need("stop_after", 0 <= self.stop_after <= self.steps, f"in [0, steps={self.steps}]")
        need("ckpt_minutes", self.ckpt_minutes >= 0, ">= 0 (0 = off)")
        need("keep_checkpoints", self.keep_checkpoints >= 1, ">= 1")
        need("resume", self.resume in RESUME, "one of " + ", ".join(map(repr, RESUME)))
        need("steps_per_job", self.steps_per_job >= 0, ">= 0 (0 = no limit)")
        need("nan_policy", self.nan_policy in NAN_POLICIES, "one of " + ", ".join(NAN_POLICIES))
        need("max_skips", self.max_skips >= 1, ">= 1")
        need("comm_timeout", self.comm_timeout >= 0 or self.comm_timeout == -1, ">= 0, or -1 for auto")
        if self.time_limit and self.time_limit != "slurm":
            try:
                parse_duration(self.time_limit)
            except ValueError as err:
                raise ConfigError(f"time_limit: {err}") from None
        need("dtype", self.dtype in DTYPES, "one of " + ", ".join(DTYPES))
        need("backend", self.backend in BACKENDS, "one of " + ", ".join(BACKENDS))
        need("initial_loss_scale", self.initial_loss_scale >= 1, ">= 1")
        need("loss_scale_window", self.loss_scale_window >= 1, ">= 1")
        need("dp", self.dp >= 0, ">= 0 (0 = derive from the world size)")
        need("tp", self.tp >= 1, ">= 1")
        need("pp", self.pp >= 1, ">= 1")
        need("cp", self.cp >= 1, ">= 1")
        need("ep", self.ep >= 1, ">= 1")
        need("zero", 0 <= self.zero <= 3, "in 0..3")
        need("moe_imbalance", self.moe_imbalance >= 1, ">= 1 (1: even routing)")
        need("microbatches", self.microbatches >= 0, ">= 0")
        need("chunks", self.chunks >= 1, ">= 1")
        try:  # an alias (zb, interleaved-1f1b, ...) is stored as its canonical name
            self.schedule = _canonical_schedule(self.schedule)
        except ScheduleError:
            need("schedule", False, "one of " + ", ".join(SCHEDULES))
        need("recompute", self.recompute in RECOMPUTE, "one of " + ", ".join(RECOMPUTE))
        for key, parse in (("recompute_layers", parse_layers), ("memory_budget", explicit_budget)):
            try:
                parse(getattr(self, key))
            except ValueError as err:
                raise ConfigError(f"{key}: {err}") from None
        check_model_values(self.model_overrides, prefix="model.")


def parse_duration(text: str) -> float:
    """Seconds in a wall-time string: ``3h50m``, ``90m``, ``45s``, ``1.5h``, ``2d`` (units may be
    combined), ``HH:MM:SS``, ``MM:SS`` or plain seconds. ValueError names the text."""
    t = text.strip().lower()
    try:
        if ":" in t:
            parts = [float(x) for x in t.split(":")]
            if len(parts) > 3:
                raise ValueError
            seconds = sum(v * 60 ** i for i, v in enumerate(reversed(parts)))
        elif t and t[-1].isdigit():
            seconds = float(t)
        else:
            units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
            seconds, number = 0.0, ""
            for ch in t:
                if ch in units and number:
                    seconds, number = seconds + float(number) * units[ch], ""
                elif ch.isdigit() or ch == ".":
                    number += ch
                else:
                    raise ValueError
            if number:
                raise ValueError
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a duration (e.g. 3h50m, 90m, 1:30:00)") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{text!r} is not a positive duration")
    return seconds


_TYPES = {k: t for k, t in field_types(TrainConfig).items() if k != "model_overrides"}


def _assign(values: dict, model: dict, key: str, value, *, text: bool, where: str = "") -> None:
    """Store one override under its TrainConfig field or, for ``model.<field>``, in ``model``."""
    if key in _TYPES:
        values[key] = convert_value(key, value, _TYPES[key], text=text, where=where)
    elif key == "model.name":
        values["model"] = convert_value(key, value, str, text=text, where=where)
    elif key.startswith("model.") and key[6:] in modeling.config_fields():
        model[key[6:]] = convert_value(key, value, modeling.config_fields()[key[6:]], text=text, where=where)
    else:
        known = [*_TYPES, "model.name", *(f"model.{k}" for k in modeling.config_fields())]
        raise unknown_key_error(key, known, where)


def _load_toml(path: str, values: dict, model: dict) -> None:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    where = f" (in {path})"
    for key, value in data.items():
        if key == "model" and isinstance(value, dict):
            for sub, v in value.items():
                _assign(values, model, f"model.{sub}", v, text=False, where=where)
        else:
            _assign(values, model, key, value, text=False, where=where)


def help_text() -> str:
    """The --help text: every key with its default and description."""
    lines = ["usage: python -m mpirt.train [CONFIG.toml] [--key=value | --key value | --flag] ...",
             "", "Keys (command line > CONFIG.toml > default; '-' and '_' are alike; bools accept",
             "bare --flag, true/false, 1/0, yes/no, on/off):", ""]
    for f in dataclasses.fields(TrainConfig):
        if f.name == "model_overrides":
            continue
        default = json.dumps(f.default)
        lines.append(f"  --{f.name:<17} {default:<10} {f.metadata['help']}")
    fields = textwrap.fill(", ".join(modeling.config_fields()), 96, initial_indent=" " * 4,
                           subsequent_indent=" " * 4)
    lines += ["", "  --model.<field>=VALUE  override one model field (or a [model] table in the",
              "                         TOML file; --model.name=X is --model=X). Fields:", fields]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Build a validated TrainConfig from ``[CONFIG.toml] [overrides...]`` (default: sys.argv).

    ``-h``/``--help`` prints help_text() and exits 0. Raises ConfigError naming the bad key.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        raise SystemExit(0)
    values: dict = {}
    model: dict = {}
    if argv and not argv[0].startswith("-"):
        _load_toml(argv.pop(0), values, model)
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"{arg}: unexpected argument (CONFIG.toml must come first; "
                              "overrides are --key=value or --key value)")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            if _TYPES.get(key) is bool:  # bare flag = true, unless a bool word follows
                nxt = argv[i].lower() if i < len(argv) else ""
                value, i = (argv[i], i + 1) if nxt in TRUE_WORDS + FALSE_WORDS else ("true", i)
            elif i < len(argv):
                value, i = argv[i], i + 1
            else:
                raise ConfigError(f"{key}: missing value (use --{key}=VALUE)")
        _assign(values, model, key, value, text=True)
    cfg = TrainConfig(**values, model_overrides=model)
    cfg.validate()
    return cfg


def config_hash(cfg: TrainConfig | dict) -> str:
    """A stable sha256 hex digest of the canonical JSON of ``cfg`` (a TrainConfig or its dict)."""
    d = cfg.to_dict() if isinstance(cfg, TrainConfig) else cfg
    blob = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def diff_configs(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Sorted dotted names of the keys whose values differ between ``a`` and ``b``
    (present in only one counts as differing), e.g. ``["lr", "model_overrides.n_layer"]``."""
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, dataclasses.MISSING), b.get(key, dataclasses.MISSING)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += diff_configs(va, vb, f"{prefix}{key}.")
        elif va != vb or type(va) is not type(vb):
            out.append(prefix + key)
    return out
