"""Train a model: ``[mpiexec -n N] python -m mpirt.train [CONFIG.toml] [--key=value ...]``.

One linear script, nanoGPT style: configure, check the layout, load data and model, shard it over
the dp x pp x tp grid, loop over optimizer steps (each ``grad_accum`` micro-batches of the global
batch), evaluate, checkpoint, summarise. ``python -m mpirt.train --help`` lists every key.
Everything that can be refused is refused before training, in one line naming the key (and the
rank): every rank reaches the same agreements whatever failed (:mod:`mpirt.run.startup`).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

import mpirt.core.backend as B
from mpirt import comm
from mpirt.cpu import blas, kernels
from mpirt.run import faults, health, jobctl, startup
from mpirt.checkpoint.store import (CheckpointError, CheckpointReader, looks_like_checkpoint,
                                    read_checkpoint_meta, verify_checkpoint)
from mpirt.checkpoint.sharded import save_sharded
from mpirt.run.config import ConfigError, parse_args, parse_duration
from mpirt.data.tokens import DataError, MetaError, TokenDataset, default_dataset_dir, get_batch, get_eval_batch, num_eval_batches
from mpirt.run.distributed import init_distributed, input_fingerprint
from mpirt.parallel.grid import Grid
from mpirt.plan.budget import available_budget
from mpirt.plan.memory import (busiest_expert_bound, check_budget, decode_over_budget, expert_load_bound,
                               explicit_budget, format_size, measured_baseline, over_budget_flag, predict, recompute_where_it_pays)
from mpirt.monitor.live import Metrics, Progress, RunMonitor, format_seconds, monitor_lines, tensorboard_writer_class
from mpirt.monitor.steps import owned_bytes
from mpirt.core.optim import cosine_lr
from mpirt.core.precision import LossScaler, is_half
from mpirt.parallel.engine import Engine
from mpirt.parallel.layout import Layout, LayoutError
from mpirt.parallel.preflight import check_step
from mpirt.plan import format_lines as prediction_lines, self_check
from mpirt.core.modeling import apply_overrides, check_config, config_from_dict, flops_per_token, load_model_config, \
    missing_model_file, model_label, num_parameters, open_hf


def plan_layout(cfg, world_size: int) -> Layout:
    """The run's :class:`~mpirt.parallel.layout.Layout` (pure: no communication), refusing
    impossible layouts (ConfigError naming the key)."""
    try:
        return Layout.resolve(cfg, world_size)
    except LayoutError as err:
        raise ConfigError(str(err)) from None


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


def check_fit(cfg, model_cfg, data: TokenDataset, layout: dict) -> list[str]:
    """Refuse a run whose data, sequence length or tp does not fit the model, naming the numbers;
    returns notes for the start-up lines (a split whose ids are checked as it is read)."""
    try:
        Layout.of(cfg, layout).check_model(cfg, model_cfg)
    except LayoutError as err:
        raise ConfigError(str(err)) from None
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


def evaluate(engine, tokens, grid, *, batches: int, batch_size: int, seq_len: int) -> float:
    """Mean loss over the first ``batches`` x ``batch_size`` consecutive windows of ``tokens``,
    each dp rank taking its rows of every batch; the same number on any layout."""
    total = 0.0
    for i in range(batches):
        x, y = get_eval_batch(tokens, i, batch_size=batch_size, seq_len=seq_len,
                              dp_rank=grid.coords["dp"], dp_size=grid.sizes["dp"])
        total += engine.evaluate(x, y)
    return total / batches


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
        + _recompute_skipped(cfg, model_cfg, layout),
        f"mpirt: out {out}: {where}, steps {start_step} -> {end_step} of {cfg.steps}; checkpoint "
        f"{', '.join(stops) or 'at the end'}, keep {cfg.keep_checkpoints}"
        + (f"; time limit {cfg.time_limit}" if cfg.time_limit else ""),
    ]
    return "\n".join(lines)


def _recompute_skipped(cfg, model_cfg, layout: Layout) -> str:
    """The banner's note on the pipeline stages where recomputation would not lower the peak and
    so does not run (:func:`mpirt.plan.memory.recompute_where_it_pays` left them out of ``layout``)."""
    picked = Layout.of(cfg, layout, model_cfg).recomputed
    stages = sorted({layout.pipeline_rank(i) for i in set(picked) - set(layout.recomputed)})
    if not stages:
        return ""
    if len(stages) == layout.pp:
        return ", skipped: it would not lower the peak"
    return f", not on pp stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))}: it would not lower the peak there"


def main(argv=None) -> dict:
    startup.end_on_signal()  # a TERM before training ends the process, even one waiting inside MPI
    comm.install_abort_on_error()
    world = comm.world()
    # watched before anything can fail on one rank: every rank reaches the agreements below, and a
    # rank stalled in the pre-flight (data, checksums) or exiting is named instead of waited for
    comm.start_watchdog(startup.preflight_timeout())
    started = time.time()
    error, lock, cfg, pin = None, None, None, None
    try:
        cfg = parse_args(argv)
        comm.start_watchdog(startup.preflight_timeout(cfg))
        mismatch = jobctl.launch_mismatch(world.size, library=comm.library_version())
        if mismatch:  # each singleton would print it: only the launcher's first task speaks
            if os.environ.get("SLURM_PROCID", "0") == "0":
                print(f"error: {mismatch}", file=sys.stderr)
            sys.exit(jobctl.EXIT_REFUSED)
        layout = plan_layout(cfg, world.size)
        out = Path(cfg.out_dir)
        if not cfg.eval_only:
            cfg = plan_out_dir(cfg, out)
        check_out_dir(out)
        if world.rank == 0:
            pin = startup.pin_checkpoint(cfg.init_from)  # `latest` read once, for every rank
    except PREFLIGHT_ERRORS as err:
        error = str(err)
    startup.refuse_if_any(comm.first_error(error), world.rank)  # the first agreement, whatever failed
    pin = comm.world_comm().broadcast_object(pin)
    try:
        cfg = startup.follow_pin(cfg, pin)
        comm.start_watchdog(startup.preflight_timeout(cfg, pin))
        data = open_dataset(cfg.data)
        model_cfg, hf_weights, resume = resolve_model(cfg)
        if not (resume or hf_weights is not None):
            model_cfg = vocab_from_data(cfg, model_cfg, data, layout["tp"])
        notes = [f"mpirt: data: {note}" for note in check_fit(cfg, model_cfg, data, layout)]
        # the step's communication (pipeline, ring attention, ZeRO-3 gathers) proven consistent: each
        # rank checks its own program against its stage's, and the stages' together
        check_step(recompute_where_it_pays(cfg, model_cfg, Layout.of(cfg, layout, model_cfg)), model_cfg,
                   cfg.seq_len, np.dtype(cfg.dtype).itemsize, rank=world.rank)
        cfg, eval_warning = fit_eval_batches(cfg, data)
        for line in notes + ([eval_warning] if eval_warning else []):
            if world.rank == 0:
                print(line, file=sys.stderr, flush=True)
        check_resources(cfg, data)
        resumed_meta = read_checkpoint_meta(cfg.init_from) if resume else None
        # what built the model in the first place (kept across resumes): --model, or weights it started from
        model_source = ((resumed_meta.get("extra") or {}).get("model_source") if resume
                        else f"init_from {cfg.init_from}" if cfg.init_from else cfg.model)
        if resume and cfg.resume == "auto":
            check_resume(cfg, resumed_meta, data.directory)
            if model_source == cfg.model:
                check_resumed_model(cfg, model_cfg, data)
        deadline = jobctl.Deadline.from_config(cfg.time_limit, started, parse_duration)
        if world.rank == 0 and not cfg.eval_only:
            lock = jobctl.acquire_lock(out)
    except PREFLIGHT_ERRORS as err:
        error = str(err)
    failed = comm.first_error(error)  # every rank stops if any rank found a problem
    if failed is None:
        # each rank's process as it stands before the model is built: the baselines of the predictions
        if world.rank == 0 and cfg.monitor:
            tensorboard_writer_class()  # rank 0's writer: imported now, it is counted in its baseline
        # and what each can have: the budget of --memory-budget auto (the default)
        mine = (measured_baseline(), available_budget(cfg.backend, world.local_rank, world.local_size)
                if cfg.memory_budget.strip().lower() == "auto" else None)
        baselines, available = (list(x) for x in zip(*comm.world_comm().allgather_object(mine)))
        try:
            check_budget(cfg, model_cfg, layout, world.size, baselines=baselines, available=available,
                         host_heap=host_heap(cfg))
        except ValueError as err:  # the same on every rank: they all hold the same baselines
            failed = (0, str(err))
    startup.refuse_if_any(failed, world.rank, lock)
    try:
        return train(cfg, layout, model_cfg, hf_weights, resume, data, deadline, out, started, model_source,
                     baselines)
    except DataError as err:  # an id out of the vocabulary, or a token file changed under the job
        sys.stderr.write(f"error: rank {world.rank}: {err}; {last_checkpoint(out)}\n")
        sys.stderr.flush()
        sys.exit(jobctl.EXIT_REFUSED)
    except OSError as err:
        if err.errno not in DISK_FULL:
            raise
        # metrics, summary, trace: one line from the rank that hit it (the abort hook ends the job)
        sys.stderr.write(f"error: rank {world.rank}: out of disk space writing {err.filename or 'a file'} "
                         f"({err.strerror}); {last_checkpoint(out)}\n")
        sys.stderr.flush()
        sys.exit(1)
    finally:
        if lock is not None:
            jobctl.release_lock(lock)


def last_checkpoint(out: Path) -> str:
    """What an error says of the run's newest complete checkpoint under ``out``."""
    try:
        return f"the last complete checkpoint is step {read_checkpoint_meta(out / 'ckpt')['step']}"
    except (CheckpointError, OSError):
        return "no checkpoint was written"


