"""The communication watchdog, and how a rank leaves the job without leaving the others hanging.

``start_watchdog(timeout_s)`` (collective over the world) starts one daemon thread per process.
Every :class:`~mpirt.comm.Comm` call sits in its communicator's in-flight slot while it runs
(:mod:`mpirt.comm.flight`; a couple of list and attribute writes, no lock), and the thread looks at
the slots a few times a second. Two things end the job:

- **A timeout.** A call (blocking, a handle's ``wait()``, or a loop polling a handle's ``test()``)
  waited more than ``timeout_s`` seconds. The thread asks every other rank, on its own duplicate
  of the world communicator (mpi4py initialises MPI_THREAD_MULTIPLE, so it can talk while the
  main thread is blocked inside MPI), for its state and its collective count on the stuck
  communicator; each rank prints its state and its ring of recent calls and answers within
  :data:`REPLY_S`. Ranks of the communicator whose count is behind, or who do not answer, never
  arrived; for a point-to-point call the peer is the one waited for. The rank prints the call in
  the runtime's terms (op, axis, bytes, and its label, e.g. a pipeline action), the missing ranks
  with their state, its own ring, and calls ``abort_job(EXIT_TIMEOUT)`` (``MPI_Abort`` once its output is out): the job
  exits with code **4** (:data:`EXIT_TIMEOUT`).
- **A rank that exits on its own.** At exit (``sys.exit``, ``SystemExit`` or the end of the
  program) a rank tells the others it is leaving, with its collective counts, and waits for them
  in a barrier. A rank whose main thread waits for a rank that has left (a collective that rank
  never entered, or a point-to-point call with it still pending :data:`EXIT_GRACE_S` seconds after
  it left) prints who left, with which code, and what it waits in, and aborts with that code (1
  when it was 0 or unknown). Ranks that all exit reach the barrier together and finish cleanly.
  A SIGKILLed rank needs nothing: hydra's ``mpiexec`` then kills the others itself.

``timeout_s=0`` turns the timeouts off but keeps the exit rule. ``exit_together(code)`` is how
all ranks leave together on purpose (a refused config, a graceful stop): it waits for every rank
(watched by the timeout), finalises MPI and exits with ``code``, with no abort. ``sys.exit`` is
wrapped so that a report can name the code; a ``SystemExit`` raised directly is reported as an
exit with an unknown code.
"""
from __future__ import annotations

import atexit
import signal
import sys
import threading
import time

from mpi4py import MPI

from mpirt.comm.communicator import Comm
from mpirt.comm.flight import CHAN, COUNT, PEER, channels, describe, dump, state, waiting
from mpirt.comm.job import abort_job
from mpirt.comm.registry import _clock

EXIT_TIMEOUT = 4      # the job's exit code after a watchdog timeout
REPLY_S = 3.0         # how long a rank that reports waits for the others' answers
EXIT_GRACE_S = 2.0    # a point-to-point call still pending this long after its peer left is stuck
_TAG_QUERY, _TAG_ANSWER, _TAG_EXIT = 1, 2, 3

_watchdog: "Watchdog | None" = None
_exit_code = None     # the argument of this process's latest sys.exit call
_sys_exit = sys.exit


