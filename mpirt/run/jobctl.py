"""Job control for runs left alone on a cluster: stop requests, wall-time limits, the launcher seen,
and the lock that keeps two jobs out of one output directory. Pure Python, no MPI: the training
script reduces the per-rank flags these produce so that every rank acts at the same step.

Exit codes of ``python -m mpirt.train`` (the same on every rank):

====  =====================================================================================
0     finished, or nothing left to do
2     refused before training: bad configuration, data or checkpoint (one ``error:`` line)
3     stopped by the non-finite policy (``--nan-policy stop``, or ``--max-skips`` in a row)
4     the communication watchdog ended the job (a collective or p2p waited too long)
5     a rank's measured peak memory exceeded ``--memory-budget`` (every rank stops; no checkpoint)
75    stopped early on request (SIGTERM/SIGINT, ``--time-limit``) after saving a checkpoint:
      run the same command with ``--resume auto`` to continue (EX_TEMPFAIL: retry later)
====  =====================================================================================
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

EXIT_REFUSED, EXIT_NONFINITE, EXIT_WATCHDOG, EXIT_MEMORY, EXIT_STOPPED = 2, 3, 4, 5, 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """SIGTERM/SIGINT handlers that note the first signal (``requested`` holds its name) so the run
    can stop at the next step boundary with a checkpoint; a second signal ends the process at once
    with the signal's default action."""

    def __init__(self):
        self.requested: str | None = None

    def install(self) -> "StopRequests":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:  # the second notice: no more waiting
            print(f"mpirt: second {name}: exiting now without a checkpoint", file=sys.stderr, flush=True)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = name


