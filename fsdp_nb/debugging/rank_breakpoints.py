"""Breakpoints in cells, rank side: ``breakpoint()`` stops the ranks the cell chose.

An engine has no terminal: torch's ``torch.distributed.breakpoint()`` reopens
``/dev/stdin``, which it lacks, and IPython's ``input()`` on an engine fails. So
``install`` (run once per engine, as its hang-watch thread starts) points
``sys.breakpointhook`` and ``pdb.set_trace`` at this module: a rank among the cell's
debug ranks (``arm``, from ``%%px --debug 1,3`` or ``sess.execute(code, debug=[1, 3])``),
or any rank ``fsdp_nb.breakpoint(ranks=...)`` names, opens a ``pdb.Pdb`` whose stdin is
a queue and whose stdout is a buffer. Everywhere else ``breakpoint()`` does nothing.

The notebook drives it through the rank's hang-watch thread, which answers while the
main thread is stopped (``answer``): it sees the stop in the rank's state
(``RankState.stopped``), polls what pdb printed, sends command lines and holds the stop.

Call order: ``install()`` once; per cell ``arm(ranks)``, then the cell, then
``cell_ended()`` (``rank_cell_debug``, on IPython's ``post_execute``); ``answer(payload)``
on the watch thread at any time.

A stop never outlives the notebook: a rank that hears nothing (no poll and no hold,
which the console sends every ``HOLD_EVERY_S`` while it waits for the user) for
``hold_s`` seconds continues, says so in its log, and ignores the cell's later
breakpoints: a closed tab or a dead kernel leaves no rank stopped.
"""

from __future__ import annotations

import logging
import os
import pdb
import queue
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from ..engine.registry import Part, part
from ..engine.stacks import in_library
from ..wire.decode import encode
from .rank_cell_places import caller_frame, cell_name, stopped_at
from .rank_collective_check import breakpoint_held
from .wire_breakpoints import DebugState

__all__ = ["HOLD", "HOLD_EVERY_S", "POLL", "RELEASE", "SEND", "Breakpoints", "answer", "arm", "breakpoint",
           "cell_ended", "install", "is_request"]

log = logging.getLogger("fsdp_nb")

POLL = b"debug poll"
"""Request: this rank's ``DebugState``, pdb's output since the last poll taken."""
SEND = b"debug send "
"""Request head: the command line after it goes to pdb (utf-8)."""
HOLD = b"debug hold"
"""Request: the notebook is still there (keeps the stop alive)."""
RELEASE = b"debug release"
"""Request: leave the debugger, continue, and stop no more this cell (Ctrl-C in the notebook)."""
HOLD_EVERY_S = 2.0
"""How often the console says it is still there while it waits for the user."""
HOLD_ENV = "FSDP_NB_BREAKPOINT_HOLD"
"""Seconds a stopped rank waits without hearing from the notebook (default 60)."""


def _hold_s() -> float:
    """``FSDP_NB_BREAKPOINT_HOLD`` in seconds (default 60); a value that is not a number
    of seconds above twice ``HOLD_EVERY_S`` is said and replaced by the default."""
    text = os.environ.get(HOLD_ENV) or "60"
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 2 * HOLD_EVERY_S:
        log.warning("fsdp_nb: %s=%r is not a number of seconds above %g: a stopped rank waits 60 s for the notebook",
                    HOLD_ENV, text, 2 * HOLD_EVERY_S)
        return 60.0
    return value


def is_request(payload: bytes) -> bool:
    """Whether ``payload`` is one of this module's requests (for the watch thread)."""
    return payload in (POLL, HOLD, RELEASE) or payload.startswith(SEND)


