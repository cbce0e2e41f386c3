"""Where a rank's recent optimizer steps' time went, as it measured it (``sess.steps()``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankSteps"]


@dataclass(frozen=True, kw_only=True)
class RankSteps:
    """One rank's last optimizer steps, oldest first: each list has one entry per step."""

    rank: int
    """The rank that measured."""
    index: list[int]
    """Each step's number, counted from the view's start on this rank."""
    seconds: list[float]
    """Each step: from the end of the optimizer step before to the end of its own."""
    compute: list[float]
    """Its time computing: in a wrapped model's forward and backward, or the optimizer step."""
    collective: list[float]
    """Its time in a collective (transferring, or waiting for the other ranks to arrive)."""
    other: list[float]
    """The rest: data loading, Python between the steps, the host."""
    device: str
    """``"cpu"`` (host clocks are the truth) or ``"cuda"`` (host clocks are not: see the view)."""
