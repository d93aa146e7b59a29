"""Run monitoring: the progress line on rank 0, per-rank JSONL metrics, and :class:`RunMonitor`,
which ties together what a training run measures: the honest MFU and GEMM floor
(:mod:`mpirt.monitor.flops`), the per-step breakdown and stragglers (:mod:`mpirt.monitor.steps`), the
Chrome trace (:mod:`mpirt.monitor.trace`), GPU sampling (:mod:`mpirt.monitor.gpu`) and TensorBoard scalars
(when the ``tensorboard`` extra is installed).

Over 400 lines: the live view's parts (progress, metrics, RunMonitor) share the step's records.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import mpirt.core.backend as B
from mpirt.monitor import flops, gpu, steps
from mpirt.monitor.steps import aggregate, owned_bytes


def format_seconds(seconds: float) -> str:
    """``75.2`` -> ``1m15s``; ``4000`` -> ``1h06m``; under a minute with one decimal."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


class Progress:
    """The rank-0 progress display: a tqdm bar on a terminal (redrawn in place; a plain
    redrawn line when tqdm is not installed), a line per update otherwise (a log file, SLURM
    output: never control characters). Shows the elapsed time of this run and the time left at
    its pace so far to ``total`` (or to ``end`` when this job ends earlier)."""

    def __init__(self, total: int, start: int = 0, stream=sys.stderr, enabled: bool = True, end: int | None = None):
        self.total, self.start, self.done, self.stream, self.enabled = total, start, start, stream, enabled
        self.end = total if end is None else end
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled and self.tty:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=start, file=stream, dynamic_ncols=True, leave=True,
                                bar_format="{n_fmt}/{total_fmt} |{bar}| {postfix} [{elapsed}<{remaining}]")
            except ImportError:
                pass

    def update(self, step: int, **fields) -> None:
        """Show ``step`` of ``total`` with ``fields`` (name -> number or text)."""
        if not self.enabled:
            return
        self.done = step
        parts = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(parts, refresh=False)
            self.bar.refresh()
            return
        width = 24
        filled = int(width * step / max(self.total, 1))
        elapsed = time.perf_counter() - self.t0
        left = elapsed / (step - self.start) * (self.end - step) if step > self.start else math.inf
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} {parts} "
                f"| {format_seconds(elapsed)} elapsed, {format_seconds(left)} left")
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _json_or_none(line: str):
    """A metrics line, or None for one cut short when a job was killed mid-write."""
    try:
        return json.loads(line)
    except ValueError:
        return None


class Metrics:
    """Per-step records: kept in memory for the summary and written to ``path`` as JSON lines.

    A fresh run (``resume_step`` None) starts the file empty. A resumed run keeps the records up to
    ``resume_step`` (the checkpoint's step) and drops the later ones, which the resumed run is
    about to redo: the file then holds each step once, as an uninterrupted run's would. Its first
    record has ``resumed_from``: the checkpoint's step (the report marks the resume there)."""

    def __init__(self, path: str | Path | None, resume_step: int | None = None):
        self.records: list[dict] = []
        self.file = None
        self.resumed_from = resume_step
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and path.exists():
                self.records = [r for r in map(_json_or_none, path.read_text().splitlines())
                                if r is not None and r.get("step", 0) <= resume_step]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            tmp.replace(path)
            self.file = open(path, "a", buffering=1)

    def log(self, **record) -> None:
        if self.resumed_from is not None:
            record["resumed_from"], self.resumed_from = self.resumed_from, None
        self.records.append(record)
        if self.file:
            try:
                self.file.write(json.dumps(record) + "\n")
            except OSError as err:   # name the file (a write on an open file says only the errno)
                raise OSError(err.errno, err.strerror, self.file.name) from None

    def median(self, key: str, skip_first: int = 1) -> float:
        """Median of ``key`` over the records, skipping warm-up steps when there are enough."""
        values = [r[key] for r in self.records if key in r]
        if len(values) > skip_first:
            values = values[skip_first:]
        return statistics.median(values) if values else math.nan

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None


