"""Train a model: ``python -m mpirt.train [CONFIG.toml] [--key=value ...]``.

One linear script, nanoGPT style: configure, load data and model, loop over optimizer steps
(each one ``grad_accum`` micro-batches of the global batch), evaluate, checkpoint, summarise.
``python -m mpirt.train --help`` lists every key.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import mpirt.backend as B
from mpirt import comm
from mpirt.checkpoint import is_checkpoint, load_checkpoint, read_checkpoint_meta, save_checkpoint
from mpirt.config import ConfigError, parse_args
from mpirt.data import TokenDataset, default_dataset_dir, get_batch, get_eval_batch, num_eval_batches, \
    split_microbatches
from mpirt.monitor import Metrics, Progress, measure_peak_flops
from mpirt.optim import AdamW, clip_grad_norm, cosine_lr
from mpirt.tensor import no_grad
from models import build_model
from models.config import GPTConfig
from models.hf import load_hf_gpt2
from models.presets import load_model_config


def evaluate(model, tokens, *, batches: int, batch_size: int, seq_len: int) -> float:
    """Mean loss over the first ``batches`` x ``batch_size`` consecutive windows of ``tokens``."""
    available = num_eval_batches(tokens, batch_size, seq_len)
    if batches > available:
        raise ValueError(f"eval_batches: {batches} requested but the validation split holds only "
                         f"{available} batches of {batch_size} x {seq_len} tokens")
    model.eval()
    total = 0.0
    with no_grad():
        for i in range(batches):
            x, y = get_eval_batch(tokens, i, batch_size=batch_size, seq_len=seq_len)
            total += model(B.asarray(x), B.asarray(y))[1].item()
    model.train()
    return total / batches


def resolve_model(cfg) -> tuple[GPTConfig, dict | None, dict | None]:
    """Model config, initial weights (or None) and checkpoint meta (or None) for ``cfg``."""
    source = cfg.init_from
    if source and is_checkpoint(source):
        meta = read_checkpoint_meta(source)
        return GPTConfig(**meta["extra"]["model_config"]), None, meta
    if source:
        if not (Path(source) / "config.json").exists():
            raise ConfigError(f"init_from: {source} is neither an mpirt checkpoint nor a HF GPT-2 directory")
        model_cfg, weights = load_hf_gpt2(source, dtype=cfg.dtype)
        return model_cfg, weights, None
    return load_model_config(cfg.model, cfg.model_overrides), None, None


def check_fit(cfg, model_cfg: GPTConfig, data: TokenDataset) -> None:
    """Refuse a run whose data or sequence length does not fit the model, naming both numbers."""
    if cfg.seq_len > model_cfg.n_positions:
        raise ConfigError(f"seq_len: {cfg.seq_len} exceeds the model's n_positions {model_cfg.n_positions}")
    if data.vocab_size is not None and data.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"data: vocabulary {data.vocab_size} of {data.directory} exceeds the model's "
                          f"vocab_size {model_cfg.vocab_size}")


def main(argv=None) -> dict:
    comm.install_abort_on_error()
    world = comm.world()
    try:
        cfg = parse_args(argv)
        if world.size > 1:
            raise ConfigError(f"world size {world.size}: parallel training (dp/tp/pp) is not available "
                              "yet; run on one rank")
        model_cfg, hf_weights, ckpt_meta = resolve_model(cfg)
        data = TokenDataset(cfg.data or default_dataset_dir())
        check_fit(cfg, model_cfg, data)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)

    B.select(cfg.backend)
    B.bind_device(world.local_rank)
    out = Path(cfg.out_dir)
    model = build_model(model_cfg, dtype=cfg.dtype, seed=cfg.seed)
    optimizer = AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    start_step = 0
    if hf_weights is not None:
        model.load_state_dict(hf_weights)
    if ckpt_meta is not None:
        start_step = load_checkpoint(cfg.init_from, model, optimizer)["step"]
    is_main = world.rank == 0

    if cfg.eval_only:
        val_loss = evaluate(model, data.val, batches=cfg.eval_batches, batch_size=cfg.batch_size,
                            seq_len=cfg.seq_len)
        if is_main:
            print(json.dumps({"val_loss": val_loss, "eval_batches": cfg.eval_batches,
                              "batch_size": cfg.batch_size, "seq_len": cfg.seq_len}))
            _write_summary(out, {"val_loss": val_loss, "steps": start_step, "world_size": world.size,
                                 "layout": {"dp": 1, "tp": 1, "pp": 1}})
        return {"val_loss": val_loss}

    flops_per_step = model.flops_per_token(cfg.seq_len) * cfg.batch_size * cfg.seq_len
    peak = measure_peak_flops(cfg.dtype)
    metrics = Metrics(out / "metrics" / f"rank{world.rank}.jsonl")
    progress = Progress(cfg.steps, start_step, enabled=is_main and cfg.progress)
    model.zero_grad()
    val_loss = math.nan
    end_step = cfg.stop_after or cfg.steps
    for step in range(start_step, end_step):
        t0 = time.perf_counter()
        optimizer.lr = cosine_lr(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps,
                                 total_steps=cfg.steps)
        x, y = get_batch(data.train, step, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
        loss_sum = 0.0
        for xm, ym in split_microbatches(x, y, cfg.grad_accum):
            _, loss = model(B.asarray(xm), B.asarray(ym))
            (loss * (1.0 / cfg.grad_accum)).backward()
            loss_sum += loss.item()
        grad_norm = clip_grad_norm(model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
        optimizer.step()
        model.zero_grad()
        B.synchronize()
        dt = time.perf_counter() - t0
        loss_value = loss_sum / cfg.grad_accum
        record = {"step": step + 1, "loss": loss_value, "lr": optimizer.lr, "grad_norm": grad_norm,
                  "step_time_s": dt, "tokens_per_s": cfg.batch_size * cfg.seq_len / dt,
                  "mfu": flops_per_step / dt / peak}
        last = step + 1 == end_step
        if cfg.eval_interval and (step + 1) % cfg.eval_interval == 0 or last:
            val_loss = evaluate(model, data.val, batches=cfg.eval_batches, batch_size=cfg.batch_size,
                                seq_len=cfg.seq_len)
            record["val_loss"] = val_loss
        metrics.log(**record)
        if (step + 1) % cfg.log_interval == 0 or step == start_step or last or "val_loss" in record:
            shown = {"loss": loss_value, "tok/s": round(record["tokens_per_s"]), "time": f"{dt * 1e3:.0f}ms",
                     "mfu": f"{100 * record['mfu']:.1f}%"}
            if "val_loss" in record:
                shown["val"] = val_loss
            progress.update(step + 1, **shown)
        if is_main and (last or cfg.ckpt_interval and (step + 1) % cfg.ckpt_interval == 0):
            save_checkpoint(out / "ckpt", model, optimizer, step=step + 1, config=cfg.to_dict(),
                            extra={"model_config": dataclasses.asdict(model_cfg), "data": str(data.directory)})
    progress.close()
    metrics.close()

    summary = {
        "steps": end_step,
        "first_loss": metrics.records[0]["loss"] if metrics.records else math.nan,
        "last_loss": metrics.records[-1]["loss"] if metrics.records else math.nan,
        "val_loss": val_loss,
        "tokens_per_s": metrics.median("tokens_per_s"),
        "step_time_s": metrics.median("step_time_s"),
        "mfu": metrics.median("mfu"),
        "peak_flops": peak,
        "world_size": world.size,
        "layout": {"dp": 1, "tp": 1, "pp": 1},
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
