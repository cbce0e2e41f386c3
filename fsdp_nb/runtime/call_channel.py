"""The fast path for session calls: one direct socket per engine.

An ipyparallel call goes notebook -> controller -> engine and back (about 10 ms on
two busy cores). Session calls (``sess.run``, ``push``, ``pull``, async saves) can
instead go straight to each engine's call server (``fsdp_nb.engine.call_channel``),
which runs them on the engine's main thread between cells: a round trip of a few
hundred microseconds. The dispatcher keeps its failure handling: each rank's
:class:`CallResult` answers as an ipyparallel ``AsyncResult`` does (``ready``,
``successful``, ``get``, ``metadata`` with the output so far), and
:meth:`CallChannel.wait` stands in for ``client.wait`` in the gather loop, so pid
liveness, Ctrl-C, timeouts and partial failures are handled as for any call.

The servers start on first use, through ipyparallel; an engine that cannot start
one (or a replaced engine, until it has one) keeps the ipyparallel path, and so does
a call whose pickled request is over the server's ``MAX_REQUEST_BYTES``. Every message
both ways is signed with the cluster's key (``engine.signing``): a reply that is not
the engine's is dropped before it is unpickled.

Each request says, inside its signed payload, whether it is the user's own call
(``sess.run``: ``send(..., cell=True)``), which the engine then treats as a cell (its
step owner hears the call start and end), or one of the session's own (``push``,
``pull``, an async save and its polls), which is no cell.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import cloudpickle
import ipyparallel as ipp
import zmq

from ..engine import call_channel as engine_side
from ..engine.signing import HEADER_BYTES, Link, Refused, frame_digests

if TYPE_CHECKING:
    from .cluster import EngineCluster

__all__ = ["CallChannel", "CallResult"]

log = logging.getLogger("fsdp_nb")

_STREAMS = {engine_side.STDOUT: "stdout", engine_side.STDERR: "stderr"}


class CallResult:
    """One rank's answer to a direct call, read like an ipyparallel ``AsyncResult``."""

    def __init__(self, rank: int):
        self.rank = rank
        self.metadata: dict[str, Any] = {"stdout": "", "stderr": "", "completed": None}
        """Output so far (``stdout``, ``stderr``) and, once done, ``completed`` (UTC)."""
        self._done = False
        self._value: Any = None
        self._error: tuple[str, str, str] | None = None

    def ready(self) -> bool:
        return self._done

    def successful(self) -> bool:
        if not self._done:
            raise RuntimeError("Cannot check successful() if not done.")
        return self._error is None

    def wait_for_output(self, timeout: float = -1) -> bool:
        return True  # output comes before the reply on the same socket

    @property
    def data(self) -> dict[str, Any] | None:
        """None: a direct call publishes nothing (progress goes through ipyparallel)."""
        return None

    def get(self, timeout: float | None = None) -> Any:
        if not self._done:
            raise TimeoutError("Result not ready.")
        if self._error is not None:
            ename, evalue, tb = self._error
            raise ipp.error.RemoteError(ename, evalue, tb)
        return self._value

    def _resolve(self, status: bytes, body: bytes, finished: float) -> None:
        self.metadata["completed"] = datetime.fromtimestamp(finished, timezone.utc)
        if status == engine_side.OK:
            self._value = pickle.loads(body)
        else:
            self._error = pickle.loads(body)
        self._done = True


