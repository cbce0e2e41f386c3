"""One dashboard: session status, live memory, shard layouts and checkpoints.

``sess.dashboard()`` returns a :class:`Dashboard` (tabs). The status table renders from
:class:`SessionStatus`, filled by :func:`session_status` from the recovery layer's
status (the controller's queue status and the engines' pids: it answers while
engines run a cell).
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass
from typing import Any

import ipywidgets as W

from ._render import StaticForm, html_table, text_table

__all__ = ["Dashboard", "RankStatus", "SessionStatus", "dashboard", "session_status"]


@dataclass(frozen=True)
class RankStatus:
    """One rank's row in the status table."""

    rank: int
    """Global rank."""
    engine_id: int
    """ipyparallel engine id."""
    host: str
    """Host name."""
    pid: int
    """Engine process id."""
    device: str
    """Device it computes on."""
    state: str
    """``busy``, ``idle`` or ``dead``."""
    queued: int = 0
    """Requests waiting or running on the engine."""


@dataclass(frozen=True)
class SessionStatus:
    """The session at one moment."""

    state: str
    """Session state (``ready``, ``closed``...)."""
    backend: str
    """Process-group backend."""
    ranks: tuple[RankStatus, ...]
    """One row per rank."""
    taken: float
    """Unix time it was read."""

    HEADER = ("rank", "engine", "host", "pid", "device", "state", "queued")

    def rows(self) -> list[tuple[Any, ...]]:
        return [(r.rank, r.engine_id, r.host, r.pid, r.device, r.state, r.queued)
                for r in self.ranks]

    def to_text(self) -> str:
        return (f"session {self.state}, backend {self.backend}, {len(self.ranks)} ranks\n"
                + text_table(self.HEADER, self.rows()))

    def to_html(self) -> str:
        colors = {"busy": "#ff7f0e", "idle": "#2ca02c", "dead": "#d62728"}
        rows = [(*r[:5], f"<b style='color:{colors.get(r[5], '#333')}'>{html.escape(r[5])}</b>",
                 r[6]) for r in self.rows()]
        when = time.strftime("%H:%M:%S", time.localtime(self.taken))
        return (f"<div class='fsdp-nb-status'><b>Session</b> {html.escape(self.state)}, "
                f"backend {html.escape(self.backend)}, {len(self.ranks)} ranks "
                f"<small>(at {when})</small>{html_table(self.HEADER, rows, raw_cols=(5,))}</div>")


def session_status(sess: Any) -> SessionStatus:
    """Busy / idle / dead per rank, from ``fsdp_nb.recovery.status``.

    Without stacks: the dashboard does not show them, and taking them signals every
    busy rank.
    """
    from ..recovery import status

    st = status(sess, with_stacks=False)
    rows = tuple(
        RankStatus(s.rank, s.engine_id, s.host, s.pid, info.device, s.state, s.queued)
        for s, info in zip(st.ranks, sess.ranks)
    )
    return SessionStatus(sess.state, sess.backend, rows, time.time())


class Dashboard(StaticForm, W.VBox):
    """Tabs: status, memory, one layout per model, checkpoints."""

    def __init__(self, sess: Any, *, models: Any = None, root: str | None = None,
                 memory: bool = True, interval: float = 1.0, **ckpt_kwargs: Any):
        from .checkpoints import CheckpointBrowser
        from .layout import layout_widget
        from .memory import memory_widget

        self.sess = sess
        self.status = session_status(sess)
        self.status_view = W.HTML(self.status.to_html())
        self.b_status = W.Button(description="Refresh status", icon="refresh")
        self.b_status.on_click(lambda _b: self.refresh_status())
        children: list[W.Widget] = [W.VBox([self.status_view, self.b_status])]
        titles = ["Status"]
        self.memory = memory_widget(sess, interval=interval) if memory else None
        if self.memory is not None:
            children.append(self.memory)
            titles.append("Memory")
        self.layouts = []
        for m in _as_models(models):
            lw = layout_widget(m)
            self.layouts.append(lw)
            children.append(lw)
            titles.append(f"Layout: {lw.data.table.model}")
        self.checkpoints = None
        if root is not None:
            models_list = _as_models(models)
            ckpt_kwargs.setdefault("model", models_list[0] if len(models_list) == 1 else None)
            self.checkpoints = CheckpointBrowser(sess, root, **ckpt_kwargs)
            children.append(self.checkpoints)
            titles.append("Checkpoints")
        self.tabs = W.Tab(children=children, titles=titles)
        super().__init__([self.tabs])
        self.add_class("fsdp-nb-dashboard")

    def refresh_status(self) -> SessionStatus:
        self.status = session_status(self.sess)
        self.status_view.value = self.status.to_html()
        return self.status

    def to_text(self) -> str:
        parts = [self.status.to_text()]
        parts += [w.to_text() for w in (self.memory, *self.layouts, self.checkpoints) if w]
        return "\n\n".join(parts)

    def to_html(self) -> str:
        parts = [self.status.to_html()]
        parts += [w.to_html() for w in (self.memory, *self.layouts, self.checkpoints) if w]
        return "<hr>".join(parts)

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
        super().close()


def _as_models(models: Any) -> list[Any]:
    if models is None:
        return []
    if isinstance(models, (list, tuple)):
        return list(models)
    return [models]


def dashboard(sess: Any, *, models: Any = None, root: str | None = None, memory: bool = True,
              interval: float = 1.0, **ckpt_kwargs: Any) -> Dashboard:
    """Status, live memory, the layouts of ``models`` and the checkpoints under ``root``."""
    return Dashboard(sess, models=models, root=root, memory=memory, interval=interval,
                     **ckpt_kwargs)
