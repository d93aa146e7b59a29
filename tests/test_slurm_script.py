"""mpirt.slurm and the job scripts in slurm/, without SLURM: rendering, validation, shell safety,
and the script's own logic (stop notice, requeue, MPICH cleanup) run against stub srun/scancel/
scontrol on PATH. tests/slurm/ runs the same scripts on a real SLURM."""
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirt.run.slurm import TEMPLATES, JobSpec, SlurmScriptError, epilog, main, render, time_seconds

ROOT = Path(__file__).resolve().parents[1]
PWN = "PWNED"
# each tries to run `touch PWNED` in the directory the script runs in
PAYLOADS = ["$(touch PWNED)", "`touch PWNED`", "x; touch PWNED", "x' ; touch PWNED ; '", 'x" ; touch PWNED ; "',
            "x && touch PWNED", "x | touch PWNED", "${IFS}$(touch${IFS}PWNED)", "x\ntouch PWNED", "-x $(touch PWNED)"]
STUB = r'''#!/bin/bash
# records its arguments (NUL-separated) and acts as told by STUB_* variables; runs the command of
# the script's per-node cleanup step (srun --mpi=none ...) on this node
name=$(basename "$0")
if [ "$name" = srun ] && [ "$1" = --mpi=none ]; then
    while [[ $1 == --* ]]; do shift; done
    exec "$@"
fi
if [ "$name" = scontrol ] && [ "$1" = show ]; then echo "${STUB_SHOW_JOB:-}"; exit 0; fi
printf '%s\0' "$@" >"$STUB_LOG/$name.args"
[ "$name" = srun ] || exit "${STUB_OTHER_RC:-0}"
if [ -n "${STUB_REAL:-}" ]; then  # run the ranks' command itself, as one rank
    while [[ $1 == --* ]]; do shift; done
    exec "$@"
fi
out=""
while [ $# -gt 0 ]; do [ "$1" = --out-dir ] && out=$2; shift; done
for _ in $(seq "${STUB_TENTHS:-0}"); do sleep 0.1; done
if [ -n "${STUB_CKPT:-}" ]; then mkdir -p "$out/ckpt" && echo "$STUB_CKPT" >"$out/ckpt/latest"; fi
# what rank 0 writes at the end (default: every step done when the ranks exit 0; "none": nothing)
summary=${STUB_SUMMARY:-}
[ -n "$summary" ] || [ "${STUB_RC:-0}" != 0 ] || summary='{"steps": 10, "total_steps": 10, "exit_code": 0}'
if [ -n "$summary" ] && [ "$summary" != none ]; then mkdir -p "$out" && echo "$summary" >"$out/summary.json"; fi
exit "${STUB_RC:-0}"
'''


def bash_n(path: Path) -> None:
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"bash -n {path}: {result.stderr}"


@pytest.fixture
def job_env(tmp_path):
    """A directory to run job scripts in: stubs on PATH, a site env, an empty venv, SLURM's variables."""
    stubs, log, shm = tmp_path / "stubs", tmp_path / "log", tmp_path / "shm"
    for d in (stubs, log, shm, tmp_path / "venv" / "bin", tmp_path / "run"):
        d.mkdir(parents=True)
    for name in ("srun", "scancel", "scontrol"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(0o755)
    (stubs / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # the venv's, as a job's
    (stubs / "python").chmod(0o755)
    (tmp_path / "venv" / "bin" / "activate").write_text("")
    (tmp_path / "site.env").write_text(f"MPIRT_VENV={tmp_path / 'venv'}\n")
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_LOG": str(log), "MPIRT_SITE_ENV": str(tmp_path / "site.env"),
           "MPIRT_SHM_DIR": str(shm), "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "SLURM_NTASKS": "2",
           "SLURM_CPUS_PER_TASK": "3", "SLURM_SUBMIT_DIR": str(tmp_path), "HOME": str(tmp_path)}
    return tmp_path, env


def start(script_text: str, where: Path, env: dict, *args, **extra) -> subprocess.Popen:
    script = where / "job.sbatch"
    script.write_text(script_text)
    return subprocess.Popen(["bash", str(script), *args], cwd=where, env={**env, **extra},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_job(script_text: str, where: Path, env: dict, *args, **extra) -> tuple[int, str]:
    proc = start(script_text, where, env, *args, **extra)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


def stub_args(where: Path, name: str) -> list[str] | None:
    path = where / "log" / f"{name}.args"
    return path.read_text().split("\0")[:-1] if path.exists() else None


def cpu_spec(**kw) -> JobSpec:
    return dataclasses.replace(JobSpec(ntasks_per_node=2), **kw)


# --- the checked-in files -------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_checked_in_template_is_the_renderer_output(name):
    spec = dataclasses.replace(TEMPLATES[name][1], template=name)
    assert (ROOT / "slurm" / f"{name}.sbatch").read_text() == render(spec), \
        f"slurm/{name}.sbatch is stale: python -m mpirt.slurm --template {name} -o slurm/{name}.sbatch"


def test_a_notice_that_does_not_fit_the_time_is_shortened_or_refused(capsys):
    assert [time_seconds(t) for t in ("2", "2:30", "01:00:00", "1-2", "1-2:03", "1-2:03:04")] == \
        [120, 150, 3600, 93600, 93780, 93784]
    main(["--time", "2"])                       # the default 120 s notice: none fits 2 minutes
    assert "#SBATCH --signal" not in capsys.readouterr().out
    main(["--time", "4"])                       # 4 min: half less 60 s
    assert "#SBATCH --signal=B:USR1@60" in capsys.readouterr().out
    main(["--time", "12:00:00"])                # the default where it fits
    assert "#SBATCH --signal=B:USR1@120" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["--time", "5", "--notice", "120"])
    assert stop.value.code == 2 and "--notice: must be at most 90 s for --time 5" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--", "--stepz", "10"], "training arguments: stepz: unknown key; did you mean 'steps'?"),
    (["--", "--lr", "fast"], "training arguments: lr"),
    (["--ntasks-per-node", "8", "--tp", "8", "--model", "gpt2"], "--tp: tensor parallelism: tp=8 must divide n_head=12"),
    (["--ntasks-per-node", "2", "--tp", "2", "--model", "mlp"], "--tp: model_type 'mlp' has no tensor-parallel plan"),
    (["--ntasks-per-node", "4", "--cp", "4", "--", "--seq-len", "100"],
     "--cp: seq_len 100 does not cut into 2 x cp = 8 equal chunks"),
    (["--ntasks-per-node", "2", "--cp", "2", "--model", "mlp"], "--cp: model_type 'mlp' has no attention"),
    (["--ntasks-per-node", "2", "--ep", "4", "--model", "mixtral-tiny"], "--ep: 4 does not divide dp=2"),
    (["--ntasks-per-node", "2", "--ep", "2", "--model", "gpt2"], "--ep: model_type 'gpt2' has no experts to split"),
    # what the script sets itself: its run directory, resumed, stopped before the job's end
    (["--run-dir", "r", "--", "--lr", "1e-3", "--out-dir", "OTHER"],
     "training arguments: --out-dir: the run directory is the script's: --run-dir DIR"),
    (["--", "--out_dir=OTHER"], "training arguments: --out_dir: the run directory is the script's"),
    (["--", "--resume", "auto"], "training arguments: --resume: the script always resumes its run directory"),
    (["--", "--time-limit=3h"], "training arguments: --time-limit: the script stops before the job's end "
                                "(--time-limit slurm): set the job's limit with --time"),
])
def test_training_arguments_are_checked_at_render_time(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_context_parallelism_reaches_the_training_command(capsys):
    main(["--nodes", "2", "--ntasks-per-node", "4", "--cp", "4", "--model", "gpt2", "--", "--seq-len", "1024"])
    assert "--model gpt2 --cp 4 --seq-len 1024" in capsys.readouterr().out.replace("'", "")


def test_expert_parallelism_reaches_the_training_command(capsys):
    main(["--nodes", "2", "--ntasks-per-node", "4", "--ep", "4", "--model", "mixtral-tiny"])
    assert "--model mixtral-tiny --ep 4" in capsys.readouterr().out.replace("'", "")


def test_a_model_file_only_the_cluster_has_is_left_to_the_run(capsys):
    main(["--ntasks-per-node", "2", "--tp", "2", "--model", "/cluster/only/model.toml"])
    assert "--model /cluster/only/model.toml --tp 2" in capsys.readouterr().out.replace("'", "")


def test_checked_in_epilog_is_the_renderer_output():
    assert (ROOT / "slurm" / "epilog-mpich-shm.sh").read_text() == epilog(), \
        "slurm/epilog-mpich-shm.sh is stale: python -m mpirt.slurm --epilog -o slurm/epilog-mpich-shm.sh"


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "slurm").iterdir()))
def test_checked_in_scripts_pass_bash_n(path):
    bash_n(ROOT / "slurm" / path)


