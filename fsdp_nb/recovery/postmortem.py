"""``sess.debug``: pdb on the frame where a rank failed, driven from the notebook.

The engine keeps its last failure (``fsdp_nb.recovery.rank_postmortem``); this side picks
the rank (the first to fail in the last ``RankError`` by default) and either runs a
list of commands there in one call, returning the text, or reads commands with
``input()`` one at a time, as pdb would in a terminal. Only that rank is busy; the
others stay idle, and nothing is sent to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import rank_postmortem as _pm

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["debug"]


def _check(ctx: SessionContext, rank: Any, commands: Any) -> None:
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ctx.world_size
    ):
        raise ValueError(f"rank must be one of 0..{ctx.world_size - 1} or None, got {rank!r}")
    if commands is not None and (
        isinstance(commands, str)
        or not isinstance(commands, Sequence)
        or not all(isinstance(c, str) for c in commands)
    ):
        raise TypeError(
            f"commands must be a list of pdb command lines (e.g. ['p x', 'up']), got {commands!r}"
        )


def _pick_rank(ctx: SessionContext) -> int | None:
    """The first failing rank of the last RankError; else the lowest rank holding a
    failure (a session attached after the failure); None when no rank has one."""
    d = ctx.dispatcher
    if d.last_error is not None:
        return d.last_error.first.rank
    held = d.gather(d.apply("look for failures", _pm.last_failure))
    return next((r for r, f in enumerate(held) if f is not None), None)


def debug(ctx: SessionContext, rank: int | None = None, commands: Sequence[str] | None = None) -> str | None:
    """Post-mortem pdb on ``rank`` (see ``Session.debug``)."""
    _check(ctx, rank, commands)
    if rank is None:
        rank = _pick_rank(ctx)
        if rank is None:
            return _say("no rank has a failure to debug", commands)
    d = ctx.dispatcher
    prompt = f"(Pdb rank {rank}) "

    def on_rank(fn: Any, *args: Any) -> Any:
        return d.gather(d.apply(f"debug(rank={rank})", fn, ranks=[rank], args=args))[0]

    none = f"rank {rank} has no failure to debug (a rank keeps its last failure until the next)"
    if commands is not None:
        text = on_rank(_pm.run_commands, list(commands), prompt)
        return text or _say(none, commands)
    opened = on_rank(_pm.open_debugger)
    if opened.done:
        return _say(none, commands)
    print(opened.text, end="", flush=True)
    while True:
        try:
            line = input(prompt)
        except (EOFError, KeyboardInterrupt):
            line = "q"
        reply = on_rank(_pm.send, line)
        print(reply.text, end="", flush=True)
        if reply.done:
            return None


def _say(message: str, commands: Sequence[str] | None) -> str | None:
    """Return ``message`` to a caller that gave commands; print it in interactive use."""
    if commands is not None:
        return message + "\n"
    print(message)
    return None