class Breakpoints(Part):
    """This rank's breakpoints: which ranks the cell stops, and the stop open now."""

    def __init__(self) -> None:
        self.debug_ranks: frozenset[int] = frozenset()
        """The ranks the running cell's ``breakpoint()`` stops (``arm``)."""
        self.hold_s = _hold_s()
        """Seconds without a word from the notebook before a stop is left."""
        self.stops = 0
        """Stops so far (a continue followed at once by another stop is still told apart)."""
        self.where: str | None = None
        """Where pdb is stopped now (None: running)."""
        self.waiting = False
        """pdb waits for a command line."""
        self.reads = 0
        """Command lines pdb has asked for (``DebugState.reads``)."""
        self.commands: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        self.lock = threading.Lock()
        self.contact = time.monotonic()
        """When the notebook last asked (``time.monotonic``)."""
        self.abandoned = False
        """The notebook let go (Ctrl-C) or went silent: no more stops this cell."""
        self.installed: tuple[Any, Any] | None = None
        """The hooks replaced by ``install`` (``sys.breakpointhook``, ``pdb.set_trace``)."""
        self.on_stop: Callable[[], None] | None = None
        """Called at each stop (``install``)."""

    def take(self) -> str:
        with self.lock:
            text, self.out = "".join(self.out), []
        return text

    def reformed(self, world: Any) -> None:
        """A new group: the cut-short cell's choice of ranks ends."""
        self.debug_ranks, self.abandoned = frozenset(), False

    def closed(self) -> None:
        if self.installed is not None:
            sys.breakpointhook, pdb.set_trace = self.installed
            self.installed = None
        self.abandoned = True
        self.commands.put("c")


class _Commands:
    """pdb's stdin: the notebook's command lines, or ``c`` once it went silent."""

    def __init__(self, bp: Breakpoints):
        self.bp = bp

    def readline(self) -> str:
        bp = self.bp
        bp.contact = time.monotonic()  # its hold time counts from when it asks (another rank may have had the user)
        bp.reads += 1
        bp.waiting = True
        try:
            while True:
                if bp.abandoned:
                    return "c\n"
                try:
                    return bp.commands.get(timeout=0.25) + "\n"
                except queue.Empty:
                    if time.monotonic() - bp.contact > bp.hold_s:
                        log.warning("fsdp_nb: rank %s heard nothing from the notebook for %g s at its breakpoint "
                                    "(%s): it continues, and stops no more this cell", _rank(), bp.hold_s, bp.where)
                        bp.abandoned = True
        finally:
            bp.waiting = False


class _Output:
    """pdb's stdout: kept until the notebook polls."""

    def __init__(self, bp: Breakpoints):
        self.bp = bp

    def write(self, text: str) -> int:
        with self.bp.lock:
            self.bp.out.append(text)
        return len(text)

    def flush(self) -> None:
        pass


class _RankPdb(pdb.Pdb):
    """pdb reading the notebook's lines, its place told to the watch thread."""

    def __init__(self, bp: Breakpoints, origin: FrameType | None):
        super().__init__(stdin=_Commands(bp), stdout=_Output(bp), nosigint=True)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.prompt = ""  # the notebook shows "(Pdb rank N) "
        self.bp, self.origin = bp, origin

    def stop_here(self, frame: FrameType) -> bool:
        """Stop in user code only (cells, the user's files, and the frame ``breakpoint()``
        was called in, wherever it is): IPython runs each statement of a cell as code of
        its own, so ``n`` at a statement's end goes on through IPython's frames to the next
        statement instead of stopping in them."""
        if frame is not self.origin and in_library(frame.f_code.co_filename):
            return False
        return bool(super().stop_here(frame))

    def user_call(self, frame: FrameType, argument_list: Any) -> None:
        if frame.f_code.co_name != "<module>":  # a statement of a cell: no stop at its start
            super().user_call(frame, argument_list)

    def user_return(self, frame: FrameType, return_value: Any) -> None:
        if frame.f_code.co_name != "<module>":  # nor at its end: the next statement's line is next
            super().user_return(frame, return_value)

    def format_stack_entry(self, frame_lineno: Any, lprefix: str = ": ") -> str:
        """pdb's ``> file(line)`` with a cell's number for IPython's temporary file name."""
        text = str(super().format_stack_entry(frame_lineno, lprefix))
        frame = frame_lineno[0]
        name = cell_name(frame.f_code.co_filename, frame)
        if name is None:
            return text
        return text.replace(self.canonic(frame.f_code.co_filename), name if name.startswith("cell [") else "<cell>", 1)

    def interaction(self, frame: FrameType | None, tb: Any) -> None:
        self.bp.where = stopped_at(frame)
        self.bp.stops += 1
        breakpoint_held(+1)  # a checked cell's other ranks do not give up on this one meanwhile
        try:
            super().interaction(frame, tb)
        finally:
            self.bp.where = None
            breakpoint_held(-1)


