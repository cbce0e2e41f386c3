"""The live step view: where each rank's steps' time goes, redrawn while a cell trains.

``sess.steps()`` returns a :class:`StepsWidget`. Each rank measures its own steps
(``steps.rank_step_timing``) and its sampler thread sends the last ``window`` of them, with
what ``fsdp_nb.log`` kept, over the side channel once a second when a step ended
(:class:`~fsdp_nb.steps.steps_feed.StepsFeed`). The widget applies them to its
:class:`~fsdp_nb.steps.steps_view.StepsView` and redraws, so nothing waits behind the
training cell and the loop carries no code for it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import ipywidgets as W

from ..display.widget_parts import StaticForm
from ..runtime.side_channel import SampleFeed
from .step_rates import StepRates
from .steps_feed import StepsFeed
from .steps_view import (
    RankParts,
    StepsView,
    Straggler,
    check_window,
    start_measuring,
    stop_measuring,
)

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["StepsWidget", "steps_widget"]

log = logging.getLogger("fsdp_nb")


class StepsWidget(StaticForm, W.VBox):
    """The step view, live: a table (a strip at many ranks), throughput, stragglers and the
    logged curves; ``close()`` stops the feed (the ranks go on measuring).

    Args:
        view: the step view it shows and moves on.
        feed: the ranks' step samples (started).
        ctx: the session context whose ranks measure.
        **kwargs: ``ipywidgets.VBox``'s (``layout=`` and the like).
    """

    def __init__(self, view: StepsView, feed: StepsFeed, ctx: SessionContext, **kwargs: Any):
        self.view, self.feed, self._ctx = view, feed, ctx
        self.html = W.HTML(view.to_html())
        self.html.add_class("fsdp-nb-steps-view")
        self.renders = 0
        """Redraws so far (one per second at most while steps end)."""
        super().__init__([self.html], **kwargs)
        self.add_class("fsdp-nb-steps-widget")
        feed.add_listener(self._on_samples)

    @property
    def window(self) -> int:
        """The last this many steps make each rank's means."""
        return self.view.window

    @property
    def ranks(self) -> dict[int, RankParts]:
        """Rank -> its mean step over the window, split into parts (as last received)."""
        return self.view.ranks

    @property
    def stragglers(self) -> list[Straggler]:
        """The ranks that hold the others back, slowest first."""
        return self.view.stragglers

    @property
    def rates(self) -> StepRates:
        """Throughput over the window, and MFU on a known GPU."""
        return self.view.rates

    @property
    def curves(self) -> dict[str, list[float]]:
        """What the ranks log with ``fsdp_nb.log``: each name's mean over the ranks."""
        return self.view.curves

    @property
    def device(self) -> str:
        """``cpu`` or ``cuda``."""
        return self.view.device

    def _on_samples(self, feed: SampleFeed) -> None:
        latest = [s for s in feed.latest() if s is not None]
        if latest:
            self.view.apply(latest)
            self._redraw()

    def _redraw(self) -> None:
        with self.hold_sync(), self.html.hold_sync():
            self.html.value = self.view.to_html()
            self.renders += 1

    def refresh(self) -> StepsWidget:
        """Read every rank's last steps now, through the task queue (after a cell; while
        one runs the widget is fed anyway), and redraw; returns the widget."""
        self.view.refresh()
        self._redraw()
        return self

    def log_to(self, target: Any) -> StepsWidget:
        """Write the ranks' steps and logged values to a TensorBoard ``SummaryWriter`` or a
        W&B run as they arrive, live while a cell trains (``StepsView.log_to``, which says
        what is written); returns the widget.

        Args:
            target: a ``torch.utils.tensorboard.SummaryWriter`` or a W&B run.
        """
        self.view.log_to(target)
        return self

    def to_text(self) -> str:
        """The view as text (``StepsView.to_text``)."""
        return self.view.to_text()

    def to_html(self) -> str:
        """The view as HTML (``StepsView.to_html``)."""
        return self.view.to_html()

    def close(self) -> None:
        """Stop the feed and close the widget; the ranks keep measuring (cheaply: ``stop``
        ends that too)."""
        self.feed.close()  # its thread joined first: no redraw after, and none missed before
        self.feed.remove_listener(self._on_samples)
        self.view.flush()  # log_to's targets have all it wrote
        super().close()

    def stop(self) -> None:
        """Stop this view's measurement on every rank and close the widget. Other open
        views go on measuring; once none is left the ranks stop (their listener and
        sampling thread go), and a later ``sess.steps()`` starts again from no steps."""
        self.close()
        stop_measuring(self._ctx, self.view.token)


def steps_widget(ctx: SessionContext, *, window: int = 20, interval: float = 1.0) -> StepsWidget:
    """Start the measurement on every rank and the live feed; the widget for ``sess``.

    Args:
        ctx: the session context whose ranks measure.
        window: the last this many steps make each rank's means (1 to 1000).
        interval: seconds between two updates while steps end.
    """
    check_window(window)
    view = StepsView(ctx, window)
    start_measuring(ctx, window, view.token)
    feed = StepsFeed(ctx, interval=interval, window=window, view=view.token, reformed=view.reformed)
    feed.start()
    return StepsWidget(view, feed, ctx)
