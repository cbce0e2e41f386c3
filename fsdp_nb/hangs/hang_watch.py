"""The hang watch, notebook side: ask every rank where it is, while a call waits.

Each engine runs a thread that says where its rank is (``fsdp_nb.hangs.rank_hang_watch``);
:meth:`HangWatch.report` asks the ranks of a call at once, over signed sockets that do
not go through the engines' task queue (a request there waits behind the running
cell), gives each ``answer_s`` to answer, checks which silent engines on this host are
stopped (by their verified process handle), and explains the whole
(``hang_report.hang_report``). The failure policy calls it to lead its errors. While
a call runs, :class:`Watching` asks the same, cheaply, through ``states`` and
``explain``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..debugging.breakpoints import console
from ..debugging.wire_breakpoints import DebugState
from ..engine.signing import Link, Refused
from ..errors import DeadRankError, RankError, RankTimeoutError, WireError
from ..runtime.listeners import start_listeners
from ..wire.decode import loads
from . import rank_hang_watch as _watch
from .hang_report import HangReport, hang_report
from .hang_view import COMPLETED, HangShow
from .wire_hang_state import Freed, RankState, WatchError

if TYPE_CHECKING:
    from ..runtime.cluster import EngineCluster
    from ..runtime.dispatch import Dispatcher

__all__ = ["HangWatch", "Watching", "how_it_ended"]

log = logging.getLogger("fsdp_nb")


class HangWatch:
    """The watch threads of one session's engines, and the questions put to them."""

    answer_s: float = 1.0
    """Seconds a rank has to answer before it counts as not responding."""
    quick_answer_s: float = 0.1
    """The same for the watch's repeated question (``now=False``), asked every 0.2 s from
    the gather loop: a rank's thread answers in about a millisecond, and a dead or
    stopped rank must not hold up the loop's own checks (liveness, a failure's grace)
    for a second each time. The ranks that miss it where a diagnosis is due are asked
    once more, without the ranks that answered, the full question with ``answer_s``
    (``Watching.poll``; it costs such a rank a 20 ms look at its main thread): a busy
    rank is not called silent, and a silent one holds the loop up for that second once,
    not at every question."""

    def __init__(self, cluster: EngineCluster):
        self.cluster = cluster
        """The engines (rank -> pid, host, handle)."""
        self.links: dict[int, tuple[str, Link]] = {}
        """Rank -> its engine's watch thread (endpoint, signed link)."""
        self.warned: set[tuple[int, str]] = set()
        """(rank, what) already logged: a rank's thread that keeps failing is said once."""
        self.stopped: dict[int, str] = {}
        """Ranks at a breakpoint now -> where (``sess.status()`` shows them), while the
        notebook's debugger console is open."""
        self.script: tuple[str, ...] = ()
        """pdb lines the console sends at each stop of the running cell before it asks the
        user (``debug_commands=``)."""
        self.prompt_limit_s = 1740.0
        """Seconds a breakpoint's prompt holds the stopped ranks without a command before
        it lets them go: the other ranks' collectives time out at the session's
        ``pg_timeout``, and a closed tab leaves the prompt open (the session sets it to
        ``pg_timeout`` less a minute)."""

    def watching(self, what: str, started: float, hang_after: float | None, notify: Callable[..., None],
                 view: HangShow | None) -> Watching:
        """One call's watch (:class:`Watching`), for the dispatcher's gather loop.

        Args:
            what: the call, in words.
            started: when it was sent (``time.monotonic``).
            hang_after: seconds a collective may wait before the diagnosis shows (None:
                never; the watch then only looks for ranks stopped at a breakpoint).
            notify: tells the status observers.
            view: shows the diagnosis under the running cell (None: nowhere).
        """
        return Watching(self, what, started, hang_after, notify, view)

    def start(self, dispatcher: Dispatcher, ranks: list[int] | None = None) -> None:
        """Start the watch thread of ``ranks``' engines (all by default; once per engine)."""
        self.links.update(start_listeners(self.cluster, dispatcher, "start the hang watch", _watch.start,
                                          "hang-watch", ranks, _watch.WINDOW))

    def states(self, ranks: list[int], now: bool = True) -> dict[int, RankState | WatchError | None]:
        """What each of ``ranks`` says about itself (``hangs.rank_hang_watch.RankWatch.state``),
        or the error its thread met telling it; None for a rank that did not answer within
        ``answer_s`` (``quick_answer_s`` for ``now=False``), or has no watch thread, or
        whose answer did not decode (logged once).
        ``now=False``: the watch's cheap question, whose answer names only a collective
        already in flight at the previous one."""
        answers = self._ask({r: _watch.QUERY_NOW if now else _watch.QUERY for r in ranks},
                            self.answer_s if now else self.quick_answer_s)
        out: dict[int, RankState | WatchError | None] = {}
        for r, raw in answers.items():
            got = None if raw is None else self._decode(r, raw, RankState, WatchError)
            if isinstance(got, WatchError):
                self._warn_once(r, "error", "fsdp_nb: rank %d's hang watch could not tell where it is: %s", got.error)
            out[r] = got
        return out

    def debug(self, requests: dict[int, bytes]) -> dict[int, DebugState | None]:
        """Send each rank its debugger request (``debugging.rank_breakpoints``); rank -> its
        ``DebugState``, None when it did not answer within ``answer_s``."""
        out: dict[int, DebugState | None] = {}
        for r, raw in self._ask(requests).items():
            got = None if raw is None else self._decode(r, raw, DebugState, WatchError)
            out[r] = got if isinstance(got, DebugState) else None
        return out

    def free(self, ranks: list[int]) -> dict[int, int | None]:
        """Ask ``ranks`` to shut their connections to every other engine (their TCP
        endpoints, read from their pids), so a main thread blocked in a gloo collective
        returns; how many each rank shut, None if it gave no answer (or could not)."""
        peers = self.cluster.tcp_endpoints()
        answers = self._ask({r: _watch.FREE + json.dumps([e for q, es in peers.items() if q != r for e in es]).encode()
                             for r in ranks})
        out: dict[int, int | None] = {}
        for r, raw in answers.items():
            got = None if raw is None else self._decode(r, raw, Freed, WatchError)
            out[r] = got.closed if isinstance(got, Freed) else None
        return out

    def _decode(self, rank: int, raw: bytes, *types: type[Any]) -> Any:
        """Rank ``rank``'s answer as the first of ``types`` it decodes as; None (logged once)
        when it is none of them: another version of fsdp_nb on that engine."""
        for i, cls in enumerate(types):
            try:
                return loads(cls, raw)
            except WireError as why:
                if i == len(types) - 1:
                    self._warn_once(rank, "wire", "fsdp_nb: rank %d's hang watch answers in a form this notebook "
                                    "cannot read: %s", str(why))
        return None

    def _warn_once(self, rank: int, what: str, message: str, detail: str) -> None:
        if (rank, what) not in self.warned:
            self.warned.add((rank, what))
            log.warning(message, rank, detail)

    def _ask(self, requests: dict[int, bytes], wait: float | None = None) -> dict[int, bytes | None]:
        """Send each rank its request at once; its answer (checked, its signature
        removed), None after ``wait`` seconds (default ``answer_s``)."""
        import zmq

        ranks = list(requests)

        ctx: Any = zmq.Context.instance()
        socks: dict[Any, tuple[int, Link]] = {}
        out: dict[int, bytes | None] = {r: None for r in ranks}
        poller = zmq.Poller()
        for r in ranks:
            if r not in self.links:
                continue
            endpoint, link = self.links[r]
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send(link.pack(requests[r]))
            socks[sock] = (r, link)
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + (self.answer_s if wait is None else wait)
        try:
            while socks and any(out[r] is None for r, _ in socks.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for sock, _ in poller.poll(int(left * 1000) + 1):
                    r, link = socks[sock]
                    try:
                        out[r] = link.unpack(sock.recv())
                    except Refused as exc:
                        link.refused(str(exc), self.links[r][0])
        finally:
            for sock in socks:
                sock.close(linger=0)
        return out

    def report(self, running: list[int], now: bool = True) -> HangReport:
        """Every rank explained, for a call that ``running`` ranks have not finished: where
        each is, who waits in which collective, who is missing from it and where.
        ``now=False``: the watch's repeated cheap question (``states``)."""
        return self.explain(self.states(list(range(self.cluster.world_size)), now), running)

    def explain(self, states: dict[int, RankState | WatchError | None], running: list[int]) -> HangReport:
        """``states`` (every rank's, from ``states``) explained, the silent ranks checked
        for a stopped process (``report``)."""
        silent = [r for r, st in states.items() if st is None]
        return hang_report(states, set(self.cluster.stopped_ranks(silent)) if silent else set(), set(running))


class Watching:
    """One call's watch: ask every rank where it is each ``tick`` seconds while the call
    runs; once some rank has waited in a collective ``hang_after`` seconds, show the
    diagnosis (``view``) and tell the observers (``notify``), again when it changes or
    ``every`` seconds later, and say how the wait ended (:meth:`end`): the collective
    completed, or the call was cut off by its timeout, interrupted or failed first.

    A rank's wait is counted from the first question that found it waiting (or, with the
    flight recorder, from the collective's own start), so asking from the call's start
    puts the diagnosis on screen within ``hang_after + tick`` of the wait's start (and a
    turn of the gather loop; and up to ``answer_s`` more for a rank that missed the quick
    question). A question costs a rank about 0.1 ms under the GIL (counters,
    its user frame; the recorder's status once its main thread sat still between two
    questions) and nothing per collective.

    With ``hang_after=None`` it still asks, for a rank stopped at a breakpoint (which it
    hands to the debugger console), and shows no diagnosis."""

    tick: float = 0.2
    """Seconds between two questions to the ranks."""
    every: float = 2.0
    """Seconds between two showings of an unchanged diagnosis."""

    def __init__(self, watch: HangWatch, what: str, started: float, hang_after: float | None,
                 notify: Callable[..., None], view: HangShow | None):
        self.watch, self.what, self.hang_after = watch, what, hang_after
        self.notify, self.view = notify, view
        self.next = started + min(self.tick, self.tick if hang_after is None else hang_after)
        self.shown: HangReport | None = None
        """The diagnosis on display (None: nothing shown)."""
        self.shown_at = 0.0
        self.paused = 0.0
        """Seconds the call spent with a rank at a breakpoint (no ``timeout=`` counts them)."""
        self.resumed = float("-inf")
        """When the last breakpoint's console closed (``time.monotonic``)."""

    def poll(self, running: list[int]) -> None:
        """Called on every turn of the gather loop; asks the ranks only when due."""
        now = time.monotonic()
        if now < self.next or not running:
            return
        world = self.watch.cluster.world_size
        states = self.watch.states(list(range(world)), now=False)
        stopped = {r: st.stopped for r, st in states.items() if isinstance(st, RankState) and st.stopped}
        if stopped:  # the user's breakpoint: not a hang; the console holds the loop until they go on
            note = "; ".join(f"rank {r} is at a breakpoint in {where}" for r, where in sorted(stopped.items()))
            self.notify(self.what, "breakpoint", sorted(stopped), note=note)
            began = time.monotonic()
            self.watch.stopped = dict(stopped)
            try:
                console(self.watch.debug, stopped, world, script=self.watch.script,
                        idle_s=self.watch.prompt_limit_s)
            finally:
                self.watch.stopped = {}
                self.paused += time.monotonic() - began
                self.resumed = time.monotonic()
            self.notify(self.what, "running", running)
            self.next = time.monotonic() + self.tick
            return
        if self.hang_after is None or time.monotonic() - self.resumed < self.hang_after:
            # no diagnosis, or not yet: the ranks that waited for a stopped rank have waited
            # since before it stood, and are given hang_after from when it went on
            self.next = time.monotonic() + self.tick
            return
        report = self.watch.explain(states, running)
        again = set(report.stalled) - set(report.stopped) - set(self.shown.stalled if self.shown else ())
        if report.triggered(self.hang_after) and again:
            # a rank busy past the quick question (a loaded host, a GIL-bound step) is not
            # called silent before it had answer_s; one already shown silent is not waited on
            states.update(self.watch.states(sorted(again), now=True))
            report = self.watch.explain(states, running)
            now = time.monotonic()
        self.next = time.monotonic() + self.tick
        if report.triggered(self.hang_after):
            if self._showing(report, now):
                return
            self.shown, self.shown_at = report, now
            self.notify(self.what, "hang", report.missing or report.waiting, note=report.text)
            if self.view is not None:
                self.view(self.what, report)
        elif self.shown is not None:
            self.end()

    def _showing(self, report: HangReport, now: float) -> bool:
        """Whether ``report`` says what the diagnosis on display says, shown under ``every`` ago."""
        return self.shown is not None and _who(report) == _who(self.shown) and now - self.shown_at < self.every

    def end(self, error: BaseException | None = None) -> None:
        """The call ended or its collective completed: take the diagnosis down, saying how
        (``error``: what ended the call, None when it returned or the collective completed
        while it ran; :func:`how_it_ended`)."""
        if self.shown is None:
            return
        self.shown = None
        ended = how_it_ended(error)
        self.notify(self.what, "hang-cleared", note=ended)
        if self.view is not None:
            self.view(self.what, None, ended)


def how_it_ended(error: BaseException | None) -> str:
    """How a diagnosed wait ended, in words: the collective completed (``error`` None), or
    the call ended first, which it did not (cut off by its ``timeout=``, Ctrl-C, a rank's
    error or death)."""
    if error is None:
        return COMPLETED
    if isinstance(error, RankTimeoutError):
        why = "the call was cut off by its timeout="
    elif isinstance(error, KeyboardInterrupt):
        why = "the call was interrupted (Ctrl-C)"
    elif isinstance(error, DeadRankError):
        why = "a rank died"
    elif isinstance(error, RankError) and error.collateral:
        why = (f"the call failed on rank(s) {', '.join(str(r) for r in error.ranks if r not in error.collateral)}"
               " and the others were stopped")
    else:  # every rank returned (its error, or one raised in the notebook): the wait ended, somehow
        failed = f" on rank(s) {', '.join(map(str, error.ranks))}" if isinstance(error, RankError) else ""
        return f"the call ended with {type(error).__name__}{failed}"
    return f"{why}: the collective did not complete"


def _who(report: HangReport) -> tuple[Any, ...]:
    """What a diagnosis says, less how long: who waits, who is missing, who is silent."""
    return report.waiting, report.missing, report.stalled, report.mismatch
