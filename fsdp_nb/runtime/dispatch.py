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

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine.call_channel import as_cell
from ..errors import DeadRankError, RankError, RankFailure, RankTimeoutError, add_note, hide_frame
from .call_channel import CallChannel
from .cluster import EngineCluster
from .lifecycle import Lifecycle
from .results import Pending, RankResult, completed, failure, per_rank
from .terminal import CtrlC, Echo

if TYPE_CHECKING:  # the hang watch sits above the runtime: the session hands one in
    from ..hangs.hang_view import HangShow
    from ..hangs.hang_watch import HangWatch, Watching

__all__ = ["CallEvent", "Dispatcher", "FailurePolicy", "Pending"]

log = logging.getLogger("fsdp_nb")

@dataclass(frozen=True)
class CallEvent:
    """What a dispatcher tells its observers (a live status view) about its calls."""

    what: str
    """The call ("execute", "run(train)"), or "session" / "restart" for a recovery."""
    phase: str
    """``running``, ``done``, ``failed``, ``interrupted``, ``dead``, ``recovering``,
    ``recovered``, ``degraded``, ``hang`` or ``breakpoint`` (ranks stopped by the user)."""
    ranks: tuple[int, ...] = ()
    """The ranks concerned: those still running, those that died, those being recovered."""
    failures: tuple[RankFailure, ...] = ()
    """For ``failed``: each failing rank's error, first failure first."""
    note: str = ""
    """For recovery phases: what was done; for ``hang`` the diagnosis, for ``breakpoint``
    where each rank stopped."""


