"""Runs left alone: signals, time limits, resume, non-finite steps and output-directory safety,
each exercised on real ``python -m mpirt.train`` processes (under mpiexec where ranks matter)."""
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, run_module
from mpirt.comm import library_version
from runs import TINY, read_metrics

EXIT_NONFINITE, EXIT_STOPPED = 3, 75
F64 = [*TINY, "--dtype=float64"]


def start(args, out, *, ranks=2, env=None):
    """Start a long training run in the background (stdout/stderr to files in ``out``'s parent)."""
    cmd = [sys.executable, "-m", "mpirt.train", *map(str, args), f"--out-dir={out}"]
    if ranks:
        cmd = ["mpiexec", "-n", str(ranks), *cmd]
    log = open(f"{out}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env=dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", **(env or {})))


def wait_for_steps(out, steps: int, proc, timeout: float = 120) -> None:
    """Wait until rank 0's metrics hold ``steps`` records (the run is in its loop)."""
    path = out / "metrics" / "rank0.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, open(f"{out}.log").read()
        time.sleep(0.1)
    raise AssertionError(f"no {steps} steps within {timeout} s")


# the syscall time.sleep blocks in (the first field of /proc/PID/task/TID/syscall)
CLOCK_NANOSLEEP = {"x86_64": "230", "aarch64": "115"}.get(platform.machine(), "unknown")


def main_thread(pid: int) -> tuple[str, int]:
    """The syscall ``pid``'s main thread is blocked in (``running`` when in none) and its count of
    voluntary context switches (each block in a syscall adds one)."""
    task = Path(f"/proc/{pid}/task/{pid}")
    try:
        call = (task / "syscall").read_text().split()[0]
        status = (task / "status").read_text()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "gone", -1
    switches = next(line for line in status.splitlines() if line.startswith("voluntary_ctxt_switches:"))
    return call, int(switches.split()[1])


def wait_until(what: str, proc, out, ready, timeout: float = 60):
    """Poll ``ready()`` until it returns something true (returned); fail naming ``what`` when the run
    ends first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not (got := ready()):
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}:\n" + open(f"{out}.log").read()
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}:\n" + open(f"{out}.log").read()
        time.sleep(0.01)
    return got


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (hydra puts its proxy and the ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for line in subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rank_pids(proc) -> list[int]:
    """The training processes under the launcher ``proc``."""
    return [p for p in descendants(proc.pid)
            if os.path.basename(open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")[0]).startswith(b"python")]


def finish(proc, timeout: float = 60) -> int:
    """Wait for the launcher; on a timeout kill it and every process below it."""
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            for pid in [*descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def summary(out):
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("how", ["SIGTERM to one rank", "SIGTERM to mpiexec", "SIGINT to every rank",
                                 "Ctrl-C (SIGINT to mpiexec's process group)"])
def test_a_signal_stops_every_rank_with_a_checkpoint_and_resume_continues(tiny_data, tmp_path, how):
    out = tmp_path / "run"
    proc = start([*TINY, f"--data={tiny_data}", "--steps=100000"], out)
    wait_for_steps(out, 3, proc)
    t0 = time.time()
    if how == "SIGTERM to mpiexec":
        proc.send_signal(signal.SIGTERM)
    elif how.startswith("Ctrl-C"):   # what a terminal does: the whole foreground group, mpiexec and ranks
        os.killpg(proc.pid, signal.SIGINT)
    else:
        targets = rank_pids(proc)
        assert len(targets) == 2, targets
        for pid in targets[:1] if how == "SIGTERM to one rank" else targets:
            os.kill(pid, signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT)
    code = finish(proc)
    print(f"{how}: exit {code} {time.time() - t0:.2f} s after the signal")
    log = open(f"{out}.log").read()
    assert code == EXIT_STOPPED, log
    s = summary(out)
    assert s["stopped"] and s["last_checkpoint_step"] == s["steps"] >= 3
    assert f"step {s['steps']}: checkpoint saved" in log and "continue with the same command and --resume auto" in log
    # the same command with --resume auto continues from there; each step is in the metrics once
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--steps={s['steps'] + 3}", f"--out-dir={out}",
               "--resume=auto", ranks=2)
    assert [r["step"] for r in read_metrics(out)] == list(range(1, s["steps"] + 4))
    assert summary(out)["steps"] == s["steps"] + 3


def test_stop_and_resume_by_signal_equals_the_uninterrupted_run(tiny_data, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = [*F64, f"--data={tiny_data}", "--steps=8"]
    run_module("mpirt.train", *common, f"--out-dir={full}", ranks=2)
    env = dict(os.environ, MPIRT_FAULT="signal@1:4")
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mpirt.train", *common, f"--out-dir={part}"],
                            capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert result.returncode == EXIT_STOPPED, result.stderr
    assert summary(part)["steps"] == 4 and summary(part)["stopped"] == "a stop request on rank 1"
    run_module("mpirt.train", *common, f"--out-dir={part}", "--resume=auto", ranks=2)
    assert [r["loss"] for r in read_metrics(part)] == [r["loss"] for r in read_metrics(full)]
    assert summary(part)["val_loss"] == summary(full)["val_loss"]


def mpmd(rank0: list, rank1: list, wdirs=None) -> list:
    """The command of a 2-rank launch whose ranks get their own arguments (and working directories:
    one relative path, two views, as on two nodes)."""
    blocks = []
    for args, wdir in zip((rank0, rank1), wdirs or (None, None)):
        blocks += [":"] * bool(blocks) + (["-wdir", str(wdir)] if wdir else []) + [
            "-n", "1", sys.executable, "-m", "mpirt.train", *map(str, args)]
    return ["mpiexec", *blocks]


@pytest.mark.parametrize("case", ["arguments", "CONFIG.toml"])
def test_a_rank_that_cannot_start_ends_every_rank_in_one_line(tiny_data, tmp_path, case):
    """Rank 1 cannot parse its arguments (an MPMD launch), or cannot read the CONFIG.toml rank 0
    reads (a relative path that only rank 0's working directory holds): both ranks reach the same
    first agreement, and the job ends at once with one line naming rank 1 (it once skipped the
    collective that started the watchdog while rank 0 waited in it: both ranks spun for good)."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    (nodes[0] / "run.toml").write_text("steps = 3\n")
    args = [*TINY, f"--data={tiny_data}", f"--out-dir={tmp_path / 'out'}"]
    if case == "arguments":
        cmd, reason = mpmd([*args, "--steps", "3"], [*args, "--steps", "abc"]), "steps: expected int, got 'abc'"
    else:
        cmd, reason = mpmd(["run.toml", *args], ["run.toml", *args], nodes), "config file run.toml: No such file or directory"
    t0 = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    print(f"rank 1 cannot start ({case}): exit {result.returncode} after {time.time() - t0:.1f} s")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"error on rank 1: {reason}"], result.stderr


