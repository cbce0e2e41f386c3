"""Send work to every rank at once and gather it back in rank order.

One result per rank (a multi-engine ipyparallel call split into its ranks' parts, or
a direct call's ``CallResult``), so a failure, a death or a hang is seen per rank while
the others are still running. ``gather`` polls instead of blocking, which is what lets
the notebook stay responsive: it notices dead engines on this host by pid within
``liveness_every`` (others when the controller drops them), honours ``timeout``, and
hands Ctrl-C and ranks that failed while others wait in a collective to the session's
failure policy (``FailurePolicy``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import ipyparallel as ipp

from .call_channel import CallChannel, CallResult
from .cluster import EngineCluster
from .errors import DeadRankError, RankError, RankFailure, RankTimeoutError

__all__ = ["CallEvent", "Dispatcher", "FailurePolicy", "Pending"]

log = logging.getLogger("fsdp_nb")

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
OUTPUT_LIMIT = 64_000
"""At most this many characters of one rank's stdout or stderr are echoed per call."""


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text or "")


@dataclass
class Pending:
    """Work submitted to some ranks: one result per rank, read as an ``AsyncResult``."""

    what: str
    """What was asked ("execute", "run(train)"), for messages."""
    results: dict[int, RankResult | CallResult]
    """rank -> its result: its part of the ipyparallel call, or its direct call's."""
    started: float = field(default_factory=time.monotonic)
    on_poll: Callable[[], None] | None = None
    """Called after each wait while ranks still run (a progress bar's update)."""
    interrupted: bool = False
    """Ctrl-C came while the call was being sent: ``gather`` raises it at its first check."""
    echoed: tuple[int, ...] | None = None
    """Ranks whose output is streamed to the notebook (None: every rank)."""
    waiter: Callable[[list[Any], float], Any] = field(kw_only=True)
    """Waits up to some seconds for some of ``results``: ``client.wait``, or the direct
    call channel's."""

    def wait_for(self, ranks: Sequence[int], timeout: float) -> None:
        """Wait up to ``timeout`` seconds for these ranks' results."""
        self.waiter([self.results[r] for r in ranks], timeout)


@dataclass(frozen=True)
class CallEvent:
    """What a dispatcher tells its observers (a live status view) about its calls."""

    what: str
    """The call ("execute", "run(train)"), or "session" / "restart" for a recovery."""
    phase: str
    """``running``, ``done``, ``failed``, ``interrupted``, ``dead``, ``recovering``,
    ``recovered`` or ``degraded``."""
    ranks: tuple[int, ...] = ()
    """The ranks concerned: those still running, those that died, those being recovered."""
    failures: tuple[RankFailure, ...] = ()
    """For ``failed``: each failing rank's error, first failure first."""
    note: str = ""
    """For recovery phases: what was done."""


class FailurePolicy:
    """What ``gather`` does when ranks fail while others still run, or on Ctrl-C.

    The base policy only reports; the session installs one that also recovers
    (``fsdp_nb.recovery``).
    """

    grace: float = 5.0
    """Seconds ranks may keep running after another rank failed before we intervene."""

    def on_partial_failure(
        self, pending: Pending, failures: list[RankFailure], running: list[int]
    ) -> None:
        """Some ranks failed, ``running`` have not returned after ``grace``: raise."""
        raise RankError(pending.what, failures, len(pending.results))

    def on_interrupt(self, pending: Pending, running: list[int]) -> None:
        """Ctrl-C in the notebook while ``running`` ranks work."""

    def on_dead(self, pending: Pending, dead: list[int]) -> None:
        """Engines died; the default raises DeadRankError."""
        raise DeadRankError(dead, f"while running {pending.what}")

    def on_timeout(self, pending: Pending, running: list[int], timeout: float) -> None:
        raise RankTimeoutError(pending.what, timeout, running)