def tensorboard_writer_class():
    """``tensorboard.summary.Writer``, or None without the ``tensorboard`` extra. Rank 0 imports
    it before its memory baseline is measured (:func:`mpirt.plan.memory.measured_baseline`): the
    package's modules are ~9 MiB of the process, resident from then on."""
    try:
        from tensorboard.summary import Writer
    except Exception:  # not installed, or an install that fails to import: no scalars, the run goes on
        return None
    return Writer


class _TensorBoard:
    """Scalars to ``directory`` through ``tensorboard.summary.Writer`` (the ``tensorboard``
    extra); :attr:`note` says why there are none when it is not installed."""

    def __init__(self, directory: Path):
        writer = tensorboard_writer_class()
        if writer is None:
            self.writer, self.note = None, "off (pip install mpirt[tensorboard])"
            return
        self.writer, self.note = writer(str(directory)), str(directory)

    def add(self, step: int, scalars: dict) -> None:
        if self.writer is not None:
            for tag, value in scalars.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(tag, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# per-step figures shown in TensorBoard (rank 0's), beside the ranks' spread
_TB_KEYS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "step_over_gemm_floor",
            "compute_s", "mpi_wait_s", "comm_s", "bubble_s", "dp_exposed_s", "memory_bytes", "moe_imbalance",
            "moe_expert_load", "moe_busiest_expert_load", "moe_dropped", "moe_aux_loss")


def expert_figures(routers) -> dict:
    """A mixture of experts' routing in the step's last micro-batch, over this rank's layers
    (``routers``: modules whose ``stats`` hold ``tokens_per_expert``, ``dropped``, ``aux_loss``):
    ``moe_tokens_per_expert`` (summed over the layers), ``moe_imbalance`` (the busiest expert's
    tokens over the mean, 1 when balanced), ``moe_dropped`` (assignments over capacity) and
    ``moe_aux_loss`` (the layers' mean load-balancing loss); under expert parallelism
    ``moe_expert_load``: the rows this rank's experts ran in the step's layers and micro-batches
    over its own tokens x top_k (1: even routing; what the memory prediction's ``expert_load``
    means; the hooks' count restarts); ``moe_busiest_expert_load``: in this rank's deepest layer,
    the most rows one of its experts ran in one forward over an expert's even share (``top_k`` x the
    ep group's tokens / ``n_expert``; the prediction's ``busiest_expert``): under ep the step's
    largest, without it the last micro-batch's (the router's ``tokens_per_expert``). The deepest
    layer's: its backward runs first, beside every layer's kept activations, where its experts'
    transient makes the step's peak (an earlier layer's runs after the later ones' are freed).
    ``moe_expert_load_per_layer`` and ``moe_busiest_expert_load_per_layer``: the same per layer of
    this rank, in model order (an earlier layer whose experts ran more can make the peak: the
    prediction at the measured loads takes them). {} without routers."""
    stats = [m.stats for m in routers if m.stats]
    if not stats:
        return {}
    counts = [sum(int(s["tokens_per_expert"][e]) for s in stats) for e in range(len(stats[0]["tokens_per_expert"]))]
    mean = sum(counts) / len(counts)
    out = {"moe_tokens_per_expert": counts, "moe_imbalance": max(counts) / mean if mean else 0.0,
           "moe_dropped": sum(s["dropped"] for s in stats),
           "moe_aux_loss": sum(s["aux_loss"] for s in stats) / len(stats)}
    hooks = [m.expert_parallel for m in routers if m.expert_parallel is not None]
    if hooks:
        ran, assigned, busiest = zip(*(h.take_load() for h in hooks))
        out["moe_expert_load"] = sum(ran) / sum(assigned) if sum(assigned) else 0.0
        out["moe_expert_load_per_layer"] = [r / a if a else 0.0 for r, a in zip(ran, assigned)]
    else:  # one rank runs every expert of its tokens' assignments (dropped ones included in the share)
        busiest = [max(s["tokens_per_expert"]) * len(s["tokens_per_expert"]) / (sum(s["tokens_per_expert"]) + s["dropped"])
                   for s in stats]
    out["moe_busiest_expert_load"] = busiest[-1]
    out["moe_busiest_expert_load_per_layer"] = list(busiest)
    return out


