"""The training script's set-up (:mod:`mpirt.run.train`): the pre-flight checks and decisions
before any rank builds a model (the layout, the model and its weights, the data, the output
directory, a resume's compatibility, the resources), and the banner. Everything here refuses in
one line naming the key (:data:`PREFLIGHT_ERRORS`); :mod:`mpirt.verify` builds its sides with the
same helpers.
"""
from __future__ import annotations

import dataclasses
import errno
import math
import os
from pathlib import Path

import mpirt.core.backend as B
from mpirt.checkpoint.store import CheckpointError, looks_like_checkpoint, read_checkpoint_meta, verify_checkpoint
from mpirt.core.modeling import (apply_overrides, check_config, config_from_dict, load_model_config, missing_model_file,
                                 model_label, num_parameters, open_hf)
from mpirt.core.precision import is_half
from mpirt.cpu import blas, kernels
from mpirt.data.tokens import MetaError, TokenDataset, default_dataset_dir, num_eval_batches
from mpirt.parallel.layout import Layout, LayoutError
from mpirt.plan.memory import recompute_where_it_pays
from mpirt.core.settings import format_size
from mpirt.run import jobctl, startup
from mpirt.run.config import ConfigError


def plan_layout(cfg, world_size: int, model_cfg=None) -> Layout:
    """The run's :class:`~mpirt.parallel.layout.Layout` (pure: no communication), refusing
    impossible layouts (ConfigError naming the key). With the model: the one object the runtime
    is built from, its stages, and recomputation only where it lowers the peak
    (:func:`mpirt.plan.memory.recompute_where_it_pays`)."""
    try:
        layout = Layout.resolve(cfg, world_size, model_cfg)
    except LayoutError as err:
        raise ConfigError(str(err)) from None
    return layout if model_cfg is None else recompute_where_it_pays(cfg, model_cfg, layout)


# --model.* keys that must equal the loaded model's: they set tensor shapes, or (initializer_range)
# only the initial weights, which init_from replaces; the others (dropout rates,
# layer_norm_epsilon) change no loaded tensor and apply on top of it
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)   # a write failed for want of space or quota
PROBE_BYTES = 64 << 10   # what check_out_dir writes: a disk without this much free is full
# what a rank may find wrong before training: agreed on by every rank, one line, exit 2 (OSError: a
# file that this rank's node cannot read)
PREFLIGHT_ERRORS = (ConfigError, OSError, ValueError, jobctl.DirectoryLocked)
FIXED_BY_WEIGHTS = ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size", "n_inner", "model_type",
                    "initializer_range", "n_kv_head", "n_expert")
# what a shape field means where None stands for a derived value (n_inner: 4 C or 8/3 C; n_kv_head: n_head)
EFFECTIVE = {"n_inner": lambda c: c.hidden, "n_kv_head": lambda c: c.n_kv_head or c.n_head}


def resolve_model(cfg) -> tuple[object, object | None, bool]:
    """Model config, a reader of the initial weights in a HF directory (or None), and whether
    ``init_from`` is an mpirt checkpoint (weights, optimizer state and step are then loaded from it).

    The HF reader (:func:`mpirt.core.modeling.open_hf`) has checked every config.json field and
    every tensor (name, shape, dtype, finite values; a stored head compared with the table); the
    engine has each rank read its own boxes (``engine.load_sharded(reader, with_optimizer=False)``).

    A checkpoint is verified end to end here (checksums included), before any collective, so a
    damaged one is refused in one line naming the file. With ``init_from``, ``--model.*``
    overrides of :data:`FIXED_BY_WEIGHTS` are refused unless equal to the loaded value; the rest
    apply, and the returned config (what the checkpoints record) includes them.
    """
    source = cfg.init_from
    if not source:
        return load_model_config(cfg.model, cfg.model_overrides), None, False
    path = Path(source)
    if looks_like_checkpoint(path):
        try:
            meta = verify_checkpoint(path)
        except (CheckpointError, FileNotFoundError) as err:
            raise startup.damaged_checkpoint(path, err) from None
        try:
            loaded, weights, resume = config_from_dict(meta["extra"]["model_config"]), None, True
        except (KeyError, TypeError) as err:
            raise ConfigError(f"init_from: {meta['path']}/meta.json holds no usable extra.model_config "
                              f"({err!r})") from None
    elif (path / "config.json").is_file():
        (loaded, weights), resume = open_hf(path, dtype=cfg.dtype), False
    else:
        raise ConfigError(f"init_from: {source} is neither an mpirt checkpoint (no {path / 'latest'} or "
                          f"{path / 'meta.json'}) nor a Hugging Face GPT-2, Llama or Mixtral directory (no {path / 'config.json'})")
    changed = apply_overrides(loaded, cfg.model_overrides)
    for key in FIXED_BY_WEIGHTS:
        before, after = getattr(loaded, key, None), getattr(changed, key, None)
        value = EFFECTIVE.get(key, lambda c: getattr(c, key, None))
        if key in cfg.model_overrides and value(loaded) != value(changed):
            raise ConfigError(f"model.{key}: {source} holds {key}={before!r}, the override asks for {after!r}; "
                              f"it cannot change with --init-from (drop the override or start from scratch)")
    try:
        check_config(changed)  # an override the loaded architecture refuses (top_k above its experts)
    except ValueError as err:
        raise ConfigError(f"model.{err}") from None
    return changed, weights, resume


