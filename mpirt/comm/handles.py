"""Handles for non-blocking calls, and the receive-side checks shared by ``recv`` and ``irecv``."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpirt.comm import buffers
from mpirt.comm.flight import CHAN, DONE, DTYPE, NBYTES, OP, POLLED, SINCE, T0
from mpirt.comm.job import CommError
from mpirt.comm.registry import _clock, stats


class Handle:
    """A pending non-blocking operation. ``test()`` drives MPI progress and says whether it is done
    (MPICH progresses requests only inside MPI calls); ``wait()`` completes it and returns the
    result array. Keeps the buffers alive until completion.

    For the watchdog, ``wait()`` puts the call (see :mod:`mpirt.comm.flight`) in its
    communicator's in-flight slot, and so does an unsuccessful ``test()``, which also notes the
    time of the test, so a polling loop is watched like a blocking wait."""

    __slots__ = ("_req", "_finish", "_engine", "_call", "_status", "_result", "_done", "_keep", "_recv")

    def __init__(self, req, finish, engine, result, call, status=None, keep=None, recv=None):
        self._req, self._finish, self._engine, self._call = req, finish, engine, call
        self._result, self._status, self._keep, self._recv = result, status, keep, recv
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    @property
    def engine(self) -> str:
        """What carries the operation: ``"host"`` (MPI on host arrays), ``"staged"`` (MPI on host
        copies of device arrays) or ``"nccl"``."""
        return self._engine

    def test(self) -> bool:
        """Drive progress; True once the operation has completed (then the result is ready)."""
        if self._done:
            return True
        call = self._call
        try:
            if self._req is not None and not self._req.Test(self._status):
                now = _clock()
                ch = call[CHAN]
                if ch.cur is not call:  # a new polling run starts here
                    call[SINCE] = now
                    ch.cur = call
                call[POLLED] = now
                return False
        except MPI.Exception as err:
            raise self._error(err) from err
        if call[CHAN].cur is call:
            call[CHAN].cur = None
        self._complete()
        return True

    def wait(self):
        """Complete the operation and return its result array."""
        if not self._done:
            call = self._call
            ch = call[CHAN]
            call[SINCE], call[POLLED] = _clock(), None
            ch.cur = call
            try:
                if self._req is not None:
                    self._req.Wait(self._status)
            except MPI.Exception as err:
                raise self._error(err) from err
            finally:
                ch.cur = None
            self._complete(waited_since=call[SINCE])
        return self._result

    def _error(self, err):
        return _recv_error(err, *self._recv) if self._recv else err

    def _complete(self, waited_since: float | None = None) -> None:
        """Mark done and record the call; ``waited_since``: when ``wait()`` began blocking on it
        (the registry's ``blocked``; completion found by ``test()`` blocked nothing)."""
        self._done = True
        if self._finish is not None:
            self._finish(self._status)
        call = self._call
        t1 = call[DONE] = _clock()
        stats.add(call[OP], call[CHAN].axis, call[NBYTES], t1 - call[T0], self._engine,
                  0.0 if waited_since is None else t1 - waited_since, call[DTYPE])
        self._req = self._finish = self._keep = None


def _done_handle(result) -> Handle:
    """A completed handle for a call that moves nothing (a PROC_NULL peer); not recorded."""
    h = Handle(None, None, "host", result, None)
    h._done = True
    return h


def wait_all(handles) -> list:
    """Wait for every handle; returns their results in order."""
    return [h.wait() for h in handles]


def test_all(handles) -> bool:
    """Test every handle (driving progress on all of them); True when all are done."""
    return all([h.test() for h in handles])


def _recv_buffer(out, engine):
    if engine == "staged":
        return np.empty(out.shape, out.dtype)
    return out if out.flags.c_contiguous else buffers._xp(out).empty(out.shape, out.dtype)


def _finish_recv(status, buf, out, source, tag) -> None:
    got = status.Get_count(MPI.BYTE)
    if got != out.nbytes:
        raise CommError(f"recv from source {status.Get_source()} (asked {source}) tag {tag}: got {got} bytes "
                        f"({got / out.itemsize:g} {out.dtype} elements), out holds {out.size} "
                        f"({out.nbytes} bytes)")
    if buf is not out:
        out[...] = buffers._xp(out).asarray(buf)


def _recv_error(err, out, source, tag) -> Exception:
    if err.Get_error_class() == MPI.ERR_TRUNCATE:
        return CommError(f"recv from source {source} tag {tag}: the message is larger than out, which holds "
                         f"{out.size} {out.dtype} elements ({out.nbytes} bytes)")
    return err
