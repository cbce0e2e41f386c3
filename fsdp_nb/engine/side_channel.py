"""The side channel, engine side: a sampler thread publishing a rank's readings (its
memory, or its recent steps for ``sess.steps()``) over its own socket.

A request sent through the engines' task queue waits behind the cell that is running
(2.6 s measured), so live memory cannot be polled that way while ``%%px`` trains.
Instead ``start`` (called once through the task queue) binds a zmq XPUB socket on the
address the notebook gives (loopback when the notebook is on this host) and starts a
daemon thread that publishes one JSON sample per interval, as the feature's reading makes
it (``fsdp_nb.memory.rank_memory_kinds.MemoryReading``: a ``MemorySample``;
``fsdp_nb.steps.rank_step_timing.StepsReading``: a ``RankSteps``, sent only when a step
ended or a scalar was logged since the last one). The thread stops when its
last subscriber goes away (XPUB sees the unsubscribe when the notebook closes its SUB
socket or dies), or when nobody subscribed within ``wait_subscriber`` seconds: it
never outlives its widget.

Only the notebook gets samples. The socket takes subscriptions by hand
(``XPUB_MANUAL``): a subscription's topic must be the sampler's token signed with the
cluster's key (``signing.Link``, the sampler's nonce in its key), and only then is it
applied; any other subscriber is sent nothing. Each sample goes out under its
subscriber's topic, signed, so the notebook drops anything else that reaches it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ..wire.decode import encode
from .registry import Part, part
from .signing import Link, Refused, engine_key, new_nonce

__all__ = ["MAX_SUBSCRIPTION_BYTES", "Reading", "dropped", "running", "start"]

MAX_SUBSCRIPTION_BYTES = 1024
"""The largest subscription message the sampler takes (a signed one is under 200 bytes)."""



class Reading:
    """What a sampler publishes: a feature's rank half subclasses it (one made per sampler).

    Call order: ``prepare()`` once, on the main thread, when the sampler starts; then
    ``read(rank, seq, process)`` on the sampler's thread each interval.
    """

    name: str = "reading"
    """What it reads, in words (thread names, log lines)."""

    @classmethod
    def prepare(cls) -> None:
        """Main-thread work the readings need before the first one (nothing here)."""

    def read(self, rank: int, seq: int, process: Any) -> Any:
        """This interval's sample for ``rank`` (``seq``: its number), or None when there is
        no news to send. ``process``: this engine's ``psutil.Process``. It must touch no
        tensor the training thread may change."""
        raise NotImplementedError

class Samplers(Part):
    """This engine's sampler threads, by token (the registry's part for the side channel).

    A re-formed group keeps them: each publishes what its reading reads, and a reading
    says itself what the new group changed (the step view's epoch). A rank that leaves
    stops them.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, _Sampler] = {}
        """Token -> its thread, while it runs (a thread ends when its subscriber goes)."""

    def closed(self) -> None:
        """Stop every sampler (each closes its socket within an interval)."""
        with self.lock:
            for s in self.running.values():
                s.stopping.set()


