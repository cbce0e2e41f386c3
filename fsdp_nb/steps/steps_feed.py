"""Each rank's recent steps and logged scalars as they end, over the side channel: the feed
the live step view draws (``fsdp_nb.runtime.side_channel`` does the receiving; each rank's
sampler reads ``rank_step_timing.StepsReading``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..runtime.side_channel import SampleFeed
from .rank_step_timing import StepsReading
from .wire_step_times import RankSteps

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["StepsFeed"]


class StepsFeed(SampleFeed):
    """Each rank's recent steps and logged scalars (``RankSteps``), as they end.

    Args:
        ctx: the session context whose ranks publish.
        interval: seconds between two messages of a rank while its steps end.
        window: the steps each rank keeps (a rank that joins later is started with it).
        view: the token of the view it feeds (``StepsView.token``).
        reformed: called once the group formed again, before the feed subscribes anew.
    """

    reading = StepsReading
    sample = RankSteps

    def __init__(self, ctx: SessionContext, *, interval: float = 1.0, window: int = 20, view: str = "",
                 reformed: Callable[[], None] | None = None):
        super().__init__(ctx, interval=interval, history=2)
        self.window, self.view, self.reformed = window, view, reformed

    def _rejoined(self) -> None:
        """Make sure the view measures on every rank of the new world (the ranks agreed on
        it already when the group formed again: ``StepTiming.reformed``), and tell the view
        (``reformed``) that what the ranks sent before is gone."""
        from .steps_view import start_measuring

        start_measuring(self.ctx, self.window, self.view)
        if self.reformed is not None:
            self.reformed()
