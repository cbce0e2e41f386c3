"""Session calls over a direct socket, served on the engine's main thread.

``serve`` (called once per engine through ipyparallel's task queue) binds a zmq
ROUTER socket and registers it with the engine kernel's own event loop, so each
request runs on the main thread between cells, exactly where ``%%px`` code and
ipyparallel's ``apply`` run, but without the controller's hop each way.

A request is ``[call id, cloudpickle of (fn, args)]``; ``fn(*args)`` runs with
SIGINT raising ``KeyboardInterrupt`` (as in a cell, so Ctrl-C and the recovery's
interrupt reach it; not in the server's own bookkeeping: ``interrupts``), its
printed lines travel back as they are written
(``[id, b"stdout" | b"stderr", text]``), then one reply: ``[id, b"ok", result]``
or ``[id, b"error", (ename, evalue, traceback)]``, with the finish time.
"""

from __future__ import annotations

import io
import logging
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any

import cloudpickle

from . import interrupts

__all__ = ["after_reply", "serve"]

log = logging.getLogger("fsdp_nb")

_SERVER: _Server | None = None
_AFTER: list[Any] | None = None
"""While a call runs on the server: what runs once its reply is sent (``after_reply``)."""


def after_reply(fn: Any) -> None:
    """Run ``fn()`` once the reply to the call now running has left, or at once outside
    a call server request (an ipyparallel call, a cell).

    For background work that a call starts, such as an async save's copy and write: its
    threads would otherwise compete with the reply for the GIL and the cores, and the
    notebook would wait for them.
    """
    if _AFTER is None:
        fn()
    else:
        _AFTER.append(fn)


def serve(addr: str) -> str:
    """Start this engine's call server on ``addr`` (once; later calls return the same);
    its zmq endpoint."""
    global _SERVER
    if _SERVER is None:
        _SERVER = _Server(addr)
    return _SERVER.endpoint


class _Server:
    def __init__(self, addr: str):
        import zmq
        from zmq.eventloop.zmqstream import ZMQStream

        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{addr}")
        self.endpoint = f"tcp://{addr}:{port}"
        self.stream = ZMQStream(self.sock)  # the kernel's event loop: the main thread
        self.stream.on_recv(self._on_request, copy=False)

    def _send(self, frames: list[Any]) -> None:
        try:
            self.sock.send_multipart(frames, copy=False)
        except Exception as exc:  # noqa: BLE001 - the notebook may have gone
            log.warning("a call reply could not be sent: %s", exc)

    def _on_request(self, frames: list[Any]) -> None:
        global _AFTER
        _AFTER = after = []
        try:
            self._answer(frames)
        finally:
            _AFTER = None
            for fn in after:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - the call has been answered already
                    log.exception("work started after a call's reply failed")

    def _answer(self, frames: list[Any]) -> None:
        ident, call_id, payload = frames[0].bytes, frames[1].bytes, frames[2].buffer
        out = _Output(self, ident, call_id, b"stdout", sys.stdout)
        err = _Output(self, ident, call_id, b"stderr", sys.stderr)
        old_int = signal.getsignal(signal.SIGINT)
        old_out, old_err = sys.stdout, sys.stderr
        try:
            signal.signal(signal.SIGINT, interrupts.guarded)
            sys.stdout, sys.stderr = out, err
            fn, args = cloudpickle.loads(payload)
            result = _invoke(fn, args)
            status, body = b"ok", _dumps(result)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the notebook
            sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
            tb = "".join(traceback.format_exception(type(exc), exc, _below_server(exc.__traceback__)))
            status, body = b"error", pickle.dumps((type(exc).__name__, str(exc), tb))
        finally:
            sys.stdout, sys.stderr = old_out, old_err
            signal.signal(signal.SIGINT, old_int)
            out.flush()
            err.flush()
        self._send([ident, call_id, status, body, str(time.time()).encode()])


def _invoke(fn: Any, args: tuple) -> Any:
    """The call, in a frame of its own: a SIGINT while ``fn`` runs (a builtin such as
    ``time.sleep`` has no frame) lands here, not in ``_on_request``'s bookkeeping."""
    return fn(*args)


interrupts.own(_Server._on_request, _Server._answer)


def _below_server(tb: Any) -> Any:
    """The traceback from the call down: the server's own frames left out."""
    own = (_Server._on_request.__code__, _Server._answer.__code__, _invoke.__code__)
    while tb is not None and tb.tb_frame.f_code in own and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def _dumps(result: Any) -> bytes:
    try:
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - notebook-defined types: by value
        return cloudpickle.dumps(result)


class _Output(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` during a call: whole lines go back to the notebook
    as they are written; writes from other threads go to the engine's own stream (the
    socket belongs to the main thread)."""

    def __init__(self, server: _Server, ident: bytes, call_id: bytes, name: bytes, inner: Any):
        self.server, self.ident, self.call_id, self.name, self.inner = server, ident, call_id, name, inner
        self.main = threading.main_thread()
        self.buf = ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if threading.current_thread() is not self.main:
            return self.inner.write(s)
        self.buf += s
        cut = self.buf.rfind("\n") + 1
        if cut:
            self._emit(self.buf[:cut])
            self.buf = self.buf[cut:]
        return len(s)

    def flush(self) -> None:
        if self.buf and threading.current_thread() is self.main:
            self._emit(self.buf)
            self.buf = ""

    def _emit(self, text: str) -> None:
        self.server._send([self.ident, self.call_id, self.name, text.encode("utf-8", "replace")])
