"""Every error fsdp_nb raises for a user to act on: one class per thing a user can do
about it, all under :class:`FsdpNbError`.

Each also derives from the builtin a caller would have caught before (``RuntimeError``,
``TimeoutError``), so ``except RuntimeError`` code keeps working. Mistakes in
arguments stay ``TypeError`` / ``ValueError``, as Python's own calls raise them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "add_note",
    "CheckpointError",
    "CollectiveMismatchError",
    "hide_frame",
    "CorruptCheckpointError",
    "DeadRankError",
    "FsdpNbError",
    "RankError",
    "RankFailure",
    "RankTimeoutError",
    "ResizeError",
    "SessionClosedError",
    "SessionUnfinishedError",
    "UnsafeCheckpointError",
    "WireError",
]


class FsdpNbError(Exception):
    """The base of every error fsdp_nb raises for a user to act on."""


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank."""

    rank: int
    """The rank (never the ipyparallel engine id)."""
    ename: str
    """Exception class name raised on the engine, e.g. ``"ValueError"``."""
    evalue: str
    """The exception message."""
    traceback: str
    """The engine-side traceback as text (ANSI colours stripped)."""

    def __str__(self) -> str:
        return f"[rank {self.rank}] {self.ename}: {self.evalue}"


class RankError(FsdpNbError, RuntimeError):
    """One or more ranks raised; ``failures`` lists them, the first failing rank first.

    ``what``: the call that failed; ``world_size``: the ranks it ran on; ``collateral``:
    ranks that failed only because another rank had (stopped by recovery); ``summary``:
    lines that explain the failure, shown right after the first (a rank out of memory:
    what it held, the allocation that failed, the change that would fit)."""

    def __init__(
        self, what: str, failures: list[RankFailure], world_size: int | None = None,
        collateral: list[int] | None = None, summary: list[str] | None = None,
    ):
        self.what = what
        self.failures = list(failures)
        self.world_size = world_size
        self.collateral = list(collateral or [])
        """Ranks whose failure was a consequence of the first ones'."""
        ranks = ", ".join(str(f.rank) for f in self.failures)
        of = f" of {world_size}" if world_size else ""
        self.summary = list(summary or [])
        """What explains the failure, in the message's first lines."""
        lines = [f"{what} failed on rank(s) {ranks}{of}.", *self.summary]
        for f in self.failures:
            lines.append(f"\n--- rank {f.rank}: {f.ename}: {f.evalue}")
            if f.traceback:
                lines.append(f.traceback.rstrip())
        super().__init__("\n".join(lines))

    @property
    def ranks(self) -> list[int]:
        """The failing ranks, first failure first."""
        return [f.rank for f in self.failures]

    @property
    def first(self) -> RankFailure:
        """The first rank that failed: usually the cause, the rest its echo."""
        return self.failures[0]


class DeadRankError(FsdpNbError, RuntimeError):
    """An engine process died (killed, OOM); ``sess.restart()`` brings the rank back."""

    def __init__(self, ranks: list[int], detail: str = ""):
        self.dead_ranks = sorted(ranks)
        msg = (
            f"rank(s) {', '.join(map(str, self.dead_ranks))} died (engine process gone). "
            "Call sess.restart() to bring the same ranks back and rebuild the session."
        )
        if detail:
            msg += f"\n{detail}"
        super().__init__(msg)


class RankTimeoutError(FsdpNbError, TimeoutError):
    """A call did not finish on every rank within its ``timeout``.

    ``pending``: the ranks still running; ``diagnosis``: one line per rank, who waits in
    which collective and who is missing from it, and where (the message starts with
    them); ``stacks``: where each rank was (rank -> its stacks as text, framework frames
    folded), shown after them."""

    def __init__(self, what: str, timeout: float, pending: list[int], stacks: dict[int, str] | None = None,
                 diagnosis: list[str] | tuple[str, ...] = ()):
        self.pending = sorted(pending)
        self.diagnosis = list(diagnosis)
        """Who waits in which collective, who is missing and where: one line per rank."""
        self.stacks = dict(stacks or {})
        """Rank -> the stacks it was in when the timeout struck."""
        lines = "".join(f"\n  {line}" for line in self.diagnosis)
        text = "".join(f"\n\n--- rank {r} was at:\n{s.rstrip()}" for r, s in sorted(self.stacks.items()))
        super().__init__(
            f"{what} did not finish within {timeout:g} s on rank(s) "
            f"{', '.join(map(str, self.pending))}{':' if lines else '; sess.status() shows where they are.'}"
            f"{lines}{text}"
        )