# --- wall-time limit ------------------------------------------------------------------------------
def slurm_end_time(env=None) -> float | None:
    """The epoch time at which SLURM will end this job, or None outside SLURM / when unknown.

    ``SLURM_JOB_END_TIME`` (exported by newer SLURM) when set, else ``squeue -h -o %e -j JOBID``."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(env["SLURM_JOB_END_TIME"])
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    for attempt in range(3):  # a busy slurmctld may drop a query: ask again before giving up
        try:
            out = subprocess.run(["squeue", "-h", "-o", "%e", "-j", job], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
            return _dt.datetime.fromisoformat(out).timestamp()  # local time, as squeue prints it
        except FileNotFoundError:
            return None
        except (OSError, ValueError, subprocess.SubprocessError):
            if attempt < 2:
                time.sleep(1.0)
    return None


class Deadline:
    """When to stop so that the last checkpoint is on disk before a wall-time limit.

    ``should_stop(step_s, save_s, extra_s)`` is true once the time left cannot hold two more of the
    slowest step seen, one save as long as the slowest seen (a step's worth before the first),
    ``extra_s`` (the evaluations due before the next chance to stop) and a second of slack; and
    never later than ``reserve`` seconds before the end: a tenth of the limit, at most 30 s (room
    for a slow filesystem and a scheduler that is on time)."""

    def __init__(self, end: float | None, reserve: float = 0.0):
        self.end = end  # epoch seconds, or None for no limit
        self.reserve = reserve

    @classmethod
    def from_config(cls, time_limit: str, start: float, parse_duration) -> "Deadline":
        """``time_limit``: "" (none), "slurm" (the job's end time), or a duration from ``start``."""
        if not time_limit:
            return cls(None)
        end = slurm_end_time() if time_limit == "slurm" else start + parse_duration(time_limit)
        if end is None and os.environ.get("SLURM_JOB_ID"):
            print(f"mpirt: warning: --time-limit slurm: could not read job {os.environ['SLURM_JOB_ID']}'s end "
                  "time from squeue; running without a time limit", file=sys.stderr, flush=True)
        return cls(end, min(30.0, 0.1 * (end - start)) if end is not None else 0.0)

    def left(self, now: float | None = None) -> float:
        return float("inf") if self.end is None else self.end - (time.time() if now is None else now)

    def should_stop(self, step_s: float, save_s: float | None, now: float | None = None, extra_s: float = 0.0) -> bool:
        margin = 2 * step_s + (step_s if save_s is None else save_s) + extra_s + 1.0
        return self.left(now) < max(margin, self.reserve)


# --- launcher ---------------------------------------------------------------------------------------
def launcher_info(env=None) -> dict:
    """What started this process, from the environment: ``name`` (srun, mpiexec (hydra), Open MPI,
    or none), ``tasks`` (how many processes that launcher started, or None), and ``pmi`` (the
    process-management interface seen)."""
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_SIZE" in env:
        return {"name": "Open MPI mpiexec", "tasks": int(env["OMPI_COMM_WORLD_SIZE"]), "pmi": "PMIx"}
    if "PMI_SIZE" in env or "PMI_RANK" in env:
        pmi = "PMI-2" if "PMI_FD" in env or env.get("SLURM_MPI_TYPE", "").startswith("pmi2") else "PMI"
        name = f"srun --mpi={env['SLURM_MPI_TYPE']}" if env.get("SLURM_MPI_TYPE") and "SLURM_STEP_ID" in env \
            else "mpiexec (hydra)"
        return {"name": name, "tasks": int(env.get("PMI_SIZE", 0)) or None, "pmi": pmi}
    if "PMIX_RANK" in env:
        return {"name": "PMIx launcher", "tasks": None, "pmi": "PMIx"}
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
        return {"name": f"srun --mpi={env.get('SLURM_MPI_TYPE', 'none')}", "tasks": int(tasks) if tasks else None,
                "pmi": "none"}
    return {"name": "none (singleton)", "tasks": None, "pmi": "none"}


def pmi_for(library: str) -> str:
    """The ``srun --mpi`` type an MPI library (its version line) starts under: pmix for Open MPI
    (4.x and 5.x), pmi2 for MPICH and its derivatives (Intel MPI, MVAPICH, the PyPI wheel)."""
    return "pmix" if "open mpi" in library.lower() else "pmi2"


def launch_mismatch(world_size: int, env=None, library: str = "") -> str | None:
    """A message when the launcher started several tasks but MPI sees a world of one (each task a
    separate singleton run, e.g. ``srun`` without a PMI the MPI library speaks), else None;
    ``library`` (the MPI library's version line) picks the PMI it suggests."""
    info = launcher_info(env)
    if world_size == 1 and info["tasks"] and info["tasks"] > 1:
        pmi = pmi_for(library)
        named = f" ({library})" if library else ""
        return (f"{info['name']} started {info['tasks']} tasks but MPI sees a world of 1: every task would train "
                f"alone; launch with `srun --mpi={pmi}`{named} (or mpiexec inside the allocation)")
    return None


# --- the output directory ---------------------------------------------------------------------------
LOCK = ".lock"


class DirectoryLocked(RuntimeError):
    """Another live job holds the output directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


SLURM_ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
               "DEADLINE"}


def slurm_job_ended(job: str) -> bool:
    """True when SLURM says job ``job`` is no longer queued or running (``squeue -h -j JOB``
    lists nothing, or no longer knows the id); False while it is listed, or when squeue cannot
    be asked (no SLURM here, no answer): then the job may still be alive."""
    try:
        r = subprocess.run(["squeue", "-h", "-o", "%T", "-j", str(job)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    if r.returncode == 0:   # squeue lists a finished job for a while (MinJobAge) with its end state
        state = r.stdout.split()[0] if r.stdout.split() else ""
        return not state or state in SLURM_ENDED
    return "invalid job id" in (r.stderr + r.stdout).lower()


def acquire_lock(out: Path, env=None) -> Path:
    """Take ``out/.lock`` for this job, or raise :class:`DirectoryLocked` naming its holder.

    The lock is written whole into a temporary file first and then linked into place (``os.link``
    is atomic and fails when the name exists), so of two jobs starting together exactly one wins
    and no reader ever sees it empty or half written; a disk too full for it leaves no lock at all.
    A lock is stale, and taken over, when it names no live job: empty or unreadable (a crash
    mid-write of an older mpirt), its holder was this same SLURM job (a requeue keeps the job id),
    a process on this host that no longer exists, or a SLURM job that squeue says has ended (a
    job hard-killed on another node leaves its lock)."""
    env = os.environ if env is None else env
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": env.get("SLURM_JOB_ID"), "since": time.time()}
    mine = out / f"{LOCK}.{me['host']}.{me['pid']}.tmp"
    try:
        with open(mine, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        mine.unlink(missing_ok=True)
        raise DirectoryLocked(f"out_dir: cannot write the lock {path} ({err.strerror or err}): free space in {out} "
                              f"(or fix its permissions) and start again") from None
    try:
        for _ in range(2):
            try:
                os.link(mine, path)
                return path
            except FileExistsError:
                holder = _lock_holder(path)
            if _names_no_live_job(holder, me):
                path.unlink(missing_ok=True)
                continue
            who = f"pid {holder.get('pid')} on {holder.get('host')}" + (f", SLURM job {holder['job']}" if holder.get("job") else "")
            check = f" (`squeue -j {holder['job']}` lists it while it is alive)" if holder.get("job") else ""
            raise DirectoryLocked(f"out_dir: {out} is in use by another job ({who}); use another --out-dir, or "
                                  f"remove {path} if that job is gone{check}")
        raise DirectoryLocked(f"out_dir: could not take {path}")
    finally:
        mine.unlink(missing_ok=True)


def _lock_holder(path: Path) -> dict:
    """What a lock file says of its holder; {} when it is empty, unreadable or not a lock."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _names_no_live_job(holder: dict, me: dict) -> bool:
    """Whether a lock whose holder is ``holder`` may be taken over by ``me`` (see :func:`acquire_lock`)."""
    if not holder.get("host") or not isinstance(holder.get("pid"), int) or holder["pid"] <= 0:
        return True
    if me["job"] is not None and holder.get("job") == me["job"]:
        return True
    if holder["host"] == me["host"] and not _alive(holder["pid"]):
        return True
    return bool(holder.get("job")) and slurm_job_ended(holder["job"])


def release_lock(path: Path) -> None:
    """Remove the lock if it is still this process's."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass
