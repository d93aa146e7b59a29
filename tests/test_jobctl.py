"""Unit tests of mpirt.run.jobctl: the wall-time rule, the launcher seen, the output-directory lock."""
import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from mpirt.run import jobctl
from mpirt.run.config import parse_duration


def test_deadline_keeps_room_for_two_steps_a_save_and_a_reserve():
    d = jobctl.Deadline.from_config("100s", start=1000.0, parse_duration=parse_duration)
    assert d.end == 1100.0 and d.reserve == 10.0  # a tenth of the limit
    assert not d.should_stop(step_s=1.0, save_s=2.0, now=1089.0)
    assert d.should_stop(step_s=1.0, save_s=2.0, now=1090.5)     # the reserve
    assert not d.should_stop(step_s=10.0, save_s=20.0, now=1058.0)  # 42 s left, 2 x 10 + 20 + 1 = 41 needed
    assert d.should_stop(step_s=10.0, save_s=20.0, now=1060.0)
    assert jobctl.Deadline.from_config("4h", 0.0, parse_duration).reserve == 30.0
    assert not jobctl.Deadline.from_config("", 0.0, parse_duration).should_stop(1e9, 1e9)


def test_slurm_end_time_prefers_the_environment():
    assert jobctl.slurm_end_time({"SLURM_JOB_END_TIME": "1800000000"}) == 1.8e9
    assert jobctl.slurm_end_time({}) is None


