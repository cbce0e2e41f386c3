"""The session's status as plain data: which rank is busy, idle, failed or dead, and where.

One model for ``sess.status()``, the dashboard, the live status widget and notebooks:
:class:`SessionStatus` of :class:`RankStatus` rows, with a text and an HTML form.
:func:`read_status` fills it from the controller's queue status and the engines' pids,
never through an engine's task queue, so it answers while a cell runs; busy ranks'
stacks come from ``fsdp_nb.runtime.health`` (faulthandler dumps on a signal).
:func:`apply_event` moves it on as the dispatcher reports calls starting, failing and
recovering (``fsdp_nb.runtime.dispatch.CallEvent``), which is how the live widget follows a cell.
"""

from __future__ import annotations

import html
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..display.rank_strip import COMPACT, StripCell, html_strip, text_strip
from ..display.tables import text_table
from ..runtime.output_lines import rank_label

if TYPE_CHECKING:
    from ..context import SessionContext
    from ..runtime.dispatch import CallEvent

__all__ = ["RankStatus", "SessionStatus", "apply_event", "read_status"]

log = logging.getLogger("fsdp_nb")

_COLOURS = {"busy": "#b58900", "stopped": "#268bd2", "idle": "#2aa198", "dead": "#dc322f", "failed": "#dc322f",
            "interrupted": "#cb4b16", "recovering": "#6c71c4", "recovered": "#859900"}
_MARKS = {"busy": "b", "stopped": "s", "idle": ".", "dead": "x", "failed": "F", "interrupted": "i", "recovering": "r",
          "recovered": "R"}
_EVENTS_KEPT = 20


@dataclass(frozen=True)
class RankStatus:
    """One rank's state right now."""

    rank: int
    """The rank."""
    engine_id: int
    """Its current ipyparallel engine id."""
    host: str
    """Host the engine runs on."""
    pid: int | None
    """Engine process id."""
    device: str
    """Device it computes on (``"cuda:0"``, ``"cpu"``)."""
    state: str
    """``"busy"`` (running or queued work), ``"idle"``, ``"dead"`` or ``"stopped"`` (at a
    breakpoint, the debugger console open); as the live widget follows calls also ``"failed"``, ``"interrupted"``, ``"recovering"``, ``"recovered"``."""
    queued: int = 0
    """Tasks the controller has sent this engine that have not finished (running included)."""
    stack: str | None = None
    """For a busy rank, when asked for: every thread's Python stack, the main thread first."""
    activity: str = ""
    """What the notebook last saw the rank do: the call it runs, its error, a recovery."""

    @property
    def where(self) -> str | None:
        """The innermost frame of the main thread ("File ..., line N in fn"), if known."""
        if not self.stack:
            return None
        first = self.stack.split("\n\n", 1)[0].splitlines()
        frames = [line.strip() for line in first if line.strip().startswith("File ")]
        return frames[0] if frames else None