class RunMonitor:
    """What a training run measures beyond loss and time, on every rank (collective at start,
    at :meth:`interval` and at :meth:`finish`). Build it right after a world barrier: its clock
    then is the trace's origin.

    Always: the peak and MFU, the GEMM rate and floor (:mod:`mpirt.monitor.flops`). With
    ``cfg.monitor``: the per-step breakdown (:class:`mpirt.monitor.steps.StepMonitor`), stragglers
    every logging interval, the trace of ``cfg.trace_steps`` steps (from the second step of the
    run), GPU samples and TensorBoard scalars on rank 0.
    """

    def __init__(self, cfg, ctx, grid, engine, model_cfg, out: Path, start_step: int, flops_per_step: float):
        from mpirt.cpu import threads
        from mpirt.monitor.trace import TraceRecorder

        self.cfg, self.ctx, self.grid, self.engine, self.out = cfg, ctx, grid, engine, out
        self.routers = [m for _, m in engine.model.named_modules()   # a mixture of experts' layers
                        if "tokens_per_expert" in getattr(m, "stats_keys", ())]
        self.world, self.is_main, self.enabled = ctx.comm, ctx.rank == 0, bool(cfg.monitor)
        self.flops_per_step = flops_per_step
        rows = max(1, engine.layout.rows) * engine.layout.tokens  # this rank's tokens of a micro-batch
        hidden = getattr(model_cfg, "hidden", 4 * model_cfg.n_embd) // grid.sizes["tp"]
        products = flops.layer_products(model_cfg.n_embd, hidden, rows, cfg.dtype)
        ceiling = (flops.cpu_ceiling(self.world, cfg.dtype, threads.num_threads())
                   if B.name == "numpy" and not cfg.peak_flops else None)
        self.world.barrier()  # every rank times together, sharing the node as in training
        # a best rate already recorded bounds the result from below: a short run confirms or beats it
        known = B.name == "numpy" and flops.known_gemm_rate(products, ctx.local_size) > 0
        rate = flops.gemm_rate(products, flops.GEMM_CONFIRM_S if known else flops.GEMM_MEASURE_S)
        if B.name == "numpy":  # a start under load must not make a peak that later steps beat
            rate = flops.remembered_gemm_rate(products, rate, ctx.local_size)
        cores = min(threads.num_threads(), (os.cpu_count() or 1) / ctx.local_size)
        if B.name == "numpy":  # ranks oversubscribing the cores get their share of them, not a core each
            rate *= cores / threads.num_threads()
        self.peak = flops.resolve_peak(cfg.dtype, cores, rate, cfg.peak_flops, ceiling)
        import numpy as np
        self.peak_total, self.gemm_total = (float(v) for v in self.world.allreduce(
            np.array([self.peak.per_rank, rate], dtype=np.float64), "sum"))  # the dtype never from the values
        self.steps = self.stepmon = self.trace = self.gpu = self.tb = None
        self.gpu_note = self.tb_note = "off (--monitor false)"
        self.origin = time.perf_counter()
        if not self.enabled:
            return
        coords = grid.coords
        label = f"rank {ctx.rank} (" + ", ".join(f"{a} {coords[a]}" for a in ("dp", "pp", "cp", "tp")
                                                  if a != "cp" or grid.sizes["cp"] > 1) + ")"
        if cfg.trace_steps:
            self.trace = TraceRecorder(ctx.rank, label, self.origin, start_step + 2, cfg.trace_steps)
        self.stepmon = steps.StepMonitor(self.trace)
        self.interval_stats, self.run_stats = steps.Interval(), steps.Interval()
        self.first_step = start_step + 1
        self.gpu, self.gpu_note = gpu.start()
        self.tb = _TensorBoard(out / "tensorboard") if self.is_main else None
        self.tb_note = self.tb.note if self.tb else ""
        self.last_aggregate: dict | None = None

    def describe(self) -> str:
        """The banner line: the peak and where it comes from, the GEMM rate, GPU sampling."""
        ranks = "" if self.ctx.size == 1 else f" for all {self.ctx.size} ranks"
        line = (f"mpirt: MFU against a peak of {self.peak_total / 1e12:.3g} TFLOP/s{ranks}, by "
                f"{self.peak.source}{'' if self.ctx.size == 1 else ' on rank 0'}: {self.peak.detail}; "
                f"GEMM rate {self.gemm_total / 1e12:.3g} TFLOP/s{ranks}")
        if self.enabled:
            line += f"; GPU: {self.gpu_note}"
        return line

    def begin(self, step: int) -> None:
        """Step ``step`` (counted from 1) starts."""
        if self.stepmon:
            self.stepmon.begin(step)
            if self.trace is not None:  # the local part lists its actions while traced
                self.engine.local.trace = self.trace.recording

    def mark(self, part: str) -> None:
        """The time since the previous mark went to ``part`` (see :mod:`mpirt.monitor.steps`)."""
        if self.stepmon:
            self.stepmon.mark(part)

    def end(self, step: int, seconds: float, engine_stats: dict) -> dict:
        """The step's figures for its metrics record: MFU, ``step_over_gemm_floor`` and, with
        monitoring on, the breakdown. ``seconds``: the step's wall time."""
        out = {"mfu": self.flops_per_step / seconds / self.peak_total,
               "step_over_gemm_floor": seconds * self.gemm_total / self.flops_per_step,
               **expert_figures(self.routers)}
        if self.stepmon:
            out.update(self.stepmon.end(engine_stats))
            if self.trace is not None and self.trace.recording:
                self.trace_end = time.perf_counter()
            if step > self.first_step:  # the first step warms up: not a straggler figure
                self.interval_stats.add({**out, "step_time_s": seconds})
                self.run_stats.add({**out, "step_time_s": seconds})
        return out

    def interval(self, record: dict) -> dict:
        """Collective, at every logging interval: the ranks' spread into rank 0's ``record``
        (``stragglers``), GPU means into every rank's, TensorBoard scalars. Returns the extra
        progress-line fields (rank 0)."""
        if not self.enabled:
            return {}

        if self.gpu is not None:
            samples = self.gpu.drain()
            record.update({k: round(v, 3) for k, v in gpu.mean(samples).items()})
            if self.trace is not None:
                for t, s in samples:
                    if t <= getattr(self, "trace_end", math.inf):
                        self.trace.add_counter(t, "GPU %", {"util": s["gpu_util"], "mem_bw": s["gpu_mem_bw_util"]})
        agg = aggregate(self.interval_stats, self.world)
        if not self.is_main:
            return {}
        self.last_aggregate = agg
        record["stragglers"] = agg
        step = record["step"]
        self.tb.add(step, {k: record[k] for k in _TB_KEYS if k in record})
        self.tb.add(step, {f"ranks/{k}_{s}": v for k, d in agg["ranks"].items() for s, v in d.items()})
        shown = {}
        t = record.get("step_time_s", 0.0)
        if t > 0 and "comm_s" in record:
            shown["comm"] = f"{100 * record['comm_s'] / t:.0f}%"
            if self.grid.sizes["pp"] > 1:
                shown["bubble"] = f"{100 * record['bubble_s'] / t:.0f}%"
        if self.ctx.size > 1 and agg["slowest_compute_over_median"] > 1.1:
            shown["slowest"] = f"rank {agg['slowest_rank']} (x{agg['slowest_compute_over_median']:.2f})"
        return shown

    def finish(self, records: list[dict]) -> dict:
        """Collective, after the last step: the trace joined on rank 0 (``OUT_DIR/trace.json``),
        memory per rank, the whole run's straggler figures. Returns on rank 0 the summary's
        monitoring fields (the peak and GEMM figures on every rank)."""
        from mpirt.monitor import trace as T

        out = {"peak_flops_source": self.peak.source, "peak_flops_detail": self.peak.detail,
               "gemm_rate_flops": self.gemm_total,
               "step_over_gemm_floor": _median(records, "step_over_gemm_floor")}
        if not self.enabled:
            return out
        if self.gpu is not None:
            self.gpu.close()
        parts = self.out / "trace"
        if self.trace is not None:
            self.trace.write(parts / f"rank{self.ctx.rank}.json")
        agg = aggregate(self.run_stats, self.world)
        memory = self.world.allgather_object(memory_by_category(self.engine, records, self.stepmon.peak_stash_bytes))
        if self.tb:
            self.tb.close()
        if not self.is_main:
            return out
        if self.trace is not None:
            T.merge([parts / f"rank{r}.json" for r in range(self.ctx.size)], self.out / "trace.json",
                    {"layout": dict(self.grid.sizes), "steps": [self.trace.first, self.trace.last]})
            parts.rmdir()
        keys = sorted({k for r in records for k in r if k.endswith("_s") or k.endswith("_bytes")})
        out["monitor"] = {"breakdown": {k: _median(records, k) for k in keys}, "stragglers": agg,
                          "memory_per_rank": memory, "gpu": self.gpu_note, "tensorboard": self.tb_note,
                          "trace": str(self.out / "trace.json") if self.trace is not None else None}
        return out