# the syscall a process opening a FIFO nobody writes blocks in
OPENAT = {"x86_64": "257", "aarch64": "56"}.get(platform.machine(), "unknown")


def test_a_term_before_training_ends_every_rank_even_waiting_inside_mpi(tiny_data, tmp_path):
    """`timeout` sends the launcher one TERM: ranks hung in the pre-flight (rank 1 opening a FIFO
    as its dataset, rank 0 waiting for it inside MPI, no watchdog timeout) must end. A Python stop
    handler never runs while its thread is inside MPI: the early one swallowed the TERM."""
    stalled = tmp_path / "stalled"
    stalled.mkdir()
    os.mkfifo(stalled / "meta.json")
    args = [*TINY, "--comm-timeout=0", f"--out-dir={tmp_path / 'o'}"]
    proc = subprocess.Popen(mpmd([*args, f"--data={tiny_data}"], [*args, f"--data={stalled}"]), cwd=ROOT,
                            stdout=open(tmp_path / "o.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def hung():  # rank 1 blocked opening the FIFO (past the first agreements), rank 0 spinning on
        return sorted(main_thread(pid)[0] for pid in rank_pids(proc)) == sorted([OPENAT, "running"])

    wait_until(f"rank 1 blocked opening its FIFO (syscall {OPENAT})", proc, tmp_path / "o", hung)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    finish(proc, timeout=20)
    print(f"TERM in a hung pre-flight: every rank gone {time.time() - t0:.1f} s after it")
    assert not descendants(proc.pid)


def test_a_rank_stalled_before_training_is_caught_by_the_watchdog(tiny_data, tmp_path):
    """Rank 1's dataset is a FIFO nobody writes (its open never returns) while rank 0 waits in the
    pre-flight's agreement: --comm-timeout 10 ends the job with exit 4, not a hang."""
    stalled = tmp_path / "stalled"
    stalled.mkdir()
    os.mkfifo(stalled / "meta.json")
    args = [*TINY, "--comm-timeout=10", f"--out-dir={tmp_path / 'o'}"]
    cmd = mpmd([*args, f"--data={tiny_data}"], [*args, f"--data={stalled}"])
    t0 = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    print(f"stalled pre-flight: exit {result.returncode} after {time.time() - t0:.1f} s")
    assert result.returncode == 4, result.stderr
    assert "rank 1" in result.stderr and time.time() - t0 < 90


def test_a_second_signal_exits_at_once(tiny_data, tmp_path):
    out = tmp_path / "run"
    # a rank stalled in its step cannot reach the step boundary: only the second signal ends it
    proc = start([*TINY, f"--data={tiny_data}", "--steps=100000"], out, ranks=0, env={"MPIRT_FAULT": "stall@0:3"})
    wait_for_steps(out, 2, proc)
    # past step 2's stop check and asleep in step 3's stall: a TERM before that would stop the run
    # cleanly at step 2's boundary instead
    asleep = f"rank 0 asleep in step 3's stall (syscall {CLOCK_NANOSLEEP} on {platform.machine()})"
    stalled = wait_until(asleep, proc, out, lambda: (
        "rank 0 step 3: injecting stall" in open(f"{out}.log").read()
        and (thread := main_thread(proc.pid))[0] == CLOCK_NANOSLEEP and thread))
    proc.send_signal(signal.SIGTERM)
    # the first TERM's Python handler has run once the thread is back in its sleep (PEP 475: an
    # interrupted time.sleep runs the handlers, then sleeps on) with a context switch more
    wait_until("the first SIGTERM handled and the stall resumed", proc, out, lambda: (
        (thread := main_thread(proc.pid))[0] == CLOCK_NANOSLEEP and thread[1] > stalled[1]))
    assert proc.poll() is None
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    code = finish(proc, timeout=20)
    assert code == -signal.SIGTERM and time.time() - t0 < 5
    assert "second SIGTERM" in open(f"{out}.log").read()


def test_time_limit_stops_with_a_checkpoint_before_the_limit(tiny_data, tmp_path):
    out = tmp_path / "run"
    t0 = time.time()
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=1000000", "--time-limit=8s",
                        f"--out-dir={out}", ranks=2, check=False)
    wall = time.time() - t0
    print(f"--time-limit 8s: exit {result.returncode} after {wall:.1f} s (launcher included)")
    assert result.returncode == EXIT_STOPPED, result.stderr
    s = summary(out)
    assert "time limit" in s["stopped"] and s["last_checkpoint_step"] == s["steps"] > 0
    assert s["wall_time_s"] < 8  # on the script's own clock, which the limit counts from
    assert wall < 8 + 20  # the launcher, interpreters and MPI start before that clock (slow under load)


def test_time_limit_counts_the_evaluations(tiny_data, tmp_path):
    """Evaluations of several seconds every few steps: the run still ends inside its limit."""
    out = tmp_path / "run"
    args = [a for a in TINY if not a.startswith(("--eval-batches", "--eval-interval"))]
    result = run_module("mpirt.train", *args, f"--data={tiny_data}", "--steps=1000000", "--time-limit=12s",
                        "--eval-interval=4", "--eval-batches=600", f"--out-dir={out}", ranks=2, check=False)
    assert result.returncode == EXIT_STOPPED, result.stderr
    s = summary(out)
    print(f"--time-limit 12s with evaluations: stopped at step {s['steps']} after {s['wall_time_s']:.1f} s")
    assert "time limit" in s["stopped"] and s["last_checkpoint_step"] == s["steps"] > 0
    assert s["wall_time_s"] < 12


def test_steps_per_job_splits_a_run_into_jobs(tiny_data, tmp_path):
    out = tmp_path / "run"
    args = [*F64, f"--data={tiny_data}", "--steps=7", "--steps-per-job=3", "--resume=auto", f"--out-dir={out}"]
    done, codes, vals = [], [], []
    for _ in range(4):
        result = run_module("mpirt.train", *args, check=False)
        done.append(summary(out)["steps"])
        codes.append(result.returncode)
        vals.append(summary(out)["val_loss"])
    assert all(v is not None for v in vals[:3]), vals  # each job's share ends with an evaluation
    assert done == [3, 6, 7, 7] and "nothing to do" in result.stderr and not result.stdout
    assert codes == [EXIT_STOPPED, EXIT_STOPPED, 0, 0]   # work left: 75, so a requeue chain goes on
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 8))
    assert summary(out)["val_loss"] is not None and math.isfinite(summary(out)["val_loss"])