def check_fit(cfg, model_cfg, data: TokenDataset) -> list[str]:
    """Refuse a run whose data does not fit the model (its vocabulary, a validation batch), naming
    the numbers; returns notes for the start-up lines (a split whose ids are checked as it is
    read). What the layout refuses of the model :func:`plan_layout` has said."""
    if data.vocab_size is not None and data.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"data: vocabulary {data.vocab_size} of {data.directory} exceeds the model's "
                          f"vocab_size {model_cfg.vocab_size}")
    if num_eval_batches(data.val, cfg.batch_size, cfg.seq_len) < 1:
        raise ConfigError(f"data: the validation split of {data.directory} holds no batch of {cfg.batch_size} x "
                          f"{cfg.seq_len} tokens to evaluate on")
    return data.check_ids(model_cfg.vocab_size)  # last: it may read a small split without a record


def open_dataset(directory: str) -> TokenDataset:
    """The dataset of ``--data`` (the built-in corpus when empty); a folder that is not a
    prepared dataset is refused naming the key and the command that prepares one."""
    try:
        return TokenDataset(directory or default_dataset_dir())
    except MetaError as err:                   # a prepared dataset with a damaged meta.json
        raise ConfigError(f"data: {err}") from None
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"data: {err} ({directory} is not a prepared dataset: make one from a folder of text "
                          f"files with `python -m mpirt.data prepare SRC_DIR OUT_DIR`)") from None


def fit_eval_batches(cfg, data: TokenDataset):
    """``cfg`` with ``eval_batches`` lowered to what the validation split holds, and the warning
    to print (None when it fits): a small dataset needs no flag lowered by hand."""
    available = num_eval_batches(data.val, cfg.batch_size, cfg.seq_len)
    if cfg.eval_batches <= available:
        return cfg, None
    return dataclasses.replace(cfg, eval_batches=available), (
        f"mpirt: warning: eval_batches {cfg.eval_batches}: the validation split of {data.directory} holds "
        f"{available} batches of {cfg.batch_size} x {cfg.seq_len} tokens; evaluating on {available}")


