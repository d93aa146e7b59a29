"""mpirt's job scripts on a real one-node SLURM, submitted as a normal user.

Run by tests/slurm/run.sh, which starts the cluster (MpiDefault=none, so the scripts must choose
the PMI themselves) and sets MPIRT_ROOT (the repository), MPIRT_SLURM_WORK (a directory this user
may write) and SLURM_CONF. Each scenario prints one ``slurm scenario:`` line with its timings.
"""
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(os.environ["MPIRT_ROOT"])
WORK = Path(os.environ["MPIRT_SLURM_WORK"])
TINY = ["--model", "tiny", "--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--seq-len", "32",
        "--batch-size", "4", "--eval-batches", "1", "--eval-interval", "0", "--log-interval", "1"]
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


def run(*cmd, timeout=60, check=True, **kw) -> str:
    result = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=timeout, **kw)
    if check and result.returncode:
        raise AssertionError(f"{shlex.join(map(str, cmd))} exited {result.returncode}:\n{result.stdout}{result.stderr}")
    return result.stdout


@pytest.fixture(scope="session")
def data() -> Path:
    from mpirt.data.tokens import prepare

    out = WORK / "data"
    prepare(ROOT / "mpirt", out, pattern="*.py", val_fraction=0.2)
    return out


@pytest.fixture(scope="session")
def site_env() -> Path:
    """The site env file these jobs use: the venv the tier runs from; MPI_TYPE left to the default."""
    path = WORK / "site.env"
    path.write_text(f"MPIRT_VENV={shlex.quote(str(ROOT / '.venv'))}\n")
    return path


def render(name: str, *flags, train=()) -> Path:
    """A job script written by ``python -m mpirt.slurm`` for this 2-core node."""
    path = WORK / f"{name}.sbatch"
    run(sys.executable, "-m", "mpirt.slurm", "--gpus-per-node", "0", "--ntasks-per-node", "2", "--cpus-per-task", "1",
        "--job-name", name, *flags, "-o", path, "--", *train)
    return path


def submit(script, *args, sbatch=(), env=None, fault: str | None = None, inject: str | None = None) -> str:
    """Submit ``script``; ``fault`` is an MPIRT_FAULT value the job's ranks inherit, ``inject`` a
    test-only MPIRT_VERIFY_INJECT bug."""
    env = dict(os.environ, MPIRT_SITE_ENV=str(env or WORK / "site.env"), **({"MPIRT_FAULT": fault} if fault else {}),
               **({"MPIRT_VERIFY_INJECT": inject} if inject else {}))
    out = run("sbatch", "--parsable", f"--output={WORK}/%x-%j.out", *sbatch, script, *args, cwd=WORK, env=env)
    return out.strip().split(";")[0]


def job(jid: str, tries: int = 5) -> dict:
    """The job's fields from ``scontrol show job``. A poll that loses its connection to slurmctld
    (CI once saw scontrol killed by SIGPIPE while the controller was busy) is retried; the last
    failure is raised."""
    for attempt in range(tries):
        try:
            text = run("scontrol", "show", "job", "-o", jid)
            return dict(re.findall(r"(\w+)=(\S*)", text))
        except AssertionError:
            if attempt == tries - 1:
                raise
            time.sleep(1.0)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    end = time.time() + timeout
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_done(jid: str, timeout: float = 120) -> dict:
    """Wait until the job reached a final state and its processes are gone."""
    def done():
        info = job(jid)
        return info if info["JobState"] in FINAL and not ranks_alive(jid) else None
    return wait_for(done, timeout, f"job {jid} to end")


def ranks_alive(jid: str) -> bool:
    """Whether any process of job ``jid`` still runs on this node (the jobs run as this user)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if f"SLURM_JOB_ID={jid}\0".encode() in (proc / "environ").read_bytes() and \
                    b"mpirt.train" in (proc / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def output(jid: str, name: str) -> str:
    return (WORK / f"{name}-{jid}.out").read_text()


def shown(info: dict, text: str) -> str:
    """An assertion message: the job's state and the end of its output, in full."""
    lines = [line for line in text.splitlines() if "injecting stall" not in line]
    return f"job {info.get('JobId')}: {info.get('JobState')} exit {info.get('ExitCode')} restarts " \
           f"{info.get('Restarts')}\n" + "\n".join(lines[-60:])


