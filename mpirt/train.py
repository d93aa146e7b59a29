"""Train a model: ``[mpiexec -n N] python -m mpirt.train [CONFIG.toml] [--key=value ...]``.

One linear script, nanoGPT style: configure, check the layout, load data and model, shard it over
the dp x pp x tp grid, loop over optimizer steps (each ``grad_accum`` micro-batches of the global
batch), evaluate, checkpoint, summarise. ``python -m mpirt.train --help`` lists every key.
Everything that can be refused is refused before the first collective, naming the key.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import mpirt.backend as B
from mpirt import comm
from mpirt.checkpoint import is_checkpoint, load_state, read_checkpoint_meta, save_state
from mpirt.config import ConfigError, parse_args
from mpirt.data import TokenDataset, default_dataset_dir, get_batch, get_eval_batch, num_eval_batches, \
    split_microbatches
from mpirt.distributed import init_distributed
from mpirt.grid import Grid, check_layout, resolve_dp
from mpirt.monitor import Metrics, Progress, measure_peak_flops
from mpirt.optim import AdamW, clip_grad_norm, cosine_lr
from mpirt.parallel import tensor as TP
from mpirt.parallel.data import DataParallel
from mpirt.parallel.state import gather_state, scatter_state
from mpirt.parallel.zero import ZeroOptimizer
from mpirt.tensor import no_grad
from models import build_model
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
    if cfg.pp > 1:
        raise ConfigError(f"pp: pipeline parallelism (pp={cfg.pp}) is not available yet")
    if cfg.zero and cfg.tp > 1:
        raise ConfigError(f"zero: ZeRO (zero={cfg.zero}) together with tp={cfg.tp} is not supported yet")
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
    if layout["tp"] > 1:
        try:
            TP.check_tp_layout(layout["tp"], n_head=model_cfg.n_head, n_embd=model_cfg.n_embd,
                               hidden=model_cfg.hidden, vocab_size=model_cfg.vocab_size, seq_len=cfg.seq_len,
                               sequence_parallel=cfg.sequence_parallel)
        except ValueError as err:
            raise ConfigError(f"tp: {err}") from None


def evaluate(model, tokens, grid: Grid, *, batches: int, batch_size: int, seq_len: int) -> float:
    """Mean loss over the first ``batches`` x ``batch_size`` consecutive windows of ``tokens``,
    each dp rank taking its rows of every batch; the same number on any layout."""
    available = num_eval_batches(tokens, batch_size, seq_len)
    if batches > available:
        raise ValueError(f"eval_batches: {batches} requested but the validation split holds only "
                         f"{available} batches of {batch_size} x {seq_len} tokens")
    model.eval()
    total = 0.0
    with no_grad():
        for i in range(batches):
            x, y = get_eval_batch(tokens, i, batch_size=batch_size, seq_len=seq_len,
                                  dp_rank=grid.coords["dp"], dp_size=grid.sizes["dp"])
            total += model(B.asarray(x), B.asarray(y))[1].item()
    model.train()
    return grid.comm["dp"].allreduce_scalar(total / batches, "avg")


def main(argv=None) -> dict:
    comm.install_abort_on_error()
    world = comm.world()
    try:
        cfg = parse_args(argv)
        layout = plan_layout(cfg, world.size)
        model_cfg, hf_weights, resume = resolve_model(cfg)
        data = TokenDataset(cfg.data or default_dataset_dir())
        check_fit(cfg, model_cfg, data, layout)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        if world.rank == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)

    ctx = init_distributed(cfg.seed, cfg.backend, config=cfg.to_dict())  # all ranks: same config
    grid = Grid(layout["dp"], layout["pp"], layout["tp"])
    dp, tp = grid.sizes["dp"], grid.sizes["tp"]
    tp_comm = grid.comm["tp"]
    is_main = ctx.rank == 0
    out = Path(cfg.out_dir)

    # Model: every layout starts from the same weights (full tensors from the seed, then sliced).
    model = build_model(model_cfg, dtype=cfg.dtype, seed=cfg.seed if tp == 1 else None)
    if tp > 1:
        TP.parallelize(model, tp_comm, sequence_parallel=cfg.sequence_parallel, seed=cfg.seed)
    TP.reseed_dropouts(model, ctx.rank_seed(f"dropout-dp{grid.coords['dp']}", rank=0), grid.coords["tp"],
                       cfg.sequence_parallel)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.zero:
        ddp, optimizer = None, ZeroOptimizer(model, grid.comm["dp"], stage=cfg.zero, lr=cfg.lr, betas=betas,
                                             weight_decay=cfg.weight_decay)
    else:
        ddp = DataParallel(model, grid.comm["dp"]) if dp > 1 else None
        optimizer = AdamW(model.parameters(), lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)
    start_step = 0
    if hf_weights is not None:
        scatter_state(model, optimizer, hf_weights, None, tp_comm)
    if resume:
        meta, weights, state = load_state(cfg.init_from)
        scatter_state(model, optimizer, weights, state, tp_comm)
        start_step = meta["step"]
    summary_layout = {"dp": dp, "tp": tp, "pp": grid.sizes["pp"]}

    def eval_loss() -> float:
        return evaluate(model, data.val, grid, batches=cfg.eval_batches, batch_size=cfg.batch_size,
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
        weights, state = gather_state(model, optimizer, tp_comm)
        if is_main:
            save_state(out / "ckpt", weights, state, step=step, config=cfg.to_dict(),
                       extra={"model_config": dataclasses.asdict(model_cfg), "data": str(data.directory),
                              "layout": summary_layout})

    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_per_step = model.flops_per_token(cfg.seq_len) * tokens_per_step
    peak = measure_peak_flops(cfg.dtype) * ctx.size
    metrics = Metrics(out / "metrics" / f"rank{ctx.rank}.jsonl")
    progress = Progress(cfg.steps, start_step, enabled=is_main and cfg.progress)
    val_loss = math.nan
    end_step = cfg.stop_after or cfg.steps
    for step in range(start_step, end_step):
        t0 = time.perf_counter()
        optimizer.lr = cosine_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=min(cfg.warmup_steps, cfg.steps),
                                 total_steps=cfg.steps)
        optimizer.zero_grad()
        x, y = get_batch(data.train, step, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                         dp_rank=grid.coords["dp"], dp_size=dp)
        micro = split_microbatches(x, y, cfg.grad_accum)
        loss_sum = 0.0
        for i, (xm, ym) in enumerate(micro):
            # gradients of all but the last micro-batch only accumulate locally
            with ddp.no_sync() if ddp and i < len(micro) - 1 else contextlib.nullcontext():
                _, loss = model(B.asarray(xm), B.asarray(ym))
                (loss * (1.0 / cfg.grad_accum)).backward()
            loss_sum += loss.item()
        if ddp:
            ddp.finish()
        TP.sync_sequence_parallel_grads(model, tp_comm)
        grad_norm = None
        if cfg.grad_clip > 0:
            if cfg.zero:
                grad_norm = optimizer.clip_grad_norm(cfg.grad_clip)
            elif tp > 1:
                grad_norm = TP.clip_grad_norm(model.parameters(), cfg.grad_clip, {"tp": tp_comm})
            else:
                grad_norm = clip_grad_norm(model.parameters(), cfg.grad_clip)
        optimizer.step()
        loss_value = grid.comm["dp"].allreduce_scalar(loss_sum / cfg.grad_accum, "avg")
        B.synchronize()
        dt = time.perf_counter() - t0
        record = {"step": step + 1, "loss": loss_value, "lr": optimizer.lr, "grad_norm": grad_norm,
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
    if ddp:
        ddp.close()

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
        "num_parameters": model.num_parameters(),
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