@pytest.mark.parametrize("clip", ["0", "1"])
def test_non_finite_steps_are_skipped_then_stop_the_run_without_a_bad_checkpoint(tiny_data, tmp_path, clip):
    out = tmp_path / "run"
    # a good checkpoint at step 2, then an absurd learning rate from a resumed run blows up the weights
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=2", f"--out-dir={out}", ranks=2)
    good = sorted(p.name for p in (out / "ckpt").iterdir())
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=40", "--lr=1e30", "--min-lr=0",
                        f"--grad-clip={clip}", "--max-skips=3", f"--out-dir={out}", "--resume=auto", ranks=2,
                        check=False)
    assert result.returncode == EXIT_NONFINITE, result.stderr
    assert "update skipped" in result.stderr and "last good checkpoint" in result.stderr
    records = read_metrics(out)
    assert sum(r["skipped"] for r in records) == 3 and records[-1]["skipped"]
    assert summary(out)["skipped_steps"] == 3 and summary(out)["exit_code"] == EXIT_NONFINITE
    # whatever was saved after step 2 is finite; the step-2 checkpoint or a finite successor is latest
    meta = json.loads((out / "ckpt" / (out / "ckpt" / "latest").read_text().strip() / "meta.json").read_text())
    assert meta["step"] >= 2 and good


