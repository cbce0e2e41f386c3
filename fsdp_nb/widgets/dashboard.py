"""One dashboard: session status, live memory, shard layouts and checkpoints.

``sess.dashboard()`` returns a :class:`Dashboard` (tabs). The status table renders from
:class:`fsdp_nb.status.SessionStatus`, filled by :func:`session_status` from the session's
status (the controller's queue status and the engines' pids: it answers while
engines run a cell).
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W

from ..status import SessionStatus, read_status
from ._render import StaticForm

__all__ = ["Dashboard", "dashboard", "session_status"]


def session_status(sess: Any) -> SessionStatus:
    """Busy / idle / dead per rank (``fsdp_nb.status.read_status``), without stacks:
    the dashboard does not show them, and taking them signals every busy rank."""
    return read_status(sess, with_stacks=False)


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