def wait_steps(jid: str, name: str, run_dir: Path, n: int) -> None:
    """Wait until the running job logged ``n`` steps; fail at once, with its output, if it ended."""
    def trained():
        info = job(jid)
        if info["JobState"] in FINAL:
            raise AssertionError("the job ended before training " + shown(info, output(jid, name)))
        return (run_dir / "metrics" / "rank0.jsonl").exists() and len(metric_steps(run_dir)) >= n
    wait_for(trained, 60, f"{n} training steps")


def metric_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


def latest_step(run_dir: Path) -> int:
    return int((run_dir / "ckpt" / "latest").read_text().strip().split("-")[-1])


def stall_every_step(steps: int, seconds: float) -> str:
    """MPIRT_FAULT making rank 0 sleep at each step: a slow run to signal half-way, at no CPU cost."""
    return ",".join(f"stall={seconds}@0:{s}" for s in range(1, steps + 1))


def report(name: str, **numbers) -> None:
    print(f"\nslurm scenario: {name}: " + ", ".join(f"{k} {v}" for k, v in numbers.items()), flush=True)


def test_cpu_template_trains_on_a_world_of_two(data, site_env):
    """The checked-in CPU template, 2 tasks: one world of 2 ranks (not two singletons)."""
    run_dir = WORK / "runs" / "cpu2"
    jid = submit(ROOT / "slurm" / "cpu.sbatch", run_dir, "--data", data, *TINY, "--steps", "6",
                 sbatch=["--ntasks-per-node=2", "--cpus-per-task=1", "--time=5", "--job-name=cpu2"])
    info = wait_done(jid)
    text = output(jid, "cpu2")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", shown(info, text)
    assert "world_size 2" in text and "srun --mpi=pmi2" in text, shown(info, text)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6 and summary["layout"]["dp"] == 2, summary
    assert latest_step(run_dir) == 6
    assert metric_steps(run_dir) == list(range(1, 7))
    report("cpu template, 2 tasks", world_size=summary["world_size"], steps=summary["steps"])


def test_verify_job_passes_a_layout_and_fails_an_injected_bug(data, site_env):
    """``python -m mpirt.slurm --verify``: a job of the check alone. tp 2 on the job's 2 ranks
    against one rank: COMPLETED, exit 0; with a row-parallel backward missing its 1/tp (the
    test-only MPIRT_VERIFY_INJECT): FAILED with verify's exit 1, the first step and tensor named."""
    script = render("verify", "--verify", "--time", "00:05:00", train=["--data", str(data), *TINY, "--tp", "2"])
    seconds = {}
    for inject, state, code in ((None, "COMPLETED", 0), ("tp-row-scale", "FAILED", 1)):
        start = time.time()
        jid = submit(script, WORK / "runs" / f"verify{code}", inject=inject)
        info = wait_done(jid)
        seconds[state] = round(time.time() - start, 1)
        text = output(jid, "verify")
        assert info["JobState"] == state and info["ExitCode"] == f"{code}:0", shown(info, text)
        assert f"verify: exit {code}" in text and ("DIFFERS: step 1: " in text) == bool(code), shown(info, text)
        assert "mpirt.train" not in text, shown(info, text)
    report("verify job, tp 2 against one rank", equal_s=seconds["COMPLETED"], injected_bug_s=seconds["FAILED"])


def test_cancel_saves_then_requeue_resumes(data, site_env):
    """``scancel`` sends TERM to the ranks (and the batch shell, which does not forward it): they
    agree on a step, save, exit 75 within KillWait. ``scontrol requeue`` then resumes the same run
    directory to the end, after the script removed a stale MPICH file and kept one in use."""
    steps = 30
    run_dir = WORK / "runs" / "cancel"
    script = render("cancel", "--template", "preemptible", "--time", "5", "--run-dir", run_dir,
                    train=["--data", data, *TINY, "--steps", steps])
    jid = submit(script, fault=stall_every_step(steps, 0.3))
    wait_steps(jid, "cancel", run_dir, 4)
    t0 = time.time()
    run("scancel", jid)
    info = wait_done(jid, timeout=60)
    stop_s = time.time() - t0
    text = output(jid, "cancel")
    assert info["JobState"] == "CANCELLED", shown(info, text)
    assert "exit 75" in text and "requeueing" not in text, shown(info, text)
    saved = latest_step(run_dir)
    assert 4 <= saved < steps and max(metric_steps(run_dir)) == saved, (saved, metric_steps(run_dir))

    stale, busy = Path("/dev/shm/mpich_mpirt_tier_stale"), Path("/dev/shm/mpich_mpirt_tier_busy")
    stale.write_bytes(b"x")
    busy.write_bytes(b"x")
    holder = subprocess.Popen(["sleep", "120"], stdin=busy.open("rb"))
    try:
        t1 = time.time()
        run("scontrol", "requeue", jid)
        info = wait_done(jid, timeout=90)
        resume_s = time.time() - t1
        assert not stale.exists() and busy.exists(), "the script must remove only the MPICH file no process uses"
    finally:
        holder.kill()
        holder.wait()
        stale.unlink(missing_ok=True)
        busy.unlink()
    text = output(jid, "cancel")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", shown(info, text)
    assert f"removed stale MPICH shared memory {stale}" in text, shown(info, text)
    assert metric_steps(run_dir) == list(range(1, steps + 1))  # each step once, none lost
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["world_size"] == 2, summary
    report("scancel (TERM to ranks and batch shell), then scontrol requeue", signal_to_exit_s=f"{stop_s:.1f}",
           saved_step=saved, requeue_to_end_s=f"{resume_s:.1f}", final_steps=summary["steps"])