@pytest.mark.parametrize("flags, train", [
    (["--template", "multi_node", "--partition", "gpu,gpu-long", "--account", "proj_1", "--run-dir", "/scratch/r 1"],
     []),
    (["--template", "preemptible", "--time", "2-00:00", "--notice", "300", "--mpi", "pmix_v4", "--run-dir", "r"], []),
    (["--nodes", "2", "--ntasks-per-node", "4", "--dp", "2", "--tp", "2", "--pp", "2", "--model", "gpt2",
      "--data", "/data/owt", "--run-dir", "runs/a", "--no-exclusive"], ["--lr", "3e-4", "--microbatches", "4"]),
    (["--template", "cpu", "--notice", "0", "--mem", "500G", "--exclusive", "--site-env", "/etc/mpirt/site.env"], []),
])
def test_rendered_scripts_pass_bash_n(tmp_path, flags, train):
    out = tmp_path / "job.sbatch"
    assert main([*flags, "-o", str(out), "--", *train]) == 0
    bash_n(out)
    assert all(a in out.read_text() for a in train)


# --- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, flag", [
    (["--time", "1:2:3:4"], "--time"), (["--time", "0"], "--time"), (["--time", "1h"], "--time"),
    (["--nodes", "0"], "--nodes"), (["--nodes", "two"], "--nodes"), (["--gpus-per-node", "-1"], "--gpus-per-node"),
    (["--cpus-per-task", "0"], "--cpus-per-task"), (["--notice", "-5"], "--notice"),
    (["--partition", "gpu long"], "--partition"), (["--account", "a/b"], "--account"),
    (["--job-name", "-x"], "--job-name"), (["--mem", "10X"], "--mem"), (["--output", "a b.out"], "--output"),
    (["--mpi", "none"], "--mpi"), (["--mpi", "openmpi"], "--mpi"), (["--run-dir", "--lr"], "--run-dir"),
    (["--run-dir", "a\tb"], "--run-dir"), (["--model", "x\ny"], "--model"), (["--data", "d\r"], "--data"),
    (["--ntasks-per-node", "4", "--dp", "3"], "--dp/--tp/--pp"),
    (["--nodes", "2", "--ntasks-per-node", "2", "--tp", "3"], "--dp/--tp/--pp"),
    (["--ntasks-per-node", "4", "--cp", "3"], "--dp/--tp/--pp/--cp"), (["--cp", "0"], "--cp"),
    (["--gpus-per-node", "8", "--ntasks-per-node", "4"], "--ntasks-per-node"),
])
def test_bad_values_are_refused_naming_the_flag(capsys, flags, flag):
    with pytest.raises(SystemExit) as exit_:
        main(flags)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: {flag}" in err or f"argument {flag}" in err, err


@pytest.mark.parametrize("field", ["time", "partition", "account", "job_name", "mem", "output", "mpi"])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_injection_into_sbatch_lines_is_refused(field, payload):
    with pytest.raises(SlurmScriptError, match="^--" + field.replace("_", "-")):
        render(cpu_spec(**{field: payload}))


