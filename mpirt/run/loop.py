"""The training script's loop (:mod:`mpirt.run.train`): a :class:`TrainingRun` is built once the
pre-flight agreed (the distributed start, the grid, the engine, the weights it loads), then steps:
cosine LR, the batch, ``train_step``, the clip, the update unless non-finite, one small allreduce of
the stop/time/checkpoint/memory flags so every rank acts on the same step, save, evaluate, log.
"""
from __future__ import annotations

import dataclasses
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
from mpirt.checkpoint.sharded import save_sharded
from mpirt.checkpoint.store import CheckpointReader
from mpirt.core.modeling import flops_per_token
from mpirt.core.optim import cosine_lr
from mpirt.core.precision import LossScaler
from mpirt.data.tokens import get_batch, get_eval_batch
from mpirt.monitor.live import Metrics, Progress, RunMonitor
from mpirt.monitor.steps import owned_bytes
from mpirt.parallel.engine import Engine, Hyper
from mpirt.parallel.grid import Grid
from mpirt.plan.budget import decode_over_budget, over_budget_flag
from mpirt.plan.memory import predict
from mpirt.core.settings import explicit_budget, format_size
from mpirt.run import faults, health, jobctl
from mpirt.run.config import ConfigError
from mpirt.run.distributed import init_distributed, input_fingerprint
from mpirt.run.finish import write_json
from mpirt.run.prepare import banner, comm_timeout
from mpirt.verify.cli import verify_before_training


def evaluate(engine, tokens, grid, *, batches: int, batch_size: int, seq_len: int) -> float:
    """Mean loss over the first ``batches`` x ``batch_size`` consecutive windows of ``tokens``,
    each dp rank taking its rows of every batch; the same number on any layout."""
    total = 0.0
    for i in range(batches):
        x, y = get_eval_batch(tokens, i, batch_size=batch_size, seq_len=seq_len,
                              dp_rank=grid.coords["dp"], dp_size=grid.sizes["dp"])
        total += engine.evaluate(x, y)
    return total / batches