def test_the_last_good_checkpoint_is_the_one_before_the_divergence_and_its_flag_resumes(tiny_data, tmp_path):
    """10 good steps, then lr 1e6: step 12's version is finite (loss ~1e12) but diverged. The stop
    names step 10 as the last good checkpoint with the exact flag, which resumes (exit 0); every
    version records its loss, gradient norm and verdict, and the good ones were not pruned."""
    out = tmp_path / "run"
    common = [*TINY, f"--data={tiny_data}", "--ckpt-interval=2", "--keep-checkpoints=2", f"--out-dir={out}"]
    run_module("mpirt.train", *common, "--steps=10")
    result = run_module("mpirt.train", *common, "--steps=40", "--lr=1e6", "--min-lr=0", "--resume=auto",
                        check=False)
    flag = f"--init-from {out / 'ckpt' / 'step-00000010'}"
    assert result.returncode == EXIT_NONFINITE, result.stderr
    assert f"the last good checkpoint is step 10: resume from it with {flag}" in result.stderr, result.stderr
    assert "the loss left its recent range" in result.stderr
    metas = {p.name: json.loads((p / "meta.json").read_text())["extra"] for p in (out / "ckpt").glob("step-*")}
    assert metas["step-00000010"]["good"] and math.isfinite(metas["step-00000010"]["grad_norm"])
    bad = metas["step-00000012"]
    assert bad["good"] is False and bad["loss"] > 1e3, metas
    resumed = run_module("mpirt.train", *common, "--steps=12", *flag.split())
    assert f"resuming {out / 'ckpt' / 'step-00000010'} at step 10" in resumed.stderr


def test_a_non_finite_state_at_a_save_stops_with_exit_3_not_done(tiny_data, tmp_path):
    """lr 1e39 makes step 1's weights infinite and every later step non-finite: each save finds the
    state not finite; the run must stop there with exit 3 and say so, never end \"done\" (exit 0)."""
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=5", "--lr=1e39", "--warmup-steps=0",
                        "--grad-clip=0", "--ckpt-interval=1", f"--out-dir={tmp_path}", ranks=2, check=False)
    assert result.returncode == 3, result.stderr
    assert "stopped at step 1 of 5" in result.stderr and "the weights or optimizer state are not finite" in result.stderr
    assert "nothing was saved after the failure: no checkpoint was written" in result.stderr
    assert not (tmp_path / "ckpt" / "latest").exists()


def test_a_skip_streak_never_rotates_out_the_checkpoints_of_real_updates(tiny_data, tmp_path):
    """4 good steps (versions 2 and 4 kept), then a resumed run whose steps 5-8 are all skipped
    (non-finite gradients injected): its interval and final saves write nothing, so 2 and 4 stay."""
    common = [*TINY, f"--data={tiny_data}", "--ckpt-interval=2", "--keep-checkpoints=2", f"--out-dir={tmp_path}"]
    run_module("mpirt.train", *common, "--steps=4", ranks=2)
    faults = ",".join(f"overflow@0:{step}" for step in range(5, 9))
    env = dict(os.environ, MPIRT_FAULT=faults, OPENBLAS_NUM_THREADS="1")
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mpirt.train", *common, "--steps=8",
                             "--resume=auto"], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    assert "step 8: no update since the checkpoint of step 4 (every step skipped): nothing new to save" in result.stderr
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000002", "step-00000004"]
    assert (ckpt / "latest").read_text().strip() == "step-00000004" and summary(tmp_path)["last_checkpoint_step"] == 4


def test_nan_policy_stop_ends_at_the_first_non_finite_step(tiny_data, tmp_path):
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=40", "--lr=1e30", "--min-lr=0",
                        "--warmup-steps=0", "--grad-clip=0", "--nan-policy=stop", f"--out-dir={tmp_path}", check=False)
    assert result.returncode == EXIT_NONFINITE, result.stderr
    assert sum(r["skipped"] for r in read_metrics(tmp_path)) == 1


def test_an_earlier_run_is_not_overwritten_unless_asked(tiny_data, tmp_path):
    args = [*TINY, f"--data={tiny_data}", "--steps=2", f"--out-dir={tmp_path}"]
    run_module("mpirt.train", *args)
    before = (tmp_path / "summary.json").read_text()
    result = run_module("mpirt.train", *args, check=False)
    assert result.returncode == 2 and result.stderr.count("error:") == 1
    assert "holds an earlier run" in result.stderr and "--resume auto" in result.stderr
    assert (tmp_path / "summary.json").read_text() == before
    run_module("mpirt.train", *args, "--overwrite", "--steps=3")
    assert summary(tmp_path)["steps"] == 3 and [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    # --eval-only writes its own file and leaves the training summary alone
    before = (tmp_path / "summary.json").read_text()
    out = run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--init-from={tmp_path / 'ckpt'}", "--eval-only",
                     f"--out-dir={tmp_path}").stdout
    assert json.loads((tmp_path / "eval.json").read_text())["val_loss"] == json.loads(out.splitlines()[-1])["val_loss"]
    assert (tmp_path / "summary.json").read_text() == before