class Dispatcher:
    """Submit per-rank calls and gather them in rank order."""

    poll: float = 0.02
    """Seconds between checks of the pending results during a call's first second."""
    slow_poll: float = 0.25
    """Seconds between checks after that. Completion wakes the wait at once either
    way; this only paces failure, Ctrl-C and output checks, so a long training cell
    does not lose CPU to the notebook (measured: 2.7% of a core at 50 Hz)."""
    liveness_every: float = 0.5
    """Seconds between pid checks of the engines while waiting."""

    def __init__(
        self, cluster: EngineCluster, policy: FailurePolicy | None = None,
        channel: CallChannel | None = None,
    ):
        self.cluster = cluster
        self.policy = policy or FailurePolicy()
        self.channel = channel
        """Direct sockets to the engines, for calls sent with ``fast=True``."""
        self.echo = True
        self.observers: list[Callable[[CallEvent], None]] = []
        """Called on the notebook's thread as calls start, change, end and recover."""
        self.last_error: RankError | None = None
        """The last ``RankError`` a call raised: which rank failed first (``sess.debug``)."""

    def notify(self, what: str, phase: str, ranks: Sequence[int] = (), *,
               failures: Sequence[RankFailure] = (), note: str = "") -> None:
        """Tell every observer a ``CallEvent`` (built only when someone listens: this is
        on every call's path); ``ranks`` defaults to the failing ones. An observer that
        fails is logged and kept out of the call's way."""
        if not self.observers:
            return
        event = CallEvent(what, phase, tuple(ranks or (f.rank for f in failures)), tuple(failures), note)
        for fn in list(self.observers):
            try:
                fn(event)
            except Exception as exc:
                log.warning("a status observer failed on %s/%s: %s", event.what, event.phase, exc)

    # -- submit -----------------------------------------------------------------

    def apply(
        self,
        what: str,
        fn: Callable[..., Any],
        args_by_rank: Sequence[tuple] | None = None,
        *,
        ranks: Sequence[int] | None = None,
        args: tuple = (),
        fast: bool = False,
    ) -> Pending:
        """Call ``fn(*args)`` on each rank (or ``fn(*args_by_rank[i])`` on ranks[i]).

        ``fast``: over the direct call channel when every rank has one (a call that
        publishes no progress data: that travels through ipyparallel only).
        """
        ranks = list(range(self.cluster.world_size)) if ranks is None else list(ranks)
        self._check_alive(what, ranks)
        per_rank = [args_by_rank[i] if args_by_rank is not None else args for i in range(len(ranks))]
        channel = self.channel
        if fast and channel is not None and channel.ready_for(ranks):
            with _CtrlC() as ctrl_c:
                direct = channel.send(fn, per_rank, ranks)
            if direct is not None:  # None: too large for the direct sockets
                return Pending(what, dict(direct), interrupted=ctrl_c.hit, waiter=channel.wait)
        results: dict[int, Any] = {}
        # every rank gets the call; a Ctrl-C meanwhile waits for gather
        with _CtrlC() as ctrl_c, self._sending(what, ranks):
            if args_by_rank is None:
                results = _per_rank(ranks, self.cluster.ranks_view(ranks).apply_async(fn, *args))
            else:
                for r, a in zip(ranks, per_rank):
                    results[r] = RankResult(self.cluster.rank_view(r).apply_async(fn, *a), 0)
        return Pending(what, results, interrupted=ctrl_c.hit, waiter=self._client_wait)

    def _client_wait(self, results: list[RankResult], timeout: float) -> None:
        self.cluster.client.wait([r.future for r in results], timeout=timeout)

    def execute(
        self, code: str, *, ranks: Sequence[int] | None = None, echoed: Sequence[int] | None = None,
        silent: bool = False,
    ) -> Pending:
        """Run ``code`` in every rank's namespace (or ``ranks``'), as ``%%px`` does;
        ``echoed``: the ranks whose output is streamed (None: all). ``silent``: no
        ``Out`` value, history or execution count (as ipyparallel's ``view.execute``
        sends it: fewer messages); printed output and errors come back either way."""
        ranks = list(range(self.cluster.world_size)) if ranks is None else list(ranks)
        self._check_alive("execute", ranks)
        with _CtrlC() as ctrl_c, self._sending("execute", ranks):  # as in apply
            ar = self.cluster.ranks_view(ranks).execute(code, block=False, silent=silent)
            results = _per_rank(ranks, ar)
        shown = None if echoed is None else tuple(echoed)
        return Pending("execute", results, interrupted=ctrl_c.hit, echoed=shown, waiter=self._client_wait)

    @contextmanager
    def _sending(self, what: str, ranks: Sequence[int]) -> Iterator[None]:
        """A send that fails because a rank died since the last check (ipyparallel has
        dropped its engine: a ``KeyError`` for its id) raises that rank's death."""
        try:
            yield
        except Exception:
            self._check_alive(what, ranks)
            raise

    def _check_alive(self, what: str, ranks: Sequence[int]) -> None:
        dead = [r for r in self.cluster.dead_ranks() if r in ranks]
        if dead:
            self.cluster.start_replacements(dead)
            raise DeadRankError(dead, f"{what} was not sent.")

    # -- gather -----------------------------------------------------------------

    def gather(self, pending: Pending, timeout: float | None = None) -> list[Any]:
        """Wait for every rank; return results in rank order or raise the failures."""
        with _CtrlC() as ctrl_c:
            ctrl_c.hit = pending.interrupted
            try:
                return self._gather(pending, timeout, ctrl_c)
            except RankError as exc:
                self.last_error = exc
                raise
            except KeyboardInterrupt:
                running = [r for r, ar in pending.results.items() if not ar.ready()]
                self.notify(pending.what, "interrupted", running)
                self.policy.on_interrupt(pending, running)
                raise

    def _gather(self, pending: Pending, timeout: float | None, ctrl_c: _CtrlC) -> list[Any]:
        echo = _Echo(pending) if self.echo else None
        first_failure_at: float | None = None
        next_liveness = time.monotonic() + self.liveness_every
        shown: list[int] | None = None
        while True:
            ctrl_c.check()
            running = [r for r, ar in pending.results.items() if not ar.ready()]
            if self.observers and running != shown:
                shown = running
                self.notify(pending.what, "running", running)
            if not running:
                break
            now = time.monotonic()
            if first_failure_at is None and _any_failed(pending):
                first_failure_at = now
            if first_failure_at is not None and now - first_failure_at >= self.policy.grace:
                failed = self.failures(pending)
                self.notify(pending.what, "failed", failures=failed)
                self.policy.on_partial_failure(pending, failed, running)
                first_failure_at = None  # policy chose to keep waiting
            if now >= next_liveness:
                next_liveness = now + self.liveness_every
                dead = [r for r in self.cluster.dead_ranks() if r in running]
                if dead:
                    self.notify(pending.what, "dead", dead)
                    self.policy.on_dead(pending, dead)
            if timeout is not None and now - pending.started > timeout:
                self.policy.on_timeout(pending, running, timeout)
            poll = self.poll if now - pending.started < 1.0 else self.slow_poll
            pending.wait_for(running, poll)
            if pending.on_poll is not None:
                pending.on_poll()
            if echo:
                echo.flush()
        if echo:
            deadline = time.monotonic() + 5.0  # results may come before the last output
            for ar in pending.results.values():
                ar.wait_for_output(max(0.01, deadline - time.monotonic()))
            echo.flush(final=True)
        ctrl_c.check()
        failures = self.failures(pending)
        if failures:
            dead = [r for r in self.cluster.dead_ranks() if r in pending.results]
            if dead:  # the controller reported the death before our pid check did
                self.notify(pending.what, "dead", dead)
                self.policy.on_dead(pending, dead)
            self.notify(pending.what, "failed", failures=failures)
            raise RankError(pending.what, failures, self.cluster.world_size)
        self.notify(pending.what, "done")
        return [pending.results[r].get() for r in sorted(pending.results)]

    def failures(self, pending: Pending) -> list[RankFailure]:
        """Failed ranks, the first to fail first (by completion time, then rank)."""
        out = []
        for r, ar in pending.results.items():
            if ar.ready() and not ar.successful():
                out.append((_completed(ar), r, _failure(r, ar)))
        out.sort(key=lambda t: (t[0], t[1]))
        return [f for _, _, f in out]