class TrainingRun:
    """One job's training after the pre-flight checks (begun at ``started``, epoch seconds): built
    on every rank (collective), then :meth:`loop`; its fields are what the finish summarises.
    ``model_source`` (``--model``, or ``init_from PATH``: what built the model first) is recorded
    in the checkpoints, so a later resume knows what to compare; ``baselines``: every rank's process
    before the model was built (:func:`mpirt.plan.memory.measured_baseline`), the baselines of the
    memory predictions (None: :data:`mpirt.plan.memory.PROCESS_BYTES`)."""

    def __init__(self, cfg, layout, model_cfg, hf_weights, resume, data, deadline, out: Path, started: float,
                 model_source: str | None = None, baselines: list[int] | None = None):
        try:  # all ranks: the same config, and the same contents behind its paths
            ctx = init_distributed(cfg.seed, cfg.backend,
                                   config={**cfg.to_dict(), "inputs": input_fingerprint(cfg, data.directory)})
        except ConfigError as err:  # raised alike on every rank: one line, as for the pre-flight errors
            if comm.world().rank == 0:
                print(f"error: {err}", file=sys.stderr)
            sys.exit(jobctl.EXIT_REFUSED)
        comm.start_watchdog(comm_timeout(cfg, model_cfg))  # a stuck call, or a rank exiting alone, ends the job
        if cfg.verify:  # the layout held to one rank first; exits 2 when it differs
            verify_before_training(cfg, model_cfg, data.train, comm.world_comm())
        self.layout = layout  # resolved with the model by the pre-flight (run.prepare.plan_layout)
        self.grid = Grid(**layout)  # a Layout is the mapping of its axis sizes
        self.cfg, self.model_cfg, self.data, self.deadline, self.out, self.started = \
            cfg, model_cfg, data, deadline, out, started
        self.resume, self.model_source, self.ctx = resume, model_source, ctx
        self.is_main, self.world_comm = ctx.rank == 0, ctx.comm
        self.baselines = baselines or [None] * ctx.size
        B.limit_pool(explicit_budget(cfg.memory_budget))  # on a GPU the pool itself holds an explicit budget
        # one dropout seed for every rank: the masks depend on each element's place in the global batch
        self.engine = Engine(layout, model_cfg, self.grid, Hyper.of(cfg), dropout_seed=ctx.rank_seed("dropout", rank=0))
        self.optimizer = self.engine.optimizer
        self.scaler = LossScaler(cfg.initial_loss_scale, cfg.loss_scale_window) if cfg.dtype == "float16" else None
        self.start_step = 0
        if hf_weights is not None:
            self.engine.load_sharded(hf_weights, with_optimizer=False)  # this rank's boxes of the HF files only
        if resume:
            self._load_checkpoint()
        self.summary_layout = dict(self.grid.sizes)
        self.eval_seconds = None   # how long the last evaluation took (the deadline counts the next ones)
        self.end_step = min(cfg.stop_after or cfg.steps,
                            self.start_step + cfg.steps_per_job if cfg.steps_per_job else cfg.steps)
        self.last_save = {"time": time.time(), "seconds": None, "step": self.start_step if resume else None}

    def _load_checkpoint(self) -> None:
        cfg = self.cfg
        reader = CheckpointReader(cfg.init_from, verify=False)  # checksums: verified in resolve_model
        meta = reader.meta
        self.engine.load_sharded(reader, with_optimizer=meta["optimizer"] is not None)  # only this rank's boxes
        if self.scaler is not None:
            self.scaler.load_state_dict((meta["optimizer"] or {}).get("scalars", {}))
        self.start_step = meta["step"]
        if self.is_main and not health.version_good(meta, dtype=cfg.dtype):   # a resume that replays a divergence
            advice = health.resume_advice(Path(meta["path"]).parent, dtype=cfg.dtype)
            print(f"mpirt: warning: {cfg.init_from} (step {self.start_step}) was saved after the loss left its "
                  f"recent range; {advice}", file=sys.stderr, flush=True)

    # --- predictions, evaluation, checkpoints ------------------------------------------------------
    def predictions(self) -> list[dict]:
        """Every rank's predicted memory, as the end block's model check counts them, a mixture of
        experts' at the routing's bounds (those the budget is checked against)."""
        return [self.prediction(r) for r in range(self.ctx.size)]

    def prediction(self, rank: int, load=None, busiest=None) -> dict:
        """World rank ``rank``'s predicted memory at expert load ``load`` and busiest expert's
        ``busiest`` (numbers, or lists per block the rank holds; None: their bounds)."""
        return predict(self.cfg, self.model_cfg, self.layout, rank, process_bytes=self.baselines[rank],
                       expert_load=load, busiest_expert=busiest, host_heap=B.name == "numpy")

    def predicted_peaks(self) -> list[int]:
        return [p["peak"] for p in self.predictions()]

    def eval_loss(self) -> float:
        cfg, t0 = self.cfg, time.time()
        loss = evaluate(self.engine, self.data.val, self.grid, batches=cfg.eval_batches, batch_size=cfg.batch_size,
                        seq_len=cfg.seq_len)
        self.eval_seconds = time.time() - t0
        return loss

    def evaluates(self, n: int) -> bool:
        """Whether step ``n`` ends with an evaluation (the run's last step always does)."""
        return n == self.end_step or bool(self.cfg.eval_interval) and n % self.cfg.eval_interval == 0

    def evaluation_time(self, n: int, step_s: float) -> float:
        """Seconds the evaluations after step ``n`` and after the next will take: the last one's
        time, or before any, half a training step per batch (a forward pass over as many tokens)."""
        each = self.eval_seconds if self.eval_seconds is not None else self.cfg.eval_batches * step_s / 2
        return each * (self.evaluates(n) + self.evaluates(n + 1))

    def save(self, step: int, loss: float, grad_norm: float, good: bool) -> bool:
        """Checkpoint ``step`` (collective: every rank writes its own boxes, rank 0 commits), noting
        the step's training ``loss``, ``grad_norm`` and whether the loss was in its recent range
        (``good``, :mod:`mpirt.run.health`); False when the state is not finite and nothing was written."""
        cfg, out, last_save, t0 = self.cfg, self.out, self.last_save, time.time()
        scalars = {**self.optimizer.scalars(), **(self.scaler.state_dict() if self.scaler is not None else {})}
        try:
            path = save_sharded(out / "ckpt", self.world_comm, self.engine.save_sharded, step=step,
                                config=cfg.to_dict(), keep=cfg.keep_checkpoints,
                                optimizer={"type": "AdamW", "scalars": scalars},
                                extra={"model_config": dataclasses.asdict(self.model_cfg),
                                       "model_source": self.model_source, "data": str(self.data.directory),
                                       "layout": self.summary_layout,
                                       "loss": loss if math.isfinite(loss) else None,
                                       "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
                                       "good": good},
                                params_limit=float(np.finfo(np.float16).max) if cfg.dtype == "float16" else None)
        except OSError as err:  # disk full, quota, permissions on any rank: the previous version stays intact
            if self.is_main:
                kept = f"is step {last_save['step']}" if last_save["step"] is not None else "none: none was written"
                print(f"error: step {step}: writing the checkpoint under {out / 'ckpt'} failed: {err}; the last "
                      f"complete checkpoint {kept}", file=sys.stderr, flush=True)
            sys.exit(1)  # every rank knows: the abort hook ends the job
        if path is None and self.is_main:
            print(f"mpirt: step {step}: the weights or optimizer state are not finite: no checkpoint written "
                  f"(the last good one stays)", file=sys.stderr, flush=True)
        elif path is not None:
            if self.is_main:
                print(f"mpirt: step {step}: checkpoint saved to {path} ({time.time() - t0:.1f} s)", file=sys.stderr,
                      flush=True)
            last_save["step"] = step
        last_save.update(time=time.time(), seconds=time.time() - t0)
        return path is not None

    # --- the runs that do not train ------------------------------------------------------------------
    def evaluate_only(self) -> dict:
        """``--eval-only``: one evaluation, printed and written to eval.json."""
        cfg = self.cfg
        result = {"val_loss": self.eval_loss(), "step": self.start_step, "eval_batches": cfg.eval_batches,
                  "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "init_from": cfg.init_from}
        if self.is_main:
            print(json.dumps(result))
            write_json(self.out / "eval.json", result)
        return result

    def nothing_to_do(self) -> dict:
        """A resumed run already at its end step: say so, touch the summary, train nothing."""
        out = self.out
        if self.is_main:
            print(f"mpirt: nothing to do: {self.cfg.init_from} is at step {self.start_step} and this run ends at "
                  f"step {self.end_step} (--steps {self.cfg.steps}); {out / 'summary.json'} is left as it is",
                  file=sys.stderr)
        self.engine.close()
        self.grid.free()
        if self.is_main and (out / "summary.json").exists():  # confirmed by this attempt: a job script reads
            os.utime(out / "summary.json")                    # "finished" only from a summary this new
        return {"steps": self.start_step, "nothing_to_do": True}

    # --- the loop ------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Clear an earlier run's files, start the monitor, metrics and progress, print the banner."""
        cfg, out, ctx = self.cfg, self.out, self.ctx
        if self.is_main and not self.resume and (cfg.overwrite or cfg.resume == "auto"):  # leftovers of an earlier run
            for name in ("ckpt", "metrics", "summary.json", "eval.json", "trace.json", "tensorboard", "report"):
                path = out / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        self.world_comm.barrier()  # the old files are gone before any rank writes its metrics
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        flops_per_step = flops_per_token(self.model_cfg, cfg.seq_len) * self.tokens_per_step
        self.monitor = RunMonitor(cfg, ctx, self.grid, self.engine, self.model_cfg, out, self.start_step,
                                  flops_per_step)  # collective
        self.metrics = Metrics(out / "metrics" / f"rank{ctx.rank}.jsonl",
                               resume_step=self.start_step if self.resume else None)
        if self.is_main:
            print(banner(ctx, cfg, self.layout, self.model_cfg, self.data, out, self.start_step, self.end_step,
                         comm.describe_engines(B.xp.empty(1)), max(self.predicted_peaks()), self.model_source),
                  file=sys.stderr, flush=True)
            print(self.monitor.describe(), file=sys.stderr, flush=True)
        self.progress = Progress(cfg.steps, self.start_step, enabled=self.is_main and cfg.progress, end=self.end_step)
        self.val_loss = math.nan
        self.skipped_total, self.skipped_in_row, self.slowest_step = 0, 0, 0.0
        self.updated = False   # an optimizer update since the last checkpoint (or the start): else nothing to save
        self.extra_shown = {}
        self.stopped, self.exit_code = None, 0
        self.loss_range = health.LossRange.seeded(self.metrics.records)  # good versions: saved before the loss left its range
        self.budget = explicit_budget(cfg.memory_budget)  # auto's is checked before training only
        self.step = self.start_step

    def loop(self) -> None:
        """Train from the start step to the end step or a stop every rank agreed on."""
        self.begin()
        # training starts: a TERM now stops every rank at a step boundary, with a checkpoint (until
        # here it ended the process: nothing to save, and no handler runs while waiting inside MPI)
        stops = jobctl.StopRequests().install()
        while self.step < self.end_step:
            record, scale, overflow = self.train_one_step()
            self.after_step(record, scale, overflow, stops)
            if self.stopped:
                break
        self.progress.close()
        self.metrics.close()

    def train_one_step(self):
        """One optimizer step: LR, batch, forward and backward, clip, update unless non-finite.
        Returns the step's record (before the flags), its loss scale and whether it overflowed."""
        cfg, ctx, engine, optimizer, scaler, monitor = self.cfg, self.ctx, self.engine, self.optimizer, \
            self.scaler, self.monitor
        step = self.step
        faults.inject(ctx.rank, step + 1)
        monitor.begin(step + 1)
        t0 = time.perf_counter()
        if faults.slowdown(ctx.rank, step + 1):
            monitor.mark("injected")
        optimizer.lr = cosine_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=min(cfg.warmup_steps, cfg.steps),
                                 total_steps=cfg.steps)
        x, y = get_batch(self.data.train, step, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                         dp_rank=self.grid.coords["dp"], dp_size=self.grid.sizes["dp"])
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
            self.updated = True
        if scaler is not None:
            scaler.update(overflow)
        B.synchronize()
        monitor.mark("optimizer")
        dt = time.perf_counter() - t0
        self.slowest_step = max(self.slowest_step, dt)
        self.step = step = step + 1
        self.skipped_total += skipped
        self.skipped_in_row = self.skipped_in_row + 1 if skipped else 0
        record = {"step": step, "loss": loss_value, "lr": optimizer.lr, "grad_norm": grad_norm, "skipped": skipped,
                  "step_time_s": dt, "tokens_per_s": self.tokens_per_step / dt, **monitor.end(step, dt, engine.stats)}
        return record, scale, overflow

    def after_step(self, record: dict, scale: float, overflow: bool, stops) -> None:
        """What every rank does after step ``record["step"]``, agreed by one small allreduce: stop
        (a signal, the time limit, memory over budget, non-finite steps, the job's share done), save,
        evaluate, log and show progress."""
        cfg, ctx, is_main, step = self.cfg, self.ctx, self.is_main, self.step
        loss_value, grad_norm, skipped, dt = record["loss"], record["grad_norm"], record["skipped"], record["step_time_s"]
        in_range = self.loss_range.observe(step, loss_value)
        if self.scaler is not None:
            record.update(loss_scale=scale, overflow=overflow)
            if overflow and is_main:
                print(f"mpirt: step {step}: float16 gradient overflow at loss scale {scale:g}: update skipped, "
                      f"scale now {self.scaler.scale:g}", file=sys.stderr, flush=True)
        last = step == self.end_step
        # one small reduction per step: a stop request or a timed checkpoint on any rank acts on all
        signal_stop = ctx.size - ctx.rank if stops.requested is not None else 0  # max: the lowest rank asking
        time_stop = is_main and self.deadline.should_stop(self.slowest_step, self.last_save["seconds"],
                                                          extra_s=self.evaluation_time(step, self.slowest_step))
        ckpt_due = is_main and cfg.ckpt_minutes > 0 and time.time() - self.last_save["time"] > 60 * cfg.ckpt_minutes
        over = over_budget_flag(owned_bytes(peak=True), self.budget, ctx.rank)
        flags = self.world_comm.allreduce(np.array([signal_stop, time_stop, ckpt_due, over], dtype=np.int64), "max")
        if flags[3] and not self.stopped:  # the same verdict on every rank; no checkpoint: gathering needs memory
            over_rank, over_peak = decode_over_budget(flags[3])
            self.stopped = (f"rank {over_rank}: measured peak memory {format_size(over_peak)} > memory budget "
                            f"{format_size(self.budget)}")
            self.exit_code = jobctl.EXIT_MEMORY
            sys.stderr.write(f"error: {self.stopped}\n")  # one write: the ranks' lines must not interleave
            sys.stderr.flush()
        if skipped:
            if is_main:
                print(f"mpirt: step {step}: non-finite loss {loss_value} or gradient norm {grad_norm}: update skipped "
                      f"({self.skipped_in_row} in a row, {self.skipped_total} in all)", file=sys.stderr, flush=True)
            if cfg.nan_policy == "stop" or self.skipped_in_row >= cfg.max_skips:
                self.stopped = f"non-finite loss or gradient norm ({self.skipped_in_row} step(s) in a row)"
                self.exit_code = jobctl.EXIT_NONFINITE
        share_done = last and not self.stopped and self.end_step < cfg.steps  # this job's share (--steps-per-job, --stop-after)
        if share_done:
            self.stopped = f"this job's share of the run is done, {cfg.steps - step} steps left"
            self.exit_code = jobctl.EXIT_STOPPED                # work left: a requeue chain continues on 75
        if not last and not self.stopped and (flags[0] or flags[1]):
            self.stopped = (stops.requested or f"a stop request on rank {ctx.size - flags[0]}" if flags[0] else
                            f"time limit {cfg.time_limit} near ({self.deadline.left():.0f} s left)")
            self.exit_code = jobctl.EXIT_STOPPED
        self.checkpoint_if_due(step, last, bool(flags[2]), loss_value, grad_norm, in_range)
        if (share_done or not self.stopped) and (last or cfg.eval_interval and step % cfg.eval_interval == 0):
            self.val_loss = record["val_loss"] = self.eval_loss()
        if step % cfg.log_interval == 0 or last or self.stopped:  # collective: the ranks' spread to rank 0
            self.extra_shown = self.monitor.interval(record)
        self.metrics.log(**record)
        if step % cfg.log_interval == 0 or step == self.start_step + 1 or last or skipped or "val_loss" in record:
            shown = {"loss": loss_value, "tok/s": round(record["tokens_per_s"]), "time": f"{dt * 1e3:.0f}ms",
                     "mfu": f"{100 * record['mfu']:.1f}%"}
            if self.skipped_total:
                shown["skipped"] = self.skipped_total
            if "val_loss" in record:
                shown["val"] = self.val_loss
            self.progress.update(step, **shown, **self.extra_shown)

    def checkpoint_if_due(self, step: int, last: bool, timed: bool, loss: float, grad_norm: float,
                          in_range: bool) -> None:
        """Save before evaluating: an evaluation that fails loses nothing; a non-finite stop saves
        nothing; with every step since the last save skipped there is nothing new, and a save would
        only rotate out the versions made by real updates (a skip streak would delete the good ones)."""
        cfg = self.cfg
        due = self.exit_code not in (jobctl.EXIT_NONFINITE, jobctl.EXIT_MEMORY) and (
            last or self.stopped or timed or cfg.ckpt_interval and step % cfg.ckpt_interval == 0)
        if due and not self.updated:
            if self.is_main and (last or self.stopped):
                print(f"mpirt: step {step}: no update since " + (
                    f"the checkpoint of step {self.last_save['step']}" if self.last_save["step"] is not None
                    else "the start") + " (every step skipped): nothing new to save", file=sys.stderr, flush=True)
        elif due:
            if not self.save(step, loss, grad_norm, in_range):   # a state not finite: no later step recovers it
                self.stopped = f"the weights or optimizer state are not finite at step {step}"
                self.exit_code = jobctl.EXIT_NONFINITE
            self.updated = False