def test_two_jobs_on_one_directory(tiny_data, tmp_path):
    out = tmp_path / "run"
    first = start([*TINY, f"--data={tiny_data}", "--steps=100000"], out, ranks=0)
    wait_for_steps(out, 2, first)
    second = run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=5", f"--out-dir={out}", "--resume=auto",
                        check=False)
    first.send_signal(signal.SIGTERM)
    assert finish(first) == EXIT_STOPPED and summary(out)["stopped"] == "SIGTERM"  # one rank: its own signal
    assert second.returncode == 2 and "in use by another job" in second.stderr
    assert not (out / ".lock").exists()  # released by the job that stopped
    # a lock left by a process that is gone (kill -9) does not block the next job
    (out / ".lock").write_text(json.dumps({"host": os.uname().nodename, "pid": 2 ** 22 + 7, "job": None}))
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--steps={summary(out)['steps'] + 1}",
               f"--out-dir={out}", "--resume=auto")


def test_srun_without_a_pmi_is_refused(tiny_data, tmp_path):
    """srun started 2 tasks, but MPI came up as a singleton: each task would train alone."""
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    result = subprocess.run([sys.executable, "-m", "mpirt.train", *TINY, f"--data={tiny_data}", f"--out-dir={tmp_path}"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, **env))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: srun --mpi=none started 2 tasks but MPI sees a world of 1: every task would train alone; "
        f"launch with `srun --mpi=pmi2` ({library_version()}) (or mpiexec inside the allocation)"]


def test_a_full_disk_at_a_save_ends_the_job_naming_the_path_and_keeps_the_last_checkpoint(tiny_data, tmp_path):
    out = tmp_path / "run"
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=2", f"--out-dir={out}", ranks=2)
    # from step 3 on, rank 0's files may not grow past 64 KiB (a checkpoint of the tiny model is ~270 KB)
    env = dict(os.environ, MPIRT_FAULT="diskfull@0:3")
    t0 = time.time()
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mpirt.train", *TINY, f"--data={tiny_data}",
                             "--steps=4", f"--out-dir={out}", "--resume=auto"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    print(f"full disk at a save: exit {result.returncode} after {time.time() - t0:.1f} s")
    assert result.returncode != 0
    assert f"error: step 4: writing the checkpoint under {out / 'ckpt'} failed" in result.stderr
    assert "the last complete checkpoint is step 2" in result.stderr
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=4", f"--out-dir={out}", "--resume=auto",
               "--eval-only")  # step 2 still loads (checksums verified)


def test_training_beside_a_folder_named_mpirt_saves_its_checkpoints(tiny_data, tmp_path):
    """From the folder that holds a clone named mpirt (its parent), `import mpirt` finds that folder
    first; the run must still save (it once trained to the end, then died at its first save)."""
    (tmp_path / "mpirt" / "mpirt").mkdir(parents=True)
    out = tmp_path / "run"
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=2", "--ckpt-interval=1", f"--out-dir={out}",
               ranks=2, cwd=tmp_path)
    latest = (out / "ckpt" / "latest").read_text().strip()
    meta = json.loads((out / "ckpt" / latest / "meta.json").read_text())
    from mpirt.version import __version__
    assert summary(out)["last_checkpoint_step"] == 2 and meta["step"] == 2 and meta["mpirt_version"] == __version__


@pytest.mark.parametrize("target", ["a_file/run", "/proc/run"])
def test_an_out_dir_that_cannot_be_written_is_refused_before_step_1(tiny_data, tmp_path, target):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / target if not target.startswith("/") else target
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", f"--out-dir={out}", ranks=2, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: out_dir: cannot write to {out}"), result.stderr


def test_a_full_disk_at_the_metrics_file_is_one_error_line(tiny_data, tmp_path):
    """The metrics file (not a checkpoint) is the first to hit the limit: one clean line, no traceback."""
    env = dict(os.environ, MPIRT_FAULT="diskfull@0:2", OPENBLAS_NUM_THREADS="1")
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mpirt.train", *TINY, f"--data={tiny_data}",
                             "--steps=400", f"--out-dir={tmp_path}"], capture_output=True, text=True, timeout=240,
                            cwd=ROOT, env=env)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert (f"error: rank 0: out of disk space writing {tmp_path / 'metrics' / 'rank0.jsonl'} (File too large); "
            "no checkpoint was written") in result.stderr, result.stderr


@pytest.mark.parametrize("case, message", [("cupy", "backend: cupy was asked for"),
                                           ("short", "fewer than one sequence"),
                                           ("mlp-tp", "tp: model_type 'mlp' has no tensor-parallel plan")])
