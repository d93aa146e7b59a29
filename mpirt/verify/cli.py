"""``python -m mpirt.verify``: does this layout compute what one rank computes?

    mpiexec -n N python -m mpirt.verify [CONFIG.toml] [training flags] [--steps 3] [--layers L]
                                        [--reference "tp=2"] [--json PATH] [--work DIR]
    mpiexec -n N python -m mpirt.verify --replay CKPT_DIR [--against "dp=1 tp=2"] [--json PATH]

The first form takes exactly ``mpirt.train``'s flags (:func:`mpirt.run.config.parse_args`) and runs
the run's model at its real widths with the fewest blocks that keep every pipeline stage and chunk
non-empty (or ``--layers``), a short sequence (unless ``--seq-len``), the smallest batch both
layouts split (unless ``--batch-size``), in float64, ``--steps`` steps at the fixed learning rate
:data:`VERIFY_LR` with the run's dropout, on the run's layout (all ranks of the launch) and on the
reference (one rank, or the smaller layout ``--reference`` names), one after the other in this
launch. The second loads a checkpoint ``mpirt.train`` saved and runs the step after it (the run's
batch, dropout masks and learning rate, in the run's dtype) on the run's layout and on ``--against``
(default one rank). Both compare loss, gradient norm before clipping, routing and every weight
(:mod:`mpirt.verify.compare`) and exit 0 when equal within the stated tolerance, 1 when not, 2 on
bad input (one line naming it).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mpirt import comm
from mpirt.checkpoint.store import CheckpointError, CheckpointReader, read_checkpoint_meta
from mpirt.core.injected import check_environment
from mpirt.core.modeling import apply_overrides, config_from_dict, load_model_config
from mpirt.run.config import ConfigError, TrainConfig, parse_args
from mpirt.run.distributed import init_distributed
from mpirt.run.prepare import comm_timeout, open_dataset, resolve_model, vocab_from_data
from mpirt.verify.compare import TOLERANCES, abnormal_steps, build_report, compare_tensors, format_table
from mpirt.verify.sides import check_axes, layout_config, resolve, run_side, short_shape

EXIT_EQUAL, EXIT_DIFFERS, EXIT_BAD_INPUT = 0, 1, 2
VERIFY_LR = 1e-2       # AdamW moves every weight by about this much a step: a wrong gradient shows at once
OWN_FLAGS = {"steps": int, "layers": int, "reference": str, "json": str, "work": str, "replay": str, "against": str}


@dataclass
class Plan:
    """What a verification runs: two configs on their resolved layouts, where the weights start
    (``reader``: a checkpoint path, None: the seeded init) and how the comparison is labelled."""
    run: TrainConfig
    ref: TrainConfig
    run_layout: object
    ref_layout: object
    model_cfg: object
    tokens: object
    first_step: int
    steps: int
    lr: float | None
    reader: str | None
    loss_scale: float
    tolerance: float
    names: tuple
    header: str
    work: Path
    json_path: str | None
    record: list = dataclasses.field(default_factory=list)   # a replay: the run's metrics up to its checkpoint


def split_args(argv: list[str]) -> tuple[dict, list[str], set]:
    """``(verify's own flags, the training flags, the training keys given on the command line)``."""
    own, rest, given, i = {}, [], set(), 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        if key in OWN_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"--{key}: missing value")
                value, i = argv[i + 1], i + 1
            try:
                own[key] = OWN_FLAGS[key](value)
            except ValueError:
                raise ConfigError(f"--{key}: expected {OWN_FLAGS[key].__name__}, got {value!r}") from None
        else:
            rest.append(arg)
            if key:
                given.add(key)
        i += 1
    for key in ("steps", "layers"):
        if own.get(key, 1) < 1:
            raise ConfigError(f"--{key}: must be >= 1, got {own[key]}")
    return own, rest, given


def plan_verify(own: dict, argv: list[str], given: set, world_size: int) -> Plan:
    """The run's layout against the reference on the reduced model (see the module docstring)."""
    cfg = parse_args(argv)
    data = open_dataset(cfg.data)
    model_cfg, weights, resumed = resolve_model(cfg)
    if weights is None and not resumed:
        model_cfg = vocab_from_data(cfg, model_cfg, data, cfg.tp)
    return plan_layout_check(cfg, model_cfg, data.train, own, given, world_size)


