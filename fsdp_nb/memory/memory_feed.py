"""Each rank's memory as it changes, over the side channel: the feed ``sess.memory()``
and the dashboard draw (``fsdp_nb.runtime.side_channel`` does the receiving; each rank's
sampler reads ``rank_memory_kinds.MemoryReading``)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..runtime.side_channel import SampleFeed
from .rank_memory_kinds import MemoryReading
from .wire_memory_sample import MemorySample

__all__ = ["MemoryFeed"]


class MemoryFeed(SampleFeed):
    """Each rank's memory (``MemorySample``), kept as latest + short history."""

    reading = MemoryReading
    sample = MemorySample

    def _kept(self, s: Any) -> Any:
        got: MemorySample = dataclasses.replace(s, received=time.time())
        self.ctx.last_memory[got.rank] = got  # for a death's report
        return got