def train(cfg, layout, model_cfg, hf_weights, resume, data, deadline, out: Path, started: float,
          model_source: str | None = None, baselines: list[int] | None = None) -> dict:
    """Everything after the pre-flight checks (begun at ``started``, epoch seconds): set up, train,
    checkpoint, summarise. ``model_source`` (``--model``, or ``init_from PATH``: what built the
    model first) is recorded in the checkpoints, so a later resume knows what to compare;
    ``baselines``: every rank's process before the model was built (:func:`measured_baseline`),
    the baselines of the memory predictions (None: :data:`mpirt.plan.memory.PROCESS_BYTES`)."""
    try:  # all ranks: the same config, and the same contents behind its paths
        ctx = init_distributed(cfg.seed, cfg.backend,
                               config={**cfg.to_dict(), "inputs": input_fingerprint(cfg, data.directory)})
    except ConfigError as err:  # raised alike on every rank: one line, as for the pre-flight errors
        if comm.world().rank == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(jobctl.EXIT_REFUSED)
    comm.start_watchdog(comm_timeout(cfg, model_cfg))  # a stuck call, or a rank exiting alone, ends the job
    if cfg.verify:  # the layout held to one rank first; exits 2 when it differs
        from mpirt.verify.cli import verify_before_training  # here: mpirt.verify imports this module
        verify_before_training(cfg, model_cfg, data.train, comm.world_comm())
    # the final config's, with the model's stages and the blocks that recompute
    layout = recompute_where_it_pays(cfg, model_cfg, Layout.of(cfg, layout, model_cfg))
    grid = Grid(layout["dp"], layout["pp"], layout["tp"], cp=layout["cp"], ep=layout["ep"])
    dp = grid.sizes["dp"]
    is_main = ctx.rank == 0
    world_comm = ctx.comm
    baselines = baselines or [None] * ctx.size

    def predictions(loads=None, busiest=None) -> list[dict]:  # every rank's, as the end block's model check
        # counts them; ``loads``, ``busiest``: each rank's measured expert load and busiest expert's (None:
        # the bounds the budget is checked against)
        return [predict(cfg, model_cfg, layout, r, process_bytes=baselines[r], expert_load=loads[r] if loads else None,
                        busiest_expert=busiest[r] if busiest else None, host_heap=B.name == "numpy")
                for r in range(ctx.size)]

    def predicted_peaks(loads=None) -> list[int]:
        return [p["peak"] for p in predictions(loads)]

    B.limit_pool(explicit_budget(cfg.memory_budget))  # on a GPU the pool itself holds an explicit budget
    # one dropout seed for every rank: the masks depend on each element's place in the global batch
    engine = Engine(cfg, model_cfg, grid, dropout_seed=ctx.rank_seed("dropout", rank=0), layout=layout)
    optimizer = engine.optimizer
    scaler = LossScaler(cfg.initial_loss_scale, cfg.loss_scale_window) if cfg.dtype == "float16" else None
    start_step = 0
    if hf_weights is not None:
        engine.load_sharded(hf_weights, with_optimizer=False)  # this rank's boxes of the HF files only
    if resume:
        reader = CheckpointReader(cfg.init_from, verify=False)  # checksums: verified in resolve_model
        meta = reader.meta
        engine.load_sharded(reader, with_optimizer=meta["optimizer"] is not None)  # only this rank's boxes
        if scaler is not None:
            scaler.load_state_dict((meta["optimizer"] or {}).get("scalars", {}))
        start_step = meta["step"]
        if is_main and not health.version_good(meta, dtype=cfg.dtype):   # a resume that replays a divergence
            advice = health.resume_advice(Path(meta["path"]).parent, dtype=cfg.dtype)
            print(f"mpirt: warning: {cfg.init_from} (step {start_step}) was saved after the loss left its recent "
                  f"range; {advice}", file=sys.stderr, flush=True)
    summary_layout = dict(grid.sizes)

    eval_seconds = {"last": None}   # how long the last evaluation took (the deadline counts the next ones)

    def eval_loss() -> float:
        t0 = time.time()
        loss = evaluate(engine, data.val, grid, batches=cfg.eval_batches, batch_size=cfg.batch_size,
                        seq_len=cfg.seq_len)
        eval_seconds["last"] = time.time() - t0
        return loss

    def evaluates(n: int) -> bool:
        """Whether step ``n`` ends with an evaluation (the run's last step always does)."""
        return n == end_step or bool(cfg.eval_interval) and n % cfg.eval_interval == 0

    def evaluation_time(n: int, step_s: float) -> float:
        """Seconds the evaluations after step ``n`` and after the next will take: the last one's
        time, or before any, half a training step per batch (a forward pass over as many tokens)."""
        each = eval_seconds["last"] if eval_seconds["last"] is not None else cfg.eval_batches * step_s / 2
        return each * (evaluates(n) + evaluates(n + 1))

    if cfg.eval_only:
        val_loss = eval_loss()
        result = {"val_loss": val_loss, "step": start_step, "eval_batches": cfg.eval_batches,
                  "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "init_from": cfg.init_from}
        if is_main:
            print(json.dumps(result))
            _write_json(out / "eval.json", result)
        return result

    end_step = min(cfg.stop_after or cfg.steps, start_step + cfg.steps_per_job if cfg.steps_per_job else cfg.steps)
    if start_step >= end_step:
        if is_main:
            print(f"mpirt: nothing to do: {cfg.init_from} is at step {start_step} and this run ends at step "
                  f"{end_step} (--steps {cfg.steps}); {out / 'summary.json'} is left as it is", file=sys.stderr)
        engine.close()
        grid.free()
        if is_main and (out / "summary.json").exists():  # confirmed by this attempt: a job script reads
            os.utime(out / "summary.json")               # "finished" only from a summary this new
        return {"steps": start_step, "nothing_to_do": True}
    if is_main and not resume and (cfg.overwrite or cfg.resume == "auto"):  # leftovers of an earlier run
        for name in ("ckpt", "metrics", "summary.json", "eval.json", "trace.json", "tensorboard", "report"):
            path = out / name
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    world_comm.barrier()  # the old files are gone before any rank writes its metrics

    last_save = {"time": time.time(), "seconds": None, "step": start_step if resume else None}

    def save(step: int, loss: float, grad_norm: float, good: bool) -> bool:
        """Checkpoint ``step`` (collective: every rank writes its own boxes, rank 0 commits), noting
        the step's training ``loss``, ``grad_norm`` and whether the loss was in its recent range
        (``good``, :mod:`mpirt.run.health`); False when the state is not finite and nothing was written."""
        t0 = time.time()
        scalars = {**optimizer.scalars(), **(scaler.state_dict() if scaler is not None else {})}
        try:
            path = save_sharded(out / "ckpt", world_comm, engine.save_sharded, step=step, config=cfg.to_dict(),
                                keep=cfg.keep_checkpoints, optimizer={"type": "AdamW", "scalars": scalars},
                                extra={"model_config": dataclasses.asdict(model_cfg), "model_source": model_source,
                                       "data": str(data.directory),
                                       "layout": summary_layout,
                                       "loss": loss if math.isfinite(loss) else None,
                                       "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
                                       "good": good},
                                params_limit=float(np.finfo(np.float16).max) if cfg.dtype == "float16" else None)
        except OSError as err:  # disk full, quota, permissions on any rank: the previous version stays intact
            if is_main:
                kept = f"is step {last_save['step']}" if last_save["step"] is not None else "none: none was written"
                print(f"error: step {step}: writing the checkpoint under {out / 'ckpt'} failed: {err}; the last "
                      f"complete checkpoint {kept}", file=sys.stderr, flush=True)
            sys.exit(1)  # every rank knows: the abort hook ends the job
        if path is None and is_main:
            print(f"mpirt: step {step}: the weights or optimizer state are not finite: no checkpoint written "
                  f"(the last good one stays)", file=sys.stderr, flush=True)
        elif path is not None:
            if is_main:
                print(f"mpirt: step {step}: checkpoint saved to {path} ({time.time() - t0:.1f} s)", file=sys.stderr,
                      flush=True)
            last_save["step"] = step
        last_save.update(time=time.time(), seconds=time.time() - t0)
        return path is not None

    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_per_step = flops_per_token(model_cfg, cfg.seq_len) * tokens_per_step
    monitor = RunMonitor(cfg, ctx, grid, engine, model_cfg, out, start_step, flops_per_step)  # collective
    metrics = Metrics(out / "metrics" / f"rank{ctx.rank}.jsonl", resume_step=start_step if resume else None)
    if is_main:
        print(banner(ctx, cfg, layout, model_cfg, data, out, start_step, end_step,
                     comm.describe_engines(B.xp.empty(1)), max(predicted_peaks()), model_source),
              file=sys.stderr, flush=True)
        print(monitor.describe(), file=sys.stderr, flush=True)
    progress = Progress(cfg.steps, start_step, enabled=is_main and cfg.progress, end=end_step)
    val_loss = math.nan
    skipped_total, skipped_in_row, slowest_step = 0, 0, 0.0
    updated = False   # an optimizer update since the last checkpoint (or the start): else nothing to save
    extra_shown = {}
    stopped, exit_code = None, 0
    loss_range = health.LossRange.seeded(metrics.records)  # good versions: saved before the loss left its range
    budget = explicit_budget(cfg.memory_budget)  # auto's is checked before training only
    step = start_step
    # training starts: a TERM now stops every rank at a step boundary, with a checkpoint (until
    # here it ended the process: nothing to save, and no handler runs while waiting inside MPI)
    stops = jobctl.StopRequests().install()
    while step < end_step:
        faults.inject(ctx.rank, step + 1)
        monitor.begin(step + 1)
        t0 = time.perf_counter()
        if faults.slowdown(ctx.rank, step + 1):
            monitor.mark("injected")
        optimizer.lr = cosine_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=min(cfg.warmup_steps, cfg.steps),
                                 total_steps=cfg.steps)
        x, y = get_batch(data.train, step, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                         dp_rank=grid.coords["dp"], dp_size=dp)
        monitor.mark("data")
        scale = scaler.scale if scaler is not None else 1.0
        loss_value = engine.train_step(x, y, loss_scale=scale * faults.loss_scale_factor(ctx.rank, step + 1),
                                       step=step + 1)
        monitor.mark("train_step")
        # the norm is reduced over the grid (the loss over dp): every rank reaches the same verdict; the
        # gradients are `scale` times the loss's, so the clipping threshold too
        grad_norm = engine.clip((cfg.grad_clip if cfg.grad_clip > 0 else math.inf) * scale) / scale
        # a float16 gradient overflow (finite loss) is the loss scaler's to handle, not a failure
        overflow = scaler is not None and math.isfinite(loss_value) and not math.isfinite(grad_norm)
        skipped = not overflow and not (math.isfinite(loss_value) and math.isfinite(grad_norm))
        if not (skipped or overflow):
            optimizer.grad_scale = 1.0 / scale
            optimizer.step()
            updated = True
        if scaler is not None:
            scaler.update(overflow)
        B.synchronize()
        monitor.mark("optimizer")
        dt = time.perf_counter() - t0
        slowest_step = max(slowest_step, dt)
        step += 1
        in_range = loss_range.observe(step, loss_value)
        skipped_total += skipped
        skipped_in_row = skipped_in_row + 1 if skipped else 0
        record = {"step": step, "loss": loss_value, "lr": optimizer.lr, "grad_norm": grad_norm, "skipped": skipped,
                  "step_time_s": dt, "tokens_per_s": tokens_per_step / dt, **monitor.end(step, dt, engine.stats)}
        if scaler is not None:
            record.update(loss_scale=scale, overflow=overflow)
            if overflow and is_main:
                print(f"mpirt: step {step}: float16 gradient overflow at loss scale {scale:g}: update skipped, "
                      f"scale now {scaler.scale:g}", file=sys.stderr, flush=True)
        last = step == end_step
        # one small reduction per step: a stop request or a timed checkpoint on any rank acts on all
        signal_stop = ctx.size - ctx.rank if stops.requested is not None else 0  # max: the lowest rank asking
        time_stop = is_main and deadline.should_stop(slowest_step, last_save["seconds"],
                                                     extra_s=evaluation_time(step, slowest_step))
        ckpt_due = is_main and cfg.ckpt_minutes > 0 and time.time() - last_save["time"] > 60 * cfg.ckpt_minutes
        over = over_budget_flag(owned_bytes(peak=True), budget, ctx.rank)
        flags = world_comm.allreduce(np.array([signal_stop, time_stop, ckpt_due, over], dtype=np.int64), "max")
        if flags[3] and not stopped:  # the same verdict on every rank; no checkpoint: gathering needs memory
            over_rank, over_peak = decode_over_budget(flags[3])
            stopped = (f"rank {over_rank}: measured peak memory {format_size(over_peak)} > memory budget "
                       f"{format_size(budget)}")
            exit_code = jobctl.EXIT_MEMORY
            sys.stderr.write(f"error: {stopped}\n")  # one write: the ranks' lines must not interleave
            sys.stderr.flush()
        if skipped:
            if is_main:
                print(f"mpirt: step {step}: non-finite loss {loss_value} or gradient norm {grad_norm}: update skipped "
                      f"({skipped_in_row} in a row, {skipped_total} in all)", file=sys.stderr, flush=True)
            if cfg.nan_policy == "stop" or skipped_in_row >= cfg.max_skips:
                stopped = f"non-finite loss or gradient norm ({skipped_in_row} step(s) in a row)"
                exit_code = jobctl.EXIT_NONFINITE
        share_done = last and not stopped and end_step < cfg.steps   # this job's share (--steps-per-job, --stop-after)
        if share_done:
            stopped = f"this job's share of the run is done, {cfg.steps - step} steps left"
            exit_code = jobctl.EXIT_STOPPED                # work left: a requeue chain continues on 75
        if not last and not stopped and (flags[0] or flags[1]):
            stopped = (stops.requested or f"a stop request on rank {ctx.size - flags[0]}" if flags[0] else
                       f"time limit {cfg.time_limit} near ({deadline.left():.0f} s left)")
            exit_code = jobctl.EXIT_STOPPED
        # save before evaluating: an evaluation that fails loses nothing; a non-finite stop saves nothing;
        # with every step since the last save skipped there is nothing new, and a save would only
        # rotate out the versions made by real updates (a skip streak would delete the good ones)
        due = exit_code not in (jobctl.EXIT_NONFINITE, jobctl.EXIT_MEMORY) and (
            last or stopped or flags[2] or cfg.ckpt_interval and step % cfg.ckpt_interval == 0)
        if due and not updated:
            if is_main and (last or stopped):
                print(f"mpirt: step {step}: no update since " + (
                    f"the checkpoint of step {last_save['step']}" if last_save["step"] is not None else "the start")
                    + " (every step skipped): nothing new to save", file=sys.stderr, flush=True)
        elif due:
            if not save(step, loss_value, grad_norm, in_range):   # a state not finite: no later step recovers it
                stopped = f"the weights or optimizer state are not finite at step {step}"
                exit_code = jobctl.EXIT_NONFINITE
            updated = False
        if (share_done or not stopped) and (last or cfg.eval_interval and step % cfg.eval_interval == 0):
            val_loss = record["val_loss"] = eval_loss()
        if step % cfg.log_interval == 0 or last or stopped:  # collective: the ranks' spread to rank 0
            extra_shown = monitor.interval(record)
        metrics.log(**record)
        if step % cfg.log_interval == 0 or step == start_step + 1 or last or skipped or "val_loss" in record:
            shown = {"loss": loss_value, "tok/s": round(record["tokens_per_s"]), "time": f"{dt * 1e3:.0f}ms",
                     "mfu": f"{100 * record['mfu']:.1f}%"}
            if skipped_total:
                shown["skipped"] = skipped_total
            if "val_loss" in record:
                shown["val"] = val_loss
            progress.update(step, **shown, **extra_shown)
        if stopped:
            break
    progress.close()
    metrics.close()
    monitored = monitor.finish(metrics.records)  # collective: trace, memory, stragglers
    engine.close()
    grid.free()

    peaks = world_comm.allgather_object(owned_bytes(peak=True))
    # a mixture of experts' rows follow the routing: the model is held at the rank's measured loads
    # (its experts' rows under ep, its deepest layer's busiest expert), the budget was checked at
    # their bounds (memory.expert_load_bound, busiest_expert_bound), reported beside them
    def largest(key: str) -> list:  # every rank's largest over its steps (None: never measured)
        mine = [r[key] for r in metrics.records if key in r]
        return world_comm.allgather_object(max(mine) if mine else None)

    loads, busiest = largest("moe_expert_load"), largest("moe_busiest_expert_load")
    busiest = None if None in busiest else busiest  # None: no mixture of experts
    loads = None if busiest is None else loads if layout["ep"] > 1 else [1.0] * ctx.size  # one rank: every row
    planned, expected = predicted_peaks(), predictions(loads, busiest)
    predicted = [p["peak"] for p in expected]
    summary = {
        "steps": step,
        "total_steps": cfg.steps,
        "first_loss": metrics.records[0]["loss"] if metrics.records else math.nan,
        "last_loss": metrics.records[-1]["loss"] if metrics.records else math.nan,
        "val_loss": val_loss,
        "tokens_per_s": metrics.median("tokens_per_s"),
        "step_time_s": metrics.median("step_time_s"),
        "mfu": metrics.median("mfu"),
        "peak_flops": monitor.peak_total,
        "wall_time_s": time.time() - started,
        "peak_memory_bytes": max(peaks),
        "peak_memory_bytes_per_rank": peaks,
        "world_size": ctx.size,
        # the grid and every other layout setting (the checkpoint's extra keeps the grid alone)
        "layout": {**summary_layout, "zero": cfg.zero, "sequence_parallel": cfg.sequence_parallel,
                   "schedule": cfg.schedule if layout["pp"] > 1 else None,
                   "microbatches": layout.microbatches if layout["pp"] > 1 else None,
                   "recompute": cfg.recompute},
        "num_parameters": num_parameters(model_cfg),
        "skipped_steps": sum(1 for r in metrics.records if r.get("skipped")),
        "overflow_steps": sum(1 for r in metrics.records if r.get("overflow")),
        "loss_scale": scaler.scale if scaler is not None else None,
        "stopped": stopped,
        "exit_code": exit_code,
        "last_checkpoint_step": last_save["step"],
        "loss_left_range": loss_range.describe() or None,
        "resume_advice": health.resume_advice(out / "ckpt", loss_range, cfg.dtype) if is_main else None,
        "predicted_peak_bytes": max(predicted),
        "predicted_peak_bytes_per_rank": predicted,
        "planned_peak_bytes_per_rank": planned,
        # what the report draws where no pipeline stash was measured (a whole model's activations)
        "predicted_activations_bytes_per_rank": [p["activations"] for p in expected],
        **({"moe_expert_load_per_rank": loads, "moe_expert_load_planned": expert_load_bound(cfg, model_cfg, layout["ep"])}
           if loads and layout["ep"] > 1 else {}),
        **({"moe_busiest_expert_load_per_rank": busiest,
            "moe_busiest_expert_load_planned": busiest_expert_bound(cfg, model_cfg)} if busiest else {}),
        "process_baseline_bytes_per_rank": baselines,
        "memory_budget_bytes": budget,
        **monitored,
    }
    if is_main:  # the performance model's prediction for this layout beside what was measured
        summary["prediction"] = self_check(cfg, model_cfg, layout, summary)
        _write_json(out / "summary.json", summary)
        print(end_block(summary, out, start_step), file=sys.stderr, flush=True)
    if exit_code:
        comm.exit_together(exit_code)
    return summary