class Watchdog:
    """The per-process watchdog thread; made by :func:`start_watchdog`."""

    def __init__(self, timeout_s: float):
        world = MPI.COMM_WORLD
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.timeout = float(timeout_s)
        self.together = False           # set by exit_together: leaving is agreed, not announced
        self._tick = min(0.2, self.timeout / 5) if self.timeout > 0 else 0.2
        self._comm = world.Dup()        # the thread's own: queries, answers, exit notices
        self._exit = Comm(world.Dup(), axis="exit")  # the barrier at exit, watched like any call
        self._left: dict[int, tuple] = {}  # world rank -> (exit code, collective counts, seen at)
        self._told = False              # this rank has printed its state for another's report
        self._firing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpirt-watchdog", daemon=True)
        self._thread.start()

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            self._serve()
            if not self._firing:
                self._check(_clock())

    def _serve(self, answers: dict | None = None) -> None:
        """Take every message waiting for this thread: answer queries, note ranks that left,
        collect answers (into ``answers`` while reporting)."""
        status = MPI.Status()
        while self._comm.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            source, tag = status.Get_source(), status.Get_tag()
            msg = self._comm.recv(source=source, tag=tag)
            if tag == _TAG_QUERY:
                self._answer(source, msg)
            elif tag == _TAG_EXIT:
                self._left[source] = (msg["code"], msg["counts"], _clock())
            elif answers is not None:
                answers[source] = msg

    def _answer(self, source: int, query: dict) -> None:
        now = _clock()
        here = state(now)
        if not self._told:
            self._told = True
            _write(f"mpirt watchdog: rank {self.rank}: rank {source} reports {query['what']}\n"
                   f"  rank {self.rank} is {here}\n{dump(self.rank, now)}")
        count = next((ch.calls for ch in channels() if ch.key == query["key"]), 0)
        self._comm.send({"state": here, "count": count}, dest=source, tag=_TAG_ANSWER)

    def _check(self, now: float) -> None:
        exit_channel = self._exit._ch
        for ch in channels():
            call = ch.cur
            if call is None:
                continue
            if self.timeout > 0:
                waited = waiting(call, now, self.timeout)
                if waited is not None:
                    self._report(f"{describe(call)}: waited {waited:.1f} s (comm_timeout {self.timeout:g} s)",
                                 call, EXIT_TIMEOUT)
                    return
            if ch is exit_channel or waiting(call, now) is None:
                continue
            for rank, (code, counts, seen) in list(self._left.items()):
                if _needs(call, rank, counts, now - seen):
                    self._report(f"rank {rank} exited on its own ({_exit_text(code)}) while this rank waits for "
                                 f"it in {describe(call)}", call, code if isinstance(code, int) and code else 1)
                    return

    def _report(self, headline: str, call: list, code: int) -> None:
        """Ask the other ranks for their state, print the report and the ring, end the job."""
        self._firing = True
        answers = self._ask(call)
        lines = [f"mpirt watchdog: rank {self.rank}: {headline}; ending the job with exit code {code}",
                 *_missing(call, answers, self.rank), dump(self.rank)]
        _write("\n".join(lines))
        abort_job(code)

    def _ask(self, call: list) -> dict:
        query = {"what": describe(call), "key": call[CHAN].key}
        pending = [self._comm.isend(query, dest=r, tag=_TAG_QUERY) for r in range(self.size) if r != self.rank]
        answers: dict = {}
        deadline = _clock() + REPLY_S
        while len(answers) < self.size - 1 and _clock() < deadline:
            self._serve(answers)  # other reporting ranks get their answers meanwhile
            time.sleep(0.01)
        MPI.Request.Testall(pending)
        return answers

    # -- leaving ------------------------------------------------------------------------------

    def barrier(self, label) -> None:
        """Wait (polling, off the CPU) until every rank is here; watched like any other call."""
        with self._exit.labelled(label):
            handle = self._exit.ibarrier()
        while not handle.test():
            time.sleep(0.005)

    def leave(self, code) -> None:
        """Tell the other ranks this one is exiting, then wait for them at the exit barrier."""
        counts = {ch.key: ch.calls for ch in channels()}
        notices = [self._comm.isend({"code": code, "counts": counts}, dest=r, tag=_TAG_EXIT)
                   for r in range(self.size) if r != self.rank]
        self.barrier(f"rank {self.rank} at exit ({_exit_text(code)}): waiting for the other ranks to finish")
        MPI.Request.Waitall(notices)

    def close(self) -> None:
        """Stop the thread and take the messages still addressed to it (before MPI finalises)."""
        self._stop.set()
        self._thread.join()
        status = MPI.Status()
        while self._comm.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            self._comm.recv(source=status.Get_source(), tag=status.Get_tag())


