"""One step of a post-mortem on a rank: :class:`DebugReply`, returned by
``fsdp_nb.recovery.rank_postmortem`` to ``sess.debug`` (``fsdp_nb.recovery.postmortem``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DebugReply"]


@dataclass(frozen=True)
class DebugReply:
    """What one step of a post-mortem printed, and whether the debugger closed."""

    text: str
    """pdb's output (the stack entry on open, then each command's output)."""
    done: bool = False
    """The session ended (``q``, ``c``, or no failure to debug)."""
