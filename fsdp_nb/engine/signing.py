"""Signed frames: how fsdp_nb's own sockets tell the session's messages from anyone else's.

ipyparallel signs every message with the cluster's key (HMAC-SHA256, checked before it
deserializes anything). fsdp_nb's side channels (the direct call channel, the NCCL abort
listener, the memory feed) follow the same rule with the same secret, after
jupyter_client's ``Session``: every message starts with one frame holding a header
(the sender's random id and a counter) and an HMAC-SHA256 over the header and each
payload frame's SHA-256 in order, so frames cannot be changed, moved, cut or joined (a
payload sent to several engines is hashed once: ``frame_digests``). A receiver checks
the signature with ``hmac.compare_digest`` before it reads, let alone unpickles, a byte
of the payload, then refuses a counter it has already seen from that sender: a
captured message cannot be replayed.

The cluster's key never travels. Each side reads it where it already is (the notebook's
ipyparallel client, the engine's own session) and derives a key per link, direction
and purpose from it (``Link``): a link's keys include a nonce the listening side picked
when it bound (handed over through ipyparallel's signed channel with its endpoint), so
a message captured on one link is worthless on any other, an engine restarted on the
same port included, and a request cannot be reflected back as a reply.

A message that fails any check raises :class:`Refused`; the receiver drops it, logs
the first one per link at WARNING (the rest at DEBUG, counted in ``Link.dropped``)
and keeps serving.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any

from .registry import Part

__all__ = [
    "AUTH_BYTES", "HEADER_BYTES", "Link", "ListenerState", "Refused", "cluster_key", "engine_key", "frame_bytes",
    "frame_digests", "new_nonce", "start_listener",
]

log = logging.getLogger("fsdp_nb")

_HEADER = struct.Struct("!16sQ")
"""A message's header: the sender's random id (16 bytes) and its counter (u64)."""
HEADER_BYTES = _HEADER.size
AUTH_BYTES = HEADER_BYTES + hashlib.sha256().digest_size
"""A signed message's first frame: its header and its HMAC-SHA256."""
_SIDES = ("client", "server")


class Refused(ValueError):
    """A message that is not the session's: unsigned, badly signed, cut short, or replayed."""


def new_nonce() -> bytes:
    """A listening socket's nonce: 16 random bytes, part of every key of its links."""
    return os.urandom(16)


def engine_key() -> bytes:
    """The cluster's key as this engine holds it (its ipyparallel session's), for
    ``Link``; raises ``RuntimeError`` outside an engine or for a cluster with no key."""
    from ipyparallel.engine.app import IPEngine

    if not IPEngine.initialized():
        raise RuntimeError("not inside an ipyparallel engine: there is no cluster key to sign with")
    key = IPEngine.instance().session.key
    if not key:
        raise RuntimeError("this engine's cluster has no key: its messages are not signed, "
                           "so fsdp_nb opens no side channel on it")
    return bytes(key)


def frame_bytes(frame: Any) -> bytes | memoryview:
    """A received frame's bytes without a copy (a zmq ``Frame``, bytes, or a buffer)."""
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else frame


def frame_digests(frames: Sequence[Any]) -> list[bytes]:
    """Each frame's SHA-256: what a signature covers. Hash a payload once and pass its
    digest to every ``Link.sign`` that sends it."""
    return [hashlib.sha256(frame_bytes(f)).digest() for f in frames]