class _CtrlC:
    """While sending a call and gathering it, Ctrl-C sets a flag that the poll loop turns
    into KeyboardInterrupt.

    A KeyboardInterrupt raised at an arbitrary point can land inside a destructor
    (zmq frames) and be swallowed, leaving the notebook waiting, or stop a call sent to
    some ranks only; checking a flag at the top of each poll makes the interrupt
    reliable (one that came while sending is carried to the gather in
    ``Pending.interrupted``). A second Ctrl-C raises at once.
    Only active in the main thread and when SIGINT has Python's default handler.
    """

    def __init__(self) -> None:
        self.hit = False
        self._old: Any = None

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def check(self) -> None:
        if self.hit:
            self.hit = False
            raise KeyboardInterrupt

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


class _Echo:
    """Streams each rank's new stdout / stderr while a call runs, tagged by rank.

    Whole lines only (a partial line waits for its newline or the end), and at most
    ``OUTPUT_LIMIT`` characters per rank and stream, so a chatty rank cannot flood
    the notebook.
    """

    def __init__(self, pending: Pending):
        self.pending = pending
        self.offsets: dict[tuple[int, str], int] = {}
        self.shown: dict[tuple[int, str], int] = {}

    def flush(self, final: bool = False) -> None:
        echoed = self.pending.echoed
        for r in sorted(self.pending.results):
            if echoed is not None and r not in echoed:
                continue
            md = self.pending.results[r].metadata
            for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                text = md.get(name)
                text = text if isinstance(text, str) else "".join(text or [])
                key = (r, name)
                start = self.offsets.get(key, 0)
                end = len(text) if final else text.rfind("\n", start) + 1
                if end <= start:
                    continue
                self.offsets[key] = end
                chunk = text[start:end]
                room = OUTPUT_LIMIT - self.shown.get(key, 0)
                if room <= 0:
                    continue
                if len(chunk) > room:
                    chunk = chunk[:room] + f"\n... [rank {r} {name} cut at {OUTPUT_LIMIT} characters]\n"
                self.shown[key] = self.shown.get(key, 0) + len(chunk)
                stream.write(_tag(r, chunk))
                stream.flush()


def _any_failed(pending: Pending) -> bool:
    """Cheap check for the poll loop: has any rank finished with an error?"""
    return any(ar.ready() and not ar.successful() for ar in pending.results.values())


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


def _per_rank(ranks: Sequence[int], ar: ipp.AsyncResult) -> dict[int, RankResult]:
    """rank -> its own part of a multi-engine ``AsyncResult`` (sent in rank order), so
    each rank's failure, death or hang is still seen on its own."""
    return {r: RankResult(ar, i) for i, r in enumerate(ranks)}


def _tag(rank: int, text: str) -> str:
    lines = text.splitlines()
    return "".join(f"[rank {rank}] {line}\n" for line in lines)


def _completed(ar: RankResult | CallResult) -> float:
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


def _failure(rank: int, ar: RankResult | CallResult) -> RankFailure:
    """What a failed rank's result raises, as a ``RankFailure``."""
    exc: BaseException | None = None
    try:
        ar.get(0)
    except Exception as e:  # noqa: BLE001 - we only read it
        exc = e
    if isinstance(exc, ipp.error.RemoteError):
        return RankFailure(rank, exc.ename, exc.evalue, strip_ansi(exc.traceback or ""))
    return RankFailure(rank, type(exc).__name__, str(exc), "")