class FailurePolicy:
    """What ``gather`` does when ranks fail while others still run, or on Ctrl-C.

    The base policy only reports; the session installs one that also recovers
    (``fsdp_nb.recovery.restart``).
    """

    grace: float = 5.0
    """Seconds ranks may keep running after another rank failed before we intervene."""

    def on_partial_failure(
        self, pending: Pending, failures: list[RankFailure], running: list[int]
    ) -> None:
        """Some ranks failed, ``running`` have not returned after ``grace``: raise."""
        raise RankError(pending.what, failures, len(pending.results))

    def summarize(self, failures: list[RankFailure]) -> list[str]:
        """Lines that explain ``failures``, first in the error (the session's policy
        explains a rank out of memory); called once every rank has answered."""
        return []

    def on_failure(self, pending: Pending, failures: list[RankFailure]) -> list[str]:
        """Every rank has answered and ``failures`` failed: notes for the error, which is
        raised next (the session's policy re-forms a group the failure left out of step)."""
        return []

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
        self.watch: HangWatch | None = None
        """Asks the ranks where they are (the session's ``RankHealth.watch``); None: no hang watch."""
        self.hang_after: float | None = None
        """Seconds a call runs before the watch starts asking (the session's ``hang_after``;
        None: never)."""
        self.hang_view: HangShow | None = None
        """Shows a call's live diagnosis (None: take it down, saying how the call ended): in
        place in a notebook, on stderr in a script."""
        self.lifecycle: Lifecycle | None = None
        """The session's state, asked before each call is sent (``Lifecycle.check_usable``:
        a session whose restart stopped part way refuses calls); None: never asked."""

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
            except Exception as exc:  # noqa: BLE001 - one broken observer (a widget) must not break the user's call
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
        cell: bool = False,
    ) -> Pending:
        """Call ``fn(*args)`` on each rank (or ``fn(*args_by_rank[i])`` on ranks[i]).

        ``fast``: over the direct call channel when every rank has one (a call that
        publishes no progress data: that travels through ipyparallel only). ``cell``: the
        call is the user's own (``sess.run``), which the ranks treat as a cell
        (``CallChannel.send``; through ipyparallel, ``engine.call_channel.as_cell``).
        """
        ranks = list(range(self.cluster.world_size)) if ranks is None else list(ranks)
        if self.lifecycle is not None:
            self.lifecycle.check_usable(what)
        self._check_alive(what, ranks)
        rank_args = [args_by_rank[i] if args_by_rank is not None else args for i in range(len(ranks))]
        channel = self.channel
        if fast and channel is not None and channel.ready_for(ranks):
            with CtrlC() as ctrl_c:
                direct = channel.send(fn, rank_args, ranks, cell=cell)
            if direct is not None:  # None: too large for the direct sockets
                return Pending(what, dict(direct), interrupted=ctrl_c.hit, cell=cell, waiter=channel.wait)
        if cell:  # the ranks run it as a cell on this path too
            fn, args, rank_args = as_cell, (fn, *args), [(fn, *a) for a in rank_args]
        results: dict[int, Any] = {}
        # every rank gets the call; a Ctrl-C meanwhile waits for gather
        with CtrlC() as ctrl_c, self._sending(what, ranks):
            if args_by_rank is None:
                results = per_rank(ranks, self.cluster.ranks_view(ranks).apply_async(fn, *args))
            else:
                for r, a in zip(ranks, rank_args):
                    results[r] = RankResult(self.cluster.rank_view(r).apply_async(fn, *a), 0)
        return Pending(what, results, interrupted=ctrl_c.hit, cell=cell, waiter=self._client_wait)

    def _client_wait(self, results: list[RankResult], timeout: float) -> None:
        self.cluster.client.wait([r.future for r in results], timeout=timeout)

    def execute(
        self, code: str, *, ranks: Sequence[int] | None = None, echoed: Sequence[int] | None = None,
        silent: bool = False, merged: bool = True,
    ) -> Pending:
        """Run ``code`` in every rank's namespace (or ``ranks``'), as ``%%px`` does;
        ``echoed``: the ranks whose output is streamed (None: all); ``merged``: lines
        the ranks print alike show once (``Pending.merged``). ``silent``: no
        ``Out`` value, history or execution count (as ipyparallel's ``view.execute``
        sends it: fewer messages); printed output and errors come back either way."""
        ranks = list(range(self.cluster.world_size)) if ranks is None else list(ranks)
        if self.lifecycle is not None:
            self.lifecycle.check_usable("execute")
        self._check_alive("execute", ranks)
        with CtrlC() as ctrl_c, self._sending("execute", ranks):  # as in apply
            ar = self.cluster.ranks_view(ranks).execute(code, block=False, silent=silent)
            results = per_rank(ranks, ar)
        shown = None if echoed is None else tuple(echoed)
        return Pending("execute", dict(results), interrupted=ctrl_c.hit, echoed=shown, merged=merged,
                       cell=True, waiter=self._client_wait)

    @contextmanager
    def _sending(self, what: str, ranks: Sequence[int]) -> Iterator[None]:
        """A send that fails because a rank died since the last check (ipyparallel has
        dropped its engine: a ``KeyError`` for its id) raises that rank's death."""
        try:
            yield
        except Exception:  # re-raised, after naming a dead rank as the cause
            self._check_alive(what, ranks)
            raise

    def _check_alive(self, what: str, ranks: Sequence[int]) -> None:
        dead = [r for r in self.cluster.dead_ranks() if r in ranks]
        if dead:
            self.cluster.start_replacements(dead)
            raise DeadRankError(dead, f"{what} was not sent.")

    # -- gather -----------------------------------------------------------------

    def gather(self, pending: Pending, timeout: float | None = None, hang_after: float | None = None) -> list[Any]:
        """Wait for every rank; return results in rank order or raise the failures.

        ``hang_after``: seconds after which the hang watch explains a collective that
        waits (default: the session's ``hang_after``)."""
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        hang_after = self.hang_after if hang_after is None else hang_after
        watching = None if self.watch is None else self.watch.watching(
            pending.what, pending.started, hang_after, self.notify, self.hang_view)
        ended: BaseException | None = None  # how this call ended (not an exception an outer frame handles)
        with CtrlC() as ctrl_c:
            ctrl_c.hit = pending.interrupted
            try:
                return self._gather(pending, timeout, ctrl_c, watching)
            except RankError as exc:
                self.last_error = ended = exc
                raise
            except KeyboardInterrupt as exc:
                ended = exc
                running = [r for r, ar in pending.results.items() if not ar.ready()]
                self.notify(pending.what, "interrupted", running)
                self.policy.on_interrupt(pending, running)
                raise
            except BaseException as exc:
                ended = exc
                raise
            finally:
                if watching is not None:  # how the call ended: a timeout, Ctrl-C or failure is no completion
                    watching.end(ended)

    def _gather(self, pending: Pending, timeout: float | None, ctrl_c: CtrlC,
                watching: Watching | None = None) -> list[Any]:
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        echo = Echo(pending) if self.echo else None
        try:
            return self._poll(pending, timeout, ctrl_c, watching, echo)
        except BaseException:
            if echo:  # the lines held back to merge are the last before a failure: show them
                echo.flush(final=True)
            raise

    def _poll(self, pending: Pending, timeout: float | None, ctrl_c: CtrlC, watching: Watching | None,
              echo: Echo | None) -> list[Any]:
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
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
            paused = watching.paused if watching is not None else 0.0  # at a breakpoint: not the call's time
            if timeout is not None and now - pending.started - paused > timeout:
                self.policy.on_timeout(pending, running, timeout)
            if watching is not None:
                watching.poll(running)
            poll = self.poll if now - pending.started < 1.0 else self.slow_poll
            if watching is not None:  # wake for the watch's next question, not a turn later
                poll = max(0.0, min(poll, watching.next - time.monotonic()))
            pending.wait_for(running, poll)
            if pending.on_poll is not None:
                pending.on_poll()
            if echo:
                echo.flush()
        return self._settle(pending, echo, ctrl_c)

    def _settle(self, pending: Pending, echo: Echo | None, ctrl_c: CtrlC) -> list[Any]:
        """Every rank has answered: the last output, then the results or the failures."""
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
            err = RankError(pending.what, failures, self.cluster.world_size, summary=self.policy.summarize(failures))
            for note in self.policy.on_failure(pending, failures):
                add_note(err, note)
            raise err
        self.notify(pending.what, "done")
        return [pending.results[r].get() for r in sorted(pending.results)]

    def failures(self, pending: Pending) -> list[RankFailure]:
        """Failed ranks, the first to fail first (by completion time, then rank)."""
        out = []
        for r, ar in pending.results.items():
            if ar.ready() and not ar.successful():
                out.append((completed(ar), r, failure(r, ar)))
        out.sort(key=lambda t: (t[0], t[1]))
        return [f for _, _, f in out]


def _any_failed(pending: Pending) -> bool:
    """Cheap check for the poll loop: has any rank finished with an error?"""
    return any(ar.ready() and not ar.successful() for ar in pending.results.values())


