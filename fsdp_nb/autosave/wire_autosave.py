"""What the ranks receive to save on their own, every N optimizer steps (``sess.autosave``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["AutosaveSpec", "AutosaveState"]


@dataclass(frozen=True, kw_only=True)
class AutosaveSpec:
    """One ``sess.autosave`` call, as every rank receives it."""

    root: str
    """The folder (local path or fsspec URL) that holds one ``step-<N>`` checkpoint per save."""
    storage_options: dict[str, Any]
    """fsspec options for ``root``, as the notebook has them."""
    every: int
    """Save after every this many optimizer steps."""
    model: str
    """Engine global name of the wrapped model."""
    optimizer: str
    """Engine global name of its optimizer, whose steps are counted."""
    state: tuple[str, ...] = ()
    """Engine globals kept per rank beside the shards (``sess.save(state=)``)."""
    keep_last: int | None = None
    """Keep the newest this many checkpoints under ``root``."""
    run: str
    """A token shared by the ranks: with the step, the name of each save's temporary folder."""
    meta: dict[str, Any] = field(default_factory=dict)
    """What the notebook knows of every save (versions); the ranks add the time and step."""
    start_step: int = 0
    """The step count to go on from (the step of the checkpoint a restart restored)."""


@dataclass(frozen=True, kw_only=True)
class AutosaveState:
    """Where one rank's autosave is."""

    step: int
    """Optimizer steps counted, ``start_step`` included."""
    saved: str | None
    """The last checkpoint this rank started (its commit may still be under way)."""
    failed: str | None
    """What went wrong with the last save that failed, if one did."""
    blocked_s: float = 0.0
    """Seconds training on this rank was held by its autosaves: the saves' calls at the
    iteration boundary and the waits of later steps for their staging copies."""