# --- the script body, run with stub srun/scancel/scontrol -----------------------------------------
@pytest.mark.parametrize("payload", PAYLOADS)
def test_injection_into_quoted_fields_stays_text(job_env, payload):
    """Every text field of the body carries the payload; bash -n passes; the stub srun receives each
    as one literal argument and nothing runs `touch`."""
    where, env = job_env
    safe = payload.replace("\n", " ")  # paths refuse control characters; train args may hold any text
    site = where / f"site {safe.replace('/', '_')}"
    site.mkdir()
    (site / "site.env").write_text((where / "site.env").read_text())
    spec = cpu_spec(model=safe, data=safe, run_dir="r" + safe, train_args=[payload, "--lr", payload],
                    site_env=str(site / "site.env"))
    text = render(spec)
    (where / "check.sbatch").write_text(text)
    bash_n(where / "check.sbatch")
    env.pop("MPIRT_SITE_ENV")
    rc, out = run_job(text, where, env, payload, "--seed=1")
    assert rc == 0, out
    assert not (where / PWN).exists() and not (where / "run" / PWN).exists(), out
    assert stub_args(where, "srun") == [
        "--mpi=pmi2", "--kill-on-bad-exit=1", "--cpu-bind=cores", "python", "-m", "mpirt.train",
        "--out-dir", "r" + safe, "--resume", "auto", "--time-limit", "slurm",
        "--model", safe, "--data", safe, payload, "--lr", payload, payload, "--seed=1"]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_template_run_dir_argument_stays_text(job_env, payload):
    where, env = job_env
    text = render(dataclasses.replace(TEMPLATES["cpu"][1], template="cpu"))
    rc, out = run_job(text, where, env, "r" + payload, payload)
    assert rc == 0, out
    assert not (where / PWN).exists(), out
    args = stub_args(where, "srun")
    assert args[args.index("--out-dir") + 1] == "r" + payload and args[-1] == payload


def test_template_needs_a_run_directory(job_env):
    where, env = job_env
    text = render(dataclasses.replace(TEMPLATES["cpu"][1], template="cpu"))
    for args in ([], ["--steps", "10"]):
        rc, out = run_job(text, where, env, *args)
        assert rc == 2 and "give the run directory first" in out, out
    assert stub_args(where, "srun") is None


def test_verify_first_checks_the_layout_before_training(job_env):
    """--verify-first: mpirt.verify runs with the training arguments first (a tenth of the limit at
    most); a layout that differs from one rank (exit 1) ends the job untrained; a short limit, or a
    job that resumes a checkpoint, skips the check."""
    where, env = job_env
    text = render(cpu_spec(run_dir="r", verify_first=True, time="01:00:00", train_args=["--tp", "2"]))
    assert "VERIFY_SECONDS=360" in text
    rc, out = run_job(text, where, env, STUB_RC="1")
    assert rc == 1 and "verify failed (exit 1): not training" in out, out
    args = stub_args(where, "srun")
    assert args[3:6] == ["python", "-m", "mpirt.verify"] and args[-2:] == ["--tp", "2"], args
    rc, out = run_job(text, where, env, STUB_CKPT="step-00000010")
    assert rc == 0 and "verify: the layout computes what one rank computes" in out, out
    assert stub_args(where, "srun")[5] == "mpirt.train"
    rc, out = run_job(text, where, env)   # the checkpoint the first start left: a resume, not checked again
    assert rc == 0 and "checking the layout" not in out, out
    assert "VERIFY_SECONDS=0" in render(cpu_spec(run_dir="r", verify_first=True, time="00:30:00"))


def test_verify_job_is_the_check_alone_with_its_exit_code(job_env):
    """--verify: a job that runs mpirt.verify with the training arguments over the whole limit,
    on every start (a checkpoint in the run directory changes nothing), never trains, and exits
    with verify's code; --verify with --verify-first is refused naming both."""
    where, env = job_env
    text = render(cpu_spec(run_dir="r", verify_only=True, time="00:30:00", train_args=["--tp", "2"]))
    assert "VERIFY_SECONDS=1800" in text and "VERIFY_ONLY=1" in text
    for code in ("0", "1", "2"):
        rc, out = run_job(text, where, env, STUB_RC=code, STUB_CKPT="step-00000010")
        assert rc == int(code) and f"verify: exit {code}" in out, out
        args = stub_args(where, "srun")
        assert args[3:6] == ["python", "-m", "mpirt.verify"] and args[-2:] == ["--tp", "2"], args
    with pytest.raises(SlurmScriptError, match="^--verify and --verify-first: choose one"):
        render(cpu_spec(run_dir="r", verify_only=True, verify_first=True))
@pytest.mark.parametrize("arg", ["--out-dir", "--out_dir=OTHER", "--resume", "--time-limit=3h"])
def test_the_script_refuses_its_own_training_arguments_on_the_sbatch_line(job_env, arg):
    """``sbatch SCRIPT RUN_DIR --out-dir OTHER`` would train elsewhere while the script checks and
    requeues RUN_DIR: refused before anything starts, naming the flag to use instead."""
    where, env = job_env
    text = render(dataclasses.replace(TEMPLATES["cpu"][1], template="cpu"))
    rc, out = run_job(text, where, env, "run", "--steps", "10", arg, "OTHER")
    assert rc == 2 and f"error: {arg.partition('=')[0]}: " in out, out
    assert stub_args(where, "srun") is None