def plan_layout_check(cfg: TrainConfig, model_cfg, tokens, own: dict, given: set, world_size: int) -> Plan:
    """:func:`plan_verify` of a parsed config and its resolved model (``tokens``: the training
    split); ``given``: the training keys the user set (their seq_len and batch_size are kept)."""
    steps = own.get("steps", 3)
    base = dataclasses.replace(cfg, dtype="float64", steps=steps, lr=VERIFY_LR, min_lr=VERIFY_LR, warmup_steps=0,
                               init_from="", resume="")
    ref = layout_config(base, own.get("reference", ""), "reference")
    ref_world = ref.dp * ref.pp * ref.cp * ref.tp
    if ref_world > world_size:
        raise ConfigError(f"reference: {own['reference']!r} needs {ref_world} ranks, the launch has {world_size}")
    check_axes(base, world_size, "layout")
    check_axes(ref, ref_world, f"reference {own['reference']}" if "reference" in own else "reference")
    stages = max(c.pp * (c.chunks if c.schedule == "interleaved" and c.pp > 1 else 1) for c in (base, ref))
    model_cfg = apply_overrides(model_cfg, {"n_layer": own.get("layers", stages)})
    seq_len, batch = short_shape([(base, world_size), (ref, ref_world)],
                                 cfg.seq_len if "seq_len" in given else None,
                                 cfg.batch_size if "batch_size" in given else None, model_cfg.n_positions)
    base, ref = (dataclasses.replace(c, seq_len=seq_len, batch_size=batch) for c in (base, ref))
    run_layout = resolve(base, model_cfg, world_size, "layout")
    try:
        ref_layout = resolve(ref, model_cfg, ref_world, f"reference {own.get('reference', 'one rank')}")
    except ConfigError as err:
        raise ConfigError(f"{err} (--reference names a smaller layout to hold this one to)") from None
    widths = ", ".join(f"{k} {getattr(model_cfg, k)}" for k in ("n_embd", "n_head", "n_kv_head", "n_inner",
                                                                 "n_expert", "vocab_size") if getattr(model_cfg, k, None))
    dropout = {k: v for k, v in dataclasses.asdict(model_cfg).items() if "drop" in k and v}
    header = (f"mpirt verify: layout {run_layout.describe()} ({world_size} rank{'s' * (world_size > 1)}) vs reference "
              f"{ref_layout.describe()} ({ref_world} rank{'s' * (ref_world > 1)})\n"
              f"mpirt verify: model {cfg.model} with {model_cfg.n_layer} of its blocks at its real widths ({widths}), "
              f"float64, seq_len {seq_len}, batch {batch}, {steps} steps at lr {VERIFY_LR:g}, "
              f"dropout {dropout or 'off'}")
    return Plan(base, ref, run_layout, ref_layout, model_cfg, tokens, 0, steps, VERIFY_LR, None, 1.0,
                TOLERANCES["float64"], ("layout", "reference"), header, _work(own, cfg.out_dir), own.get("json"))


def plan_replay(own: dict, argv: list[str], given: set, world_size: int) -> Plan:
    """The step after checkpoint ``--replay`` on the run's layout and on ``--against``."""
    meta = read_checkpoint_meta(own["replay"])
    try:
        saved = TrainConfig(**{f.name: meta["config"][f.name] for f in dataclasses.fields(TrainConfig)
                               if f.name in meta["config"]})
        model_cfg = config_from_dict(meta["extra"]["model_config"])
        sizes, data_dir = meta["extra"]["layout"], meta["extra"]["data"]
    except (KeyError, TypeError) as err:
        raise ConfigError(f"replay: {meta['path']}/meta.json is not a checkpoint of mpirt.train (no {err})") from None
    if meta.get("optimizer") is None:
        raise ConfigError(f"replay: {meta['path']} holds no optimizer state: the step after it cannot be replayed")
    _check_replay_flags(argv, given, model_cfg, meta["path"])
    run = dataclasses.replace(saved, **{k: sizes.get(k, 1) for k in ("dp", "tp", "pp", "cp", "ep")})
    run_world = run.dp * run.pp * run.cp * run.tp
    against = layout_config(run, own.get("against", "dp=1"), "against")
    against_world = against.dp * against.pp * against.cp * against.tp
    for name, n in (("the run's layout", run_world), (f"against {own.get('against', 'dp=1')!r}", against_world)):
        if n > world_size:
            raise ConfigError(f"replay: {name} needs {n} ranks, the launch has {world_size}")
    run_layout = resolve(run, model_cfg, run_world, "replay: the run's layout")
    ref_layout = resolve(against, model_cfg, against_world, f"against {own.get('against', 'dp=1')}")
    scalars = (meta.get("optimizer") or {}).get("scalars") or {}
    step = meta["step"]
    header = (f"mpirt verify --replay {meta['path']}: step {step + 1} on the run's layout {run_layout.describe()} "
              f"({run_world} ranks) vs {ref_layout.describe()} ({against_world} rank{'s' * (against_world > 1)}), "
              f"{saved.dtype}, model {saved.model} ({model_cfg.n_layer} blocks), batch {saved.batch_size} x {saved.seq_len}")
    return Plan(run, against, run_layout, ref_layout, model_cfg, open_dataset(data_dir).train, step,
                own.get("steps", 1), None, meta["path"],
                float(scalars.get("loss_scale", 1.0)) if saved.dtype == "float16" else 1.0,
                TOLERANCES[saved.dtype], ("run", "against"), header, _work(own, "."), own.get("json"),
                run_record(meta["path"], step))