class CallChannel:
    """A DEALER socket per engine to its call server, used from one thread at a time."""

    def __init__(self, cluster: EngineCluster):
        self.cluster = cluster
        self.enabled = True
        """False: every call takes the ipyparallel path (benchmarks compare the two)."""
        self._ctx: zmq.SyncContext = zmq.Context.instance()
        self._socks: dict[int, zmq.Socket] = {}
        """engine id -> its socket (an engine replaced under a rank gets a new one)."""
        self._links: dict[zmq.Socket, Link] = {}
        """socket -> the signed link to its engine's server."""
        self.endpoints: dict[int, str] = {}
        """engine id -> where its call server listens."""
        self._pending: dict[bytes, CallResult] = {}
        self._failed: set[int] = set()
        """Engine ids whose server could not start: they keep the ipyparallel path."""
        self._lock = threading.RLock()

    # -- set-up ---------------------------------------------------------------------

    def ready_for(self, ranks: Sequence[int]) -> bool:
        """Start the servers these ranks' engines lack; True if every one has a socket."""
        if not self.enabled:
            return False
        eids = [self.cluster.engine_ids[r] for r in ranks]
        missing = [r for r, e in zip(ranks, eids) if e not in self._socks and e not in self._failed]
        if missing:
            self._start(missing)
        return all(e in self._socks for e in eids)

    def _start(self, ranks: list[int]) -> None:
        infos = self.cluster.ranks
        if len(infos) != self.cluster.world_size:
            return  # no group formed yet: nothing says where each engine listens
        key = self.cluster.key
        ars = {}
        for r in ranks:
            try:
                addr = self.cluster.listen_address(r)
                ars[r] = self.cluster.rank_view(r).apply_async(engine_side.serve, addr)
            except Exception as exc:  # noqa: BLE001 - e.g. the controller dropped a dead engine
                self._no_server(r, exc)
        for r, ar in ars.items():
            eid = self.cluster.engine_ids[r]
            try:
                url, nonce = self._served(r, ar)
            except Exception as exc:  # noqa: BLE001 - that engine keeps ipyparallel
                self._no_server(r, exc)
                continue
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(url)
            self._socks[eid] = sock
            self._links[sock] = Link(key, "call", nonce, "client")
            self.endpoints[eid] = url

    def _served(self, rank: int, ar: Any, timeout: float = 30.0) -> tuple[str, bytes]:
        """The endpoint and nonce ``ar`` (``engine_side.serve`` on ``rank``) answers. A rank that
        dies meanwhile fails at once: local engines run without ipyparallel's nanny, so
        the controller learns of a death only when its heartbeat gives up."""
        deadline = time.monotonic() + timeout
        while not ar.ready():
            if rank in self.cluster.dead_ranks():
                raise RuntimeError(f"rank {rank} died")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer from rank {rank} within {timeout:g} s")
            ar.wait(0.05)
        return ar.get()

    def _no_server(self, rank: int, exc: BaseException) -> None:
        """``rank``'s server did not start: a dead rank is left for the caller's liveness
        check to report (its replacement gets a server); a live one keeps ipyparallel."""
        if rank in self.cluster.dead_ranks():
            log.debug("rank %d died before its call server started: %s", rank, exc)
            return
        log.warning("rank %d: no direct call socket (%s); its calls go through ipyparallel", rank, exc)
        self._failed.add(self.cluster.engine_ids[rank])

    def drop(self, engine_ids: list[int]) -> None:
        """Close the sockets to engines that are no longer ranks (``sess.resize``)."""
        with self._lock:
            for eid in engine_ids:
                sock = self._socks.pop(eid, None)
                if sock is not None:
                    self._links.pop(sock, None)
                    sock.close(linger=0)

    def close(self) -> None:
        with self._lock:
            for sock in self._socks.values():
                sock.close(linger=0)
            self._socks.clear()
            self._links.clear()
            self._pending.clear()

    # -- calls ------------------------------------------------------------------------

    def send(self, fn: Any, args_by_rank: Sequence[tuple], ranks: Sequence[int],
             cell: bool = False) -> dict[int, CallResult] | None:
        """Send ``fn(*args_by_rank[i])`` to ``ranks[i]``; their results (not waited for).
        Ranks given the same args object share one pickled payload. None (nothing sent)
        when a pickled call is larger than the servers take: it goes through ipyparallel.
        ``cell``: the call is the user's own, which each rank runs as a cell."""
        payloads: dict[int, tuple[bytes, bytes]] = {}
        """id(args) -> its pickled call and that payload's digest (hashed once)."""
        for args in args_by_rank:
            if id(args) not in payloads:
                payload = cloudpickle.dumps((fn, tuple(args), cell))
                payloads[id(args)] = payload, frame_digests([payload])[0]
        if max(len(p) for p, _ in payloads.values()) > engine_side.MAX_REQUEST_BYTES:
            return None
        with self._lock:
            out: dict[int, CallResult] = {}
            for r, args in zip(ranks, args_by_rank):
                res = CallResult(r)
                sock = self._socks[self.cluster.engine_ids[r]]
                payload, digest = payloads[id(args)]
                signed = self._links[sock].sign([payload], [digest])
                self._pending[signed[0][:HEADER_BYTES]] = res  # the signed header: the call's id
                sock.send_multipart(signed, copy=False)
                out[r] = res
            return out

    def wait(self, results: Sequence[CallResult], timeout: float) -> bool:
        """Take what the engines sent until every one of ``results`` is done or
        ``timeout`` seconds pass; True when all are done."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._lock:
            poller = zmq.Poller()
            socks = {self._socks[self.cluster.engine_ids[r.rank]] for r in results
                     if self.cluster.engine_ids[r.rank] in self._socks}
            for s in socks:
                poller.register(s, zmq.POLLIN)
            while not all(r.ready() for r in results):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                for s, _ in poller.poll(int(left * 1000)):
                    self._drain(s)
            return True

    def _drain(self, sock: zmq.Socket) -> None:
        link = self._links[sock]
        while True:
            try:
                signed = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                frames = link.check(signed)
                if len(frames) != 2:
                    raise Refused(f"{len(frames)} payload frames where a reply has 2")
            except Refused as why:
                link.refused(why, "a reply from an engine")
                continue
            call_id, kind, finished = engine_side.read_head(frames[0])
            res = self._pending.get(call_id)
            if res is None:
                log.debug("a reply to a call no longer waited for was dropped")
                continue
            if kind in _STREAMS:
                res.metadata[_STREAMS[kind]] += frames[1].decode("utf-8", "replace")
            else:
                del self._pending[call_id]
                res._resolve(kind, frames[1], finished or time.time())