class Link:
    """One side of an authenticated link: signs what it sends, checks what it receives.

    Args:
        key: the cluster's key (``engine_key()`` on an engine, the ipyparallel client's
            ``session.key`` in the notebook). Must not be empty.
        purpose: what the link carries (``"call"``, ``"nccl-abort"``, ``"memory"``): a
            message for one purpose is refused by every other.
        nonce: the listening side's nonce (``new_nonce``), known to both ends.
        side: ``"client"`` (connects, sends requests) or ``"server"`` (binds, answers).
        window: how many counters behind a sender's highest one a message may arrive
            and still be taken, once. zmq keeps a sender's order on one connection, not
            across its sockets: the hang watch asks each question on a socket of its own,
            and a rank busy in C reads two queued questions in either order. 0 (the
            default): each sender's counter must rise.

    One ``Link`` may check messages from many senders (a server's clients); no counter
    is taken twice. ``sign`` is thread-safe; ``check`` is meant for the one thread
    that receives on the socket.
    """

    def __init__(self, key: bytes, purpose: str, nonce: bytes, side: str, window: int = 0):
        if not key:
            raise ValueError("a Link needs the cluster's key; the cluster has none (its "
                             "messages are unsigned), so fsdp_nb cannot authenticate its channels")
        if side not in _SIDES:
            raise ValueError(f"side must be one of {_SIDES}, got {side!r}")
        other = _SIDES[1 - _SIDES.index(side)]
        self.purpose = purpose
        self._send_key = _derive(key, purpose, nonce, side)
        self._recv_key = _derive(key, purpose, nonce, other)
        self._sender = os.urandom(16)
        self._counter = 0
        self._lock = threading.Lock()
        self._last: dict[bytes, int] = {}
        """Highest counter accepted from each sender (only senders that signed correctly)."""
        self.window = window
        self._late: dict[bytes, set[int]] = {}
        """Counters taken from each sender within ``window`` of its highest."""
        self.dropped = 0
        """Messages refused so far."""

    # -- multi-frame messages ([auth, *payload]; auth = header + mac) ---------------------

    def sign(self, frames: Sequence[Any], digests: Sequence[bytes] | None = None) -> list[Any]:
        """``[auth, *frames]``: what to send for the payload ``frames`` (``auth``: the
        header and the signature, one frame). ``digests``: the frames'
        ``frame_digests``, when already taken (a payload sent to several engines)."""
        if digests is None:
            digests = frame_digests(frames)
        with self._lock:
            self._counter += 1
            header = _HEADER.pack(self._sender, self._counter)
        return [header + _mac(self._send_key, header, digests), *frames]

    def check(self, frames: Sequence[Any]) -> list[Any]:
        """The payload frames of a received ``[auth, *payload]``; raises :class:`Refused`
        (nothing of the payload read) unless it is signed for this link's receiving
        direction and its counter is new."""
        if len(frames) < 2:
            raise Refused(f"{len(frames)} frame(s), where a signed message has a signature "
                          "and a payload")
        payload = list(frames[1:])
        self._verify(bytes(frame_bytes(frames[0])), payload)
        return payload

    # -- single-frame messages (auth + payload in one frame) ----------------------------

    def pack(self, payload: bytes) -> bytes:
        """One frame carrying ``payload`` signed (for sockets whose messages are one frame:
        a subscription, an abort request, a published sample)."""
        auth, _ = self.sign([payload])
        return auth + payload

    def unpack(self, frame: Any) -> bytes:
        """The payload of a frame made by ``pack``; raises :class:`Refused`."""
        data = bytes(frame_bytes(frame))
        payload = data[AUTH_BYTES:]
        self._verify(data[:AUTH_BYTES], [payload])
        return payload

    def refused(self, reason: Refused | str, where: str) -> None:
        """Count a dropped message; the first on this link is logged at WARNING."""
        self.dropped += 1
        level = logging.WARNING if self.dropped == 1 else logging.DEBUG
        log.log(level, "fsdp_nb: dropped a message on the %s channel (%s): %s; it was not "
                "read. Further drops on this channel are logged at DEBUG.", self.purpose, where, reason)

    def _verify(self, auth: bytes, payload: Sequence[Any]) -> None:
        if len(auth) != AUTH_BYTES:
            raise Refused("no valid header and signature (unsigned or cut short)")
        header, mac = auth[:HEADER_BYTES], auth[HEADER_BYTES:]
        if not hmac.compare_digest(mac, _mac(self._recv_key, header, frame_digests(payload))):
            raise Refused("bad signature (not signed with this session's key for this channel)")
        sender, counter = _HEADER.unpack(header)
        last = self._last.get(sender, 0)
        if counter > last:
            self._last[sender] = counter
        elif counter <= last - self.window or counter in self._late.get(sender, ()):
            raise Refused(f"replayed (counter {counter} already seen from that sender)")
        if self.window:
            floor = self._last[sender] - self.window
            self._late[sender] = {c for c in self._late.get(sender, ()) if c > floor} | {counter}