def start_watchdog(timeout_s: float) -> Watchdog | None:
    """Watch every communication call of this process (see the module docstring); collective over
    the world. ``timeout_s``: seconds a call may wait before the job ends with exit code 4 (0: no
    timeout; a rank that exits on its own still ends the job). Returns the :class:`Watchdog`, or
    None on a single rank (nobody to wait for). A second call only changes the timeout."""
    global _watchdog
    if timeout_s < 0:
        raise ValueError(f"comm_timeout: must be >= 0 seconds (0 = no timeout), got {timeout_s}")
    if MPI.COMM_WORLD.Get_size() == 1:
        return None
    if _watchdog is not None:
        _watchdog.timeout = float(timeout_s)
        return _watchdog
    _watchdog = Watchdog(timeout_s)
    sys.exit = _recording_exit
    atexit.register(_at_exit)  # registered after mpi4py's finalizer, so it runs before it
    return _watchdog


def exit_together(code: int = 0):
    """Leave the job on purpose, every rank with the same ``code`` (all ranks must call it, as
    the last thing they do): flush output, wait for every rank (a rank that never comes is named
    by the watchdog), finalise MPI and raise ``SystemExit(code)``. No abort, so no abort noise,
    also under ``python -m mpi4py``.

    TERM and INT are ignored from here on: a launcher that kills the other tasks as soon as one
    exits non-zero (``srun --kill-on-bad-exit``, an exit 75 after a stop) must not turn the
    agreed code of a rank still finalising into death by signal (exit 143)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    global _watchdog
    watchdog, _watchdog = _watchdog, None
    if watchdog is not None:
        watchdog.together = True
        watchdog.barrier(f"exit_together({code}): waiting for the other ranks")
        watchdog.close()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    _sys_exit(code)


def _recording_exit(code=None):
    global _exit_code
    _exit_code = code
    _sys_exit(code)


def _at_exit() -> None:
    watchdog = _watchdog
    if watchdog is None or MPI.Is_finalized():
        return
    if not watchdog.together:
        watchdog.leave(_exit_code)
    watchdog.close()


def _needs(call: list, rank: int, counts: dict, since_left: float) -> bool:
    """Whether ``call`` waits for world rank ``rank``, which left with these collective counts."""
    ch = call[CHAN]
    if rank not in ch.world:
        return False
    if call[PEER] < 0:
        return counts.get(ch.key, 0) < call[COUNT]
    return ch.world[call[PEER]] == rank and since_left > EXIT_GRACE_S


def _missing(call: list, answers: dict, me: int) -> list[str]:
    """Report lines naming the ranks ``call`` waits for that never arrived, with their state."""
    ch = call[CHAN]

    def who(r, i):
        got = answers.get(r)
        doing = got["state"] if got else f"did not answer within {REPLY_S:g} s"
        axis_rank = f" ({ch.axis} rank {i})" if ch.axis != "world" else ""
        return f"  world rank {r}{axis_rank}: {doing}"

    if call[PEER] >= 0:
        return [f"  waiting for {ch.axis} rank {call[PEER]}:", who(ch.world[call[PEER]], call[PEER])]
    late = [(r, i) for i, r in enumerate(ch.world)
            if r != me and (r not in answers or answers[r]["count"] < call[COUNT])]
    if not late:
        return [f"  every rank of axis {ch.axis} entered this collective; it did not complete"]
    return [f"  ranks that never arrived: {', '.join(str(r) for r, _ in late)} (world ranks)",
            *(who(r, i) for r, i in late)]


def _exit_text(code) -> str:
    return "exit code unknown: SystemExit or the end of the program" if code is None else f"sys.exit({code!r})"


def _write(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