def fake_squeue(tmp_path, monkeypatch, failures: int) -> None:
    """An ``squeue`` on PATH that fails ``failures`` times (as when slurmctld drops the query),
    then prints an end time."""
    counter = tmp_path / "calls"
    script = tmp_path / "squeue"
    script.write_text(f"""#!/bin/sh
n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}
[ "$n" -lt {failures} ] && {{ echo "slurm_load_jobs error: Socket timed out" >&2; exit 1; }}
echo 2030-01-02T03:04:05
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_slurm_end_time_asks_squeue_again_when_a_query_fails(tmp_path, monkeypatch):
    fake_squeue(tmp_path, monkeypatch, failures=1)
    import datetime
    assert jobctl.slurm_end_time({"SLURM_JOB_ID": "7"}) == datetime.datetime(2030, 1, 2, 3, 4, 5).timestamp()
    assert (tmp_path / "calls").read_text().strip() == "2"


def test_an_unreadable_slurm_end_time_is_reported(tmp_path, monkeypatch, capsys):
    fake_squeue(tmp_path, monkeypatch, failures=99)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert jobctl.Deadline.from_config("slurm", 0.0, parse_duration).end is None
    assert (tmp_path / "calls").read_text().strip() == "3"
    assert "could not read job 7's end time" in capsys.readouterr().err


@pytest.mark.parametrize("env, name, tasks", [
    ({"PMI_RANK": "0", "PMI_SIZE": "4"}, "mpiexec (hydra)", 4),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "SLURM_STEP_ID": "0", "SLURM_MPI_TYPE": "pmi2"}, "srun --mpi=pmi2", 2),
    ({"OMPI_COMM_WORLD_SIZE": "8"}, "Open MPI mpiexec", 8),
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, "srun --mpi=none", 2),
    ({}, "none (singleton)", None),
])
def test_launcher_info(env, name, tasks):
    info = jobctl.launcher_info(env)
    assert (info["name"], info["tasks"]) == (name, tasks)


def test_launch_mismatch_only_for_a_world_of_one_under_a_multi_task_launcher():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    assert "started 2 tasks but MPI sees a world of 1" in jobctl.launch_mismatch(1, env)
    assert jobctl.launch_mismatch(2, {"PMI_SIZE": "2", "PMI_RANK": "0"}) is None
    assert jobctl.launch_mismatch(1, {}) is None
    # the PMI named is the one the MPI library found speaks
    assert "`srun --mpi=pmix` (Open MPI v4.1.6)" in jobctl.launch_mismatch(1, env, "Open MPI v4.1.6")
    assert "`srun --mpi=pmi2` (MPICH Version: 5.0.2)" in jobctl.launch_mismatch(1, env, "MPICH Version: 5.0.2")


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one_or_the_same_job(tmp_path):
    path = jobctl.acquire_lock(tmp_path)
    holder = json.loads(path.read_text())
    assert holder["pid"] == os.getpid()
    # another live process on this host holds it
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path.write_text(json.dumps(dict(holder, pid=other.pid, job=None)))
        with pytest.raises(jobctl.DirectoryLocked, match=f"in use by another job \\(pid {other.pid}"):
            jobctl.acquire_lock(tmp_path, env={})
        # the same SLURM job (a requeue keeps the job id) takes its own lock over
        path.write_text(json.dumps(dict(holder, pid=other.pid, job="77")))
        jobctl.acquire_lock(tmp_path, env={"SLURM_JOB_ID": "77"})
    finally:
        other.kill()
        other.wait()
    # a holder that no longer exists
    path.write_text(json.dumps(dict(holder, pid=other.pid, job=None)))
    jobctl.acquire_lock(tmp_path, env={})
    jobctl.release_lock(path)
    assert not path.exists()


@pytest.mark.parametrize("state", ["RUNNING", "", "CANCELLED"])
def test_a_lock_of_another_node_is_taken_over_once_squeue_says_its_job_ended(tmp_path, monkeypatch, state):
    """A job hard-killed on another node leaves its lock: taken over when SLURM no longer lists the
    job, or lists it in an end state (for MinJobAge), else refused saying how to check (squeue
    stubbed on PATH)."""
    listed = state == "RUNNING"
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "squeue").write_text("#!/bin/sh\n" + (f"echo {state}\n" if state else "") + "exit 0\n")
    (stubs / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    out = tmp_path / "run"
    out.mkdir()
    (out / jobctl.LOCK).write_text(json.dumps({"host": "node-elsewhere", "pid": 12345, "job": "91", "since": 0}))
    if listed:
        with pytest.raises(jobctl.DirectoryLocked, match=r"SLURM job 91\); use another --out-dir, or remove .* if that "
                                                         r"job is gone \(`squeue -j 91` lists it while it is alive\)"):
            jobctl.acquire_lock(out, env={"SLURM_JOB_ID": "92"})
    else:
        path = jobctl.acquire_lock(out, env={"SLURM_JOB_ID": "92"})
        assert json.loads(path.read_text())["job"] == "92"


def test_stop_requests_note_the_first_signal():
    stops = jobctl.StopRequests().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.requested == "SIGTERM"
    finally:
        for sig in jobctl.STOP_SIGNALS:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2]", '{"host": null, "pid": null, "job": null}'],
                         ids=["empty", "not-json", "not-an-object", "no-holder"])
def test_a_lock_that_names_no_live_job_is_taken_over(tmp_path, content):
    """What a crash mid-write of an older mpirt left (its full disk once left an empty .lock that
    refused every resume, 'pid None on None'), or any lock naming no holder, is taken over."""
    (tmp_path / jobctl.LOCK).write_text(content)
    path = jobctl.acquire_lock(tmp_path, env={})
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == [jobctl.LOCK]  # its temporary file is gone


def test_a_disk_too_full_for_the_lock_leaves_no_lock(tmp_path, monkeypatch):
    """The lock is written whole before it takes its name: a write that fails for want of space
    leaves neither a .lock nor its temporary file, and says so in one line."""
    def full(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(jobctl.os, "fsync", full)
    with pytest.raises(jobctl.DirectoryLocked, match=r"out_dir: cannot write the lock .*\.lock \(No space left on "
                                                     r"device\): free space in "):
        jobctl.acquire_lock(tmp_path, env={})
    assert list(tmp_path.iterdir()) == []