def _derive(key: bytes, purpose: str, nonce: bytes, side: str) -> bytes:
    label = b"fsdp_nb/1\x00" + purpose.encode() + b"\x00" + side.encode() + b"\x00" + nonce
    return hmac.new(key, label, hashlib.sha256).digest()


def _mac(key: bytes, header: bytes, digests: Sequence[bytes]) -> bytes:
    """HMAC-SHA256 over the header and the frames' digests (fixed sizes: unambiguous);
    OpenSSL's one-shot HMAC (a few microseconds: this is on every call's path)."""
    return hmac.digest(key, header + b"".join(digests), "sha256")


def cluster_key(client: Any) -> bytes:
    """The key of ``client``'s cluster (the notebook's side of ``engine_key``); ``ValueError`` for a cluster with none, whose
    messages are unsigned: anyone who reaches it runs code as the user, and fsdp_nb's
    own channels would have nothing to sign with."""
    key = bytes(client.session.key or b"")
    if not key:
        raise ValueError(
            "this ipyparallel cluster has no key, so its messages are not signed and anyone "
            "who can reach it can run code as you; fsdp_nb refuses it. Start the cluster with "
            "a key (ipyparallel's default: do not set Session.key to empty)."
        )
    return key


class ListenerState(Part):
    """A signed listener's endpoint, nonce and link (``start_listener`` keeps them here):
    each listener's kind of registry part subclasses it. The listener serves for the
    engine's life, so closing leaves it as it is."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}


def start_listener(state: dict[str, Any], addr: str, purpose: str, sock_type: str, max_bytes: int,
                   handle: Any, name: str, window: int = 0) -> tuple[str, bytes]:
    """The server side of a signed channel, started once per engine: a zmq socket of
    ``sock_type`` (``"ROUTER"``, ``"PULL"``) bound on ``addr`` (a free port), taking frames
    of at most ``max_bytes`` (zmq drops larger senders), a fresh nonce and this engine's
    ``Link`` for ``purpose``. A daemon thread named ``name`` calls ``handle(sock, link,
    endpoint, frames)`` for each message, one at a time, for as long as the engine lives;
    it ends, closing the socket, when the engine's zmq context is terminated.

    ``window``: the link's (``Link``). ``state`` (the listener's ``ListenerState.state``) keeps ``endpoint``, ``nonce`` and ``link``; a
    second call finds them there and starts nothing. Returns the endpoint and nonce: what
    the notebook needs for its side of the link.
    """
    if "endpoint" in state:
        return state["endpoint"], state["nonce"]
    import zmq

    nonce = new_nonce()
    link = Link(engine_key(), purpose, nonce, "server", window)
    sock: zmq.SyncSocket = zmq.Context.instance().socket(getattr(zmq, sock_type))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    port = sock.bind_to_random_port(f"tcp://{addr}")
    endpoint = f"tcp://{addr}:{port}"

    def serve() -> None:
        try:
            while True:
                handle(sock, link, endpoint, sock.recv_multipart(copy=False))
        except zmq.ContextTerminated:
            log.debug("%s: the engine is exiting", name)
        finally:
            sock.close(linger=0)

    threading.Thread(target=serve, name=name, daemon=True).start()
    state.update(endpoint=endpoint, nonce=nonce, link=link)
    return endpoint, nonce
