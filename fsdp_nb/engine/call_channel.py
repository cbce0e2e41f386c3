"""Session calls over a direct socket, served on the engine's main thread.

``serve`` (called once per engine through ipyparallel's task queue) binds a zmq
ROUTER socket and registers it with the engine kernel's own event loop, so each
request runs on the main thread between cells, exactly where ``%%px`` code and
ipyparallel's ``apply`` run, but without the controller's hop each way.

Every message both ways is signed with the cluster's key (``signing.Link``, the
server's nonce in its keys): a request that is unsigned, badly signed, cut short or
replayed is dropped before a byte of it is unpickled, and the server serves on. The
socket binds to the address the notebook gives (loopback when the notebook is on this
host) and refuses frames over ``MAX_REQUEST_BYTES`` (zmq drops the sender); the
notebook sends larger calls through ipyparallel.

A request is ``[signature, cloudpickle of (fn, args, cell)]``; its signed header (sender
and counter, unique) is the call's id. ``cell`` says whether the call is the user's own
(``sess.run``): the rank's step owner is then told that a cell started and ended around
it (``fsdp_nb.engine.step``), as IPython tells it around a ``%%px`` cell, so a step's
time never counts the pause between two calls. The session's own calls (``push``,
``pull``, an async save and its polls) are no cell. ``fn(*args)`` runs with SIGINT raising
``KeyboardInterrupt`` (as in a cell, so Ctrl-C and the recovery's interrupt reach it;
not in the server's own bookkeeping: ``interrupts``), its printed lines travel back as
they are written (``[signature, head, text]``, the head saying stdout or stderr), then
one reply: ``[signature, head, result]`` or ``[signature, head, (ename, evalue,
traceback)]``, the head saying which, with the finish time (``head`` / ``read_head``).
Few frames on purpose: every ``send`` may hand the GIL to the engine's other threads.
"""

from __future__ import annotations

import io
import logging
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from typing import Any

import cloudpickle

from . import interrupts
from .registry import Part, part
from .signing import HEADER_BYTES, Link, Refused, engine_key, new_nonce
from .step import owner

__all__ = [
    "ERROR", "MAX_REQUEST_BYTES", "OK", "STDERR", "STDOUT", "after_reply", "as_cell", "dropped", "head",
    "read_head", "serve",
]

OK, ERROR, STDOUT, STDERR = b"o", b"e", b"1", b"2"
"""What a message from the server carries: a result, an error, printed output."""
_FINISHED = struct.Struct("!d")


def head(call_id: bytes, kind: bytes, finished: float | None = None) -> bytes:
    """The first payload frame of a message from the server: the call it answers, its
    kind, and (for a reply) when the call finished (Unix time)."""
    return call_id + kind + (b"" if finished is None else _FINISHED.pack(finished))


def read_head(data: bytes) -> tuple[bytes, bytes, float | None]:
    """``(call id, kind, finished or None)`` of a ``head``."""
    rest = data[HEADER_BYTES + 1:]
    finished = _FINISHED.unpack(rest)[0] if len(rest) == _FINISHED.size else None
    return data[:HEADER_BYTES], data[HEADER_BYTES:HEADER_BYTES + 1], finished

log = logging.getLogger("fsdp_nb")

