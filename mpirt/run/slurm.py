"""SLURM batch scripts for mpirt: ``python -m mpirt.slurm [FLAGS] [-- TRAIN ARGS ...]``.

Renders one self-contained sbatch script from flags (``--template NAME`` starts from the settings
of a checked-in template in slurm/, which are this module's output too). Every value that reaches
an ``#SBATCH`` line is validated (sbatch parses those lines itself, so quoting cannot help there);
every value that reaches the shell body is passed through :func:`shlex.quote`. A bad value is
refused with a message naming its flag.

What a rendered job does (the shell body, :data:`BODY`):

- sources the site's env file (``$MPIRT_SITE_ENV``, default ``slurm/site.env`` in the submit
  directory: modules, virtual environment, ``MPI_TYPE``, NCCL/UCX settings) and the venv;
- removes the job owner's MPICH shared-memory files that no process uses, on every node, before
  the ranks start and again after ranks that did not finish (a killed MPICH job leaves them, and a
  requeued job, which keeps its job id, then fails in ``MPI_Init``);
- starts the ranks with ``srun --mpi=$MPI_TYPE --kill-on-bad-exit=1`` (without ``--mpi`` a site
  with ``MpiDefault=none`` starts N singletons that each train alone) and
  ``SRUN_CPUS_PER_TASK`` exported (``srun`` in SLURM 22.05 does not inherit ``--cpus-per-task``);
- with ``--verify-first``, on the job's first start (no checkpoint yet) and when the limit leaves
  time for it, first runs ``python -m mpirt.verify`` with the training arguments (a tenth of the
  time limit at most, :data:`VERIFY_SHARE`): a layout that does not compute what one rank computes
  (exit 1) or bad input (exit 2) ends the job before training; a check that runs out of its share
  is reported and training goes on; with ``--verify`` the job is that check alone (the whole time
  limit, every start), and verify's exit code is the job's;
- trains with ``--out-dir RUN_DIR --resume auto --time-limit slurm``: one explicit run directory
  per experiment, and resubmitting the same script continues it;
- on ``--signal=B:USR1@NOTICE`` (to the batch shell only) asks the ranks to stop with a checkpoint
  (``scancel --signal=TERM`` of the job's steps). A TERM that reaches the batch shell is never
  forwarded: SLURM sends its own TERM to the ranks on ``scancel``, preemption and the time limit,
  and a second TERM would end them without a checkpoint;
- preemptible jobs (``--requeue``) requeue themselves when training stopped with a checkpoint
  (exit 75) that advanced, unless the job was cancelled or preempted (TERM to the batch shell);
- reads "finished" from ``RUN_DIR/summary.json`` (written by this attempt, every step done, exit
  code 0 recorded by rank 0), never from the launcher's exit code alone: ranks that all exit 0
  early (a library's ``exit(0)``) end the job with exit 1, saying so.

Over 400 lines: one job writer whose validation and quoting rules must be read together (splitting it would separate a value's check from its use).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys
from dataclasses import dataclass, field

from mpirt.parallel.layout import Layout, LayoutError

EXIT_STOPPED = 75  # mpirt.train: stopped early with a checkpoint
MPI_TYPES = re.compile(r"pmi2|pmix(_v[2-5])?|cray_shasta")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
_PARTITION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}(,[A-Za-z0-9][A-Za-z0-9_.+-]{0,127})*")
_MEM = re.compile(r"[0-9]+[KMGT]?")
_OUTPUT = re.compile(r"[A-Za-z0-9_./%+-]+")
# SLURM's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"(?:[0-9]+-[0-9]+(?::[0-9]{1,2}){0,2}|[0-9]+(?::[0-9]{1,2}){0,2})")


VERIFY_SHARE = 10     # --verify-first: the check takes at most 1/VERIFY_SHARE of the time limit
VERIFY_MIN_S = 300    # ... and runs only when that share is at least this long
EARLY_SIGNAL_S = 60   # SLURM may deliver --signal up to this many seconds before its time (timer resolution)


# mpirt.train's keys the job script sets itself, with what to use instead: the script's own
# contract (one run directory that it resumes, stopping before the job's end) holds only if
# nothing after `--` or on the sbatch line overrides them
OWNED_TRAIN_KEYS = {
    "out_dir": "the run directory is the script's: --run-dir DIR (or sbatch SCRIPT RUN_DIR)",
    "resume": "the script always resumes its run directory (--resume auto): a new --run-dir starts fresh",
    "time_limit": "the script stops before the job's end (--time-limit slurm): set the job's limit with --time",
}


def owned_train_arg(args) -> str | None:
    """A refusal naming the first of ``args`` (mpirt.train arguments) that sets one of
    :data:`OWNED_TRAIN_KEYS`, with the flag to use instead; None when there is none."""
    for arg in args:
        key = arg[2:].partition("=")[0].replace("-", "_") if arg.startswith("--") else ""
        if key in OWNED_TRAIN_KEYS:
            return f"{arg.partition('=')[0]}: {OWNED_TRAIN_KEYS[key]}"
    return None


def time_seconds(limit: str) -> int:
    """Seconds in a SLURM time limit: MIN, MIN:SEC, H:MM:SS, D-H, D-H:MM or D-H:MM:SS."""
    days, _, rest = limit.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return int(days) * 86400 + hours * 3600 + minutes * 60 + seconds
    if len(parts) < 3:
        return parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def longest_notice(limit_s: int) -> int:
    """The longest USR1 notice a job of ``limit_s`` seconds takes: one that arrives, even
    :data:`EARLY_SIGNAL_S` early, in the second half of the job, never during its start-up."""
    return max(0, limit_s // 2 - EARLY_SIGNAL_S)


class SlurmScriptError(ValueError):
    """A job-script setting that cannot be rendered; the message starts with the flag."""


@dataclass
class JobSpec:
    """Everything a rendered job script holds. ``run_dir`` empty: the script takes the run
    directory as its first argument (the checked-in templates)."""

    nodes: int = 1
    ntasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem: str = ""
    exclusive: bool = False
    time: str = "01:00:00"
    partition: str = ""
    account: str = ""
    job_name: str = "mpirt"
    output: str = "%x-%j.out"
    dp: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    model: str = ""
    data: str = ""
    run_dir: str = ""
    train_args: list[str] = field(default_factory=list)
    preemptible: bool = False
    verify_first: bool = False
    verify_only: bool = False
    mpi: str = ""
    notice: int = 120
    site_env: str = ""
    template: str = ""


TEMPLATES = {
    "single_node": ("one node, one rank per GPU", JobSpec(
        ntasks_per_node=8, gpus_per_node=8, cpus_per_task=8, time="02:00:00")),
    "multi_node": ("several nodes over InfiniBand, one rank per GPU, whole nodes", JobSpec(
        nodes=4, ntasks_per_node=8, gpus_per_node=8, cpus_per_task=8, exclusive=True, mem="0",
        time="12:00:00")),
    "cpu": ("CPU-only nodes, one rank per socket", JobSpec(
        ntasks_per_node=2, cpus_per_task=8, time="01:00:00")),
    "preemptible": ("one GPU node in a preemptible partition: requeued, resumed from the checkpoint",
                    JobSpec(ntasks_per_node=8, gpus_per_node=8, cpus_per_task=8, time="04:00:00",
                            preemptible=True)),
}

# Removes user $1's MPICH files in ${2:-/dev/shm} that no process maps or holds open, and, given
# $3 (epoch seconds: the job's start), only those last modified before it. Used by the job before
# srun and by the Epilog; as root (the Epilog) it sees every process, as the user only the user's
# own, which are the only ones that can open the user's 0600 files. The candidates are listed
# before the files in use, so a file another job makes meanwhile is never a candidate.
CLEAN_SHM = r'''mpirt_clean_shm() {
    local uid=$1 dir=${2:-/dev/shm} before=${3:-} busy f
    local files=("$dir"/mpich_*)
    busy=$( { cat /proc/[0-9]*/maps; ls -l /proc/[0-9]*/fd; } 2>/dev/null \
        | grep -o "$dir/mpich_[^ ]*" | sort -u) || true
    for f in "${files[@]}"; do
        [ -f "$f" ] && [ "$(stat -c %u "$f" 2>/dev/null)" = "$uid" ] || continue
        [ -z "$before" ] || [ "$(stat -c %Y "$f" 2>/dev/null || echo "$before")" -lt "$before" ] || continue
        grep -qxF -- "$f" <<<"$busy" && continue
        rm -f -- "$f" && echo "mpirt: removed stale MPICH shared memory $f"
    done
    return 0
}
'''

def _owned_args_check() -> str:
    """The job's refusal of :data:`OWNED_TRAIN_KEYS` among its own arguments (``sbatch SCRIPT
    RUN_DIR ...``), in both spellings and both ``--key value`` and ``--key=value`` forms."""
    cases = []
    for key, instead in OWNED_TRAIN_KEYS.items():
        flags = sorted({key, key.replace("_", "-")})
        patterns = "|".join(f"--{f}|--{f}=*" for f in flags)
        cases.append(f'        {patterns}) die "${{arg%%=*}}: {instead}" ;;\n')
    return 'for arg in "$@"; do\n    case $arg in\n' + "".join(cases) + "    esac\ndone\n"


BODY = r'''say() { echo "mpirt job ${SLURM_JOB_ID:-}: $*"; }
die() { say "error: $*" >&2; exit 2; }
if [ -z "$RUN_DIR" ]; then
    if [ $# -eq 0 ] || [[ $1 == -* ]]; then
        die "give the run directory first: sbatch SCRIPT RUN_DIR [--key=value ...] (one directory per experiment)"
    fi
    RUN_DIR=$1
    shift
fi

OWNED_ARGS_CHECK
site_env=${MPIRT_SITE_ENV:-$SITE_ENV}
[ -r "$site_env" ] ||
    die "site env file $site_env not found: copy slurm/site.env.example there and adapt it, or set MPIRT_SITE_ENV"
set +u  # module and venv scripts often read unset variables
. "$site_env"
venv=${MPIRT_VENV:-${SLURM_SUBMIT_DIR:-$PWD}/.venv}
[ -r "$venv/bin/activate" ] || die "no virtual environment at $venv: set MPIRT_VENV in $site_env"
. "$venv/bin/activate"
set -u
MPI_TYPE=${MPI_TYPE_FLAG:-${MPI_TYPE:-pmi2}}
[ "$MPI_TYPE" != none ] ||
    die "MPI_TYPE=none starts every rank as a world of its own: use pmi2 (MPICH) or pmix (Open MPI)"
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}          # BLAS threads per rank
export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}       # srun in SLURM 22.05 does not inherit it

CLEAN_SHM_FUNCTION
# one task per node: a killed job leaves its files on every node it ran on; only files older than
# $1 (epoch seconds: one made since may be a job's starting beside this one, not yet mapped)
clean_shm_on_nodes() {
    srun --mpi=none --nodes="${SLURM_NNODES:-1}" --ntasks="${SLURM_NNODES:-1}" --ntasks-per-node=1 \
        --cpus-per-task=1 bash -c "$(declare -f mpirt_clean_shm)"'; mpirt_clean_shm "$@"' mpirt_clean_shm \
        "$(id -u)" "${MPIRT_SHM_DIR:-/dev/shm}" "$1"
}
clean_shm_on_nodes "${SLURM_JOB_START_TIME:-$(date +%s)}" ||
    say "could not clean stale MPICH files in /dev/shm on every node; starting anyway"

notice="" got_term="" step=""
ask_stop() {
    [ -n "$step" ] && say "$1: asking the ranks to stop with a checkpoint" && scancel --signal=TERM "${SLURM_JOB_ID:-}"
}
trap 'notice=1; ask_stop "time limit near" || true' USR1
trap 'got_term=1; say "TERM: the ranks got their own from SLURM"' TERM
ckpt_before=$(cat "$RUN_DIR/ckpt/latest" 2>/dev/null || true)
say "run directory $RUN_DIR, ${SLURM_NNODES:-?} node(s), ${SLURM_NTASKS:-?} ranks," \
    "srun --mpi=$MPI_TYPE, restart ${SLURM_RESTART_COUNT:-0}"
if [ "$VERIFY_SECONDS" -gt 0 ] && { [ "$VERIFY_ONLY" = 1 ] || [ -z "$ckpt_before" ]; }; then  # a resume was checked
    say "checking the layout against one rank first (python -m mpirt.verify, at most $VERIFY_SECONDS s)"
    vrc=0
    timeout "$VERIFY_SECONDS" srun --mpi="$MPI_TYPE" --kill-on-bad-exit=1 --cpu-bind=cores python -m mpirt.verify \
        --out-dir "$RUN_DIR" ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} "$@" || vrc=$?
    if [ "$VERIFY_ONLY" = 1 ]; then  # a job of the check alone (--verify): verify's exit code is the job's
        say "verify: exit $vrc (0: the layout computes what one rank computes, 1: it does not, 2: bad input)"
        exit "$vrc"
    fi
    case $vrc in
        0) say "verify: the layout computes what one rank computes" ;;
        124) say "verify: did not finish in its $VERIFY_SECONDS s: training without its verdict" ;;
        *) say "verify failed (exit $vrc): not training"; exit "$vrc" ;;
    esac
fi
summary_stamp() { stat -c '%i %y' "$RUN_DIR/summary.json" 2>/dev/null || true; }  # rewritten: a new stamp
summary_before=$(summary_stamp)
srun --mpi="$MPI_TYPE" --kill-on-bad-exit=1 --cpu-bind=cores python -m mpirt.train \
    --out-dir "$RUN_DIR" --resume auto --time-limit slurm ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} "$@" &
step=$!
[ -z "$notice" ] || ask_stop "time limit near" || true
while kill -0 "$step" 2>/dev/null; do wait "$step" || true; done  # a trapped signal ends a wait early
rc=0
wait "$step" || rc=$?
requeued() {  # whether SLURM took the requeue although scontrol (interrupted by it) reported an error
    local n
    n=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'Restarts=[0-9]*' | cut -d= -f2)
    [ -n "$n" ] && [ "$n" -gt "${SLURM_RESTART_COUNT:-0}" ]
}
# "finished" is what rank 0 records in summary.json (every step done, exit code 0), written by this
# attempt (its inode and modification time changed: no clock is compared): a launcher exits 0
# also when a rank's library called exit(0) before the end
summary_says() {
    python - "$RUN_DIR/summary.json" "$([ "$(summary_stamp)" != "$summary_before" ] && echo new)" <<'PY'
import json, sys
path, fresh = sys.argv[1], sys.argv[2] == "new"
try:
    s = json.load(open(path))
    steps, total, code = s["steps"], s["total_steps"], s["exit_code"]
except (OSError, ValueError, KeyError, TypeError):
    sys.exit(f"{path} is missing or unreadable")
if not fresh:
    sys.exit(f"{path} is from an earlier attempt (step {steps} of {total})")
if code != 0 or steps < total:
    sys.exit(f"{path} records step {steps} of {total}, exit code {code}")
print(f"step {steps} of {total}")
PY
}
if [ "$rc" = 0 ]; then
    if done_at=$(summary_says 2>&1); then
        say "training finished ($done_at)"
    else
        say "training ended early: the ranks exited 0 but $done_at; the last checkpoint is" \
            "$(cat "$RUN_DIR/ckpt/latest" 2>/dev/null || echo none); not finished (exit 1)"
        rc=1
    fi
elif [ "$rc" = 75 ]; then
    say "training stopped with a checkpoint in $RUN_DIR/ckpt (exit 75)"
else
    say "training failed (exit $rc)"
fi
if [ "$rc" != 0 ] && [ "$rc" != 75 ]; then  # ranks that never finalised MPI (killed, exit(0) early)
    # left their files, written until their end: no age limit (a job starting beside this one
    # holds its files open); before any requeue, while this job still runs
    clean_shm_on_nodes "" || say "could not clean this job's MPICH files in /dev/shm"
fi
if [ "$rc" = 75 ] && [ -n "$got_term" ]; then
    if [ "$PREEMPTIBLE" = 1 ]; then
        say "stopped by SLURM: a preempted job is requeued by SLURM itself; after scancel," \
            "scontrol requeue $SLURM_JOB_ID continues it"
    else
        say "stopped by SLURM: submit the same command (or scontrol requeue $SLURM_JOB_ID) to continue"
    fi
elif [ "$rc" = 75 ] && [ "$PREEMPTIBLE" = 1 ]; then
    ckpt_after=$(cat "$RUN_DIR/ckpt/latest" 2>/dev/null || true)
    if [ -n "$ckpt_after" ] && [ "$ckpt_after" != "$ckpt_before" ]; then
        say "requeueing to continue from $ckpt_after"
        scontrol requeue "$SLURM_JOB_ID" || requeued ||
            say "scontrol requeue failed: submit the same command to continue"
    else
        say "no new checkpoint since the job started: not requeueing"
    fi
elif [ "$rc" = 75 ]; then
    say "submit the same command to continue"
fi
exit "$rc"
'''.replace("CLEAN_SHM_FUNCTION\n", CLEAN_SHM).replace("OWNED_ARGS_CHECK\n", _owned_args_check())


def _need(ok: bool, flag: str, rule: str, value) -> None:
    if not ok:
        raise SlurmScriptError(f"{flag}: must be {rule}, got {value!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate(spec: JobSpec) -> None:
    """Refuse settings that are malformed or could not be rendered safely, naming the flag (the
    grid's sizes through :meth:`~mpirt.parallel.layout.Layout.axes`)."""
    for name, low in (("nodes", 1), ("ntasks_per_node", 1), ("cpus_per_task", 1), ("gpus_per_node", 0),
                      ("dp", 0), ("tp", 1), ("pp", 1), ("cp", 1), ("ep", 1), ("notice", 0)):
        v = getattr(spec, name)
        _need(_is_int(v) and v >= low, "--" + name.replace("_", "-"), f"an integer >= {low}", v)
    _need(isinstance(spec.time, str) and bool(_TIME.fullmatch(spec.time))
          and any(c in "123456789" for c in spec.time), "--time",
          "a SLURM time limit: MIN, MIN:SEC, H:MM:SS, D-H, D-H:MM or D-H:MM:SS, not zero", spec.time)
    longest = longest_notice(time_seconds(spec.time))
    _need(spec.notice <= longest, "--notice", f"at most {longest} s for --time {spec.time} (half the limit less "
          f"{EARLY_SIGNAL_S} s, which SLURM may signal early: a notice during start-up would end the job; 0: none)",
          spec.notice)
    for flag, value, pattern, rule in (
            ("--partition", spec.partition, _PARTITION, "partition names (letters, digits, _.+-; commas between)"),
            ("--account", spec.account, _NAME, "a name of letters, digits and _.+-"),
            ("--job-name", spec.job_name, _NAME, "a name of letters, digits and _.+-"),
            ("--mem", spec.mem, _MEM, "a size such as 0, 64000, 500G"),
            ("--output", spec.output, _OUTPUT, "a file pattern of letters, digits and _./%+- (e.g. %x-%j.out)")):
        _need(isinstance(value, str) and (value == "" and flag not in ("--job-name", "--output")
                                           or bool(pattern.fullmatch(value))), flag, rule, value)
    if spec.verify_only and spec.verify_first:
        raise SlurmScriptError("--verify and --verify-first: choose one (--verify is a job of the check alone, "
                               "--verify-first checks before training)")
    if spec.mpi:
        _need(spec.mpi != "none", "--mpi", "a PMI the MPI library speaks (pmi2, pmix, ...); 'none' starts "
              "every rank as a world of its own", spec.mpi)
        _need(bool(MPI_TYPES.fullmatch(spec.mpi)), "--mpi", "one of pmi2, pmix, pmix_v2..pmix_v5, cray_shasta",
              spec.mpi)
    for flag, value in (("--run-dir", spec.run_dir), ("--model", spec.model), ("--data", spec.data),
                        ("--site-env", spec.site_env)):
        _need(isinstance(value, str) and not any(ord(c) < 32 or c == "\x7f" for c in value), flag,
              "text without control characters (newlines, tabs, ...)", value)
    _need(not spec.run_dir.startswith("-"), "--run-dir", "a directory, not an option", spec.run_dir)
    _need(isinstance(spec.train_args, (list, tuple)) and all(isinstance(a, str) and "\0" not in a
                                                             for a in spec.train_args),
          "train args", "strings without NUL bytes", spec.train_args)
    owned = owned_train_arg(spec.train_args)
    if owned:
        raise SlurmScriptError(f"training arguments: {owned}")
    try:
        Layout.axes(spec.nodes * spec.ntasks_per_node, spec.dp, spec.pp, spec.tp, spec.cp)
    except LayoutError as err:
        raise _refusal(spec, err) from None
    if spec.gpus_per_node:
        _need(spec.ntasks_per_node == spec.gpus_per_node, "--ntasks-per-node",
              f"equal to --gpus-per-node {spec.gpus_per_node} (mpirt runs one rank per GPU)", spec.ntasks_per_node)


def training_args(spec: JobSpec) -> list[str]:
    """The arguments the job passes to ``python -m mpirt.train`` (before its run directory's)."""
    train = []
    if spec.model:
        train += ["--model", spec.model]
    if spec.data:
        train += ["--data", spec.data]
    if spec.dp:
        train += ["--dp", str(spec.dp)]
    if spec.tp > 1 or spec.pp > 1:
        train += ["--tp", str(spec.tp), "--pp", str(spec.pp)]
    if spec.cp > 1:
        train += ["--cp", str(spec.cp)]
    if spec.ep > 1:
        train += ["--ep", str(spec.ep)]
    return train + list(spec.train_args)


def _refusal(spec: JobSpec, err: LayoutError, model: str = "") -> SlurmScriptError:
    """A layout refusal in this script's terms: the flag to change when it is one of its own
    (the grid's sizes with the job's rank count, tp with the model), else the training argument."""
    if err.key in ("cp", "ep"):
        return SlurmScriptError(f"--{err.key}: {err.reason}" + (f" (model {model})" if model else ""))
    if err.key == "dp/pp/tp":
        flags = "--dp/--tp/--pp" + ("/--cp" if spec.cp > 1 else "")
        return SlurmScriptError(f"{flags}: {err.reason} (--nodes {spec.nodes} x --ntasks-per-node "
                                f"{spec.ntasks_per_node} = {spec.nodes * spec.ntasks_per_node} ranks)")
    if err.key == "tp" and model:
        return SlurmScriptError(f"--tp: {err.reason} (model {model})")
    return SlurmScriptError(f"training arguments: {err}")


def job_layout(spec: JobSpec) -> Layout:
    """The :class:`~mpirt.parallel.layout.Layout` of the job's sizes and training arguments, read
    as ``mpirt.train`` will (keys, types, values) and checked against the model where its preset
    or file can be read here, so that a mistake is refused at render time instead of after a
    queue wait (SlurmScriptError names it): :meth:`~mpirt.parallel.layout.Layout.resolve` without
    the rules that the batch settings take part in, which wait for the start-up (``sbatch
    THIS_SCRIPT --batch-size ...`` may still change them), then ``check_model``."""
    from mpirt.run.config import ConfigError, parse_args
    from mpirt.core.modeling import load_model_config, missing_model_file
    try:
        cfg = parse_args(training_args(spec))
    except ConfigError as err:
        raise SlurmScriptError(f"training arguments: {err}") from None
    try:
        layout = Layout.resolve(cfg, spec.nodes * spec.ntasks_per_node, batch_rules=False)
    except LayoutError as err:
        raise _refusal(spec, err) from None
    if missing_model_file(cfg.model):
        return layout                # a model file on the cluster only: mpirt.train checks it at start
    try:
        model_cfg = load_model_config(cfg.model, cfg.model_overrides)
    except (ConfigError, ValueError) as err:
        raise SlurmScriptError(f"--model: {err}") from None
    try:
        layout.check_model(cfg, model_cfg)
    except LayoutError as err:
        raise _refusal(spec, err, cfg.model) from None
    return layout


def render(spec: JobSpec) -> str:
    """The sbatch script for ``spec`` (validated first; SlurmScriptError names a bad flag)."""
    validate(spec)
    q = shlex.quote
    world = spec.nodes * spec.ntasks_per_node
    kind = TEMPLATES[spec.template][0] if spec.template in TEMPLATES else "rendered job"
    gpus = f", {spec.gpus_per_node} GPUs per node" if spec.gpus_per_node else ", CPU only"
    generated = f"python -m mpirt.slurm --template {spec.template}" if spec.template else "python -m mpirt.slurm"
    usage = "sbatch THIS_SCRIPT [--key=value ...]" if spec.run_dir else "sbatch THIS_SCRIPT RUN_DIR [--key=value ...]"
    lines = [
        "#!/bin/bash",
        f"# mpirt training job: {kind}.",
        f"# {spec.nodes} node(s) x {spec.ntasks_per_node} ranks = {world} ranks{gpus}, "
        f"{spec.cpus_per_task} CPUs per rank.",
        f"# Written by `{generated}`: regenerate rather than edit.",
        "# Site settings (modules, virtual environment, MPI_TYPE, NCCL/UCX) live in one env file:",
        "# slurm/site.env in the submit directory, or $MPIRT_SITE_ENV (see slurm/site.env.example).",
        "# Partition and account: -p/-A on the sbatch command line, or SBATCH_PARTITION and",
        "# SBATCH_ACCOUNT exported before sbatch. Flags given to sbatch override the #SBATCH lines.",
        f"#   {usage}",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nodes}",
        f"#SBATCH --ntasks-per-node={spec.ntasks_per_node}",
        f"#SBATCH --cpus-per-task={spec.cpus_per_task}",
    ]
    sbatch = []
    if spec.gpus_per_node:
        sbatch.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.exclusive:
        sbatch.append("--exclusive")
    if spec.mem:
        sbatch.append(f"--mem={spec.mem}")
    sbatch += [f"--time={spec.time}", f"--output={spec.output}"]
    if spec.partition:
        sbatch.append(f"--partition={spec.partition}")
    if spec.account:
        sbatch.append(f"--account={spec.account}")
    if spec.notice:
        sbatch.append(f"--signal=B:USR1@{spec.notice}")
    if spec.preemptible:
        sbatch.append("--requeue")
    sbatch.append("--open-mode=append")   # a requeued attempt (preempted, by hand, a node failure) adds to the log
    lines += [f"#SBATCH {s}" for s in sbatch]

    train = training_args(spec)
    lines += [
        "set -euo pipefail",
        "",
        f"RUN_DIR={q(spec.run_dir)}" + ("" if spec.run_dir else "  # empty: the first argument"),
        "TRAIN_ARGS=(" + " ".join(q(a) for a in train) + ")",
        f"PREEMPTIBLE={int(spec.preemptible)}",
        f"VERIFY_SECONDS={verify_seconds(spec)}" + ("  # --verify-first: the check's share of the time limit"
                                                    if spec.verify_first else ""),
        f"VERIFY_ONLY={int(spec.verify_only)}" + ("  # --verify: the job is the check alone" if spec.verify_only
                                                  else ""),
        f"MPI_TYPE_FLAG={q(spec.mpi)}" + ("" if spec.mpi else "  # empty: MPI_TYPE from the site env, else pmi2"),
        "SITE_ENV=" + (q(spec.site_env) if spec.site_env else '"${SLURM_SUBMIT_DIR:-$PWD}/slurm/site.env"'),
        "",
    ]
    return "\n".join(lines) + "\n" + BODY