def test_missing_site_env_is_named(job_env):
    where, env = job_env
    rc, out = run_job(render(cpu_spec(run_dir="r")), where, env, MPIRT_SITE_ENV=str(where / "nope.env"))
    assert rc == 2 and f"site env file {where / 'nope.env'} not found" in out, out


def test_srun_gets_the_mpi_type_and_cpus(job_env):
    where, env = job_env
    (where / "site.env").write_text(f"MPIRT_VENV={where / 'venv'}\nMPI_TYPE=pmix\n")
    (where / "stubs" / "srun").write_text(STUB.replace("exit \"${STUB_RC:-0}\"",
                                                       'echo "cpus=$SRUN_CPUS_PER_TASK omp=$OMP_NUM_THREADS"'))
    rc, out = run_job(render(cpu_spec(run_dir="r")), where, env)
    assert rc == 0 and "cpus=3 omp=3" in out, out
    assert stub_args(where, "srun")[0] == "--mpi=pmix"
    rc, out = run_job(render(cpu_spec(run_dir="r", mpi="pmi2")), where, env)
    assert stub_args(where, "srun")[0] == "--mpi=pmi2"  # the flag given at render time wins
    (where / "site.env").write_text(f"MPIRT_VENV={where / 'venv'}\nMPI_TYPE=none\n")
    rc, out = run_job(render(cpu_spec(run_dir="r")), where, env)
    assert rc == 2 and "MPI_TYPE=none" in out, out


@pytest.mark.parametrize("preemptible, rc, ckpt, requeued", [
    (True, 75, "step-00000010", True),   # stopped with a new checkpoint: continue in a requeued job
    (True, 75, "", False),               # no progress: requeueing would loop
    (True, 0, "step-00000010", False),   # finished
    (True, 1, "step-00000010", False),   # failed
    (False, 75, "step-00000010", False),  # not requeueable: the user resubmits
])
def test_requeue_only_after_a_stop_with_a_new_checkpoint(job_env, preemptible, rc, ckpt, requeued):
    where, env = job_env
    code, out = run_job(render(cpu_spec(run_dir=str(where / "run"), preemptible=preemptible)), where, env,
                        STUB_RC=str(rc), STUB_CKPT=ckpt)
    assert code == rc, out
    assert (stub_args(where, "scontrol") == ["requeue", "4242"]) is requeued, out


@pytest.mark.parametrize("preemptible, scontrol_rc, show_job, message", [
    (True, 0, "", "requeueing to continue from step-00000010"),
    # scontrol interrupted by the requeue it asked for: SLURM counted the restart, so it worked
    (True, 1, "JobId=4242 JobName=mpirt Restarts=1 JobState=PENDING", "requeueing to continue from step-00000010"),
    (True, 1, "JobId=4242 JobName=mpirt Restarts=0 JobState=RUNNING", "scontrol requeue failed"),
    (False, 0, "", "submit the same command to continue"),
])
def test_the_end_of_a_stopped_job_says_what_happens_next(job_env, preemptible, scontrol_rc, show_job, message):
    where, env = job_env
    code, out = run_job(render(cpu_spec(run_dir=str(where / "run"), preemptible=preemptible)), where, env,
                        STUB_RC="75", STUB_CKPT="step-00000010", STUB_OTHER_RC=str(scontrol_rc), STUB_SHOW_JOB=show_job)
    assert code == 75 and message in out, out
    if message.startswith("requeueing"):
        assert "requeue failed" not in out and "submit the same command" not in out, out


