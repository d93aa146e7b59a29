"""Train a model: ``[mpiexec -n N] python -m mpirt.train [CONFIG.toml] [--key=value ...]``.

One linear script, nanoGPT style: configure, check the layout, load data and model, shard it over
the dp x pp x tp grid, loop over optimizer steps (each ``grad_accum`` micro-batches of the global
batch), evaluate, checkpoint, summarise. ``python -m mpirt.train --help`` lists every key.
Everything that can be refused is refused before the first collective, naming the key.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import mpirt.backend as B
from mpirt import comm, faults
from mpirt.checkpoint import is_checkpoint, load_state, read_checkpoint_meta, save_state
from mpirt.config import ConfigError, parse_args
from mpirt.data import TokenDataset, default_dataset_dir, get_batch, get_eval_batch, num_eval_batches
from mpirt.distributed import init_distributed
from mpirt.grid import Grid, check_layout, resolve_dp
from mpirt.monitor import Metrics, Progress, measure_peak_flops
from mpirt.optim import cosine_lr
from mpirt.parallel import tensor as TP
from mpirt.parallel.engine import build_engine
from mpirt.parallel.schedules import check_shape
from models import flops_per_token, num_parameters
from models.config import GPTConfig
from models.hf import load_hf_gpt2
from models.presets import load_model_config


def plan_layout(cfg, world_size: int) -> dict:
    """The dp/pp/tp sizes for this run (pure: no communication), refusing impossible layouts."""
    try:
        dp = resolve_dp(world_size, cfg.dp, cfg.pp, cfg.tp)
        check_layout(dp, cfg.pp, cfg.tp, world_size)
    except ValueError as err:
        raise ConfigError(f"dp/pp/tp: {err}") from None
    if cfg.zero and (cfg.tp > 1 or cfg.pp > 1):
        raise ConfigError(f"zero: ZeRO (zero={cfg.zero}) is for pure data parallelism; got tp={cfg.tp}, pp={cfg.pp}")
    if cfg.pp > 1:
        if cfg.grad_accum > 1:
            raise ConfigError(f"grad_accum: with pp={cfg.pp} the pipeline's micro-batches replace gradient "
                              f"accumulation; use --microbatches instead of --grad-accum={cfg.grad_accum}")
        m = cfg.microbatches or cfg.pp
        if (cfg.batch_size // dp) % m:
            raise ConfigError(f"microbatches: the {cfg.batch_size // dp} rows per data-parallel replica "
                              f"(batch_size {cfg.batch_size} / dp {dp}) do not split into {m} micro-batches")
        try:
            check_shape(cfg.schedule, cfg.pp, m, cfg.chunks if cfg.schedule == "interleaved" else 1)
        except ValueError as err:
            raise ConfigError(f"schedule: {err}") from None
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ConfigError("sequence_parallel: needs tp > 1")
    if cfg.batch_size % (dp * cfg.grad_accum):
        raise ConfigError(f"batch_size: the global batch {cfg.batch_size} does not divide into dp={dp} x "
                          f"grad_accum={cfg.grad_accum} = {dp * cfg.grad_accum} equal micro-batches")
    return {"dp": dp, "tp": cfg.tp, "pp": cfg.pp}


def resolve_model(cfg) -> tuple[GPTConfig, dict | None, bool]:
    """Model config, full initial weights from a HF directory (or None), and whether ``init_from``
    is an mpirt checkpoint (weights, optimizer state and step are then loaded from it)."""
    source = cfg.init_from
    if source and is_checkpoint(source):
        return GPTConfig(**read_checkpoint_meta(source)["extra"]["model_config"]), None, True
    if source:
        if not (Path(source) / "config.json").exists():
            raise ConfigError(f"init_from: {source} is neither an mpirt checkpoint nor a HF GPT-2 directory")
        model_cfg, weights = load_hf_gpt2(source, dtype=cfg.dtype)
        return model_cfg, weights, False
    return load_model_config(cfg.model, cfg.model_overrides), None, False


def check_fit(cfg, model_cfg: GPTConfig, data: TokenDataset, layout: dict) -> None:
    """Refuse a run whose data, sequence length or tp does not fit the model, naming the numbers."""
    if cfg.seq_len > model_cfg.n_positions:
        raise ConfigError(f"seq_len: {cfg.seq_len} exceeds the model's n_positions {model_cfg.n_positions}")
    if data.vocab_size is not None and data.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"data: vocabulary {data.vocab_size} of {data.directory} exceeds the model's "
                          f"vocab_size {model_cfg.vocab_size}")
    stages = layout["pp"] * (cfg.chunks if cfg.schedule == "interleaved" else 1)
    if layout["pp"] > 1 and model_cfg.n_layer < stages:
        raise ConfigError(f"pp: n_layer={model_cfg.n_layer} cannot fill pp x chunks = {stages} pipeline stages")
    available = num_eval_batches(data.val, cfg.batch_size, cfg.seq_len)
    if cfg.eval_batches > available:
        raise ConfigError(f"eval_batches: {cfg.eval_batches} requested but the validation split of "
                          f"{data.directory} holds only {available} batches of {cfg.batch_size} x {cfg.seq_len} tokens")
    if layout["tp"] > 1:
        try:
            TP.check_tp_layout(layout["tp"], n_head=model_cfg.n_head, n_embd=model_cfg.n_embd,
                               hidden=model_cfg.hidden, vocab_size=model_cfg.vocab_size, seq_len=cfg.seq_len,
                               sequence_parallel=cfg.sequence_parallel)
        except ValueError as err:
            raise ConfigError(f"tp: {err}") from None


def evaluate(engine, tokens, grid, *, batches: int, batch_size: int, seq_len: int) -> float:
    """Mean loss over the first ``batches`` x ``batch_size`` consecutive windows of ``tokens``,
    each dp rank taking its rows of every batch; the same number on any layout."""
    total = 0.0
    for i in range(batches):
        x, y = get_eval_batch(tokens, i, batch_size=batch_size, seq_len=seq_len,
                              dp_rank=grid.coords["dp"], dp_size=grid.sizes["dp"])
        total += engine.evaluate(x, y)
    return total / batches


def main(argv=None) -> dict:
    comm.install_abort_on_error()
    world = comm.world()
    error = None
    try:
        cfg = parse_args(argv)
        layout = plan_layout(cfg, world.size)
        model_cfg, hf_weights, resume = resolve_model(cfg)
        data = TokenDataset(cfg.data or default_dataset_dir())
        check_fit(cfg, model_cfg, data, layout)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        error = str(err)
    failed = comm.first_error(error)  # every rank stops if any rank found a problem
    if failed is not None:
        rank, message = failed
        if world.rank == 0:
            print(f"error: {message}" if rank == 0 else f"error on rank {rank}: {message}", file=sys.stderr)
        sys.exit(2)

    ctx = init_distributed(cfg.seed, cfg.backend, config=cfg.to_dict())  # all ranks: same config
    comm.start_watchdog(cfg.comm_timeout)  # a stuck call, or a rank exiting alone, ends the job
    grid = Grid(layout["dp"], layout["pp"], layout["tp"])
    dp = grid.sizes["dp"]
    is_main = ctx.rank == 0
    out = Path(cfg.out_dir)

    engine = build_engine(cfg, model_cfg, grid, dropout_seed=ctx.rank_seed(f"dropout-dp{grid.coords['dp']}", rank=0))
    optimizer = engine.optimizer
    start_step = 0
    if hf_weights is not None:
        engine.load_full_state(hf_weights, None)
    if resume:
        meta, weights, state = load_state(cfg.init_from)
        engine.load_full_state(weights, state)
        start_step = meta["step"]
    summary_layout = dict(grid.sizes)

    def eval_loss() -> float:
        return evaluate(engine, data.val, grid, batches=cfg.eval_batches, batch_size=cfg.batch_size,
                        seq_len=cfg.seq_len)

    if cfg.eval_only:
        val_loss = eval_loss()
        if is_main:
            print(json.dumps({"val_loss": val_loss, "eval_batches": cfg.eval_batches,
                              "batch_size": cfg.batch_size, "seq_len": cfg.seq_len}))
            _write_summary(out, {"val_loss": val_loss, "steps": start_step, "world_size": ctx.size,
                                 "layout": summary_layout})
        return {"val_loss": val_loss}

    def save(step: int) -> None:  # collective: gathers full tensors, rank 0 writes
        weights, state = engine.full_state()
        if is_main:
            save_state(out / "ckpt", weights, state, step=step, config=cfg.to_dict(),
                       extra={"model_config": dataclasses.asdict(model_cfg), "data": str(data.directory),
                              "layout": summary_layout})

    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_per_step = flops_per_token(model_cfg, cfg.seq_len) * tokens_per_step
    peak = measure_peak_flops(cfg.dtype) * ctx.size
    metrics = Metrics(out / "metrics" / f"rank{ctx.rank}.jsonl")
    progress = Progress(cfg.steps, start_step, enabled=is_main and cfg.progress)
    val_loss = math.nan
    end_step = cfg.stop_after or cfg.steps
    for step in range(start_step, end_step):
        faults.inject(ctx.rank, step + 1)
        t0 = time.perf_counter()
        optimizer.lr = cosine_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=min(cfg.warmup_steps, cfg.steps),
                                 total_steps=cfg.steps)
        x, y = get_batch(data.train, step, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                         dp_rank=grid.coords["dp"], dp_size=dp)
        loss_value = engine.train_step(x, y)
        grad_norm = engine.clip(cfg.grad_clip) if cfg.grad_clip > 0 else None
        # a non-finite norm (the same on every rank: it is reduced) means overflow: skip the update
        skipped = grad_norm is not None and not math.isfinite(grad_norm)
        if not skipped:
            optimizer.step()
        B.synchronize()
        dt = time.perf_counter() - t0
        record = {"step": step + 1, "loss": loss_value, "lr": optimizer.lr, "grad_norm": grad_norm, "skipped": skipped,
                  "step_time_s": dt, "tokens_per_s": tokens_per_step / dt, "mfu": flops_per_step / dt / peak}
        last = step + 1 == end_step
        if cfg.eval_interval and (step + 1) % cfg.eval_interval == 0 or last:
            val_loss = record["val_loss"] = eval_loss()
        metrics.log(**record)
        if (step + 1) % cfg.log_interval == 0 or step == start_step or last or "val_loss" in record:
            shown = {"loss": loss_value, "tok/s": round(record["tokens_per_s"]), "time": f"{dt * 1e3:.0f}ms",
                     "mfu": f"{100 * record['mfu']:.1f}%"}
            if "val_loss" in record:
                shown["val"] = val_loss
            progress.update(step + 1, **shown)
        if last or cfg.ckpt_interval and (step + 1) % cfg.ckpt_interval == 0:
            save(step + 1)
    progress.close()
    metrics.close()
    engine.close()
    grid.free()

    summary = {
        "steps": end_step,
        "first_loss": metrics.records[0]["loss"] if metrics.records else math.nan,
        "last_loss": metrics.records[-1]["loss"] if metrics.records else math.nan,
        "val_loss": val_loss,
        "tokens_per_s": metrics.median("tokens_per_s"),
        "step_time_s": metrics.median("step_time_s"),
        "mfu": metrics.median("mfu"),
        "peak_flops": peak,
        "world_size": ctx.size,
        "layout": summary_layout,
        "num_parameters": num_parameters(model_cfg),
    }
    if is_main:
        _write_summary(out, summary)
        print(json.dumps(summary))
    return summary


def _write_summary(out: Path, summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(out / "summary.json")


if __name__ == "__main__":
    main()