def vocab_from_data(cfg, model_cfg, data: TokenDataset, tp: int):
    """A model trained from scratch takes its vocabulary size from the dataset's meta.json unless
    ``--model.vocab_size`` is given: the dataset's size rounded up to a multiple of 64 (fast
    GEMM shapes, as nanoGPT pads GPT-2's 50257 to 50304) and of tp (whole vocabulary shards)."""
    if "vocab_size" in cfg.model_overrides or not data.vocab_size:
        return model_cfg
    step = math.lcm(64, tp)
    return dataclasses.replace(model_cfg, vocab_size=-(-data.vocab_size // step) * step)


def host_heap(cfg) -> bool:
    """Whether the run's arrays will live in the host heap (NumPy: ``--backend numpy``, or ``auto``
    without a GPU), before the backend is set up: what the memory prediction models then."""
    return cfg.backend == "numpy" or (cfg.backend == "auto" and not B.cupy_available())


def comm_timeout(cfg, model_cfg) -> float:
    """The watchdog's timeout in training: ``--comm-timeout``, or for -1 (auto) 300 s plus the time
    rank 0 may spend writing a checkpoint (weights and both AdamW moments at 50 MB/s) while the
    others wait for it in their next collective (the pre-flight's: :func:`startup.preflight_timeout`)."""
    if cfg.comm_timeout >= 0:
        return cfg.comm_timeout
    return 300.0 + 3 * num_parameters(model_cfg) * (8 if cfg.dtype == "float64" else 4) / 50e6


def check_resources(cfg, data: TokenDataset) -> None:
    """Refuse, before any collective, a run the machine or the data cannot carry: a GPU backend
    without a usable GPU, a training split too short for one sequence."""
    if cfg.backend == "cupy" and not B.cupy_available():
        raise ConfigError("backend: cupy was asked for, but CuPy is not installed or sees no usable GPU here "
                          "(use --backend numpy, or auto to pick CuPy only when a GPU is there)")
    if len(data.train) < cfg.seq_len + 1:
        raise ConfigError(f"data: {data.directory / 'train.bin'} holds {len(data.train)} tokens, fewer than one "
                          f"sequence of seq_len {cfg.seq_len} + 1")


def run_evidence(out: Path) -> str | None:
    """What in ``out`` shows an earlier run (a checkpoint, a summary, metrics), or None."""
    for name in ("ckpt", "summary.json", "metrics"):
        if (out / name).exists():
            return "a checkpoint" if name == "ckpt" and looks_like_checkpoint(out / name) else name
    return None


def plan_out_dir(cfg, out: Path):
    """How this run uses ``out`` (pure, read-only): returns ``cfg``, with ``init_from`` pointing at
    ``out/ckpt`` when ``--resume auto`` finds a checkpoint there (a damaged one too: it is then
    refused by name, never replaced by a fresh run). Refuses to start a new run over an earlier
    one unless ``--overwrite`` (or the run resumes its own checkpoint)."""
    ckpt = out / "ckpt"
    if cfg.resume == "auto":  # the one flag a requeued job needs: continue, or start afresh
        return dataclasses.replace(cfg, init_from=str(ckpt)) if looks_like_checkpoint(ckpt) else cfg
    found = run_evidence(out)
    source = Path(cfg.init_from).resolve() if cfg.init_from else None   # the run's own checkpoint, or one of its versions
    resumes_own = source is not None and (source == out.resolve() or ckpt.resolve() in (source, *source.parents))
    if found and not cfg.overwrite and not resumes_own:
        raise ConfigError(f"out_dir: {out} holds an earlier run ({found}); pass --resume auto to continue it, "
                          f"--overwrite to replace it, or another --out-dir")
    return cfg


def check_out_dir(out: Path) -> None:
    """Refuse, before step 1 (and before rank 0 takes the run's lock), an ``--out-dir`` that cannot
    be created or written by this rank, or whose disk is full: its checkpoints, metrics and summary
    all go there, and a run must not end at its first save. The folder is made if missing; a probe
    of :data:`PROBE_BYTES` is written, synced and removed."""
    probe = out / f".write-probe-{os.uname().nodename}-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(bytes(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        if err.errno in DISK_FULL:
            raise ConfigError(f"out_dir: {out} is full ({err.strerror}): free space there or use another "
                              f"--out-dir") from None
        raise ConfigError(f"out_dir: cannot write to {out} ({err.strerror or err})") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:  # the folder itself could not be made
            pass


def check_resume(cfg, meta: dict, data_dir: Path) -> None:
    """Refuse a ``--resume auto`` that would not continue the run it resumes: another model preset,
    dtype or dataset than the checkpoint's (model shapes are checked by :func:`resolve_model`)."""
    saved = meta.get("config") or {}
    conflicts = {k: (saved[k], getattr(cfg, k)) for k in ("model", "dtype") if saved.get(k, getattr(cfg, k)) != getattr(cfg, k)}
    saved_data = (meta.get("extra") or {}).get("data")
    if saved_data is not None and Path(saved_data).resolve() != data_dir.resolve():
        conflicts["data"] = (saved_data, str(data_dir))
    if conflicts:
        details = "; ".join(f"{k}: checkpoint {old!r}, now {new!r}" for k, (old, new) in conflicts.items())
        raise ConfigError(f"resume: {meta['path']} was trained with another configuration ({details}); "
                          f"use another --out-dir for a new run")


def check_resumed_model(cfg, resumed, data: TokenDataset) -> None:
    """Refuse a ``--resume auto`` whose model as ``--model`` and its overrides give it now differs
    from the checkpoint's (an edited TOML would otherwise resume as the old model, silently),
    naming each field. The vocabulary is not compared where the dataset sets it; a model file
    that no longer exists leaves the checkpoint's model as it is. Only for a run whose model was
    built from ``--model`` (the caller checks the checkpoint's ``model_source``)."""
    if missing_model_file(cfg.model):
        return
    now = load_model_config(cfg.model, cfg.model_overrides)
    mine, saved = dataclasses.asdict(now), dataclasses.asdict(resumed)
    if data.vocab_size and "vocab_size" not in cfg.model_overrides:
        mine.pop("vocab_size", None)
    fields = sorted(k for k in mine.keys() | saved.keys() if mine.get(k, saved.get(k)) != saved.get(k, mine.get(k)))
    if fields:
        details = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {mine.get(k)!r}" for k in fields)
        raise ConfigError(f"resume: model {cfg.model} is not the model of the checkpoint ({details}); use another "
                          f"--out-dir for a new run, or --init-from to start the new model from these weights")


def banner(ctx, cfg, layout: Layout, model_cfg, data, out: Path, start_step: int, end_step: int,
           engine_name: str, predicted_peak: int, model_source: str | None = None) -> str:
    """The start-up lines on rank 0: enough to see a wrong launch before a long run starts.
    ``model_source``: what built the model (the checkpoint's record), so that weights imported from
    Hugging Face are named as such, not as the ``--model`` default."""
    launch = jobctl.launcher_info()
    where = f"resuming {cfg.init_from} at step {start_step}" if start_step else "fresh start"
    stops = []
    if cfg.ckpt_interval:
        stops.append(f"every {cfg.ckpt_interval} steps")
    if cfg.ckpt_minutes:
        stops.append(f"every {cfg.ckpt_minutes:g} min")
    timeout = comm_timeout(cfg, model_cfg)
    half = is_half(cfg.dtype) and " with float32 master weights, AdamW moments and reductions" + (
        f"; loss scale from {cfg.initial_loss_scale:g}, doubled after {cfg.loss_scale_window} steps without overflow"
        if cfg.dtype == "float16" else "")
    lines = [
        f"mpirt: world_size {ctx.size}, launched by {launch['name']}"
        + (f" over {launch['pmi']}" if launch["pmi"] != "none" else "") + f"; layout {layout.describe()}",
        f"mpirt: backend {ctx.backend}; communication by {engine_name}; {ctx.threads} thread(s) per rank, OpenBLAS "
        f"{ctx.blas_threads if ctx.blas_threads is not None else 'not found'}: {ctx.blas_note}; a stuck call ends "
        f"the job " + (f"after {timeout:.0f} s" if timeout else "never (watchdog off)"),
        *([f"mpirt: GEMM {blas.describe()}; kernels {kernels.describe()}"] if ctx.backend == "numpy" else []),
        f"mpirt: model {model_label(cfg.model, model_source, model_cfg.model_type)}: "
        f"{num_parameters(model_cfg) / 1e6:.2f}M parameters, {model_cfg.n_layer} layers, n_embd {model_cfg.n_embd}, "
        f"vocab {model_cfg.vocab_size}; {cfg.dtype}" + (half or ""),
        f"mpirt: data {data.directory}: train {len(data.train):,} tokens, val {len(data.val):,}; "
        f"batch {cfg.batch_size} x {cfg.seq_len}",
        f"mpirt: memory: predicted peak {format_size(predicted_peak)} on the largest rank, budget "
        f"{cfg.memory_budget or 'none'}; recompute {cfg.recompute}"
        + (f" on blocks {cfg.recompute_layers}" if cfg.recompute_layers and cfg.recompute != "none" else "")
        + _recompute_skipped(layout),
        f"mpirt: out {out}: {where}, steps {start_step} -> {end_step} of {cfg.steps}; checkpoint "
        f"{', '.join(stops) or 'at the end'}, keep {cfg.keep_checkpoints}"
        + (f"; time limit {cfg.time_limit}" if cfg.time_limit else ""),
    ]
    return "\n".join(lines)


def _recompute_skipped(layout: Layout) -> str:
    """The banner's note on the pipeline stages where recomputation would not lower the peak and
    so does not run (:func:`mpirt.plan.memory.recompute_where_it_pays` left them out of ``layout``)."""
    stages = sorted({layout.pipeline_rank(i) for i in layout.recompute_unpaid})
    if not stages:
        return ""
    if len(stages) == layout.pp:
        return ", skipped: it would not lower the peak"
    return f", not on pp stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))}: it would not lower the peak there"



def last_checkpoint(out: Path) -> str:
    """What an error says of the run's newest complete checkpoint under ``out``."""
    try:
        return f"the last complete checkpoint is step {read_checkpoint_meta(out / 'ckpt')['step']}"
    except (CheckpointError, OSError):
        return "no checkpoint was written"

