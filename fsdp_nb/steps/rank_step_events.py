"""A GPU rank's steps as its device ran them: CUDA events at each step's first forward
and at its end (``sess.steps()`` on CUDA).

On a GPU the host runs ahead of the device, so host clocks around a step say when its
kernels were launched, not when they ran. The step view's hooks (``step_timing``) also
record a timing event on the training thread's current stream at each cell's start,
at a step's first forward and after its optimizer step. The side channel's thread reads them once the
device has passed them (``Event.query()``; it never waits for one):

- **step**: from the end event of the step before (or of the cell's start, for a cell's
  first step: the pause between two cells is no step's) to this step's end event;
- **other**: from there to this step's first-forward event, the device idle while the
  host loads data or runs Python;
- **model**: from the first-forward event to the end event: forward, backward, the
  optimizer step, and the collectives FSDP2 overlaps with them. ``sess.profile`` splits it.

On a CPU rank no event is recorded and nothing here costs anything.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

__all__ = ["DeviceSteps", "cuda_event"]


def cuda_event() -> Any:
    """A timing event recorded now on the current CUDA stream; None where this rank does
    not use CUDA (it never initialises CUDA itself)."""
    import torch

    if not (torch.cuda.is_initialized() and torch.cuda.is_available()):  # the flag first: every step asks
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class DeviceSteps:
    """The events of a rank's last steps, and their device times once the device passed them.

    Call order, on the training thread: ``cell_started()`` as a cell starts, then for each
    step ``forward()`` at its first forward and ``stepped(index)`` after its optimizer
    step (``joined()`` for a second optimizer's step in the same iteration). ``read()``
    from any thread.

    Args:
        keep: how many steps to keep (their device times need the step before's end too).
        event: makes a recorded event (``cuda_event``), or None on a CPU rank.
    """

    def __init__(self, keep: int, event: Callable[[], Any] = cuda_event) -> None:
        self.keep, self.event = keep, event
        self.rows: collections.deque[tuple[int, Any, Any, Any]] = collections.deque()
        """(step number, cell-start event or None, first-forward event or None, end
        event), oldest first."""
        self.start: Any = None
        self.since: Any = None
        """The cell's start, until the cell's first step ends (None: the step before's end)."""

    def cell_started(self) -> None:
        """A cell starts: its first step counts from here, not from the last cell's last step."""
        self.since, self.start = self.event(), None

    def forward(self) -> None:
        """A step's first forward: its start on the device."""
        self.start = self.event()

    def stepped(self, index: int) -> None:
        """A step ended (its optimizer step ran): its end on the device."""
        end = self.event()
        if end is None:
            return
        self.rows.append((index, self.since, self.start, end))
        while len(self.rows) > self.keep + 1:
            self.rows.popleft()
        self.start = self.since = None

    def joined(self) -> None:
        """A second optimizer's step in the same iteration: the step now ends after it."""
        end = self.event()
        if end is not None and self.rows and self.since is None:  # not across a cell's start: the
            index, since, start, _ = self.rows[-1]                # next step's other holds it then
            self.rows[-1] = (index, since, start, end)

    def newest_passed(self) -> int | None:
        """The newest kept step whose end the device has passed (None: none, or a CPU rank):
        one event query a step, no times read, for a sampler that asks whether to read."""
        for index, _, _, end in reversed(list(self.rows)):
            if end.query():
                return index
        return None

    def read(self) -> list[tuple[int, float, float, float]]:
        """(step number, step, other, model) in seconds for each kept step the device has
        passed, with its beginning (the step before's end, or its cell's start); oldest
        first. Never waits for the device."""
        out = []
        before_end = None
        for index, since, start, end in list(self.rows):
            before = since if since is not None else before_end
            before_end = end
            if before is None or start is None or not (before.query() and start.query() and end.query()):
                continue
            out.append((index, before.elapsed_time(end) / 1e3, before.elapsed_time(start) / 1e3,
                        start.elapsed_time(end) / 1e3))
        return out[-self.keep:]