class _Sampler(threading.Thread):
    """One publishing thread (daemon): owns its zmq context and XPUB socket."""

    def __init__(self, token: str, rank: int, addr: str, interval: float, wait_subscriber: float, key: bytes,
                 reading: type[Reading]):
        super().__init__(name=f"fsdp_nb-{reading.name}-sampler-{token[:8]}", daemon=True)
        self.token, self.rank, self.addr, self.reading = token, rank, addr, reading()
        self.interval, self.wait_subscriber = interval, wait_subscriber
        self.nonce = new_nonce()
        self.link = Link(key, "memory", self.nonce, "server")
        self.endpoint: str | None = None
        self.error: BaseException | None = None
        self.samples_sent = 0
        self._bound = threading.Event()
        self.stopping = threading.Event()
        """Set when the rank leaves: the thread ends at its next look."""

    def run(self) -> None:
        import psutil
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100)
            sock.setsockopt(zmq.XPUB_MANUAL, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
            port = sock.bind_to_random_port(f"tcp://{self.addr}")
            self.endpoint = f"tcp://{self.addr}:{port}"
        except BaseException as exc:  # noqa: BLE001 - kept and re-raised by start() on the caller's thread
            self.error = exc
            self._bound.set()
            sock.close(0)
            ctx.term()
            return
        self._bound.set()
        proc = psutil.Process(os.getpid())
        topics: set[bytes] = set()
        """Subscriptions applied: each a signed token, the topic its samples go out under."""
        ever = False
        started = time.monotonic()
        next_tick = time.monotonic()
        try:
            while not self.stopping.is_set():
                wait_ms = max(0, int((next_tick - time.monotonic()) * 1000))
                if sock.poll(wait_ms, zmq.POLLIN):
                    msg = sock.recv()
                    if msg[:1] == b"\x01" and self._subscribe(sock, msg[1:]):
                        if not ever:
                            next_tick = time.monotonic()  # first sample right away
                        topics.add(msg[1:])
                        ever = True
                    elif msg[:1] == b"\x00":
                        # an unsubscribe names its topic, not its pipe: one for a topic never
                        # applied changes nothing; samples stop once every applied one is gone
                        topics.discard(msg[1:])
                    if ever and not topics:
                        return  # the widget went away
                    continue
                if not ever and time.monotonic() - started > self.wait_subscriber:
                    return  # nobody came
                if ever and (s := self.reading.read(self.rank, self.samples_sent, proc)) is not None:
                    signed = self.link.pack(encode(s))
                    for topic in topics:
                        sock.send_multipart([topic, signed])
                    self.samples_sent += 1
                next_tick += self.interval
                if next_tick < time.monotonic():  # fell behind (suspended): do not burst
                    next_tick = time.monotonic() + self.interval
        finally:
            sock.close(0)
            ctx.term()
            samplers = part(Samplers)
            with samplers.lock:
                if samplers.running.get(self.token) is self:
                    del samplers.running[self.token]

    def _subscribe(self, sock: Any, topic: bytes) -> bool:
        """Apply the subscription just received if its topic is this sampler's token,
        signed; True if it was applied. Anything else is dropped (and logged once)."""
        import zmq

        try:
            if self.link.unpack(topic) != self.token.encode():
                raise Refused("a signed subscription for another sampler")
        except Refused as why:
            self.link.refused(why, self.endpoint or self.addr)
            return False
        sock.setsockopt(zmq.SUBSCRIBE, topic)  # XPUB_MANUAL: for the pipe it came from
        return True


def start(token: str, rank: int, addr: str, interval: float = 1.0, wait_subscriber: float = 60.0,
          key: bytes | None = None, reading: type[Reading] | None = None) -> tuple[str, bytes]:
    """Start (or find) the sampler ``token`` on this engine.

    Args:
        token: names the sampler (one per feed); its subscriber signs it as its topic.
        rank: the rank, written in each sample.
        addr: the address to bind: loopback when the notebook runs on this host, else
            the engine's address on the interface that routes to the controller.
        interval: seconds between samples.
        wait_subscriber: seconds to wait for the first subscriber before giving up.
        key: the cluster's key; default this engine's (``signing.engine_key``).
        reading: what it publishes: a :class:`Reading` subclass of a feature's rank half.

    Returns its zmq endpoint and nonce (for the notebook's ``signing.Link``).
    Idempotent per token.
    """
    if not (isinstance(interval, (int, float)) and interval > 0):
        raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
    if not (isinstance(reading, type) and issubclass(reading, Reading)):
        raise TypeError(f"reading must be a side_channel.Reading subclass (what the sampler publishes), got {reading!r}")
    key = engine_key() if key is None else key
    reading.prepare()  # on the main thread (a task): what the readings need first
    samplers = part(Samplers)
    with samplers.lock:
        s = samplers.running.get(token)
        if s is not None and s.is_alive() and s.endpoint:
            return s.endpoint, s.nonce
        s = _Sampler(token, rank, addr, float(interval), float(wait_subscriber), key, reading)
        samplers.running[token] = s
    s.start()
    s._bound.wait(10)
    if s.error is not None or not s.endpoint:
        with samplers.lock:
            samplers.running.pop(token, None)
        raise RuntimeError(f"memory sampler could not bind on {addr}: {s.error!r}")
    return s.endpoint, s.nonce


def dropped() -> int:
    """Subscriptions refused by this engine's samplers that are still running."""
    samplers = part(Samplers)
    with samplers.lock:
        return sum(s.link.dropped for s in samplers.running.values())


def running() -> list[str]:
    """Tokens of the samplers alive on this engine."""
    samplers = part(Samplers)
    with samplers.lock:
        return [t for t, s in samplers.running.items() if s.is_alive()]
