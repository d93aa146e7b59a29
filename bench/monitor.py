"""What monitoring costs: training steps with the default monitoring against steps without it.

One engine (the default run's model and batch, or whatever ``--key=value`` training options say)
runs the training loop's step twice over, as contenders that take turns step by step
(:func:`common.alternate`): ``on`` brackets the step with :class:`mpirt.monitor.live.RunMonitor` at
default settings (parts, comm window, memory, trace of its first steps, the stragglers' allgather
every ``log_interval`` steps, TensorBoard) and writes the full metrics record; ``off`` is
``--monitor false`` (loss, time and MFU only). Overhead = per-round ratio on/off - 1 (median
[min-max]). Under ``mpiexec`` every round's time is the slowest rank's.

    [mpiexec -n N] python bench/monitor.py [--repeats 40] [--quiet-wait 120] [training options]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as BC  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40, help="timed steps per contender")
    parser.add_argument("--quiet-wait", type=float, default=0.0, help="wait up to N s for a quiet machine")
    args, train_args = parser.parse_known_args()

    import mpirt.core.backend as B
    from mpirt.run.config import parse_args
    from mpirt.data.tokens import get_batch
    from mpirt.run.distributed import init_distributed
    from mpirt.parallel.grid import Grid
    from mpirt.core.modeling import flops_per_token, load_model_config
    from mpirt.monitor.live import Metrics, RunMonitor
    from mpirt.parallel.engine import Engine, Hyper
    from mpirt.run.prepare import open_dataset, plan_layout, vocab_from_data

    cfg = parse_args(train_args)
    ctx = init_distributed(cfg.seed, cfg.backend)
    layout = plan_layout(cfg, ctx.size)
    data = open_dataset(cfg.data)
    model_cfg = vocab_from_data(cfg, load_model_config(cfg.model, cfg.model_overrides), data, layout["tp"])
    layout = plan_layout(cfg, ctx.size, model_cfg)  # as mpirt.train builds it
    grid = Grid(**layout)
    engine = Engine(layout, model_cfg, grid, Hyper.of(cfg), dropout_seed=1)
    flops_per_step = flops_per_token(model_cfg, cfg.seq_len) * cfg.batch_size * cfg.seq_len
    tmp = Path(tempfile.mkdtemp(prefix="mpirt-bench-monitor-")) if ctx.rank == 0 else None
    out = Path(ctx.comm.broadcast_object(str(tmp) if tmp else None))
    contenders, monitors, metrics = {}, {}, {}
    inside = {"off": [], "on": []}  # seconds per step spent in the monitor's calls and the metrics line

    def make(name: str, on: bool):
        mcfg = dataclasses.replace(cfg, monitor=on)
        mon = monitors[name] = RunMonitor(mcfg, ctx, grid, engine, model_cfg, out / name, 0, flops_per_step)
        log = metrics[name] = Metrics(out / name / "metrics" / f"rank{ctx.rank}.jsonl")
        step = [0]

        def one_step() -> None:  # the training loop's step and what it logs
            i, clock = step[0], time.perf_counter
            c0 = clock()
            mon.begin(i + 1)
            t0 = c1 = clock()
            x, y = get_batch(data.train, i, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                             dp_rank=grid.coords["dp"], dp_size=grid.sizes["dp"])
            c2 = clock()
            mon.mark("data")
            c3 = clock()
            loss = engine.train_step(x, y)
            c4 = clock()
            mon.mark("train_step")
            c5 = clock()
            engine.clip(cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            engine.optimizer.step()
            B.synchronize()
            c6 = clock()
            mon.mark("optimizer")
            record = {"step": i + 1, "loss": loss, **mon.end(i + 1, clock() - t0, engine.stats)}
            if (i + 1) % cfg.log_interval == 0:
                mon.interval(record)
            log.log(**record)
            inside[name].append((c1 - c0) + (c3 - c2) + (c5 - c4) + (clock() - c6))
            step[0] += 1
        contenders[name] = one_step

    make("off", False)
    make("on", True)
    BC.wait_for_quiet(args.quiet_wait)
    load = BC.LoadMonitor().start()
    times = BC.alternate(contenders, args.repeats, warmup=2, before=ctx.comm.barrier)
    own = sum(ctx.comm.allgather_object(load.own_since_start()))
    times = BC.slowest_rank(times, ctx.comm.mpi) if ctx.size > 1 else times
    load.stop(own)
    for name in contenders:
        monitors[name].finish(metrics[name].records)
        metrics[name].close()
    if ctx.rank != 0:
        return
    own = {k: BC.spread(v[2:]) for k, v in inside.items()}  # rank 0's; warm-up rounds left out
    extra = own["on"]["median"] - own["off"]["median"]
    ratio = BC.paired_ratio(times["on"], times["off"])
    overhead = {k: (v - 1.0 if k != "n" else v) for k, v in ratio.items()}
    step_ms = BC.spread(times["off"])["median"]
    rows = [["off (--monitor false)", BC.fmt_spread(BC.spread(times["off"])), BC.fmt_spread(own["off"], 1e6, 0), ""],
            ["on (default monitoring)", BC.fmt_spread(BC.spread(times["on"])), BC.fmt_spread(own["on"], 1e6, 0),
             f"{100 * overhead['median']:+.2f}% [{100 * overhead['min']:+.2f}% to {100 * overhead['max']:+.2f}%]"]]
    lay = layout.describe()
    BC.write_results("monitor", f"Monitoring overhead: {cfg.model}, batch {cfg.batch_size} x {cfg.seq_len}, {lay}, "
                     f"{ctx.size} rank(s)", ["contender", "step ms median [min-max]", "in monitor calls, us", "overhead per round"],
                     rows, load, {"times": times, "overhead": overhead, "monitor_calls_s": inside,
                                  "monitor_extra_share": extra / step_ms, "repeats": args.repeats,
                                  "train_args": train_args},
                     notes=[f"{args.repeats} alternated rounds after 2 warm-up rounds; overhead = per-round on/off - 1",
                            f"time in the monitor's calls and the metrics line, on - off: {1e6 * extra:.0f} us per "
                            f"step = {100 * extra / step_ms:.2f}% of the median step (rank 0; less load-sensitive "
                            f"than the step ratio)"])


if __name__ == "__main__":
    main()