def run_record(version, step: int) -> list[dict]:
    """The run's metrics records up to ``step`` (rank 0's, beside the checkpoint root of
    ``version``: OUT_DIR/metrics/rank0.jsonl), each ``{"step", "loss", "grad_norm"}``; empty when
    the run's metrics are not there (a checkpoint copied elsewhere)."""
    try:
        lines = (Path(version).parent.parent / "metrics" / "rank0.jsonl").read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:   # a line cut short when the job was killed mid-write
            continue
        if r.get("step", step + 1) <= step:
            records.append({k: r.get(k) for k in ("step", "loss", "grad_norm")})
    return records


def _check_replay_flags(argv: list[str], given: set, model_cfg, path) -> None:
    """A replay takes its configuration from the checkpoint; ``--model`` (and ``--model.*``) may
    be given to check that the checkpoint holds that model (ConfigError naming what differs)."""
    other = sorted(k for k in given if k != "model" and not k.startswith("model."))
    if other or argv and not argv[0].startswith("--"):
        raise ConfigError(f"replay: the configuration comes from the checkpoint; only --model and --model.* may be "
                          f"given (to check it), not {'--' + other[0] if other else argv[0]}")
    if not argv:
        return
    cfg = parse_args(argv)
    wanted = dataclasses.asdict(load_model_config(cfg.model, cfg.model_overrides))
    held = dataclasses.asdict(model_cfg)
    if "vocab_size" not in cfg.model_overrides:   # a dataset may set it: not part of the model's identity
        wanted.pop("vocab_size", None)
    differ = sorted(k for k in wanted if wanted[k] != held.get(k))
    if differ:
        raise ConfigError(f"replay: {path} holds another model than --model {cfg.model} ("
                          + "; ".join(f"{k}: checkpoint {held.get(k)!r}, --model {wanted[k]!r}" for k in differ[:4]) + ")")


def _work(own: dict, out_dir: str) -> Path:
    return Path(own.get("work") or Path(out_dir) / "verify")


def make_plan(argv: list[str], world_size: int) -> Plan:
    """The :class:`Plan` of a command line; ConfigError (and the errors of reading a checkpoint or
    dataset) on bad input. Pure: no communication."""
    check_environment()
    own, rest, given = split_args(argv)
    if "against" in own and "replay" not in own:
        raise ConfigError("--against: names the second layout of a --replay; without one, use --reference")
    return plan_replay(own, rest, given, world_size) if "replay" in own else plan_verify(own, rest, given, world_size)


def execute(plan: Plan, group) -> dict:
    """Run both sides on ``group`` (a :class:`mpirt.comm.Comm`; each side on its first ranks) and
    compare them; returns the report (:func:`mpirt.verify.compare.build_report`) on every rank."""
    started = time.time()
    work = Path(group.broadcast_object(str(_fresh(plan.work)) if group.rank == 0 else None))
    records = [_side(plan, cfg, layout, group, work / name)
               for cfg, layout, name in ((plan.run, plan.run_layout, "run"), (plan.ref, plan.ref_layout, "reference"))]
    snapshots = [{r["step"]: r["snapshot"] for r in side if r["snapshot"]} for side in records]
    steps = sorted(set(snapshots[0]) & set(snapshots[1]))
    tensors = compare_tensors(group, *({s: side[s] for s in steps} for side in snapshots))
    report = build_report(*records, tensors, plan.tolerance, _coordinates(plan.run_layout))
    traffic = records[0][0]["communication"] if records[0] else []
    report["communication"] = traffic
    if traffic and report["equal"]:
        report.update(equal=False, verdict=f"step {records[0][0]['step']}: the layout's communication is not what "
                                           f"its layout predicts: " + "; ".join(traffic[:3]))
    report["abnormal"] = abnormal_steps(report["steps"], plan.record)
    if report["abnormal"]:
        report["abnormal"] += (": both layouts compute it alike, so it is the data (or the run's state), not the "
                               "layout" if report["equal"] else ", and the layouts differ too (see above)")
    group.barrier()
    if group.rank == 0:
        shutil.rmtree(work, ignore_errors=True)
    report.update(seconds=time.time() - started, layout=plan.run_layout.describe(),
                  reference=plan.ref_layout.describe(), model=plan.run.model, n_layer=plan.model_cfg.n_layer,
                  dtype=plan.run.dtype, seq_len=plan.run.seq_len, batch_size=plan.run.batch_size)
    return report


