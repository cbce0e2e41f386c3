"""A call's answers: one per rank, whichever way each travelled, and what they say.

A call sent through ipyparallel comes back as :class:`RankResult` (one rank's part of
an ``AsyncResult``); one sent over the call channel as its ``CallResult``. Both are
:class:`RankReply`: the gather loop, the failure policy and the progress bars read
either the same way.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import ipyparallel as ipp

from ..errors import RankFailure

__all__ = ["Pending", "RankReply", "RankResult", "completed", "failure", "per_rank", "strip_ansi"]

log = logging.getLogger("fsdp_nb")


class RankReply(Protocol):
    """What the notebook reads of one rank's answer, as of an ``AsyncResult``."""

    def ready(self) -> bool:
        """Whether the rank finished the call."""

    def successful(self) -> bool:
        """Whether it returned (RuntimeError before it finished)."""

    def get(self, timeout: float | None = None) -> Any:
        """Its value; raises what it raised, TimeoutError if not ready in ``timeout``."""

    def wait_for_output(self, timeout: float = -1) -> bool:
        """Wait until its value and all its output are in; False on timeout."""

    @property
    def metadata(self) -> dict[str, Any]:
        """Its metadata: ``stdout`` / ``stderr`` so far, ``completed``, ``data``."""

    @property
    def data(self) -> dict[str, Any] | None:
        """What the rank published so far while it runs (a progress count), if anything."""


@dataclass
class Pending:
    """Work submitted to some ranks: one result per rank, read as an ``AsyncResult``."""

    what: str
    """What was asked ("execute", "run(train)"), for messages."""
    results: dict[int, RankReply]
    """rank -> its result: its part of the ipyparallel call, or its direct call's."""
    started: float = field(default_factory=time.monotonic)
    on_poll: Callable[[], None] | None = None
    """Called after each wait while ranks still run (a progress bar's update)."""
    interrupted: bool = False
    """Ctrl-C came while the call was being sent: ``gather`` raises it at its first check."""
    echoed: tuple[int, ...] | None = None
    """Ranks whose output is streamed to the notebook (None: every rank)."""
    merged: bool = True
    """Lines the ranks print alike are shown once, naming the ranks (False: each rank's own)."""
    cell: bool = False
    """The ranks run it as a cell (``execute``, or ``sess.run`` over the direct channel): their
    step owners mark its start and end (``engine.step``)."""
    waiter: Callable[[list[Any], float], Any] = field(kw_only=True)
    """Waits up to some seconds for some of ``results``: ``client.wait``, or the direct
    call channel's."""

    def wait_for(self, ranks: Sequence[int], timeout: float) -> None:
        """Wait up to ``timeout`` seconds for these ranks' results."""
        self.waiter([self.results[r] for r in ranks], timeout)


class RankResult:
    """One rank's part of an ipyparallel ``AsyncResult``, read as an ``AsyncResult``
    (``ready``, ``successful``, ``get``, ``wait_for_output``, ``metadata``, ``data``).

    Straight from the message's future: ``AsyncResult.split()`` builds a whole
    ``AsyncResult`` per engine (events, combined futures, callbacks), about 0.1 ms
    each on every call's path.
    """

    __slots__ = ("ar", "future")

    def __init__(self, ar: ipp.AsyncResult, index: int):
        self.ar = ar
        """The call's ``AsyncResult``, kept: its callbacks tidy the client's caches."""
        self.future = ar._children[index]
        """This rank's message future; its ``output`` future ends with the rank's output."""

    def ready(self) -> bool:
        return self.future.done()

    def successful(self) -> bool:
        """Whether the rank's call returned (ipyparallel keeps an error as the result)."""
        if not self.future.done():
            raise RuntimeError("Cannot check successful() if not done.")
        return not isinstance(self.future.result(0), Exception)

    def get(self, timeout: float | None = None) -> Any:
        try:
            value = self.future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError("Result not ready.") from None
        if isinstance(value, Exception):
            raise value
        return value

    def wait_for_output(self, timeout: float = -1) -> bool:
        """Wait until the result and all the rank's output are in."""
        wait = None if timeout is None or timeout < 0 else timeout
        _, left = concurrent.futures.wait([self.future, self.future.output], wait)
        return not left

    @property
    def metadata(self) -> dict[str, Any]:
        """The rank's metadata as received (dates as the ISO strings they came as)."""
        return self.future.output.metadata

    @property
    def data(self) -> Any:
        """What the rank published with ipyparallel's ``publish_data`` so far."""
        return self.metadata.get("data")


def per_rank(ranks: Sequence[int], ar: ipp.AsyncResult) -> dict[int, RankResult]:
    """rank -> its own part of a multi-engine ``AsyncResult`` (sent in rank order), so
    each rank's failure, death or hang is still seen on its own."""
    return {r: RankResult(ar, i) for i, r in enumerate(ranks)}


def completed(ar: RankReply) -> float:
    """When the engine finished the task (Unix time); inf when it does not say.

    ipyparallel gives ``completed`` as a datetime for results and as an ISO string
    for errors; both count, or the first failure could not be told from its echoes.
    """
    md = ar.metadata
    done = md.get("completed") or md.get("received")
    if isinstance(done, str):
        try:
            done = datetime.fromisoformat(done.replace("Z", "+00:00"))
        except ValueError:
            log.debug("unreadable completion time %r", done)
            return float("inf")
    return done.timestamp() if isinstance(done, datetime) else float("inf")


def failure(rank: int, ar: RankReply) -> RankFailure:
    """What a failed rank's result raises, as a ``RankFailure``."""
    exc: BaseException | None = None
    try:
        ar.get(0)
    except Exception as e:  # noqa: BLE001 - we only read it
        exc = e
    if isinstance(exc, ipp.error.RemoteError):
        return RankFailure(rank, exc.ename, exc.evalue, strip_ansi(exc.traceback or ""))
    return RankFailure(rank, type(exc).__name__, str(exc), "")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes."""
    return _ANSI.sub("", text or "")
