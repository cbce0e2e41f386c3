"""The session's ranks, live: busy, failed, dead, recovering, recovered, as it happens.

``sess.status_widget()`` shows :class:`fsdp_nb.recovery.status.SessionStatus` and moves it on
with every event the session's dispatcher reports (a call starting, a rank failing or
dying, a recovery). The events come on the notebook's own thread while a cell waits
for its ranks, and a widget update sent then reaches the page at once, so the table
changes while the failing cell is still running; no thread asks the engines anything.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ipywidgets as W

from ..display.widget_parts import StaticForm
from ..runtime.dispatch import CallEvent
from .status import SessionStatus, apply_event, read_status

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["StatusWidget", "session_status", "status_widget"]

log = logging.getLogger("fsdp_nb")


def session_status(ctx: SessionContext) -> SessionStatus:
    """Busy / idle / dead per rank (``fsdp_nb.recovery.status.read_status``), without stacks:
    the widgets do not show them, and taking them signals every busy rank."""
    return read_status(ctx, with_stacks=False)


class StatusWidget(StaticForm, W.VBox):
    """A per-rank status table and a log of failures and recoveries, kept current."""

    def __init__(self, ctx: SessionContext, **kwargs: Any):
        self.ctx = ctx
        self.status: SessionStatus = session_status(ctx)
        """What the table shows now."""
        self.view = W.HTML(self.status.to_html())
        self.b_refresh = W.Button(description="Refresh", icon="refresh")
        self.b_refresh.on_click(lambda _b: self.refresh())
        super().__init__([self.view, self.b_refresh], **kwargs)
        self.add_class("fsdp-nb-status-widget")
        self._dispatcher = ctx.dispatcher
        self._dispatcher.observers.append(self.on_event)
        ctx.lifecycle.on_close(self.close)

    def on_event(self, event: CallEvent) -> None:
        """Move the table on by one dispatcher event and redraw it."""
        status = apply_event(self.status, event, state=self.ctx.state)
        if event.phase == "recovered":  # replaced engines have new pids and engine ids
            fresh = {r.rank: r for r in session_status(self.ctx).ranks}
            status = replace(status, ranks=tuple(
                replace(r, pid=fresh[r.rank].pid, engine_id=fresh[r.rank].engine_id) if r.rank in fresh else r
                for r in status.ranks))
        self.status = status
        self.view.value = status.to_html()

    def refresh(self) -> SessionStatus:
        """Read the ranks afresh (controller queues and pids), keeping the event log."""
        self.status = replace(session_status(self.ctx), events=self.status.events)
        self.view.value = self.status.to_html()
        return self.status

    def close(self) -> None:
        """Stop following the session and close the widget."""
        if self.on_event in self._dispatcher.observers:
            self._dispatcher.observers.remove(self.on_event)
        super().close()

    def to_text(self) -> str:
        return self.status.to_text()

    def to_html(self) -> str:
        return self.status.to_html()


def status_widget(ctx: SessionContext, **kwargs: Any) -> StatusWidget:
    """The live status widget for ``sess``."""
    return StatusWidget(ctx, **kwargs)
