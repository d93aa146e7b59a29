"""The communication watchdog and leaving the job: the in-flight bookkeeping and its text without
MPI, then real ``mpiexec`` jobs (each under a subprocess timeout) that stall, exit or die on one
rank and must end with a message that names the operation and the missing rank, never hang.

Each job test prints its measured time from the fault to the end of the job (``pytest -s``)."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from mpirt.comm import EXIT_TIMEOUT, flight
from mpirt.comm.watchdog import REPLY_S
from mpirt.parallel.pipeline.executor import WaitLabel
from mpirt.parallel.pipeline.schedules import RECV_GRAD, SEND_ACT, Action
from runs import TINY

JOB_TIMEOUT = 180  # seconds any one job may take before the test kills it: a hang is a failure


# ------------------------------------------------------------------ bookkeeping, without MPI

def start_call(ch, op, nbytes, peer=-1, t0=100.0):
    call = flight.new_call(ch, op, nbytes, peer, t0)
    ch.cur = None
    return call


def test_collectives_are_counted_and_point_to_point_calls_are_not():
    ch = flight.Channel("dp", (0, 1))
    start_call(ch, "allreduce", 8)
    start_call(ch, "send", 8, peer=1)
    last = start_call(ch, "barrier", 0)
    assert ch.calls == 2 and last[flight.COUNT] == 2


def test_channels_made_alike_get_the_same_keys_in_creation_order():
    a, b, c = flight.Channel("tp", (2, 3)), flight.Channel("tp", (2, 3)), flight.Channel("pp", (2, 3))
    assert a.key[:2] == b.key[:2] and b.key[2] == a.key[2] + 1
    assert c.key[0] == "pp" and {a, b, c} <= set(flight.channels())


def test_ring_keeps_the_latest_calls_and_dump_marks_the_unfinished_one():
    flight.ring.clear()
    ch = flight.Channel("dp", (0, 1))
    for i in range(flight.RING_SIZE + 5):
        call = start_call(ch, "allreduce", 4 * i, t0=float(i))
        call[flight.DONE] = i + 0.002
    stuck = flight.new_call(ch, "iallreduce", 4096, -1, 200.0)
    text = flight.dump(3, now=205.0)
    lines = text.splitlines()
    assert len(flight.ring) == flight.RING_SIZE and len(lines) == flight.RING_SIZE + 1
    assert lines[0] == f"rank 3: last {flight.RING_SIZE} communication calls (oldest first):"
    assert "allreduce on axis dp, 24 bytes" in lines[1] and "took 2.000 ms" in lines[1]  # calls 0-5 dropped
    assert lines[-1] == (f"  rank 3: t-5.000 s  iallreduce on axis dp, 4096 bytes, collective #{stuck[flight.COUNT]} "
                         "on this communicator  NOT COMPLETED")
    ch.cur = None


def test_describe_names_op_axis_bytes_peer_and_label():
    ch = flight.Channel("pp", (4, 6))
    with flight.labelled(ch, WaitLabel(1, Action(RECV_GRAD, 5, 0, 0))):
        recv = start_call(ch, "irecv", 2048, peer=0)
    send = start_call(ch, "isend", 16, peer=1)
    assert ch.label is None  # restored on leaving the block
    assert flight.describe(recv) == ("pp rank 1: recv grad mb=5 chunk 0 from pp rank 0 "
                                     "(irecv on axis pp, 2048 bytes, from pp rank 0 = world rank 4)")
    assert flight.describe(send) == "isend on axis pp, 16 bytes, to pp rank 1 = world rank 6"


def test_pipeline_wait_labels():
    assert str(WaitLabel(2, Action(RECV_GRAD, 5, 0, 3))) == "pp rank 2: recv grad mb=5 chunk 0 from pp rank 3"
    assert str(WaitLabel(0, Action(SEND_ACT, 1, 1, 1))) == "pp rank 0: send act mb=1 chunk 1 to pp rank 1"


def test_a_wait_times_out_only_while_it_is_waited_on():
    ch = flight.Channel("dp", (0, 1))
    blocking = start_call(ch, "allreduce", 8, t0=100.0)
    assert flight.waiting(blocking, 104.0, 5.0) is None
    assert flight.waiting(blocking, 106.0, 5.0) == pytest.approx(6.0)
    blocking[flight.DONE] = 106.5
    assert flight.waiting(blocking, 200.0, 5.0) is None
    polled = start_call(ch, "irecv", 8, peer=1, t0=100.0)
    polled[flight.SINCE], polled[flight.POLLED] = 101.0, 110.0  # tested in a loop since 101 s
    assert flight.waiting(polled, 110.5, 5.0) == pytest.approx(9.5)
    # tested once in passing, then left alone while the rank computes: not a hang
    assert flight.waiting(polled, 110.0 + flight.FRESH_S + 1, 5.0) is None


def test_state_names_the_call_in_flight_or_the_last_one():
    flight.ring.clear()
    ch = flight.Channel("world", (0, 1))
    call = flight.new_call(ch, "barrier", 0, -1, 10.0)
    assert flight.state(12.5).startswith("waiting 2.5 s in barrier on axis world")
    ch.cur, call[flight.DONE] = None, 13.0
    assert flight.state(15.0) == ("not in a communication call; the last one, barrier on axis world, 0 bytes, "
                                  f"collective #{call[flight.COUNT]} on this communicator, ended 2.0 s ago")


# ------------------------------------------------------------------ real jobs

def launch(cmd, env=None, timeout=JOB_TIMEOUT):
    """Run ``cmd``; returns (exit code, stdout, stderr, seconds from the line announcing the
    injected fault to the end of the job, or None without such a line)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True,
                            env=dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", **(env or {})))
    out, err, fault_at = [], [], []

    def read(stream, lines):
        for line in stream:
            if "injecting" in line and not fault_at:
                fault_at.append(time.monotonic())
            lines.append(line)

    readers = [threading.Thread(target=read, args=(proc.stdout, out)),
               threading.Thread(target=read, args=(proc.stderr, err))]
    for t in readers:
        t.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"{' '.join(cmd)} still running after {timeout} s: it hung\n{''.join(err)}")
    ended = time.monotonic()
    for t in readers:
        t.join()
    return rc, "".join(out), "".join(err), (ended - fault_at[0]) if fault_at else None


