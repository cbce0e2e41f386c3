"""``sess.memory()``, ``steps()``, ``status_widget()``, ``checkpoints()``, ``dashboard()``: the
façade's widget methods, each handing the session context to its widget.

Mixed into :class:`fsdp_nb.Session`. Each widget module is imported when first asked
for: ``import fsdp_nb`` and a session's start do not pay for ipywidgets and matplotlib.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..checkpoints.checkpoints_widget import CheckpointBrowser
    from ..context import SessionContext
    from ..memory.memory_widget import MemoryWidget
    from ..recovery.status_widget import StatusWidget
    from ..steps.steps_widget import StepsWidget
    from .dashboard import Dashboard

__all__ = ["SessionWidgets", "layout_view"]


def layout_view(model: Any) -> Any:
    """``ShardedModel.layout()``: the layout widget, its module imported when first asked for
    (the façade puts this function in the session context)."""
    from ..models.layout_widget import layout_widget

    return layout_widget(model)


class SessionWidgets:
    """The widget methods of a ``Session``."""

    _ctx: SessionContext

    def memory(self, *, interval: float = 1.0, history: int = 120) -> MemoryWidget:
        """Live per-rank memory widget (updates while a cell trains).

        Args:
            interval: seconds between samples.
            history: samples kept per rank for the sparklines.
        """

        from ..memory.memory_widget import memory_widget

        return memory_widget(self._ctx, interval=interval, history=history)

    def steps(self, window: int = 20, *, interval: float = 1.0) -> StepsWidget:
        """Where each rank's recent optimizer steps' time goes, and which rank is slow, live.

        Each call adds a view to every rank's measurement, which listens to the rank's step
        owner (no hook of its own) and starts a thread that looks every 10 ms at where the
        training thread is; ``stop()`` ends this view's, leaving the others'. After a
        restart, resize or recovery every rank's window starts afresh. The widget is fed
        while a cell trains, with no code in the loop: each rank sends its last steps, and
        what ``fsdp_nb.log`` kept, once per ``interval`` when a step ended.
        ``view.refresh()`` reads the ranks through the task queue after a cell.

        Args:
            window: the last this many steps make each rank's means (1 to 1000).
            interval: seconds between two updates while steps end.
        """

        from ..steps.steps_widget import steps_widget

        return steps_widget(self._ctx, window=window, interval=interval)

    def status_widget(self) -> StatusWidget:
        """Per-rank status that follows the session live: busy, failed, dead, recovering,
        recovered, with a log of failures and recoveries (``status()`` is a snapshot)."""

        from ..recovery.status_widget import status_widget

        return status_widget(self._ctx)

    def checkpoints(self, root: str, **kwargs: Any) -> CheckpointBrowser:
        """Checkpoint browser widget for a local folder or fsspec URL.

        Args:
            root: the folder (or URL) holding the checkpoints.
            **kwargs: ``model=`` and ``optimizer=`` enable its save and load buttons;
                ``extra=`` (a dict or a function returning one) is saved with each
                checkpoint; ``storage_options=`` are fsspec's for ``root``.
        """

        from ..checkpoints.checkpoints_widget import checkpoint_browser

        return checkpoint_browser(self._ctx, root, **kwargs)

    def dashboard(self, **kwargs: Any) -> Dashboard:
        """Status, memory, layouts and checkpoints in one widget.

        Args:
            **kwargs: ``models=`` (default: every wrapped model), ``root=`` (a checkpoint
                folder: adds the browser, with ``checkpoints``' keyword arguments),
                ``memory=False`` leaves out the memory tab, ``steps=False`` the step
                view's, ``interval=`` their seconds between samples.
        """

        from .dashboard import dashboard

        return dashboard(self._ctx, **kwargs)
