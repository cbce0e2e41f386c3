"""What the ranks receive to save on their own, every N optimizer steps (``sess.autosave``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["AutosaveSpec", "AutosaveState", "HeldCopies"]


@dataclass(frozen=True, kw_only=True)
class AutosaveSpec:
    """One ``sess.autosave`` call, as every rank receives it."""

    root: str | None
    """The folder (local path or fsspec URL) that holds one ``step-<N>`` checkpoint per save;
    None: copies in memory only (``in_memory``)."""
    storage_options: dict[str, Any]
    """fsspec options for ``root``, as the notebook has them."""
    every: int
    """Save after every this many optimizer steps."""
    model: str
    """Engine global name of the wrapped model."""
    optimizers: tuple[str, ...]
    """Engine global names of its optimizers (one, or each of several that step parts of
    its parameters): an iteration in which any of them steps is counted, and all are saved."""
    state: tuple[str, ...] = ()
    """Engine globals kept per rank beside the shards (``sess.save(state=)``), taken at the
    iteration's boundary; a torch ``DataLoader`` or ``Sampler`` among them is taken as a
    loader."""
    loaders: tuple[str, ...] = ()
    """Engine globals the loop draws batches from, kept per rank too, taken at the step's
    end, before the loop draws the next batch."""
    keep_last: int | None = None
    """Keep the newest this many checkpoints under ``root``."""
    run: str
    """A token shared by the ranks: with the step, the name of each save's temporary folder."""
    meta: dict[str, Any] = field(default_factory=dict)
    """What the notebook knows of every save (versions); the ranks add the time and step."""
    start_step: int = 0
    """The step count to go on from (the step of the checkpoint a restart restored)."""
    in_memory: bool = False
    """Also copy the state after every step into host memory, this rank's and its buddy's
    (``autosave.rank_memory_copies``)."""
    buddies: tuple[int, ...] = ()
    """With ``in_memory``: ``buddies[r]`` is the rank that keeps rank r's copies."""


@dataclass(frozen=True, kw_only=True)
class AutosaveState:
    """Where one rank's autosave is."""

    step: int
    """Optimizer steps counted, ``start_step`` included."""
    saved: str | None
    """The last save committed (rank 0's; another rank's: the last whose part it finished
    writing, rank 0 committing it); None: none yet."""
    failed: str | None
    """What went wrong with the last save that failed, if one did."""
    writing: str | None = None
    """A save still in flight (written in the background; it may yet fail)."""
    due: bool = False
    """A save is due and not yet taken (the next boundary or the cell's end writes it)."""
    blocked_s: float = 0.0
    """Seconds training on this rank was held by its autosaves: the saves' calls at the
    iteration boundary, the waits of later steps for their staging copies, and (with
    ``in_memory``) the waits for the copies in memory."""
    copies: HeldCopies | None = None
    """With ``in_memory``: what this rank holds in memory."""


@dataclass(frozen=True, kw_only=True)
class HeldCopies:
    """What one rank holds in memory of the in-memory autosave."""

    own: tuple[int, ...]
    """The steps of its own complete generations, oldest first."""
    held: dict[int, tuple[int, ...]]
    """Ward rank -> the steps of that rank's complete generations held here."""
    bytes: int = 0
    """Host bytes the generations take."""
    failed: str | None = None
    """Why the last copy did not complete, if it did not."""