def test_environment_refusals_are_one_line(tiny_data, tmp_path, case, message):
    args = [f"--data={tiny_data}", "--backend=cupy"]
    if case == "short":  # a train.bin shorter than one sequence, a val.bin long enough
        data = tmp_path / "short"
        data.mkdir()
        np.zeros(10, dtype=np.uint16).tofile(data / "train.bin")
        np.zeros(1000, dtype=np.uint16).tofile(data / "val.bin")
        args = [f"--data={data}"]
    if case == "mlp-tp":
        args = [f"--data={tiny_data}", "--model=mlp", "--tp=2"]
    result = run_module("mpirt.train", *TINY, *args, f"--out-dir={tmp_path / 'o'}", ranks=2, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_a_folder_of_raw_text_is_refused_pointing_at_prepare(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("hello\n")
    result = run_module("mpirt.train", *TINY, f"--data={tmp_path / 'text'}", f"--out-dir={tmp_path / 'o'}",
                        check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("error: data: ") and "python -m mpirt.data prepare" in result.stderr


def test_a_40_gb_dataset_without_a_record_starts_at_once_with_flat_memory(tmp_path):
    """A sparse 40 GB train.bin and no recorded ids: not scanned at start-up (the issue measured 77 s
    and 22 GB resident when it was), read window by window: peak RSS stays under 1 GB."""
    data = tmp_path / "big"
    data.mkdir()
    with open(data / "train.bin", "wb") as f:
        f.truncate(40 << 30)
    np.random.default_rng(0).integers(1, 256, 100_000).astype(np.uint16).tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps({"vocab_size": 256, "tokenizer": "bytes", "format": "uint16"}))
    result = run_module("mpirt.train", *TINY, f"--data={data}", "--steps=3", f"--out-dir={tmp_path / 'o'}", ranks=2)
    s = summary(tmp_path / "o")
    print(f"40 GB sparse dataset: {s['wall_time_s']:.1f} s, peak RSS {max(s['peak_memory_bytes_per_rank']) / 2**20:.0f} MiB")
    assert f"{data / 'train.bin'} (21,474,836,480 tokens) records no largest token id" in result.stderr
    assert max(s["peak_memory_bytes_per_rank"]) < 1 << 30 and s["wall_time_s"] < 30 and s["steps"] == 3


def test_a_token_id_out_of_range_found_while_reading_ends_the_run_in_one_line(tmp_path):
    """A train split too large to scan at start-up (no record) whose ids are all out of range: the
    first batch read ends the run with one line naming the file and the token, no traceback."""
    from mpirt.data.tokens import SCAN_TOKENS
    data = tmp_path / "bad"
    data.mkdir()
    np.full(SCAN_TOKENS + 1000, 300, dtype=np.uint16).tofile(data / "train.bin")
    np.random.default_rng(0).integers(1, 256, 100_000).astype(np.uint16).tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps({"vocab_size": 256, "tokenizer": "bytes", "format": "uint16"}))
    result = run_module("mpirt.train", *TINY, f"--data={data}", "--steps=5", f"--out-dir={tmp_path / 'o'}", ranks=2,
                        check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"{data / 'train.bin'} holds token id 300 >= the model's vocab_size 256 (token " in result.stderr
    assert "no checkpoint was written" in result.stderr


def test_a_token_file_truncated_under_a_running_job_ends_it_in_one_line(tiny_data, tmp_path):
    """train.bin cut to 1,000 tokens while the job trains: one line per rank naming the file, what
    changed and the last checkpoint (exit 2), not an ``OSError: short read`` traceback."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    out = tmp_path / "run"
    proc = start([*TINY, f"--data={data}", "--steps=100000", "--ckpt-interval=2"], out, ranks=0)
    try:
        wait_for_steps(out, 3, proc)
        os.truncate(data / "train.bin", 2000)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    log = open(f"{out}.log").read()
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in log, log
    assert len(errors) == 1 and errors[0].startswith(
        f"error: rank 0: data: {data / 'train.bin'} changed under the running job: truncated from "), log
    step = json.loads((out / "ckpt" / (out / "ckpt" / "latest").read_text().strip() / "meta.json").read_text())["step"]
    assert errors[0].endswith(f"to 2,000 bytes; the last complete checkpoint is step {step}"), log


@pytest.mark.parametrize("meta, fault", [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object, found list"),
                                         ('{"vocab_size": "256"}', "vocab_size should be an integer, found '256'")])
def test_a_malformed_dataset_meta_json_is_refused_in_one_line(tiny_data, tmp_path, meta, fault):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    (data / "meta.json").write_text(meta)
    result = run_module("mpirt.train", *TINY, f"--data={data}", f"--out-dir={tmp_path / 'o'}", ranks=2, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: data: {data / 'meta.json'}: {fault}"), lines[0]


def test_a_hugging_face_directory_missing_a_tensor_is_refused_in_one_line(tiny_data, tmp_path):
    from safetensors.numpy import load_file, save_file
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=1", f"--out-dir={tmp_path / 'run'}")
    hf = tmp_path / "hf"
    run_module("mpirt.checkpoint", "export", tmp_path / "run" / "ckpt", hf)
    tensors = load_file(str(hf / "model.safetensors"))
    tensors.pop("transformer.h.0.attn.c_proj.weight")
    save_file(tensors, str(hf / "model.safetensors"))
    result = run_module("mpirt.train", *TINY[4:], f"--data={tiny_data}", f"--init-from={hf}",
                        f"--out-dir={tmp_path / 'o'}", ranks=2, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "missing keys ['h.0.attn.c_proj.weight']" in lines[0], lines[0]


def test_resume_with_another_dataset_is_refused_naming_it(tiny_data, tmp_path):
    out = tmp_path / "run"
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=2", f"--out-dir={out}")
    other = tmp_path / "other"
    shutil.copytree(tiny_data, other)
    result = run_module("mpirt.train", *TINY, f"--data={other}", "--steps=4", f"--out-dir={out}", "--resume=auto",
                        check=False)
    assert result.returncode == 2 and "resume:" in result.stderr and "data: checkpoint" in result.stderr


def test_resume_auto_after_a_kill_between_a_first_save_and_its_pointer(tiny_data, tmp_path):
    """A first save killed after its version's rename, before `latest` was written (and a later,
    half-written version beside it): --resume auto continues from the newest version that verifies."""
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=2", f"--out-dir={tmp_path}", ranks=2)
    ckpt = tmp_path / "ckpt"
    (ckpt / "latest").unlink()
    damaged = ckpt / "step-00000009"
    shutil.copytree(ckpt / "step-00000002", damaged)
    (damaged / "meta.json").write_text("{}")              # fails its checksum
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=4", f"--out-dir={tmp_path}",
                        "--resume=auto", ranks=2)
    assert f"resuming {(ckpt / 'step-00000002').resolve()} at step 2" in result.stderr, result.stderr
    assert summary(tmp_path)["steps"] == 4 and (ckpt / "latest").read_text().strip() == "step-00000004"


def test_resume_auto_refuses_an_edited_model_file_naming_the_fields(tiny_data, tmp_path):
    toml = tmp_path / "model.toml"
    toml.write_text('model_type = "gpt2"\nn_layer = 1\nn_head = 2\nn_embd = 32\nn_positions = 32\n')
    common = [*TINY[4:], f"--data={tiny_data}", f"--model={toml}", f"--out-dir={tmp_path / 'run'}"]
    run_module("mpirt.train", *common, "--steps=2", ranks=2)
    run_module("mpirt.train", *common, "--steps=3", "--resume=auto", ranks=2)   # unchanged: resumes
    toml.write_text(toml.read_text().replace("n_layer = 1", "n_layer = 2").replace("n_embd = 32", "n_embd = 64"))
    result = run_module("mpirt.train", *common, "--steps=4", "--resume=auto", ranks=2, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: resume: model {toml} is not the model of the checkpoint (n_embd: checkpoint 32, "
                               "now 64; n_layer: checkpoint 1, now 2)"), lines[0]


def test_resume_auto_of_a_run_started_from_other_weights_is_not_held_to_model(tiny_data, tmp_path):
    """A run started from a Hugging Face Llama directory (its --model the default) resumes: its model
    is the weights', which --model never described; the banner and the checkpoint name it as the
    Llama from that directory, not as the default `tiny`."""
    run_module("mpirt.train", "--model=llama-tiny", *TINY, "--model.n_kv_head=2", f"--data={tiny_data}", "--steps=1",
               f"--out-dir={tmp_path / 'first'}")
    run_module("mpirt.checkpoint", "export", tmp_path / "first" / "ckpt", tmp_path / "hf")
    common = [*TINY[4:], f"--data={tiny_data}", f"--out-dir={tmp_path / 'run'}"]
    named = f"mpirt: model llama from {tmp_path / 'hf'}: "
    started = run_module("mpirt.train", *common, f"--init-from={tmp_path / 'hf'}", "--steps=2", ranks=2)
    resumed = run_module("mpirt.train", *common, "--steps=3", "--resume=auto", ranks=2)
    assert named in started.stderr and named in resumed.stderr, started.stderr
    assert summary(tmp_path / "run")["steps"] == 3
    info = run_module("mpirt.checkpoint", "info", tmp_path / "run" / "ckpt").stdout
    assert f"  model llama from {tmp_path / 'hf'} (llama: " in info, info


def test_resume_auto_never_replaces_a_damaged_checkpoint(tiny_data, tmp_path):
    """--resume auto refuses a damaged newest version naming the intact older one and the flag
    that resumes from it (which then works); sampling from it is one line, not a traceback."""
    out = tmp_path / "run"
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=3", "--ckpt-interval=2", f"--out-dir={out}")
    meta_path = out / "ckpt" / "step-00000003" / "meta.json"
    meta_path.write_text(meta_path.read_text().replace('"step": 3', '"step": 2'))
    result = run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=4", f"--out-dir={out}",
                        "--resume=auto", check=False)
    assert result.returncode == 2 and "meta.json was edited or corrupted" in result.stderr
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["latest", "step-00000002", "step-00000003"]
    older = out / "ckpt" / "step-00000002"
    assert f"{older} is intact: resume from it with --init-from {older}" in result.stderr, result.stderr
    sample = run_module("mpirt.sample", f"--ckpt={out / 'ckpt'}", "--tokens=2", check=False)
    assert sample.returncode == 2 and "Traceback" not in sample.stderr, sample.stderr
    assert sample.stderr.startswith(f"error: --ckpt {out / 'ckpt'}: ") and str(meta_path) in sample.stderr
    run_module("mpirt.train", *TINY, f"--data={tiny_data}", "--steps=4", f"--out-dir={out}", f"--init-from={older}")
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_the_vocabulary_comes_from_the_dataset_unless_set(tiny_data, tmp_path):
    """A dataset with 300 token ids (meta.json) trains a preset of vocab 256 from scratch: the model
    takes 320 (300 rounded up to a multiple of 64); --model.vocab_size wins when given."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps(dict(meta, vocab_size=300)))
    run_module("mpirt.train", *TINY, f"--data={data}", "--steps=1", f"--out-dir={tmp_path / 'a'}")
    saved = json.loads((tmp_path / "a" / "ckpt" / "step-00000001" / "meta.json").read_text())
    assert saved["extra"]["model_config"]["vocab_size"] == 320 and saved["params"]["wte.weight"]["shape"][0] == 320
    run_module("mpirt.train", *TINY, f"--data={data}", "--steps=1", "--model.vocab_size=400", f"--out-dir={tmp_path / 'b'}")
    saved = json.loads((tmp_path / "b" / "ckpt" / "step-00000001" / "meta.json").read_text())
    assert saved["extra"]["model_config"]["vocab_size"] == 400


def test_every_rank_loads_the_checkpoint_version_rank_0_resolved(tiny_data, tmp_path):
    """`--init-from RUN/ckpt --eval-only` of a run still saving: rank 0 sees step 2 as the latest,
    rank 1 already step 4 (its working directory holds the run one save later: one relative path,
    two views, as on a node whose file system caught up first). Rank 0 resolves the version once
    and every rank loads it: the evaluation is step 2's, not a mix of two replicas."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    run_module("mpirt.train", *F64, f"--data={tiny_data}", "--steps=4", "--ckpt-interval=2", "--eval-interval=2",
               f"--out-dir={nodes[0] / 'run'}")
    shutil.copytree(nodes[0] / "run", nodes[1] / "run")
    (nodes[0] / "run" / "ckpt" / "latest").write_text("step-00000002\n")  # rank 0: before the save of step 4
    args = [*F64, f"--data={tiny_data}", "--init-from=run/ckpt", "--eval-only", f"--out-dir={tmp_path / 'eval'}"]
    result = subprocess.run(mpmd(args, args, nodes), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    evaluated = json.loads((tmp_path / "eval" / "eval.json").read_text())
    at_step_2 = next(r["val_loss"] for r in read_metrics(nodes[0] / "run") if r["step"] == 2)
    assert evaluated["step"] == 2 and evaluated["init_from"] == str((nodes[0] / "run/ckpt/step-00000002").resolve())
    assert evaluated["val_loss"] == pytest.approx(at_step_2, rel=1e-12, abs=0)


def test_a_full_disk_is_refused_before_the_lock_and_a_lock_naming_no_job_is_taken_over(tiny_data, tmp_path):
    """`--resume auto` on a full disk (a 1 MiB tmpfs, filled): one line, exit 2, and the lock left
    as it was; once space is freed, the next job takes over the empty lock an older mpirt left
    there (it once refused every resume, 'in use by another job (pid None on None)')."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the lock's own full-disk test is in test_jobctl.py")
    try:
        out = disk / "run"
        out.mkdir()
        (out / ".lock").write_text("")
        with open(disk / "fill", "wb") as f, pytest.raises(OSError):
            while True:
                f.write(bytes(1 << 16))
                f.flush()
        args = [*TINY, f"--data={tiny_data}", "--steps=2", f"--out-dir={out}", "--resume=auto"]
        result = run_module("mpirt.train", *args, check=False)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [
            f"error: out_dir: {out} is full (No space left on device): free space there or use another --out-dir"]
        assert (out / ".lock").read_text() == ""
        (disk / "fill").unlink()
        run_module("mpirt.train", *args)
        assert summary(out)["steps"] == 2 and not (out / ".lock").exists()
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
