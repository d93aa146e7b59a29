"""Train a model: ``[mpiexec -n N] python -m mpirt.train [CONFIG.toml] [--key=value ...]``.

One linear script, nanoGPT style, a phase per module: the set-up (:mod:`mpirt.run.prepare`:
configure, check the layout, load data and model; then :class:`~mpirt.run.loop.TrainingRun`
shards it over the grid), the loop (:meth:`~mpirt.run.loop.TrainingRun.loop`: optimizer steps of
``grad_accum`` micro-batches each, evaluate, checkpoint) and the finish (:mod:`mpirt.run.finish`:
summarise). ``python -m mpirt.train --help`` lists every key. Everything that can be refused is
refused before training, in one line naming the key (and the rank): every rank reaches the same
agreements whatever failed (:mod:`mpirt.run.startup`).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mpirt import comm
from mpirt.checkpoint.store import read_checkpoint_meta
from mpirt.data.tokens import DataError
from mpirt.monitor.live import tensorboard_writer_class
from mpirt.parallel.preflight import check_step
from mpirt.plan.budget import available_budget, check_budget
from mpirt.plan.memory import measured_baseline
from mpirt.run import jobctl, startup
from mpirt.run.config import parse_args, parse_duration
from mpirt.run.finish import finish
from mpirt.run.loop import TrainingRun
from mpirt.run.prepare import (DISK_FULL, PREFLIGHT_ERRORS, check_fit, check_out_dir, check_resources, check_resume,
                               host_heap,
                               check_resumed_model, fit_eval_batches, last_checkpoint, open_dataset, plan_layout,
                               plan_out_dir, resolve_model, vocab_from_data)


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
        layout = plan_layout(cfg, world.size, model_cfg)  # the final layout: everything after is built from it
        notes = [f"mpirt: data: {note}" for note in check_fit(cfg, model_cfg, data)]
        # the step's communication (pipeline, ring attention, ZeRO-3 gathers) proven consistent: each
        # rank checks its own program against its stage's, and the stages' together
        check_step(layout, model_cfg, cfg.dtype, rank=world.rank)
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
        failed, baselines = _memory_refusal(cfg, model_cfg, layout, world)
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


def _memory_refusal(cfg, model_cfg, layout, world) -> tuple:
    """``(refusal or None, every rank's baseline)``: each rank's process as it stands before the
    model is built (the baselines of the predictions) and what each can have (the budget of
    ``--memory-budget auto``, the default), agreed by all; the refusal ``(0, message)`` when a
    rank's predicted peak is over its budget (the same on every rank: they hold the same figures)."""
    if world.rank == 0 and cfg.monitor:
        tensorboard_writer_class()  # rank 0's writer: imported now, it is counted in its baseline
    mine = (measured_baseline(), available_budget(cfg.backend, world.local_rank, world.local_size)
            if cfg.memory_budget.strip().lower() == "auto" else None)
    baselines, available = (list(x) for x in zip(*comm.world_comm().allgather_object(mine)))
    try:
        check_budget(cfg, model_cfg, layout, world.size, baselines=baselines, available=available,
                     host_heap=host_heap(cfg))
    except ValueError as err:
        return (0, str(err)), baselines
    return None, baselines


def train(cfg, layout, model_cfg, hf_weights, resume, data, deadline, out: Path, started: float,
          model_source: str | None = None, baselines: list[int] | None = None) -> dict:
    """Everything after the pre-flight checks (the arguments: :class:`~mpirt.run.loop.TrainingRun`'s):
    set up, train, checkpoint, summarise."""
    run = TrainingRun(cfg, layout, model_cfg, hf_weights, resume, data, deadline, out, started, model_source,
                      baselines)                                     # collective: the engine, the weights
    if cfg.eval_only:
        return run.evaluate_only()
    if run.start_step >= run.end_step:
        return run.nothing_to_do()
    run.loop()
    return finish(run)