def _rank() -> int | None:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except (ImportError, RuntimeError):
        return None


def _stop(frame: FrameType | None, header: str | None = None) -> None:
    bp = part(Breakpoints)
    if bp.abandoned or bp.where is not None:
        return
    bp.contact = time.monotonic()
    bp.take()
    while not bp.commands.empty():
        bp.commands.get_nowait()
    if header is not None:  # pdb.set_trace(header=...): shown above the stop
        with bp.lock:
            bp.out.append(header + "\n")
    if bp.on_stop is not None:
        bp.on_stop()
    _RankPdb(bp, frame).set_trace(frame)


def _hook(*args: Any, **kwargs: Any) -> None:
    """``sys.breakpointhook`` on a rank: stop when the cell chose this rank."""
    if _rank() in part(Breakpoints).debug_ranks:
        _stop(caller_frame(1))


def _set_trace(*, header: str | None = None, **kwargs: Any) -> None:
    """``pdb.set_trace`` on a rank: as ``breakpoint()``."""
    if _rank() in part(Breakpoints).debug_ranks:
        _stop(caller_frame(1), header)


def breakpoint(ranks: int | list[int] | tuple[int, ...] | range | None = None) -> None:  # noqa: A001 - as the builtin
    """Stop here on ``ranks`` (None: every rank that reaches it), whatever the cell chose;
    the notebook shows a ``(Pdb rank N)`` prompt. Outside a session's rank, plain pdb.

    Args:
        ranks: the ranks that stop (an int, a list, a range); the others go on.
    """
    frame = caller_frame(1)
    if part(Breakpoints).installed is None:
        pdb.Pdb().set_trace(frame)
        return
    chosen = {ranks} if isinstance(ranks, int) else (None if ranks is None else set(ranks))
    if chosen is None or _rank() in chosen:
        _stop(frame)


def install(on_stop: Callable[[], None] | None = None) -> None:
    """Point ``breakpoint()`` and ``pdb.set_trace`` at this rank's debugger (once per
    engine); ``on_stop`` is called at each stop, before pdb opens (the cell's end is then
    listened for)."""
    bp = part(Breakpoints)
    bp.on_stop = on_stop
    if bp.installed is not None:
        return
    bp.installed = (sys.breakpointhook, pdb.set_trace)
    sys.breakpointhook, pdb.set_trace = _hook, _set_trace  # type: ignore[assignment]


def arm(ranks: list[int]) -> None:
    """The next cell's ``breakpoint()`` stops ``ranks`` (``%%px --debug``)."""
    bp = part(Breakpoints)
    bp.debug_ranks, bp.abandoned = frozenset(ranks), False


def cell_ended() -> None:
    """A cell ended: its choice of ranks ends with it, and so does a step that ran off
    its end (no trace is left to stop in a later cell)."""
    bp = part(Breakpoints)
    bp.debug_ranks, bp.abandoned = frozenset(), False
    if isinstance(getattr(sys.gettrace(), "__self__", None), _RankPdb):
        sys.settrace(None)


def answer(payload: bytes) -> bytes:
    """The watch thread's answer to a debugger request: a ``DebugState`` as JSON."""
    bp = part(Breakpoints)
    bp.contact = time.monotonic()
    if payload.startswith(SEND):
        state = DebugState(where=bp.where, waiting=False, reads=bp.reads, stops=bp.stops)  # before pdb reads it
        bp.commands.put(payload[len(SEND):].decode("utf-8", "replace").strip("\n"))
        return encode(state)
    if payload == RELEASE:
        if bp.where is not None and not bp.abandoned:
            log.warning("fsdp_nb: rank %s: the notebook let go of its breakpoint (%s): it continues, and stops "
                        "no more this cell", _rank(), bp.where)
        bp.abandoned = True
    return encode(DebugState(where=bp.where, waiting=bp.waiting, reads=bp.reads, stops=bp.stops,
                             output=bp.take() if payload == POLL else ""))
