"""What the notebook's terminal sees while a call runs: each rank's output, streamed and
tagged, and Ctrl-C, turned into a flag the gather loop checks.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from .output_lines import LineMerger

if TYPE_CHECKING:
    from .results import Pending

__all__ = ["OUTPUT_LIMIT", "CtrlC", "Echo", "tag"]

OUTPUT_LIMIT = 64_000
"""At most this many characters of one rank's stdout or stderr are echoed per call."""


class CtrlC:
    """While sending a call and gathering it, Ctrl-C sets a flag that the poll loop turns
    into KeyboardInterrupt.

    A KeyboardInterrupt raised at an arbitrary point can land inside a destructor
    (zmq frames) and be swallowed, leaving the notebook waiting, or stop a call sent to
    some ranks only; checking a flag at the top of each poll makes the interrupt
    reliable (one that came while sending is carried to the gather in
    ``Pending.interrupted``). A second Ctrl-C raises at once.
    Only active in the main thread and when SIGINT has Python's default handler.
    """

    def __init__(self) -> None:
        self.hit = False
        self._old: Any = None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def check(self) -> None:
        if self.hit:
            self.hit = False
            raise KeyboardInterrupt

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


class Echo:
    """Streams each rank's new stdout / stderr while a call runs, tagged by rank.

    Whole lines only (a partial line waits for its newline or the end), and at most
    ``OUTPUT_LIMIT`` characters per rank and stream, so a chatty rank cannot flood
    the notebook. With ``pending.merged`` and more than one rank shown, lines the ranks
    print alike show once, naming the ranks (``output_lines``).
    """

    def __init__(self, pending: Pending):
        self.pending = pending
        self.offsets: dict[tuple[int, str], int] = {}
        self.shown: dict[tuple[int, str], int] = {}
        merged = pending.merged and (pending.echoed is None or len(pending.echoed) > 1) and len(pending.results) > 1
        self.mergers = {name: LineMerger(_writer(name)) for name in _STREAMS} if merged else None

    def flush(self, final: bool = False) -> None:
        # which ranks may still print is taken before their output is read: one that ends
        # in between counts as running, so its last lines are waited for, not split off
        shown = self.pending.echoed
        running = [r for r, ar in self.pending.results.items()
                   if (shown is None or r in shown) and not ar.wait_for_output(0)] if self.mergers else []
        self._read(final)
        if self.mergers is not None:
            for merger in self.mergers.values():
                merger.emit(running, final)

    def _read(self, final: bool) -> None:
        echoed = self.pending.echoed
        for r in sorted(self.pending.results):
            if echoed is not None and r not in echoed:
                continue
            md = self.pending.results[r].metadata
            for name in _STREAMS:
                text = md.get(name)
                text = text if isinstance(text, str) else "".join(text or [])
                key = (r, name)
                start = self.offsets.get(key, 0)
                end = len(text) if final else text.rfind("\n", start) + 1
                if end <= start:
                    continue
                self.offsets[key] = end
                chunk = text[start:end]
                room = OUTPUT_LIMIT - self.shown.get(key, 0)
                if room <= 0:
                    continue
                if len(chunk) > room:
                    chunk = chunk[:room] + f"\n... [rank {r} {name} cut at {OUTPUT_LIMIT} characters]\n"
                self.shown[key] = self.shown.get(key, 0) + len(chunk)
                if self.mergers is not None:
                    self.mergers[name].add(r, chunk.splitlines())
                else:
                    _writer(name)(tag(r, chunk))


_STREAMS = ("stdout", "stderr")


def _writer(name: str) -> Any:
    """Writes to ``sys.<name>`` as it is when written (a kernel or a test may swap it)."""

    def write(text: str) -> None:
        stream = getattr(sys, name)
        stream.write(text)
        stream.flush()

    return write


def tag(rank: int, text: str) -> str:
    """Every line of ``text`` prefixed ``[rank N]``."""
    lines = text.splitlines()
    return "".join(f"[rank {rank}] {line}\n" for line in lines)