class CallServing(Part):
    """This engine's call server (the registry's part for it)."""

    def __init__(self) -> None:
        self.server: _Server | None = None
        """The server, once ``serve`` started it."""
        self.after: list[Any] | None = None
        """While a call runs on the server: what runs once its reply is sent (``after_reply``)."""

    def closed(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def after_reply(fn: Any) -> None:
    """Run ``fn()`` once the reply to the call now running has left, or at once outside
    a call server request (an ipyparallel call, a cell).

    For background work that a call starts, such as an async save's copy and write: its
    threads would otherwise compete with the reply for the GIL and the cores, and the
    notebook would wait for them.
    """
    after = part(CallServing).after
    if after is None:
        fn()
    else:
        after.append(fn)


MAX_REQUEST_BYTES = 1 << 30
"""The largest frame the server takes (zmq disconnects a peer that sends more, before
anything is read): a request's pickled call. The notebook sends larger ones through
ipyparallel (``call_channel``)."""


def serve(addr: str) -> tuple[str, bytes]:
    """Start this engine's call server on ``addr`` (once; later calls return the same).

    Args:
        addr: the address to bind: loopback when the notebook runs on this host, else
            the engine's address on the interface that routes to the controller.

    Returns its zmq endpoint and its nonce (for the notebook's ``signing.Link``).
    """
    serving = part(CallServing)
    if serving.server is None:
        serving.server = _Server(addr, engine_key())
    return serving.server.endpoint, serving.server.nonce


def dropped() -> int:
    """Requests this engine's call server refused (unsigned, forged, replayed)."""
    server = part(CallServing).server
    return 0 if server is None else server.link.dropped


class _Server:
    def __init__(self, addr: str, key: bytes):
        import zmq
        from zmq.eventloop.zmqstream import ZMQStream

        self.nonce = new_nonce()
        self.link = Link(key, "call", self.nonce, "server")
        sock: zmq.SyncSocket = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock = sock
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        port = self.sock.bind_to_random_port(f"tcp://{addr}")
        self.endpoint = f"tcp://{addr}:{port}"
        self.stream = ZMQStream(self.sock)  # the kernel's event loop: the main thread
        self.stream.on_recv(self._on_request, copy=False)

    def close(self) -> None:
        """Stop serving: the stream leaves the event loop and the socket closes."""
        self.stream.close()

    def _send(self, ident: bytes, frames: list[Any]) -> None:
        try:
            self.sock.send_multipart([ident, *self.link.sign(frames)], copy=False)  # [ident, auth, head, body]
        except Exception as exc:  # noqa: BLE001 - the notebook may have gone
            log.warning("a call reply could not be sent: %s", exc)

    def _on_request(self, frames: list[Any]) -> None:
        try:
            if len(frames) != 3:  # the sender's identity, the signature, the call
                raise Refused(f"{len(frames) - 1} frames where a signed call has 2")
            ident = frames[0].bytes
            (payload,) = self.link.check(frames[1:])
        except Refused as why:
            self.link.refused(why, self.endpoint)
            return
        after: list[Any] = []
        serving = part(CallServing)
        serving.after = after
        try:
            self._answer(ident, frames[1].bytes[:HEADER_BYTES], payload.buffer)
        finally:
            serving.after = None
            for fn in after:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - the call has been answered already
                    log.exception("work started after a call's reply failed")

    def _answer(self, ident: bytes, call_id: bytes, payload: memoryview) -> None:
        out = _Output(self, ident, call_id, STDOUT, sys.stdout)
        err = _Output(self, ident, call_id, STDERR, sys.stderr)
        old_int = signal.getsignal(signal.SIGINT)
        old_out, old_err = sys.stdout, sys.stderr
        try:
            signal.signal(signal.SIGINT, interrupts.guarded)
            sys.stdout, sys.stderr = out, err
            fn, args, cell = _request(cloudpickle.loads(payload))
            status, body = OK, _dumps(as_cell(fn, *args) if cell else _invoke(fn, args))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the notebook
            sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
            tb = "".join(traceback.format_exception(type(exc), exc, _below_server(exc.__traceback__)))
            status, body = ERROR, pickle.dumps((type(exc).__name__, str(exc), tb))
        finally:
            sys.stdout, sys.stderr = old_out, old_err
            signal.signal(signal.SIGINT, old_int)
            out.flush()
            err.flush()
        self._send(ident, [head(call_id, status, time.time()), body])


def _request(loaded: Any) -> tuple[Any, tuple, bool]:
    """``(fn, args, cell)`` of a request's unpickled call; a TypeError (the call's error)
    for anything else."""
    if not (isinstance(loaded, tuple) and len(loaded) == 3 and isinstance(loaded[1], tuple)
            and isinstance(loaded[2], bool)):
        raise TypeError("a call must be (fn, args, cell): this engine runs another version of fsdp_nb "
                        "than the notebook's")
    return loaded


def as_cell(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` run as the user's cell: the rank's step owner hears it start and end
    (failed, where it raised), as IPython tells it around a ``%%px`` cell. The server runs
    a ``sess.run`` request so; the notebook wraps in it a ``sess.run`` it sends through
    ipyparallel instead (too large for the socket, or no socket)."""
    __tracebackhide__ = True  # left out of the traceback IPython shows
    _tell(lambda: owner().cell_started())
    try:
        result = _invoke(fn, args)
    except BaseException:
        _tell(lambda: owner().cell_ended(True))
        raise
    _tell(lambda: owner().cell_ended(False))
    return result


def _tell(event: Any) -> None:
    """Tell the rank's features that a user's call started or ended. A feature that fails
    there is reported on the call's stderr and logged, as IPython reports a failing
    event callback around a cell: the call itself is not its failure."""
    try:
        event()
    except Exception:  # noqa: BLE001 - reported like IPython's "Error in callback"
        log.exception("fsdp_nb: a feature failed at a call's start or end")
        traceback.print_exc()


def _invoke(fn: Any, args: tuple) -> Any:
    """The call, in a frame of its own: a SIGINT while ``fn`` runs (a builtin such as
    ``time.sleep`` has no frame) lands here, not in ``_on_request``'s bookkeeping."""
    __tracebackhide__ = True  # left out of the traceback IPython shows (``as_cell``)
    return fn(*args)


interrupts.own(_Server._on_request, _Server._answer, as_cell)
interrupts.calls(_invoke)


def _below_server(tb: Any) -> Any:
    """The traceback from the call down: the server's own frames left out."""
    own = (_Server._on_request.__code__, _Server._answer.__code__, as_cell.__code__, _invoke.__code__)
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
        self.server._send(self.ident, [head(self.call_id, self.name), text.encode("utf-8", "replace")])