def test_time_limit_notice_stops_and_requeues_itself(data, site_env):
    """The notice SLURM sends ahead of the time limit (``--signal=B:USR1@N``, here sent at once with
    ``scancel --batch --signal=USR1``): the batch shell asks the ranks to stop, they save and exit
    75, and the preemptible job requeues itself and finishes the run."""
    steps = 24
    run_dir = WORK / "runs" / "notice"
    script = render("notice", "--template", "preemptible", "--time", "5", "--run-dir", run_dir,
                    train=["--data", data, *TINY, "--steps", steps])
    jid = submit(script, fault=stall_every_step(steps, 0.3))
    wait_steps(jid, "notice", run_dir, 4)
    t0 = time.time()
    run("scancel", "--batch", "--signal=USR1", jid)
    wait_for(lambda: job(jid)["Restarts"] == "1", 60, "the job to requeue itself")
    stop_s = time.time() - t0
    info = wait_done(jid, timeout=90)
    text = output(jid, "notice")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", shown(info, text)
    assert "time limit near" in text and "exit 75" in text and "requeueing to continue from step-" in text, \
        shown(info, text)
    saved = int(re.search(r"requeueing to continue from step-0*(\d+)", text).group(1))
    assert 4 <= saved < steps
    assert metric_steps(run_dir) == list(range(1, steps + 1))
    report("USR1 notice to the batch shell, self-requeue", signal_to_requeue_s=f"{stop_s:.1f}", saved_step=saved,
           total_s=f"{time.time() - t0:.1f}")


def test_job_stops_itself_before_its_time_limit(data, site_env):
    """``--time=1`` and no notice: ``--time-limit slurm`` (the job's end time from squeue) makes the
    run stop with a checkpoint and exit 75 before SLURM would kill it."""
    run_dir = WORK / "runs" / "limit"
    script = render("limit", "--template", "cpu", "--time", "1", "--notice", "0", "--run-dir", run_dir,
                    train=["--data", data, *TINY, "--steps", 100000, "--progress", "false"])
    t0 = time.time()
    jid = submit(script)
    info = wait_done(jid, timeout=150)
    text = output(jid, "limit")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "75:0", shown(info, text)
    left = re.search(r"time limit slurm near \((\d+) s left\)", text)
    assert left and "exit 75" in text, shown(info, text)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 75 and summary["last_checkpoint_step"] == summary["steps"] == latest_step(run_dir)
    report("--time=1, stopped by --time-limit slurm", run_time=info["RunTime"], time_limit=info["TimeLimit"],
           left_at_stop_s=left.group(1), saved_step=summary["steps"], submit_to_end_s=f"{time.time() - t0:.1f}")


def test_ranks_that_exit_0_early_do_not_make_a_finished_job(data, site_env):
    """Both ranks call ``os._exit(0)`` at step 3 of 60 (a library's ``exit(0)``): srun's exit code
    is 0, but summary.json was never written, so the job says it ended early and fails (exit 1)."""
    run_dir = WORK / "runs" / "vanish"
    jid = submit(ROOT / "slurm" / "cpu.sbatch", run_dir, "--data", data, *TINY, "--steps", "60",
                 sbatch=["--ntasks-per-node=2", "--cpus-per-task=1", "--time=5", "--job-name=vanish"],
                 fault="vanish@0:3,vanish@1:3")
    info = wait_done(jid)
    text = output(jid, "vanish")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", shown(info, text)
    assert "training ended early: the ranks exited 0 but" in text and "training finished" not in text, shown(info, text)
    assert not (run_dir / "summary.json").exists()
    report("both ranks os._exit(0) at step 3 of 60", state=info["JobState"], exit=info["ExitCode"])
