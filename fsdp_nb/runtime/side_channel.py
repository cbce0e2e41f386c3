"""The side channel, notebook side: one SUB socket per rank and a thread per feed.

A feature's feed (``fsdp_nb.memory.memory_feed.MemoryFeed``, each rank's memory;
``fsdp_nb.steps.steps_feed.StepsFeed``, its recent steps) names what the ranks read
(``reading``, a class of the feature's rank half) and the sample's wire type. ``start`` asks every rank (once, through the task queue) to start a sampler
thread publishing over its own XPUB socket (``fsdp_nb.engine.side_channel``), then
subscribes to each with the feed's token signed with the cluster's key (the only
subscription a sampler applies) and drops any sample not signed by that sampler. A
receiver thread collects samples as they come (also while a ``%%px`` cell keeps the
engines' task queues busy) and, once per interval, hands a snapshot to its listeners.
``close`` drops the subscriptions: each engine's sampler sees the unsubscribe and ends;
a closed session ends the receiver too.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..engine import side_channel as _ms
from ..engine.signing import Link, Refused
from ..errors import WireError
from ..wire.decode import loads

if TYPE_CHECKING:
    from ..context import SessionContext

log = logging.getLogger("fsdp_nb")

__all__ = ["SampleFeed"]


Listener = Callable[[Any], None]
"""Called with the feed (a ``SampleFeed`` subclass) once per interval with news."""


class SampleFeed:
    """Samples from every rank of a session, kept as latest + short history.

    Args:
        ctx: the session context whose ranks publish.
        interval: seconds between two samples of a rank.
        history: samples kept per rank.
    """

    reading: type[_ms.Reading]
    """What the ranks' samplers read and publish: a class of the feature's rank half, made
    once per sampler on each rank (``engine.side_channel.Reading``)."""
    sample: type
    """The wire type of one sample."""

    def __init__(self, ctx: SessionContext, *, interval: float = 1.0, history: int = 120):
        if not (isinstance(interval, (int, float)) and not isinstance(interval, bool)
                and interval > 0):
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        if not isinstance(history, int) or history < 2:
            raise ValueError(f"history must be an int >= 2 (samples kept per rank), got {history!r}")
        self.ctx = ctx
        self.interval = float(interval)
        self.world_size = ctx.world_size
        self.history: list[deque[Any]] = [deque(maxlen=history)
                                                   for _ in range(self.world_size)]
        self.token = uuid.uuid4().hex
        self.endpoints: list[str] = []
        self.updates = 0
        self.malformed = 0
        """Signed samples that did not decode as ``sample`` (a version skew: logged once)."""
        self._closing = False
        """Whether the session closes it when it closes (registered once)."""
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- data -------------------------------------------------------------------

    def latest(self) -> list[Any]:
        """The newest sample of each rank (None before its first one)."""
        with self._lock:
            return [h[-1] if h else None for h in self.history]

    def samples(self, rank: int) -> list[Any]:
        """Rank ``rank``'s kept history, oldest first."""
        with self._lock:
            return list(self.history[rank])

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(feed)`` (from the receiver thread) once per interval with news."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Listener) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> SampleFeed:
        """Start one sampler per rank (through the task queue, once) and subscribe."""
        import zmq

        if self.running:
            return self
        d = self.ctx.dispatcher
        cluster = self.ctx.cluster
        ranks = self.ctx.ranks
        args = [(self.token, r.rank, cluster.listen_address(r.rank), self.interval) for r in ranks]
        started = d.gather(d.apply(f"start {self.reading.name} sampler",
                                     functools.partial(_ms.start, reading=self.reading), args))
        self.endpoints = [ep for ep, _ in started]
        key = cluster.key
        zctx = zmq.Context()  # the receiver thread's own: it alone terminates it, once its sockets are closed
        subs = []
        for rank, (ep, nonce) in enumerate(started):
            link = Link(key, "memory", nonce, "client")
            sub = zctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, link.pack(self.token.encode()))
            sub.connect(ep)
            subs.append((sub, link, rank))
        self._stop = stop = threading.Event()  # each receiver its own: a new start never revives an old one
        self._thread = threading.Thread(target=self._run, args=(subs, zctx, stop), daemon=True,
                                        name=f"fsdp_nb-{self.reading.name}-feed-{self.token[:8]}")
        self._thread.start()
        if not self._closing:  # once: a feed that follows a restart starts again
            self._closing = True
            self.ctx.lifecycle.on_close(self.close)
        if self._follow not in self.ctx.recovering.observers:
            self.ctx.recovering.observers.append(self._follow)
        return self

    follows: tuple[str, ...] = ("resize", "restart")
    """The recoveries after which the feed subscribes again to the (new) ranks: those that
    replace engines (a replaced rank's sampler died with it)."""

    def _follow(self, event: Any) -> None:
        """After a recovery in ``follows``, sample the new world's ranks (new samplers, a new
        topic: the old ones end as they see their subscriber go; what replaced ranks sent
        is forgotten)."""
        if event.what not in self.follows or event.phase != "recovered" or not self.running:
            return
        self._rejoined()
        self.close()
        with self._lock:
            self.world_size = self.ctx.world_size
            keep = self.history[0].maxlen
            self.history = [deque(maxlen=keep) for _ in range(self.world_size)]
            self.token = uuid.uuid4().hex
        self.start()

    def _rejoined(self) -> None:
        """What the ranks need before the feed subscribes again after a recovery (nothing here)."""

    def close(self) -> None:
        """Stop receiving; the engines' samplers end when they see the unsubscribe. A
        receiver still busy after 5 s (a listener that is slow to draw) ends on its own,
        closing its sockets and its zmq context."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._thread = None

    def _run(self, subs: list[tuple[Any, Link, int]], zctx: Any, stop: threading.Event) -> None:
        """The receiver thread: ``subs`` on ``zctx``, its own, until ``stop`` is set."""
        import zmq

        poller = zmq.Poller()
        links = {}
        for sub, link, rank in subs:
            poller.register(sub, zmq.POLLIN)
            links[sub] = (link, rank)
        next_tick = time.monotonic() + self.interval
        fresh = False
        try:
            while not stop.is_set() and getattr(self.ctx, "state", "ready") != "closed":
                wait = max(0.0, min(next_tick - time.monotonic(), 0.25))
                for sub, _ in poller.poll(int(wait * 1000)):
                    while not stop.is_set():  # once stopped, what came is no longer this feed's
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        fresh = self._store(frames, *links[sub]) or fresh
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self.interval
                    if fresh:
                        fresh = False
                        self.updates += 1
                        for fn in list(self._listeners):
                            try:
                                fn(self)
                            except Exception as exc:  # noqa: BLE001 - a broken view must not kill the feed
                                log.warning("a %s view failed to render a sample: %s", self.reading.name, exc)
        finally:
            for sub, _, _ in subs:
                sub.close(0)
            zctx.term()

    def _store(self, frames: list[bytes], link: Link, rank: int) -> bool:
        """Keep the sample in ``frames`` (``[topic, signed sample]`` from ``rank``'s
        sampler); True if it was one. Anything not signed by that sampler is dropped."""
        try:
            if len(frames) != 2:
                raise Refused(f"{len(frames)} frames where a sample has 2")
            raw = link.unpack(frames[1])
        except Refused as why:
            link.refused(why, f"a {self.reading.name} sample from rank {rank}")
            return False
        try:
            s: Any = loads(self.sample, raw)
        except WireError as why:  # signed by the sampler, so not an outsider: another version of fsdp_nb
            if not self.malformed:
                log.warning("fsdp_nb: rank %d sends %s samples this notebook cannot read: %s", rank, self.reading.name, why)
            self.malformed += 1
            return False
        if s.rank != rank:
            return False
        s = self._kept(s)
        with self._lock:
            self.history[s.rank].append(s)
        return True

    def _kept(self, s: Any) -> Any:
        """A sample just received, as the feed keeps it."""
        return s

    def __del__(self) -> None:
        try:
            self._stop.set()
        except Exception as exc:  # noqa: BLE001 - interpreter teardown: nothing left to tell
            log.debug("closing a side-channel feed: %s", exc)