def monitor_lines(s: dict, out: Path) -> list[str]:
    """The end block's monitoring lines (rank 0) from the summary ``s``."""
    lines = [f"mpirt:   MFU {100 * s['mfu']:.1f}% of {s['peak_flops'] / 1e12:.3g} TFLOP/s (peak, all ranks: "
             f"{s['peak_flops_source']}); step / GEMM floor {s['step_over_gemm_floor']:.2f}x "
             f"(GEMM rate {s['gemm_rate_flops'] / 1e12:.3g} TFLOP/s, all ranks)"]
    mon = s.get("monitor")
    if not mon:
        return lines
    b, t = mon["breakdown"], s["step_time_s"]
    share = {k: 100 * b.get(f"{k}_s", 0.0) / t for k in ("comm", "bubble")} if t > 0 else {}
    share = {"compute": 100 - sum(share.values()), **share}
    line = "mpirt:   step " + " + ".join(f"{k} {v:.0f}%" for k, v in share.items() if v >= 0.5 or k == "compute")
    if s["layout"]["dp"] * s["layout"].get("cp", 1) > 1:
        line += f"; dp sync exposed {1e3 * b['dp_exposed_s']:.1f} ms, hidden {1e3 * b['dp_hidden_s']:.1f} ms"
    if s["layout"].get("ep", 1) > 1:  # the experts' token exchanges, a step's median
        line += (f"; expert all-to-alls {1e3 * b.get('comm_ep_s', 0.0):.1f} ms "
                 f"({b.get('comm_ep_bytes', 0.0) / 2**20:.2f} MiB sent)")
    agg = mon.get("stragglers")
    if agg and s["world_size"] > 1:
        line += (f"; slowest rank {agg['slowest_rank']} (compute x{agg['slowest_compute_over_median']:.2f} "
                 f"the median)")
    lines.append(line)
    lines.append(f"mpirt:   trace {mon['trace'] or 'off'}, TensorBoard {mon['tensorboard']}; plots: "
                 f"python -m mpirt.report {out}")
    return lines