def train_with_fault(fault, data, out, *args):
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpirt.train", *TINY, "--steps=8", f"--data={data}",
           f"--out-dir={out}", *args]
    rc, _, err, seconds = launch(cmd, env={"MPIRT_FAULT": fault})
    assert seconds is not None, f"the fault {fault} was never injected:\n{err}"
    print(f"\n{fault} {' '.join(args)}: exit code {rc}, {seconds:.1f} s from the fault to the end of the job")
    return rc, err, seconds


TIMEOUT_S = 5.0
# the stuck call is seen within a tick, the others answer within REPLY_S; the rest is slack for a busy machine
TIMEOUT_BOUND = TIMEOUT_S + REPLY_S + 10


def test_a_stalled_rank_ends_the_job_naming_the_collective_and_the_missing_rank(tiny_data, tmp_path):
    rc, err, seconds = train_with_fault("stall@1:3", tiny_data, tmp_path, f"--comm-timeout={TIMEOUT_S}")
    assert rc == EXIT_TIMEOUT, err
    assert TIMEOUT_S <= seconds < TIMEOUT_BOUND, err
    assert re.search(r"mpirt watchdog: rank 0: i?allreduce on axis dp, \d+ bytes, collective #\d+ on this "
                     r"communicator: waited \d+\.\d s \(comm_timeout 5 s\)", err), err
    assert "ranks that never arrived: 1 (world ranks)" in err, err
    assert re.search(r"world rank 1 \(dp rank 1\): not in a communication call", err), err
    assert "rank 1: last " in err and "rank 0: last " in err, err  # both rings were dumped


def test_a_stalled_pipeline_rank_is_named_with_the_schedule_action(tiny_data, tmp_path):
    rc, err, seconds = train_with_fault("stall@1:3", tiny_data, tmp_path, f"--comm-timeout={TIMEOUT_S}", "--pp=2",
                                        "--model.n_layer=2")
    assert rc == EXIT_TIMEOUT, err
    assert TIMEOUT_S <= seconds < TIMEOUT_BOUND, err
    assert re.search(r"mpirt watchdog: rank 0: pp rank 0: recv grad mb=\d+ chunk 0 from pp rank 1 "
                     r"\(irecv on axis pp, \d+ bytes, from pp rank 1 = world rank 1\): waited", err), err
    assert "waiting for pp rank 1:" in err and "world rank 1 (pp rank 1): not in a communication call" in err, err


