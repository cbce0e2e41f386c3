"""One dashboard: session status, live memory, the live step view, shard layouts and checkpoints.

``sess.dashboard()`` returns a :class:`Dashboard` (tabs), each tab one of the widgets
(the status tab is the live :class:`fsdp_nb.recovery.status_widget.StatusWidget`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ipywidgets as W

from ..display.widget_parts import StaticForm
from ..recovery.status import SessionStatus
from ..recovery.status_widget import StatusWidget, session_status

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["Dashboard", "dashboard", "session_status"]


class Dashboard(StaticForm, W.VBox):
    """Tabs: status, memory, steps, one layout per model, checkpoints.

    Args:
        ctx: the session context it shows.
        models: the models whose layouts get a tab: one, a list, or None for every
            wrapped model.
        root: a checkpoint folder (or URL): adds the checkpoint browser.
        memory: whether to show the live memory tab.
        steps: whether to show the live step view's tab (it starts the measurement on
            every rank).
        interval: seconds between two samples of the live tabs.
        **ckpt_kwargs: the checkpoint browser's keyword arguments (``model=`` defaults
            to the one model shown, when there is one).
    """

    def __init__(self, ctx: SessionContext, *, models: Any = None, root: str | None = None,
                 memory: bool = True, steps: bool = True, interval: float = 1.0, **ckpt_kwargs: Any):
        from ..checkpoints.checkpoints_widget import CheckpointBrowser
        from ..memory.memory_widget import memory_widget
        from ..models.layout_widget import layout_widget
        from ..steps.steps_widget import steps_widget

        self.ctx = ctx
        self.status_widget = StatusWidget(ctx)
        children: list[W.Widget] = [self.status_widget]
        titles = ["Status"]
        self.memory = memory_widget(ctx, interval=interval) if memory else None
        if self.memory is not None:
            children.append(self.memory)
            titles.append("Memory")
        self.steps = steps_widget(ctx, interval=interval) if steps else None
        if self.steps is not None:
            children.append(self.steps)
            titles.append("Steps")
        shown = list(ctx.models.values()) if models is None else _as_models(models)
        self.layouts = []
        for m in shown:
            lw = layout_widget(m)
            self.layouts.append(lw)
            children.append(lw)
            titles.append(f"Layout: {lw.data.table.model}")
        self.checkpoints = None
        if root is not None:
            ckpt_kwargs.setdefault("model", shown[0] if len(shown) == 1 else None)
            self.checkpoints = CheckpointBrowser(ctx, root, **ckpt_kwargs)
            children.append(self.checkpoints)
            titles.append("Checkpoints")
        self.tabs = W.Tab(children=children, titles=titles)
        super().__init__([self.tabs])
        self.add_class("fsdp-nb-dashboard")

    @property
    def status(self) -> SessionStatus:
        """What the status tab shows now."""
        return self.status_widget.status

    def refresh_status(self) -> SessionStatus:
        return self.status_widget.refresh()

    def to_text(self) -> str:
        parts = [self.status.to_text()]
        parts += [w.to_text() for w in (self.memory, self.steps, *self.layouts, self.checkpoints) if w]
        return "\n\n".join(parts)

    def to_html(self) -> str:
        parts = [self.status.to_html()]
        parts += [w.to_html() for w in (self.memory, self.steps, *self.layouts, self.checkpoints) if w]
        return "<hr>".join(parts)

    def close(self) -> None:
        """Close the tabs and stop their feeds. The ranks keep measuring their steps
        (cheaply); ``self.steps.stop()`` ends that too."""
        self.status_widget.close()
        for w in (self.memory, self.steps):
            if w is not None:
                w.close()
        super().close()


def _as_models(models: Any) -> list[Any]:
    if isinstance(models, (list, tuple)):
        return list(models)
    return [models]


def dashboard(ctx: SessionContext, *, models: Any = None, root: str | None = None, memory: bool = True,
              steps: bool = True, interval: float = 1.0, **ckpt_kwargs: Any) -> Dashboard:
    """Status, live memory and steps, the layouts of ``models`` (None: every wrapped
    model) and the checkpoints under ``root`` (``Dashboard`` gives each argument)."""
    return Dashboard(ctx, models=models, root=root, memory=memory, steps=steps, interval=interval,
                     **ckpt_kwargs)
