"""Post-mortem pdb on this rank's last failure (engine side of ``sess.debug``).

IPython keeps the last exception a cell or an applied call raised on this engine in
``sys.last_traceback`` until the next one, so the frames where the rank failed stay
alive. ``open_debugger`` puts a ``pdb.Pdb`` on that traceback, writing into a buffer;
``send`` runs one command line and returns what pdb printed, so the notebook can
drive it a line at a time (``input()``) or run a list of commands at once.
"""

from __future__ import annotations

import io
import pdb
import sys

from ..engine.registry import Part, part
from .wire_postmortem import DebugReply

__all__ = ["close_debugger", "last_failure", "open_debugger", "run_commands", "send"]

class Debugging(Part):
    """The post-mortem open on this rank (the registry's part for ``sess.debug``)."""

    def __init__(self) -> None:
        self.active: list[tuple[pdb.Pdb, io.StringIO]] = []
        """The open debugger and what it printed (one at most)."""

    def closed(self) -> None:
        self.active.clear()


"""The debugger the notebook is driving on this rank (at most one)."""

_ENDS = frozenset({"c", "cont", "continue", "q", "quit", "exit", "n", "next", "s", "step", "r", "return",
         "unt", "until", "j", "jump", "run", "restart"})
"""Commands that would resume execution: in a post-mortem they end the session."""


def last_failure() -> str | None:
    """``"ValueError: boom"`` for this rank's last failure, or None if it has none."""
    if getattr(sys, "last_traceback", None) is None:
        return None
    value = getattr(sys, "last_value", None)
    return f"{type(value).__name__}: {value}"


def open_debugger() -> DebugReply:
    """Start pdb at the frame where the last failure was raised (closing any earlier one)."""
    close_debugger()
    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        return DebugReply("", done=True)
    out = io.StringIO()
    p = pdb.Pdb(stdin=io.StringIO(), stdout=out, nosigint=True)
    p.use_rawinput = False
    p.reset()
    p.setup(None, tb)
    out.write(f"{last_failure()}\n")
    p.print_stack_entry(p.stack[p.curindex])
    part(Debugging).active.append((p, out))
    return DebugReply(_take(out))


def send(line: str) -> DebugReply:
    """Run one pdb command line on the open debugger; ``done`` once it ends."""
    active = part(Debugging).active
    if not active:
        return DebugReply("no debugger is open on this rank\n", done=True)
    p, out = active[0]
    word = line.strip().split(" ", 1)[0]
    if word in _ENDS:
        close_debugger()
        return DebugReply("", done=True)
    line = p.precmd(line)
    p.onecmd(line)
    return DebugReply(_take(out))


def close_debugger() -> None:
    """End the open debugger, if any (its frames stay in ``sys.last_traceback``)."""
    active = part(Debugging).active
    while active:
        p, _ = active.pop()
        p.forget()


def _take(out: io.StringIO) -> str:
    text = out.getvalue()
    out.seek(0)
    out.truncate()
    return text


def run_commands(commands: list[str], prompt: str) -> str:
    """Open the debugger, run ``commands`` in order and close it; everything printed,
    each command after ``prompt`` as a terminal would show it ("" if no failure)."""
    opened = open_debugger()
    if opened.done:
        return ""
    parts = [opened.text]
    for line in commands:
        reply = send(line)
        parts.append(f"{prompt}{line}\n{reply.text}")
        if reply.done:
            break
    close_debugger()
    return "".join(parts)