def test_a_stalled_context_rank_is_named_with_the_ring_step_and_the_layer(tiny_data, tmp_path):
    rc, err, seconds = train_with_fault("stall@1:3", tiny_data, tmp_path, f"--comm-timeout={TIMEOUT_S}", "--cp=2")
    assert rc == EXIT_TIMEOUT, err
    assert re.search(r"mpirt watchdog: rank 0: cp rank 0: ring attention forward of h\.0\.attn, ring step 1 of 1 "
                     r"\(keys and values to cp rank 1, from cp rank 1\) \(i(send|recv) on axis cp, \d+ bytes, "
                     r"(to|from) cp rank 1 = world rank 1\): waited", err), err


@pytest.mark.parametrize("layout", [[], ["--pp=2", "--model.n_layer=2"]], ids=["dp", "pp"])
def test_a_rank_that_exits_ends_the_job_quickly_naming_it(tiny_data, tmp_path, layout):
    rc, err, seconds = train_with_fault("exit@1:3", tiny_data, tmp_path, "--comm-timeout=120", *layout)
    assert rc == 3, err
    assert seconds < 15, err  # far below the 120 s timeout: the exit itself ends the job
    assert "rank 1 exited on its own (sys.exit(3)) while this rank waits for it in" in err, err


def test_an_exception_on_one_rank_ends_the_job_with_its_traceback_and_ring(tiny_data, tmp_path):
    rc, err, seconds = train_with_fault("raise@1:3", tiny_data, tmp_path, "--comm-timeout=120")
    assert rc == 1 and seconds < 15, err
    assert "RuntimeError: injected fault on rank 1 at step 3" in err and "rank 1: last " in err, err


def test_a_killed_rank_ends_the_job(tiny_data, tmp_path):
    rc, err, seconds = train_with_fault("kill@1:3", tiny_data, tmp_path, "--comm-timeout=120")
    assert rc != 0, err
    assert seconds < 15, err


SCRIPT = """
import sys, time
import numpy as np
from mpirt import comm
mode, timeout = sys.argv[1], float(sys.argv[2])
w = comm.world_comm()
comm.start_watchdog(timeout)
if mode == "recv":          # rank 0 waits for a message that rank 1 never sends
    if w.rank == 0:
        with w.labelled("waiting for the answer"):
            w.recv(np.empty(4), 1, tag=5)
    time.sleep(600)
elif mode == "together":    # every rank leaves on purpose with code 75
    w.allreduce(np.ones(3))
    comm.exit_together(75)
elif mode == "all-exit":    # every rank calls sys.exit(75): no rank is left waiting, so no abort
    w.allreduce(np.ones(3))
    sys.exit(75)
elif mode == "exit0":       # rank 1 leaves with code 0 while rank 0 waits in a collective
    if w.rank == 1:
        sys.exit(0)
    w.allreduce(np.ones(3))
elif mode == "done":        # a normal end on every rank
    w.allreduce(np.ones(3))
"""


def run_script(mode, timeout_s, launcher=()):
    return launch(["mpiexec", "-n", "2", sys.executable, *launcher, "-c", SCRIPT, mode, str(timeout_s)])


def test_a_blocking_receive_times_out_naming_its_label_and_peer():
    rc, _, err, _ = run_script("recv", 2)
    assert rc == EXIT_TIMEOUT, err
    assert re.search(r"rank 0: waiting for the answer \(recv on axis world, 32 bytes, from world rank 1\): "
                     r"waited 2\.\d s", err), err
    assert "waiting for world rank 1:\n  world rank 1: not in a communication call" in err, err


@pytest.mark.parametrize("mode, launcher", [("together", ()), ("together", ("-m", "mpi4py")), ("all-exit", ())],
                         ids=["exit_together", "exit_together under python -m mpi4py", "sys.exit on every rank"])
def test_leaving_together_exits_with_the_code_and_no_abort(mode, launcher):
    rc, _, err, _ = run_script(mode, 60, launcher)
    assert rc == 75, err
    assert "Abort" not in err and "watchdog" not in err, err


def test_a_normal_end_is_clean_and_a_lone_exit_with_code_0_is_not():
    rc, _, err, _ = run_script("done", 60)
    assert rc == 0 and err == "", err
    t0 = time.monotonic()
    rc, _, err, _ = run_script("exit0", 60)
    assert rc == 1 and time.monotonic() - t0 < 30, err
    assert "rank 1 exited on its own (sys.exit(0)) while this rank waits for it in allreduce on axis world" in err, err
