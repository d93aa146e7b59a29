"""Point-to-point calls of :class:`~mpirt.comm.Comm` (blocking and non-blocking), kept apart
from the collectives in :mod:`mpirt.comm.communicator`."""
from __future__ import annotations

from mpi4py import MPI

import mpirt.core.backend as B
from mpirt.comm.buffers import _contig, _sync
from mpirt.comm.flight import new_call
from mpirt.comm.handles import Handle, _done_handle, _finish_recv, _recv_buffer, _recv_error
from mpirt.comm.job import PROC_NULL
from mpirt.comm.registry import _clock


class PointToPoint:
    """Send and receive arrays' bytes; mixed into :class:`~mpirt.comm.Comm`, which provides
    ``mpi``, ``_ch``, ``_engine`` and ``_record``. ``PROC_NULL`` as the peer does nothing."""

    def send(self, x, dest: int, tag: int = 0) -> None:
        """Blocking send of ``x``'s bytes to ``dest`` (PROC_NULL: nothing happens)."""
        if dest == PROC_NULL:
            return
        call = new_call(self._ch, "send", x.nbytes, dest, _clock(), x.dtype)
        try:
            engine = self._engine(x, p2p=True)
            buf = _contig(B.to_host(x) if engine == "staged" else x)
            _sync(buf)
            self.mpi.Send([buf, MPI.BYTE], dest, tag)
        finally:
            self._ch.cur = None
        self._record(call, engine)

    def recv(self, out, source: int, tag: int = 0):
        """Blocking receive into the preallocated ``out``; the message must fill it exactly, else
        :class:`CommError` names the source, tag and sizes. Returns ``out`` (PROC_NULL: unchanged)."""
        if source == PROC_NULL:
            return out
        call = new_call(self._ch, "recv", out.nbytes, source, _clock(), out.dtype)
        try:
            engine = self._engine(out, p2p=True)
            buf = _recv_buffer(out, engine)
            status = MPI.Status()
            _sync(buf)
            self.mpi.Recv([buf, MPI.BYTE], source, tag, status)
        except MPI.Exception as err:
            raise _recv_error(err, out, source, tag) from err
        finally:
            self._ch.cur = None
        _finish_recv(status, buf, out, source, tag)
        self._record(call, engine)
        return out

    def isend(self, x, dest: int, tag: int = 0) -> Handle:
        """Start sending ``x``; keep ``x`` unchanged until the handle completes."""
        if dest == PROC_NULL:
            return _done_handle(x)
        engine = self._engine(x, p2p=True)
        call = new_call(self._ch, "isend", x.nbytes, dest, _clock(), x.dtype)
        try:
            buf = _contig(B.to_host(x) if engine == "staged" else x)
            _sync(buf)
            req = self.mpi.Isend([buf, MPI.BYTE], dest, tag)
        finally:
            self._ch.cur = None
        return Handle(req, None, engine, x, call, keep=buf)

    def irecv(self, out, source: int, tag: int = 0) -> Handle:
        """Start receiving into ``out``; ``wait()`` returns ``out`` (checks the size like :meth:`recv`)."""
        if source == PROC_NULL:
            return _done_handle(out)
        engine = self._engine(out, p2p=True)
        call = new_call(self._ch, "irecv", out.nbytes, source, _clock(), out.dtype)
        try:
            buf = _recv_buffer(out, engine)
            _sync(buf)
            req = self.mpi.Irecv([buf, MPI.BYTE], source, tag)
        finally:
            self._ch.cur = None
        return Handle(req, lambda status: _finish_recv(status, buf, out, source, tag), engine, out, call,
                      status=MPI.Status(), keep=buf, recv=(out, source, tag))