def end_block(summary: dict, out: Path, start_step: int) -> str:
    """The closing lines on rank 0: how the run went and where its files are."""
    s = summary
    lines = [f"mpirt: {'stopped' if s['stopped'] else 'done'} at step {s['steps']} of {s['total_steps']} "
             f"({s['steps'] - start_step} this run) in {format_seconds(s['wall_time_s'])}, world {s['world_size']}"
             + (f": {s['stopped']}" if s["stopped"] else ""),
             f"mpirt:   loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, val "
             + (f"{s['val_loss']:.4f}" if math.isfinite(s["val_loss"]) else "not measured")
             + (f", {s['skipped_steps']} steps skipped (non-finite)" if s["skipped_steps"] else ""),
             f"mpirt:   {s['tokens_per_s']:,.0f} tokens/s, step {1e3 * s['step_time_s']:.1f} ms (median), "
             f"MFU {100 * s['mfu']:.1f}%, peak memory {s['peak_memory_bytes'] / 2**20:.0f} MiB (largest rank)",
             "mpirt:   checkpoint " + (f"{out / 'ckpt'} (step {s['last_checkpoint_step']})"
                                       if s["last_checkpoint_step"] is not None else "none")
             + f", summary {out / 'summary.json'}, metrics {out / 'metrics'}/"] + monitor_lines(s, out)
    lines += [f"mpirt:   model: {line}" for line in prediction_lines(s.get("prediction"))]
    if s["stopped"]:
        lines.append("mpirt:   " + ("continue with the same command and --resume auto"
                                     if s["exit_code"] == jobctl.EXIT_STOPPED else
                                     "nothing was saved after the failure" + (
                                         f" ({s['loss_left_range']})" if s.get("loss_left_range") else "")
                                     + f": {s['resume_advice']}; "
                                     + STOP_ADVICE.get(s['exit_code'], 'fix the cause before resuming')))
    return "\n".join(lines)


# what to change before resuming a run that stopped with this exit code (end_block's last line)
STOP_ADVICE = {jobctl.EXIT_NONFINITE: "fix the cause (e.g. a lower --lr) before resuming",
               jobctl.EXIT_MEMORY: "lower the peak (--zero 1, --recompute full, a larger tp or pp, a smaller "
                                   "--batch-size) or raise --memory-budget before resuming"}


def _write_json(path: Path, record: dict) -> None:
    """Write ``record`` to ``path`` atomically (a reader never sees half a file); non-finite
    numbers (a value never measured, a diverged loss) become null."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    tmp.write_text(json.dumps(clean, indent=2) + "\n")  # strict JSON: no NaN
    tmp.replace(path)