class CollectiveMismatchError(FsdpNbError, RuntimeError):
    """Raised on a rank, with the collective check on (``check_collectives``), before a
    collective the group's ranks do not all call alike: each rank's op, shapes, dtypes,
    cell and line, or that it finished the cell without it. Nothing was issued, so
    nothing hangs and the session stays usable."""


class SessionClosedError(FsdpNbError, RuntimeError):
    """The session was shut down; start a new one with ``fsdp_nb.Session()``."""


class SessionUnfinishedError(FsdpNbError, RuntimeError):
    """A ``sess.restart()`` stopped part way (its ``setup`` failed on a rank, say), so the
    ranks may not hold what the training cell needs: every call is refused, the message
    naming the step that failed and how to mend it, until ``sess.restart()`` runs to its
    end."""


class CheckpointError(FsdpNbError, RuntimeError):
    """A checkpoint cannot be used: incomplete, wrong keys or shapes, unknown format."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is truncated, corrupt or missing; the message names the file."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds a pickle that could run code when loaded, or metadata that names
    files outside its folder; refused before anything was loaded
    (``fsdp_nb.formats.pickles``)."""


class ResizeError(FsdpNbError, RuntimeError):
    """``sess.resize`` failed after the world began to change. The message names the
    folder the models' state was staged in (kept: ``sess.load`` reads it) and how to
    go on; the session is left degraded for ``sess.restart()``."""

    def __init__(self, message: str, staged: str | None = None):
        super().__init__(message)
        self.staged = staged
        """The staging folder holding each model's state (one DCP folder per model)."""


class WireError(FsdpNbError, ValueError):
    """Data from a rank (or a planner process) that does not match the wire type it
    should fill: a field missing, one nobody knows, or a value of the wrong type. The
    notebook and the engines then run different versions of fsdp_nb; the message names
    the type and the field (``fsdp_nb.wire.decode``)."""


def add_note(exc: BaseException, text: str) -> None:
    """Add ``text`` to ``exc`` as a note, shown below its message wherever it is shown.

    Python 3.11+ has ``BaseException.add_note``, which the traceback prints. Python 3.10,
    the oldest fsdp_nb supports, has neither the method nor a traceback that prints
    ``__notes__``: there the note is appended to the error's text (its one message
    argument), so ``str(exc)`` and the traceback show it, and kept in ``__notes__`` as
    3.11 keeps it, for code that reads them.

    Args:
        exc: the error about to be raised.
        text: the note (may hold several lines).
    """
    if sys.version_info >= (3, 11):
        exc.add_note(text)
    else:
        _note_in_text(exc, text)


def _note_in_text(exc: BaseException, text: str) -> None:
    """``add_note`` where ``BaseException.add_note`` is missing (Python 3.10): ``text`` kept
    in ``__notes__`` and appended to the message that ``str(exc)`` shows."""
    notes = getattr(exc, "__notes__", None)
    exc.__notes__ = [*(notes if isinstance(notes, list) else []), text]  # type: ignore[attr-defined]
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{text}",)
    elif not exc.args:
        exc.args = (text,)
    else:  # several arguments: str(exc) shows them as a tuple, the note as its last item
        exc.args = (*exc.args, text)


def hide_frame(excinfo: Any = None) -> bool:
    """The ``__tracebackhide__`` of fsdp_nb's own frames between a call and its ranks (the
    magic, the session, the dispatcher, the failure policy): IPython leaves them out of
    every traceback it shows (any true value) but the innermost, the line that raised,
    so a rank's error reads as the cell, that line and the ranks' own frames; pytest
    calls it and leaves them out only of an fsdp_nb error's traceback, so a bug of
    fsdp_nb's shows in full there.

    Args:
        excinfo: pytest's ``ExceptionInfo`` (None when called otherwise).
    """
    return excinfo is None or bool(excinfo.errisinstance(FsdpNbError))
