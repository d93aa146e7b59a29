"""``python -m mpirt.plan``: rank the layouts of a model on a cluster, or calibrate this machine.

    python -m mpirt.plan --model gpt2-xl --nodes 8 --gpus-per-node 8 --gpu h100 --global-batch 512 --seq-len 2048
    python -m mpirt.plan --model tiny --gpu local --nodes 1 --gpus-per-node 4 --global-batch 8 --seq-len 128
    python -m mpirt.plan --calibrate [--ranks 2,4,8] [--save-as local]
"""
from __future__ import annotations

import argparse
import json
import sys

from mpirt.core.settings import format_size, parse_size
from mpirt.plan import hardware
from mpirt.plan.search import EstimateError, describe, plan, table, tp_options, training_flags


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpirt.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="preset name, model TOML or HF directory")
    ap.add_argument("--model-override", action="extend", nargs="+", default=[], metavar="FIELD=VALUE",
                    help="model config fields (one or more, repeatable), e.g. n_positions=2048 n_kv_head=8")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8, help="devices (ranks) per node")
    ap.add_argument("--gpu", default="h100", help=f"hardware preset: {', '.join(hardware.PRESETS)}, a calibrated "
                                                  "preset (local after --calibrate) or a JSON file")
    ap.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer step")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--dtype", default="", help="default bfloat16 on GPUs, float32 on CPUs")
    ap.add_argument("--memory-budget", default="", help="per device ('70GiB'); default the device memory")
    ap.add_argument("--schedules", default="1f1b,interleaved,zb-h1")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--all", action="store_true", help="every memory setting that fits, not only the cheapest")
    ap.add_argument("--json", default="", help="also write the ranked estimates to this file")
    ap.add_argument("--emit-slurm", default="", metavar="FILE",
                    help="also write the sbatch script (python -m mpirt.slurm) that trains the best layout")
    ap.add_argument("--calibrate", action="store_true", help="measure this machine and save it as a preset")
    ap.add_argument("--ranks", default="2,4,8", help="--calibrate: the MPI rank counts to measure at")
    ap.add_argument("--save-as", default="local", help="--calibrate: the preset's name")
    a = ap.parse_args(argv)
    try:
        return run(a)
    except (ValueError, KeyError, OSError) as err:   # a bad preset, model, size or file: one line
        print(f"error: {err}", file=sys.stderr)
        return 2
    except EstimateError as err:  # a bug in the planner, not an answer: say so, with the layout
        print(f"error: planner bug: {err}", file=sys.stderr)
        return 3


def run(a) -> int:
    """The planner (or ``--calibrate``) for parsed arguments ``a``; returns the exit code."""
    if a.calibrate:
        from mpirt.plan.calibrate import calibrate

        ranks = [int(x) for x in a.ranks.split(",") if x]
        cluster = calibrate(ranks, a.save_as)
        path = hardware.save(cluster)
        print(f"calibrated: GEMM {max(cluster.gemm_rates.values()) / 1e9:.0f} GFLOP/s per core, elementwise "
              f"{cluster.memory_bandwidth / 1e9:.1f} GB/s, {cluster.op_overhead_s * 1e6:.1f} us per Function, "
              f"ew passes {cluster.ew_passes:.1f}, second thread +{100 * cluster.threads_per_core:.0f}%; "
              f"MPI at {sorted(cluster.collectives)} ranks; saved to {path}")
        return 0
    from mpirt.core.modeling import load_model_config

    overrides = {}
    for item in a.model_override:
        k, _, v = item.partition("=")
        overrides[k] = int(v) if v.lstrip("-").isdigit() else float(v) if v.replace(".", "", 1).isdigit() else v
    model_cfg = load_model_config(a.model, overrides)
    notes = []
    if a.seq_len > model_cfg.n_positions:  # planning a longer context than the preset's table
        notes.append(f"--seq-len {a.seq_len} is longer than {a.model}'s n_positions {model_cfg.n_positions}: planned "
                     f"with n_positions {a.seq_len} (train with --model.n_positions={a.seq_len})")
        model_cfg.n_positions = a.seq_len
    cluster = hardware.load(a.gpu).with_shape(a.nodes, a.gpus_per_node)
    tps = tp_options(model_cfg, cluster)
    if tps == [1] and cluster.devices_per_node > 1:
        notes.append(f"tp 1 only: tp must divide n_head={getattr(model_cfg, 'n_head', 1)} and the {cluster.devices} "
                     f"devices, within a node's {cluster.devices_per_node}")
    dtype = a.dtype or ("float32" if cluster.cores else "bfloat16")
    budget = parse_size(a.memory_budget) if a.memory_budget else None
    ests, tried = plan(model_cfg, cluster, a.global_batch, a.seq_len, dtype, budget, every=a.all,
                       schedules=tuple(a.schedules.split(",")))
    print(f"{a.model} on {a.nodes} x {a.gpus_per_node} {cluster.name} ({cluster.source}), global batch "
          f"{a.global_batch} x {a.seq_len}, {dtype}, budget {format_size(budget or cluster.memory_bytes)} per device: "
          f"{len(ests)} feasible of {tried} layouts tried")
    for note in notes:
        print(f"note: {note}")
    if not ests:
        print("no layout fits: more devices, a larger budget or a shorter sequence")
        return 1
    print(table(ests, a.top))
    best = ests[0]
    print(f"best: {describe(best)}: {best.step_s:.3g} s/step, {best.tokens_per_s:,.0f} tokens/s, MFU "
          f"{100 * best.mfu:.1f}%, largest rank {format_size(best.memory['peak'])}" +
          (f" ({'; '.join(best.notes)})" if best.notes else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([e.as_dict() for e in ests], f, indent=1, default=str)
    if a.emit_slurm:
        base = load_model_config(a.model, {})
        with open(a.emit_slurm, "w") as f:
            f.write(job_script(best, a, training_flags(best, a.global_batch, a.seq_len, model_cfg, base), cluster))
        print(f"job script of the best layout: {a.emit_slurm} (sbatch {a.emit_slurm} RUN_DIR)")
    return 0


def job_script(est, a, flags: list, cluster) -> str:
    """The sbatch script (:func:`mpirt.run.slurm.render`) that trains layout ``est`` of the parsed
    planner arguments ``a`` on its cluster: the multi-node template's settings across nodes, the
    single-node one's on one, the CPU one's on a CPU preset; the run directory left to sbatch's
    command line. SlurmScriptError (a ValueError: one line, exit 2) names what the job writer refused."""
    import dataclasses

    from mpirt.run.slurm import TEMPLATES, job_layout, render

    name = "cpu" if cluster.cores else "multi_node" if a.nodes > 1 else "single_node"
    lay = est.layout
    spec = dataclasses.replace(TEMPLATES[name][1], template=name, nodes=a.nodes, ntasks_per_node=a.gpus_per_node,
                               gpus_per_node=0 if cluster.cores else a.gpus_per_node, model=a.model,
                               dp=lay["dp"], tp=lay["tp"], pp=lay["pp"], cp=lay.get("cp", 1), ep=lay.get("ep", 1),
                               train_args=flags)
    text = render(spec)
    job_layout(spec)  # its training arguments as mpirt.train reads them, against the model
    return text


if __name__ == "__main__":
    sys.exit(main())