@dataclass(frozen=True)
class SessionStatus:
    """Per-rank busy / idle / dead, with stacks for busy ranks when asked for."""

    state: str
    """The session's state (``ready``, ``degraded``, ``closed``...)."""
    backend: str
    """Process-group backend."""
    ranks: tuple[RankStatus, ...] = ()
    """One entry per rank, in rank order."""
    taken: float = field(default_factory=time.time)
    """Unix time it was read."""
    events: tuple[str, ...] = ()
    """The latest calls' failures and recoveries, oldest first (the live widget's log)."""
    why: str = ""
    """For an ``unfinished`` session: the restart step that failed and how to mend it."""

    HEADER = ("rank", "engine", "host", "pid", "device", "state", "queued", "activity")

    def _ranks_in(self, state: str) -> list[int]:
        return [r.rank for r in self.ranks if r.state == state]

    @property
    def busy(self) -> list[int]:
        """Ranks running or queued work."""
        return self._ranks_in("busy")

    @property
    def idle(self) -> list[int]:
        """Ranks waiting for work."""
        return self._ranks_in("idle")

    @property
    def dead(self) -> list[int]:
        """Ranks whose engine process is gone."""
        return self._ranks_in("dead")

    def rows(self) -> list[tuple[Any, ...]]:
        """Table rows in ``HEADER`` order."""
        return [(r.rank, r.engine_id, r.host, r.pid, r.device, r.state, r.queued, r.activity)
                for r in self.ranks]

    def _cells(self) -> list[StripCell]:
        return [StripCell(rank=r.rank, level=None, colour=_COLOURS.get(r.state, "#dddddd"), mark=_MARKS.get(r.state, "?"),
                          title=f"rank {r.rank}: {r.state} (engine {r.engine_id}, {r.host}, pid {r.pid}) {r.activity}")
                for r in self.ranks]

    def _counts(self) -> str:
        states = [r.state for r in self.ranks]
        return ", ".join(f"{states.count(k)} {k} ({_MARKS.get(k, '?')})" for k in dict.fromkeys(states))

    @property
    def compact(self) -> bool:
        """More ranks than ``COMPACT``: a strip, and rows only for ranks neither busy nor idle."""
        return len(self.ranks) > COMPACT

    def _shown(self) -> list[RankStatus]:
        return [r for r in self.ranks if not self.compact or r.state not in ("busy", "idle")]

    def to_text(self) -> str:
        """A plain-text table (above ``COMPACT`` ranks a strip, and rows only for the ranks
        neither busy nor idle), then each busy rank's stack."""
        lines = [f"session {self.state}, backend {self.backend}, {len(self.ranks)} ranks"]
        if self.why:
            lines.append(self.why)
        if self.compact:
            lines += [self._counts(), text_strip(self._cells())]
        shown = self._shown()
        if shown:
            lines.append(text_table(self.HEADER, [row for row, r in zip(self.rows(), self.ranks, strict=True) if r in shown]))
        stacks: dict[Any, list[RankStatus]] = {}  # at many ranks, ranks stopped in one place show one stack
        for r in self.ranks:
            if r.stack:
                stacks.setdefault(r.where if self.compact else r.rank, []).append(r)
        lines += [f"--- {rank_label(x.rank for x in rs)} at {rs[0].where}\n{rs[0].stack.rstrip()}"  # type: ignore[union-attr]
                  for rs in stacks.values()]
        lines += list(self.events)
        return "\n".join(lines)

    def to_html(self) -> str:
        """An HTML table, states in colour, each busy rank's stack folded under "where"."""
        rows = []
        for r in self._shown():
            stack = (
                f"<details><summary>{html.escape(r.where or 'stack')}</summary>"
                f"<pre>{html.escape(r.stack)}</pre></details>" if r.stack else ""
            )
            cells = [r.rank, r.engine_id, html.escape(r.host), r.pid, html.escape(r.device)]
            rows.append(
                "<tr>" + "".join(f"<td>{c}</td>" for c in cells)
                + f"<td style='color:{_COLOURS.get(r.state, '')}'><b>{html.escape(r.state)}</b></td>"
                + f"<td>{r.queued}</td><td>{html.escape(r.activity)}</td><td>{stack}</td></tr>"
            )
        head = "".join(f"<th>{h}</th>" for h in (*self.HEADER, "where"))
        when = time.strftime("%H:%M:%S", time.localtime(self.taken))
        log_html = "".join(f"<li>{html.escape(e)}</li>" for e in self.events)
        return (
            f"<div class='fsdp-nb-status'><b>Session</b> <code>{html.escape(self.state)}</code>, "
            f"backend <code>{html.escape(self.backend)}</code>, {len(self.ranks)} ranks "
            f"<small>(at {when})</small>"
            + (f"<br>{html.escape(self.why)}" if self.why else "")
            + (f"<br><small>{html.escape(self._counts())}</small>" + html_strip(self._cells(), cls="fsdp-nb-status-strip")
               if self.compact else "")
            + (f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>" if rows else "")
            + (f"<ul class='fsdp-nb-status-events'>{log_html}</ul>" if log_html else "") + "</div>"
        )

    def __repr__(self) -> str:
        return f"<fsdp_nb.SessionStatus {self.state}>\n{self.to_text()}"

    def _repr_html_(self) -> str:
        return self.to_html()


def read_status(ctx: SessionContext, *, with_stacks: bool = True) -> SessionStatus:
    """Which rank of ``sess`` is busy, idle or dead, and (``with_stacks``) where busy
    ranks are. Asks the controller and the engines' pids, never an engine's queue."""
    c = ctx.cluster
    dead = set(c.dead_ranks()) if ctx.state != "closed" else set(range(c.world_size))
    queued = _queued(c.client, c.engine_ids)
    states = ["dead" if r in dead else ("busy" if queued[r] > 0 else "idle")
              for r in range(len(c.engine_ids))]
    watch = ctx.dispatcher.watch
    stops = dict(watch.stopped) if watch is not None else {}  # the debugger console is open
    busy = [r for r, s in enumerate(states) if s == "busy" and r not in stops]
    found = ctx.health.stacks(busy) if (with_stacks and busy) else {}
    devices = [info.device for info in ctx.ranks] or ["?"] * c.world_size
    ranks = tuple(
        RankStatus(r, eid, c.hosts[r] or "?", c.pids[r], devices[r], "stopped" if r in stops else states[r],
                   queued[r], found.get(r), activity=f"at a breakpoint in {stops[r]}" if r in stops else "")
        for r, eid in enumerate(c.engine_ids)
    )
    return SessionStatus(ctx.state, ctx.backend or "?", ranks, why=ctx.lifecycle.why)


def _queued(client: Any, engine_ids: Sequence[int]) -> list[int]:
    """How many tasks each engine has queued or running, by the controller's queues less
    the tasks this client has already seen finish: the controller hears of a finished
    task after the client does, so right after a call it may still count it."""
    try:
        queues = client.queue_status(targets=list(engine_ids), verbose=True)
    except Exception as exc:  # noqa: BLE001 - a dead engine id may be refused
        log.debug("queue_status failed: %s", exc)
        return [0] * len(engine_ids)
    ids = [q.get("queue", []) if isinstance(q, dict) else []
           for q in (queues.get(eid) if isinstance(queues, dict) else None for eid in engine_ids)]
    if not any(ids):
        return [0] * len(engine_ids)
    # this client's tasks whose result came (another client's task always counts);
    # (``client.results`` cannot tell: it was found empty after gathered calls)
    finished = set(client.history.copy()) - client.outstanding.copy()  # filled by its IO thread
    return [sum(1 for m in queued if m not in finished) for queued in ids]


def _short(text: str, n: int = 120) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= n else line[: n - 3] + "..."


def _rank_after(r: RankStatus, event: CallEvent) -> RankStatus:
    """One rank's row after ``event`` (pure: the new row, or ``r`` itself)."""
    ph, mine = event.phase, r.rank in event.ranks
    if ph == "running":
        if mine:
            return replace(r, state="busy", activity=event.what, stack=None)
        return replace(r, state="idle") if r.state == "busy" else r
    if ph == "done":
        return replace(r, state="idle", activity=event.what) if r.state in ("busy", "recovered") else r
    if ph == "failed":
        f = next((f for f in event.failures if f.rank == r.rank), None)
        return replace(r, state="failed", activity=_short(f"{event.what}: {f.ename}: {f.evalue}")) if f else r
    if ph == "breakpoint" and mine:  # "rank 1 is at a breakpoint in cell [12] line 4; rank 3 ..."
        said = next((ln for ln in event.note.split("; ") if ln.startswith(f"rank {r.rank} ")), "")
        return replace(r, state="stopped", activity=_short(said.replace(f"rank {r.rank} is ", "", 1)))
    if ph == "hang":  # the rank's own line of the diagnosis
        line = next((ln for ln in event.note.splitlines() if ln.startswith(f"rank {r.rank} ")), None)
        return replace(r, activity=_short(line)) if line else r
    if ph == "interrupted" and mine:
        return replace(r, state="interrupted", activity=f"{event.what}: Ctrl-C")
    if ph == "dead" and mine:
        return replace(r, state="dead", activity=f"{event.what}: engine died")
    if ph == "degraded":
        return replace(r, state="dead", activity=_short(event.note)) if mine else r
    if ph in ("recovering", "recovered") and mine:
        if ph == "recovering" and r.state == "dead":
            return r
        return replace(r, state=ph, activity=_short(f"{event.what}: {event.note}"))
    return r


def apply_event(status: SessionStatus, event: CallEvent, *, state: str | None = None) -> SessionStatus:
    """``status`` after ``event``: the concerned ranks' states, and a log line for anything
    but a call starting or ending well. ``state``: the session's state now."""
    events = status.events
    if event.phase not in ("running", "done"):
        ranks = ", ".join(map(str, event.ranks))
        detail = "; ".join(f"rank {f.rank}: {f.ename}: {f.evalue}" for f in event.failures[:2])
        line = f"{time.strftime('%H:%M:%S')} {event.what} {event.phase}"
        line += f" (rank {ranks})" if ranks and event.phase not in ("recovering", "recovered") else ""
        line += f": {detail or event.note}" if (detail or event.note) else ""
        if event.phase.startswith("hang") and events and f" {event.what} hang" in events[-1]:
            events = events[:-1]  # a diagnosis refreshed (or resolved) replaces the one shown
        events = (*events, _short(line.replace("\n", "; "), 300))[-_EVENTS_KEPT:]
    return replace(
        status, state=state or status.state, taken=time.time(), events=events,
        ranks=tuple(_rank_after(r, event) for r in status.ranks),
    )