@pytest.mark.parametrize("summary, stale, says", [
    ('{"steps": 10, "total_steps": 10, "exit_code": 0}', False, "training finished (step 10 of 10)"),
    ("none", False, "summary.json is missing or unreadable"),
    ('{"steps": 4, "total_steps": 60, "exit_code": 0}', False, "summary.json records step 4 of 60, exit code 0"),
    ('{"steps": 60, "total_steps": 60, "exit_code": 3}', False, "summary.json records step 60 of 60, exit code 3"),
    ("none", True, "summary.json is from an earlier attempt (step 4 of 60)"),
])
def test_finished_is_read_from_this_attempts_summary_not_the_exit_code(job_env, summary, stale, says):
    """Ranks that all exit 0 (a library's exit(0) on every rank, or MPICH's launcher after one
    rank's) are not a finished run: the script reads summary.json, and one from an earlier attempt
    does not count."""
    where, env = job_env
    run = where / "run"
    if stale:
        (run / "summary.json").write_text('{"steps": 4, "total_steps": 60, "exit_code": 75}')   # left untouched
    code, out = run_job(render(cpu_spec(run_dir=str(run), preemptible=True)), where, env, STUB_RC="0",
                        STUB_SUMMARY=summary, STUB_CKPT="step-00000004")
    finished = says.startswith("training finished")
    assert says in out and (code == 0) is finished and ("training finished" in out) is finished, out
    if not finished:
        assert "training ended early: the ranks exited 0 but" in out and "the last checkpoint is step-00000004" in out
        assert code == 1 and stub_args(where, "scontrol") is None, out          # reported, not requeued


def test_a_rank_that_calls_exit_0_early_is_not_a_finished_job(job_env, tiny_data):
    """A real training rank that calls os._exit(0) at step 3 of 60 (no summary, no checkpoint):
    the launcher's exit code is 0, the job says it ended early and exits 1."""
    from runs import TINY
    where, env = job_env
    run = where / "run"
    spec = cpu_spec(run_dir=str(run), train_args=[*TINY, f"--data={tiny_data}", "--steps=60"])
    code, out = run_job(render(spec), where, env, STUB_REAL="1", MPIRT_FAULT="vanish@0:3", SLURM_NTASKS="1",
                        SLURM_JOB_END_TIME=str(int(time.time()) + 3600), OPENBLAS_NUM_THREADS="1")
    assert "injecting vanish" in out and not (run / "summary.json").exists(), out
    assert code == 1 and "training ended early: the ranks exited 0 but" in out and "training finished" not in out, out