def verify_before_training(cfg: TrainConfig, model_cfg, tokens, group) -> None:
    """``mpirt.train --verify``: :func:`plan_layout_check` of the run's config and model (the run's
    layout on every rank of ``group`` against one rank, the default reduced depth and shape), run
    before the model is built. Rank 0 prints one line: the verdict when equal; else ``error:`` and
    the first difference (or the bad input), and every rank exits 2 (nothing has trained)."""
    try:
        plan = plan_layout_check(cfg, model_cfg, tokens, {"work": str(Path(cfg.out_dir) / "verify")}, set(), group.size)
    except ConfigError as err:   # the same on every rank: the planning is pure
        _refuse(group, f"--verify: {err}")
    report = execute(plan, group)
    if group.rank == 0:
        try:
            plan.work.rmdir()   # the snapshots' folder, when nothing else is in it
        except OSError:
            pass
    if not report["equal"]:
        _refuse(group, f"--verify: the layout {plan.run_layout.describe()} does not compute what one rank computes: "
                       f"{report['verdict']} (python -m mpirt.verify with the same flags prints the table)")
    if group.rank == 0:
        print(f"mpirt: --verify: {plan.run_layout.describe()} equals one rank on {plan.model_cfg.n_layer} "
              f"block{'s' * (plan.model_cfg.n_layer > 1)} "
              f"({report['verdict'].removeprefix('equal: ')}; {report['seconds']:.1f} s)", file=sys.stderr, flush=True)


def _refuse(group, message: str) -> None:
    """Rank 0 prints ``error: message``; every rank of ``group`` exits 2 (bad input, or a layout refused)."""
    if group.rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


def _coordinates(layout):
    """``rank -> {axis: place}`` over the axes ``layout`` splits (a one-rank layout: {})."""
    sizes = {"dp": layout.dp, "pp": layout.pp, "cp": layout.cp, "tp": layout.tp, "ep": layout.ep}
    return lambda rank: {k: v for k, v in layout.position(rank).items() if sizes[k] > 1}


def _fresh(root: Path) -> Path:
    """A new folder under ``root`` for this launch's snapshots."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"run-{os.getpid()}-{time.time_ns()}"
    path.mkdir()
    return path


def _side(plan: Plan, cfg, layout, group, snapshots: Path) -> list[dict]:
    """One side's step records, run on the first ``layout.world_size`` ranks of ``group`` and known to all."""
    inside = group.rank < layout.world_size
    sub = group.split(0 if inside else 1, group.rank)
    records = None
    if inside:
        reader = CheckpointReader(plan.reader) if plan.reader else None
        records = run_side(cfg, plan.model_cfg, layout, sub, plan.tokens, snapshots, first_step=plan.first_step,
                           steps=plan.steps, lr=plan.lr, reader=reader, loss_scale=plan.loss_scale)
    sub.free()
    return group.broadcast_object(records, root=0)


def main(argv=None) -> None:
    comm.install_abort_on_error()
    world = comm.world_comm()
    error = None
    try:
        plan = make_plan(list(sys.argv[1:] if argv is None else argv), world.size)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as err:
        error = str(err)
    failed = comm.first_error(error)
    if failed is not None:
        if world.rank == 0:
            rank, message = failed
            print(f"error: {message}" if rank == 0 else f"error on rank {rank}: {message}", file=sys.stderr)
        comm.exit_together(EXIT_BAD_INPUT)
    comm.start_watchdog(comm_timeout(plan.run, plan.model_cfg))
    init_distributed(plan.run.seed, plan.run.backend, config=plan.run.to_dict())
    report = execute(plan, world)
    if world.rank == 0:
        print(plan.header)
        print(format_table(report, *plan.names))
        print(f"mpirt verify: tolerance {plan.tolerance:.0e} (relative, L2 per tensor); {report['seconds']:.1f} s")
        print(("mpirt verify: " if report["equal"] else "mpirt verify: DIFFERS: ") + report["verdict"], flush=True)
        print("mpirt verify: communication of the step (every call's bytes and dtype; the counts of all but "
              "ZeRO-2/3's streamed ones) " + ("as its layout predicts" if not report["communication"] else
                                                  "NOT as its layout predicts: " + "; ".join(report["communication"])),
              flush=True)
        if report["abnormal"]:
            print(f"mpirt verify: abnormal step: {report['abnormal']}", flush=True)
        if plan.json_path:
            _write_json(Path(plan.json_path), report)
    comm.exit_together(EXIT_EQUAL if report["equal"] else EXIT_DIFFERS)


def _write_json(path: Path, report: dict) -> None:
    """The report as strict JSON (a non-finite difference becomes null), written atomically."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return [clean(x) for x in v] if isinstance(v, list) else v
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean(report), indent=2) + "\n")
    tmp.replace(path)