def _median(records: list[dict], key: str) -> float:
    """Median of ``key`` over ``records`` after the first (warm-up) one, when there are more."""
    values = [r[key] for r in records if key in r]
    values = values[1:] if len(values) > 1 else values
    return statistics.median(values) if values else math.nan


def memory_by_category(engine, records: list[dict], activations: int = 0) -> dict:
    """Bytes this rank holds: parameters, gradients, optimizer state (persistent), the pipeline's
    peak stash of ``activations``, the peak resident set (host) and the CuPy pool's, with the
    budget they must fit: the GPU's memory, else this node's memory over its ranks."""
    from mpirt import comm

    opt = engine.optimizer
    if hasattr(opt, "memory_bytes"):
        held = opt.memory_bytes()
    else:
        params = getattr(opt, "params", [])
        grads = {id(p.grad.base if p.grad.base is not None else p.grad): p.grad for p in params if p.grad is not None}
        held = {"params": sum(int(p.data.nbytes) for p in params),
                "grads": sum(int(g.base.nbytes if g.base is not None else g.nbytes) for g in grads.values()),
                "optimizer": sum(int(a.nbytes) for st in getattr(opt, "state", []) for a in st.values())}
    held["activations_peak"] = int(activations)
    held["host_peak"] = owned_bytes(peak=True)
    info = B.device_info()
    if info is not None:
        held["gpu_pool_peak"] = max((int(r.get("gpu_pool_bytes", 0)) for r in records), default=0)
        held["budget"] = info["total_memory"]
    else:
        held["budget"] = _host_memory() // comm.world().local_size
    return held


def _host_memory() -> int:
    """This node's memory (MemTotal), 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0

