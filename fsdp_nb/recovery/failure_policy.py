"""The failure policy every Session installs: failures become errors and a usable session.

The one move it relies on (measured; ``tests/test_failures.py`` holds it): when the ranks that are not
blocked leave the process group, a rank blocked in a gloo collective with them gets
"Connection closed by peer" and returns to Python, its variables intact. So:

1. ranks that returned (or were idle) leave the process group and shut their
   sockets to the others; ranks that come back leave too (with 3+ ranks a rank
   unblocked by one peer may still hold others). On NCCL, a rank blocked in a kernel
   is freed by aborting its communicators from its listener thread
   (``fsdp_nb.runtime.health.RankHealth.abort``; one GPU shows abort and re-form, several
   GPUs blocking each other have not been run);
2. ranks still running after ``nudge`` seconds get SIGINT, and again every ``nudge``
   seconds (for Python code that is not in a collective; after an interrupt, whose
   SIGINT is lost on an engine that had not yet started the call, a Ctrl-C right after
   sending, or in code that caught the KeyboardInterrupt and went on), and on
   gloo their watch thread (``hangs.hang_watch``) shuts their connections to the
   other engines, which frees a rank whose peers are blocked too (mismatched
   collectives); a rank that stopped answering at all while others wait for it
   (SIGSTOP, stuck in C) is killed first (``_explain``) so they return; after
   ``wedge_timeout`` they count as wedged: killed (only
   engines this session started) and replaced as for a dead engine;
3. every rank joins a new group on a fresh port and every DeviceMesh / FSDP2 module
   is re-pointed at the new groups (``fsdp_nb.recovery.restart``): trained weights and
   optimizers stay.

Recovery's own calls go through the session's plain dispatcher (failures reported,
never recovered), so they never recurse into this policy.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING

from ..engine import health as _health
from ..engine import step as _step
from ..engine.stacks import fold_stacks
from ..errors import DeadRankError, RankError, RankFailure, RankTimeoutError, add_note, hide_frame
from ..hangs.hang_report import HangReport, out_of_step
from ..memory.out_of_memory import explain
from ..runtime.dispatch import FailurePolicy, Pending
from .engine_deaths import explain_deaths, kernel_oom_kills
from .restart import reform, restart

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["RecoveringPolicy"]

log = logging.getLogger("fsdp_nb")


class RecoveringPolicy(FailurePolicy):
    """Turns failures into errors and a usable session, keeping every live rank's state."""

    def __init__(
        self,
        ctx: SessionContext,
        *,
        grace: float = 3.0,
        nudge: float = 2.0,
        wedge_timeout: float = 20.0,
    ):
        self.ctx = ctx
        self.grace = grace
        """Seconds ranks may keep running after another rank failed before recovery starts."""
        self.nudge = nudge
        """Seconds after leaving the group before still-running ranks get SIGINT, and
        between the SIGINTs they get until they return or ``wedge_timeout`` passes."""
        self.wedge_timeout = wedge_timeout
        """Seconds to wait for stopped ranks to return before they count as wedged."""
        self.oom_kills = kernel_oom_kills()
        """The kernel's count of out-of-memory kills when last looked at: a rise names the
        OOM killer as what ended a rank."""

    # hooks -------------------------------------------------------------------------

    def on_partial_failure(
        self, pending: Pending, failures: list[RankFailure], running: list[int]
    ) -> None:
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        first = {f.rank for f in failures}
        summary = self.summarize(failures)  # before recovery: what the failed ranks hold now
        report = self._explain(running)
        note = self._recover(pending, running, interrupt=False, cause="partial failure")
        collateral = [f for f in self.ctx.dispatcher.failures(pending) if f.rank not in first]
        err = RankError(pending.what, list(failures) + collateral, self.ctx.world_size,
                        collateral=[f.rank for f in collateral], summary=summary)
        if report.lines:
            add_note(err, "While the other ranks waited:" + "".join(f"\n  {line}" for line in report.lines))
        add_note(err, note)
        for line in self._steps_note(pending):
            add_note(err, line)
        raise err

    def summarize(self, failures: list[RankFailure]) -> list[str]:
        return explain(self.ctx, failures)

    def on_failure(self, pending: Pending, failures: list[RankFailure]) -> list[str]:
        """Every rank returned. Where the call ended on some ranks, a step it left open there
        is dropped too, and ranks that took different numbers of optimizer steps in it are named
        (``_cut_short``). A failure may also have left a group out of step (a rank issued a
        collective the others never joined): then the group is re-formed, or its next
        collective would be paired with that one."""
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        notes = self._cut_short(pending)
        try:
            lines = out_of_step(self.ctx.health.watch.states(list(range(self.ctx.world_size))))
        except Exception as exc:  # noqa: BLE001 - the failure itself must still reach the user
            log.warning("fsdp_nb: could not ask the ranks which collectives they issued: %s", exc)
            return notes
        if not lines:
            return notes
        note = self._recover(pending, [], interrupt=False, cause="collectives out of step")
        return [*notes, "The failure left the group out of step: " + "; ".join(lines) + ".\n" + note]

    # a cell that failed on some ranks ----------------------------------------------

    def _cut_short(self, pending: Pending) -> list[str]:
        """A cell that failed on some ranks only (one raised after its last collective, the
        others ended it): where it cut a step short on any rank (``engine.step.cell_failed``),
        every rank drops that step (``drop_cut_short``), or the next synced backward would
        add its unsynced gradients in on some ranks only; and :meth:`_steps_note`."""
        asked = self._ask(pending)
        if asked is None:
            return []
        ranks, answers = asked
        if any(cut for _, cut, _ in answers):
            d = self.ctx.plain_dispatcher
            try:
                d.gather(d.apply("drop the step the failed cell cut short", _step.drop_cut_short, ranks=ranks), 30)
            except Exception as exc:  # noqa: BLE001 - the failure itself must still reach the user
                log.warning("fsdp_nb: could not drop the step the failed cell cut short on every rank: %s", exc)
        return _uneven(ranks, answers)

    def _steps_note(self, pending: Pending) -> list[str]:
        """After a recovery (whose re-form dropped every cut-short step already): a note when
        the ranks took different numbers of optimizer steps in the cell (a rank stopped
        before its ``optimizer.step()`` while another had taken it, Ctrl-C landing at two
        places): their shards of the model are then from different steps, which nothing
        but a load mends. A recovery that replaced a rank starts every count again."""
        if self.ctx.state != "ready":
            return []
        asked = self._ask(pending)
        return [] if asked is None else _uneven(*asked)

    def _ask(self, pending: Pending) -> tuple[list[int], list[tuple[int, bool, bool]]] | None:
        """The call's ranks and what the cell did on each (``engine.step.cell_failed``).
        None for a call that is no cell (a save, a wrap: the ranks' last cell is not
        theirs to judge), one that ran as none (no rank says its cell failed: the request
        never reached a cell), or ranks that could not answer."""
        if not pending.cell:
            return None
        ranks = sorted(pending.results)
        d = self.ctx.plain_dispatcher
        try:
            answers = d.gather(d.apply("ask the ranks about the failed cell", _step.cell_failed, ranks=ranks), 30)
        except Exception as exc:  # noqa: BLE001 - the failure itself must still reach the user
            log.warning("fsdp_nb: could not ask the ranks what the failed cell did: %s", exc)
            return None
        return (ranks, answers) if any(failed for _, _, failed in answers) else None

    def on_interrupt(self, pending: Pending, running: list[int]) -> None:
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        if not running:
            return
        report = self._explain(running)
        note = self._recover(pending, running, interrupt=True, cause="Ctrl-C")
        lines = "".join(f"\n  {line}" for line in report.lines)
        steps = "".join(f"\n{line}" for line in self._steps_note(pending))
        print(f"fsdp_nb: interrupted {pending.what}{':' if lines else ''}{lines}\n{note}{steps}", flush=True)

    def on_dead(self, pending: Pending, dead: list[int]) -> None:
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        ctx = self.ctx
        all_dead = sorted(set(dead) | set(ctx.cluster.dead_ranks()))
        why = "".join(f"\n{line}" for line in explain_deaths(ctx, all_dead, self.oom_kills))  # before replacements
        self.oom_kills = kernel_oom_kills()
        running = [r for r, ar in pending.results.items() if not ar.ready() and r not in all_dead]
        wedged = self._unblock(pending, running, interrupt=bool(running), skip=set(all_dead))
        if wedged:
            ctx.cluster.kill(wedged)
        ctx.lifecycle.to("degraded")
        gone = tuple(sorted(set(all_dead) | set(wedged)))
        ctx.cluster.start_replacements(list(gone))
        ctx.dispatcher.notify("session", "degraded", gone, note="sess.restart() brings them back")
        others = [f for f in ctx.dispatcher.failures(pending) if f.rank not in all_dead]
        err = DeadRankError(
            sorted(set(all_dead) | set(wedged)),
            f"while running {pending.what}. The other ranks were stopped and left the "
            "process group (their variables are kept); sess.restart() replaces the dead "
            "engine(s) under the same rank(s), re-forms the group and builds every wrapped "
            "model again at its initial weights: restore='latest' (with sess.autosave) or "
            "restore=<checkpoint>, with setup= remaking what cells made, brings the trained run back." + why,
        )
        if others:
            add_note(err, "Other ranks failed as a consequence:\n" + "\n".join(map(str, others)))
        raise err

    def on_timeout(self, pending: Pending, running: list[int], timeout: float) -> None:
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        report = self._explain(running)
        found = self.ctx.health.stacks([r for r in running if r not in report.stalled])
        note = self._recover(pending, running, interrupt=True, cause="timeout")
        err = RankTimeoutError(pending.what, timeout, running, diagnosis=report.lines,
                               stacks={r: fold_stacks(s) for r, s in found.items()})
        add_note(err, note)
        for line in self._steps_note(pending):
            add_note(err, line)
        raise err

    # the diagnosis -----------------------------------------------------------------

    def _explain(self, running: list[int]) -> HangReport:
        """Where every rank is (``hangs.hang_watch``), for the error's first lines; then
        the ranks that did not answer, stopped or stuck in C while others wait for them
        in a collective, are killed (only engines this session started), which closes
        their sockets: the waiting ranks return to Python with their state, and
        recovery replaces only the stuck ones."""
        try:
            report = self.ctx.health.watch.report(running)
        except Exception as exc:  # noqa: BLE001 - the diagnosis must not stand in the way of the recovery
            log.warning("fsdp_nb: could not ask the ranks where they are: %s", exc)
            return HangReport()
        c = self.ctx.cluster
        silent = report.stalled if report.waiting else report.stopped  # others wait for them
        gone = set(c.dead_ranks()) if silent else set()
        stuck = [r for r in silent if r not in gone and c.owns_engines]  # on any host: cluster.kill
        if far := [r for r in silent if r not in gone and r not in stuck]:
            log.warning("fsdp_nb: rank(s) %s stopped responding, on engines of a cluster this session "
                        "attached to, so it will not kill them; restart them with their launcher, then "
                        "call sess.restart()", ", ".join(f"{r} ({c.hosts[r]})" for r in far))
        if stuck:
            log.warning("fsdp_nb: rank(s) %s stopped responding: killing them so the other ranks "
                        "return with their state", ", ".join(map(str, stuck)))
            self.ctx.cluster.kill(stuck)
        return report

    # the dance ---------------------------------------------------------------------

    def _recover(self, pending: Pending, running: list[int], *, interrupt: bool, cause: str) -> str:
        """Stop ``running`` ranks, re-form the group on every rank; a note saying what happened."""
        d = self.ctx.dispatcher
        everyone = tuple(range(self.ctx.world_size))
        d.notify("session", "recovering", everyone, note=cause)
        try:
            note = self._recover_or_raise(pending, running, interrupt=interrupt, cause=cause)
        except Exception as exc:  # noqa: BLE001 - the original error must still reach the user
            if self.ctx.state != "unfinished":  # a restart that stopped part way keeps saying where
                self.ctx.lifecycle.to("degraded")
            note = (
                f"fsdp_nb could not recover the session ({cause}): {type(exc).__name__}: {exc}. "
                "Call sess.restart()."
            )
            d.notify("session", "degraded", everyone, note=note)
            return note
        d.notify("session", "recovered", everyone, note=note)
        return note

    def _recover_or_raise(
        self, pending: Pending, running: list[int], *, interrupt: bool, cause: str
    ) -> str:
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        ctx = self.ctx
        dead = set(ctx.cluster.dead_ranks())
        wedged = self._unblock(pending, running, interrupt=interrupt, skip=dead)
        if wedged or dead:
            ctx.cluster.kill(wedged)
            report = restart(ctx)
            note = (
                f"fsdp_nb recovered the session ({cause}): rank(s) "
                f"{', '.join(map(str, sorted(set(wedged) | dead)))} did not return: {report.line()}"
            )
        else:
            reform(ctx)
            note = (
                f"fsdp_nb recovered the session ({cause}): every rank returned and joined a "
                "new process group; variables, models and optimizers are kept."
            )
        return note

    def _unblock(
        self, pending: Pending, running: list[int], *, interrupt: bool, skip: set[int]
    ) -> list[int]:
        """Bring ``running`` ranks back to Python; return those that did not come back."""
        ctx = self.ctx
        c = ctx.cluster
        running = [r for r in running if r not in skip]
        if interrupt and running:
            c.signal(running, signal.SIGINT)
        left: set[int] = set()

        def leave(ranks: list[int]) -> None:
            ranks = [r for r in ranks if r not in left and r not in skip]
            if not ranks:
                return
            left.update(ranks)
            d = ctx.plain_dispatcher
            peers = c.tcp_endpoints()
            args = [([e for q, es in peers.items() if q != r for e in es],) for r in ranks]
            try:
                d.gather(d.apply("leave process group", _health.leave_group, args, ranks=ranks), 30)
            except Exception as exc:  # noqa: BLE001 - a rank that cannot leave is handled as wedged
                log.warning("rank(s) could not leave the process group (handled as wedged): %s", exc)

        leave([r for r in range(c.world_size) if r not in running])
        if ctx.backend == "nccl" and running:
            # a rank blocked in an NCCL kernel returns only when its own communicators
            # are aborted (from its listener thread): closing peers' sockets is not enough
            ctx.health.abort(running)
        start = time.monotonic()
        nudges = 0
        next_liveness = start + 0.5
        still = list(running)
        while True:
            still = [r for r in still if not pending.results[r].ready()]
            leave([r for r in running if r not in still])
            if not still:
                return []
            now = time.monotonic()
            if now >= next_liveness:
                next_liveness = now + 0.5
                gone = set(c.dead_ranks())
                skip |= gone
                still = [r for r in still if r not in gone]
                if not still:
                    return []
            if now - start > self.nudge * (nudges + 1):
                late = [r for r in still if not pending.results[r].ready()]
                if late:  # again every ``nudge`` s: one that had not started the call dropped the last
                    log.info("fsdp_nb: rank(s) %s still running %.0f s after SIGINT: sent it again",
                             ", ".join(map(str, late)), now - start)
                    c.signal(late, signal.SIGINT)
                    if nudges == 0 and ctx.backend != "nccl":  # blocked in gloo on peers blocked too
                        ctx.health.watch.free(late)  # (mismatched collectives): their sockets closed free them
                nudges += 1
            if now - start > self.wedge_timeout:
                return still
            pending.wait_for(still, 0.05)


def _uneven(ranks: list[int], answers: list[tuple[int, bool, bool]]) -> list[str]:
    """The note for ranks that took different numbers of optimizer steps in a cell."""
    if len({n for n, _, _ in answers}) < 2:
        return []
    counts = ", ".join(f"rank {r}: {n}" for r, (n, _, _) in zip(ranks, answers, strict=True))
    return [f"The ranks took different numbers of optimizer steps in this call ({counts}), so their "
            "shards of the model are from different steps now: load a checkpoint (sess.load) "
            "before training on."]