def verify_seconds(spec: JobSpec) -> int:
    """The seconds a ``--verify-first`` check may take: a tenth of the time limit, 0 (no check)
    without the flag or when that share is under :data:`VERIFY_MIN_S` (the time does not permit);
    under ``--verify`` the whole limit."""
    if spec.verify_only:
        return time_seconds(spec.time)
    share = time_seconds(spec.time) // VERIFY_SHARE
    return share if spec.verify_first and share >= VERIFY_MIN_S else 0


def epilog() -> str:
    """A SLURM Epilog script that removes the job owner's stale MPICH shared-memory files."""
    return ("#!/bin/bash\n"
            "# SLURM Epilog (runs as root on each node after a job): remove the job owner's MPICH\n"
            "# shared-memory files in /dev/shm that no process uses. A killed MPICH job leaves them, and a\n"
            "# requeued job (same job id) can then fail in MPI_Init. Install on every compute node and set\n"
            "#   Epilog=/etc/slurm/epilog.d/mpirt-mpich-shm.sh   in slurm.conf (or call it from your Epilog).\n"
            "# Written by `python -m mpirt.slurm --epilog`. Always exits 0: a failing Epilog drains the node.\n"
            + CLEAN_SHM
            + '[ -n "${SLURM_JOB_UID:-}" ] && mpirt_clean_shm "$SLURM_JOB_UID" "${MPIRT_SHM_DIR:-/dev/shm}"\n'
            "exit 0\n")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mpirt.slurm",
        description="Write an sbatch script for mpirt.train. Arguments after `--` go to mpirt.train.",
        epilog="templates: " + "; ".join(f"{k}: {v[0]}" for k, v in TEMPLATES.items()))
    add = ap.add_argument
    add("--template", choices=sorted(TEMPLATES), metavar="NAME",
        help="start from a checked-in template's settings: " + ", ".join(TEMPLATES))
    add("--epilog", action="store_true", help="print the Epilog script that removes stale MPICH files instead")
    add("-o", "--out", metavar="FILE", help="write the script here (default: standard output)")
    g = ap.add_argument_group("resources (#SBATCH lines)")
    for flag, typ, help_ in (("--nodes", int, "nodes"), ("--ntasks-per-node", int, "MPI ranks per node"),
                             ("--gpus-per-node", int, "GPUs per node (0: CPU only)"),
                             ("--cpus-per-task", int, "CPU cores per rank (BLAS threads)"),
                             ("--mem", str, "memory per node (0: all of it)"),
                             ("--time", str, "wall-time limit, e.g. 12:00:00 or 1-00:00:00"),
                             ("--partition", str, "partition(s)"), ("--account", str, "account to charge"),
                             ("--job-name", str, "job name"), ("--output", str, "output file pattern"),
                             ("--notice", int, "seconds before the limit at which the ranks are asked to "
                                               "stop with a checkpoint (0: none)")):
        g.add_argument(flag, type=typ, help=help_, metavar="N" if typ is int else "TEXT")
    g.add_argument("--exclusive", action=argparse.BooleanOptionalAction, help="whole nodes")
    g.add_argument("--preemptible", action=argparse.BooleanOptionalAction,
                   help="requeue on preemption and after a stop with a checkpoint; append to the output")
    g.add_argument("--verify-first", action=argparse.BooleanOptionalAction,
                   help=f"on the first start, run python -m mpirt.verify with the training arguments before "
                        f"training (at most 1/{VERIFY_SHARE} of --time, when that is >= {VERIFY_MIN_S} s); "
                        f"train only if the layout computes what one rank computes")
    g.add_argument("--verify", dest="verify_only", action=argparse.BooleanOptionalAction,
                   help="a job of the check alone: python -m mpirt.verify with the training arguments, "
                        "no training; the job's exit code is verify's (0 equal, 1 not, 2 bad input)")
    t = ap.add_argument_group("training")
    t.add_argument("--run-dir", metavar="DIR", help="the experiment's own directory (checkpoints, metrics); "
                                     "empty: the script's first argument")
    for flag, typ, help_ in (("--dp", int, "data-parallel size (0: derive)"), ("--tp", int, "tensor-parallel size"),
                             ("--pp", int, "pipeline-parallel size"), ("--cp", int, "context-parallel size"),
                             ("--ep", int, "expert-parallel size (mixture of experts; divides dp)"),
                             ("--model", str, "model preset or file"),
                             ("--data", str, "dataset directory"),
                             ("--mpi", str, "srun --mpi type (default: MPI_TYPE from the site env, else pmi2)"),
                             ("--site-env", str, "site env file (default: slurm/site.env in the submit dir)")):
        t.add_argument(flag, type=typ, help=help_, metavar="N" if typ is int else "TEXT")
    return ap


def main(argv=None) -> int:
    """``python -m mpirt.slurm``: print or write (``-o``) a job script or the Epilog; exit 2 naming
    the flag of a bad value."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    ap = _parser()
    args = ap.parse_args(argv)
    if args.epilog:
        text = epilog()
    else:
        base = TEMPLATES[args.template][1] if args.template else JobSpec()
        values = {k: v for k, v in vars(args).items() if v is not None and k in JobSpec.__dataclass_fields__}
        spec = dataclasses.replace(base, **values, train_args=extra)
        if "notice" not in values and isinstance(spec.time, str) and _TIME.fullmatch(spec.time):
            # the default notice shortened to what the limit holds (an explicit one is checked instead)
            spec = dataclasses.replace(spec, notice=min(spec.notice, longest_notice(time_seconds(spec.time))))
        try:
            text = render(spec)
            job_layout(spec)   # the CLI also reads them as the run will (render() keeps them as text)
        except SlurmScriptError as err:
            ap.error(str(err))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
