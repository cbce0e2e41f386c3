"""Each rank's recent steps and logged scalars as they end, over the side channel: the feed
the live step view draws (``fsdp_nb.runtime.side_channel`` does the receiving; each rank's
sampler reads ``rank_step_timing.StepsReading``)."""

from __future__ import annotations

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
    """

    reading = StepsReading
    sample = RankSteps

    def __init__(self, ctx: SessionContext, *, interval: float = 1.0, window: int = 20):
        super().__init__(ctx, interval=interval, history=2)
        self.window = window

    follows = ("resize", "restart")

    def _rejoined(self) -> None:
        """Measure on the ranks that joined (a replaced rank's steps are gone with it)."""
        from .steps_view import start_measuring

        start_measuring(self.ctx, self.window)
