"""A deep look at the next training steps on every rank (``sess.profile``): what the ranks
receive, and what each gives back once its steps have run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ProfileSpec", "RankTrace"]


@dataclass(frozen=True, kw_only=True)
class ProfileSpec:
    """One ``sess.profile`` call, as every rank receives it."""

    steps: int
    """Training steps to profile, from the next one on: iterations, each counted once
    however many optimizers step in it."""
    token: str
    """Names this profile: a rank asked for another one's trace answers that it has none."""

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 1 <= self.steps <= 100:
            raise ValueError(f"steps must be an int from 1 to 100 (a trace grows with each), got {self.steps!r}")


@dataclass(frozen=True, kw_only=True)
class RankTrace:
    """One rank's trace of the profiled steps, or where it is."""

    rank: int
    """The rank that traced."""
    token: str
    """The ``ProfileSpec.token`` it traced for ("" when it holds none)."""
    steps_run: int
    """Profiled steps run so far."""
    done: bool
    """Whether all the steps ran and the trace is here (it then leaves the rank)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """The Chrome trace's events, ``ts`` in microseconds since the Unix epoch."""
    windows: list[tuple[float, float]] = field(default_factory=list)
    """Each profiled step's (start, end), on the events' clock: from the step before's
    end (the first: from the profile's first event on the training thread)."""
    thread: int = 0
    """The thread that stepped the optimizer (the training loop's), as the trace names it."""
    host: str = ""
    """The rank's host name."""
    ended: str = ""
    """Why the capture ended before its steps ran, in words ("a cell failed after 1 of its
    5 steps"; "": it did not). Its profiler is off, and what it recorded was dropped."""
