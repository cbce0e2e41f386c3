"""What a rank stopped at a breakpoint tells the notebook: :class:`DebugState`.

The rank's hang-watch thread (``fsdp_nb.hangs.rank_hang_watch``) answers the notebook's
debugger requests (``fsdp_nb.debugging.rank_breakpoints``: ``POLL``, ``SEND``, ``HOLD``,
``RELEASE``) with one of these as JSON; the console (``fsdp_nb.debugging.breakpoints``)
decodes it strictly.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DebugState"]


@dataclass(frozen=True, kw_only=True)
class DebugState:
    """One rank's debugger, now."""

    where: str | None
    """Where it is stopped (``cell [12] line 4``); None while it runs."""
    waiting: bool
    """pdb waits for a command (it answered the last one)."""
    reads: int = 0
    """Command lines pdb has asked for on this rank so far (an answer is complete once
    it asks for the next)."""
    stops: int = 0
    """Stops on this rank so far: more than before a ``c`` means it stopped again (a
    breakpoint in a loop), however quickly."""
    output: str = ""
    """What pdb printed since the last poll (taken: each line is sent once)."""