def blocked(pid: int) -> bool:
    """Whether process ``pid`` sleeps (state S in /proc/PID/stat: blocked in a syscall)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S"
    except FileNotFoundError:
        return False


def wait_started(proc: subprocess.Popen, where: Path, timeout: float = 20) -> None:
    """Until the stub srun runs and the batch shell waits for it: the stub writes its arguments
    after the shell forked it, and from that fork on the shell blocks nowhere but in the wait loop
    (past `step=$!`)."""
    end = time.monotonic() + timeout
    while stub_args(where, "srun") is None or not blocked(proc.pid):
        assert proc.poll() is None, f"the job script exited ({proc.returncode}) before it waited for srun"
        assert time.monotonic() < end, (f"not within {timeout} s: " + ("the stub srun did not start"
                                        if stub_args(where, "srun") is None else "the script never waited for srun"))
        time.sleep(0.01)


def test_term_to_the_batch_shell_is_not_forwarded(job_env):
    """SLURM TERMs the ranks itself; the script must neither pass on a second TERM nor requeue."""
    where, env = job_env
    proc = start(render(cpu_spec(run_dir=str(where / "run"), preemptible=True)), where, env,
                 STUB_TENTHS="20", STUB_RC="75", STUB_CKPT="step-00000007")
    wait_started(proc, where)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 75, out
    assert stub_args(where, "scancel") is None and stub_args(where, "scontrol") is None, out
    # a preemption: SLURM requeues the job itself, so nothing tells the user to resubmit
    assert "a preempted job is requeued by SLURM itself" in out and "submit the same command" not in out, out


def test_usr1_notice_asks_the_ranks_to_stop_then_requeues(job_env):
    where, env = job_env
    proc = start(render(cpu_spec(run_dir=str(where / "run"), preemptible=True)), where, env,
                 STUB_TENTHS="20", STUB_RC="75", STUB_CKPT="step-00000007")
    wait_started(proc, where)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 75, out
    assert stub_args(where, "scancel") == ["--signal=TERM", "4242"], out
    assert stub_args(where, "scontrol") == ["requeue", "4242"], out


# --- MPICH shared-memory cleanup ------------------------------------------------------------------
def test_the_job_removes_only_unused_files_older_than_itself(tmp_path):
    """The job's cleanup gets its start time: an unused file made since (another job of the user
    starting beside it, not yet mapped) stays; an unused older one goes."""
    from mpirt.run.slurm import CLEAN_SHM
    shm = tmp_path / "shm"
    shm.mkdir()
    start = int(time.time())
    for name, age in (("mpich_shm_old_0", 3600), ("mpich_shm_new_0", -5)):
        (shm / name).write_bytes(b"\0" * 64)
        os.utime(shm / name, (start - age, start - age))
    script = tmp_path / "clean.sh"
    script.write_text(CLEAN_SHM + f'mpirt_clean_shm "{os.geteuid()}" "{shm}" "{start}"\n')
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in shm.iterdir()) == ["mpich_shm_new_0"], result.stdout


def test_epilog_removes_only_unused_mpich_files_of_the_job_owner(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("mpich_shm_stale_0", "mpich_shm_open_0", "mpich_shm_mapped_0", "other_file"):
        (shm / name).write_bytes(b"\0" * 4096)
    holders = [subprocess.Popen(["sleep", "60"], stdin=(shm / "mpich_shm_open_0").open("rb")),
               subprocess.Popen([sys.executable, "-c", "import mmap, sys, time\n"
                                 f"f = open({str(shm / 'mpich_shm_mapped_0')!r}, 'rb')\n"
                                 "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); f.close()\n"
                                 "print('mapped', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)]
    kept = ["mpich_shm_mapped_0", "mpich_shm_open_0", "other_file"]
    if os.geteuid() == 0:  # another user's file: only that user's jobs may remove it
        (shm / "mpich_shm_nobody_0").write_bytes(b"x")
        os.chown(shm / "mpich_shm_nobody_0", 65534, 65534)
        kept.append("mpich_shm_nobody_0")
    try:
        assert holders[1].stdout.readline().strip() == "mapped"
        script = tmp_path / "epilog.sh"
        script.write_text(epilog())
        env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_UID": str(os.geteuid()), "MPIRT_SHM_DIR": str(shm)}
        result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in shm.iterdir()) == sorted(kept), result.stdout
        assert f"removed stale MPICH shared memory {shm}/mpich_shm_stale_0" in result.stdout
        # without SLURM_JOB_UID it removes nothing and still exits 0 (a failing Epilog drains the node)
        env.pop("SLURM_JOB_UID")
        assert subprocess.run(["bash", str(script)], env=env, timeout=30).returncode == 0
    finally:
        for h in holders:
            h.kill()
            h.wait()


def _as_non_root(cmd: list) -> list:
    """``cmd`` run as an ordinary user: as it is when this is one, through ``runuser -u nobody`` as root."""
    return cmd if os.geteuid() else ["runuser", "-u", "nobody", "--", *cmd]


def test_the_real_slurm_tier_says_why_a_normal_user_cannot_run_it(tmp_path):
    """tests/run.sh skips the real-SLURM tier on ``--why-not``'s line (never under CI=true, where
    it runs as root): for a user without root the line names root; run anyway, the tier fails at
    once on the same reason, before it installs or starts anything. The closing table marks the
    skipped tier as such, not as failed."""
    tier = str(ROOT / "tests" / "slurm" / "run.sh")
    why = subprocess.run(_as_non_root(["bash", tier, "--why-not"]), capture_output=True, text=True, timeout=30)
    assert why.returncode == 0 and why.stdout.startswith("it needs root"), why
    run = subprocess.run(_as_non_root(["bash", tier]), capture_output=True, text=True, timeout=30)
    assert run.returncode == 1 and f"FAILED: {why.stdout.strip()}" in run.stderr, run
    if os.geteuid() == 0:  # root here, SLURM or apt-get present (CI): the tier has nothing to say
        assert subprocess.run(["bash", tier, "--why-not"], capture_output=True, text=True).stdout == ""
    (tmp_path / "tiers").write_text("single 0 10\nslurm skipped 0\n")
    table = subprocess.run([sys.executable, str(ROOT / "tests" / "tier_report.py"), str(tmp_path)],
                           capture_output=True, text=True, check=True).stdout
    assert re.search(r"^slurm +SKIPPED \(see its line above\)", table, re.M) and "FAILED" not in table, table
