"""Breakpoints in cells, notebook side: the ``(Pdb rank N)`` console.

While a call runs, the gather loop asks every rank where it is (the hang watch,
``fsdp_nb.hangs.hang_watch.Watching``); a rank stopped at a breakpoint
(``fsdp_nb.debugging.rank_breakpoints``) says where, and the loop hands the stop to
:func:`console`. It reads command lines with ``input()``, which in a kernel is the
kernel's own input request, so the prompt shows under the cell in JupyterLab,
Notebook and VS Code alike, and sends them to the rank's hang-watch thread, which
answers while the rank's main thread is stopped. The ranks not stopped wait in their
next collective meanwhile; no timeout runs and no hang is reported while the console
is open.

Beyond pdb's own commands: ``rank N`` switches to a stopped rank; ``ranks 0-3 CMD``
(or ``ranks 0,2 CMD``) sends ``CMD`` to several, their answers merged as cell output
is (an answer alike on several ranks is shown once); ``c`` continues every stopped
rank. Ctrl-C (interrupting the kernel) lets every rank go and interrupts the cell as
Ctrl-C does; a rank not answering is named and left to its hold time.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from ..runtime.output_lines import rank_label
from . import rank_breakpoints as _bp
from .wire_breakpoints import DebugState

__all__ = ["ANSWER_S", "console", "parse_ranks"]

log = logging.getLogger("fsdp_nb")

Ask = Callable[[dict[int, bytes]], "dict[int, DebugState | None]"]
"""Sends each rank its debugger request; rank -> its ``DebugState`` (None: no answer)."""

ANSWER_S = 2.0
"""Seconds a command's ranks have to answer before the prompt comes back without them
(a ``n`` over a collective that waits for a rank still stopped)."""
_CONTINUE = frozenset({"c", "cont", "continue"})
_QUIT = frozenset({"q", "quit", "exit"})


def parse_ranks(text: str, world_size: int) -> list[int]:
    """``0-3``, ``0,2`` or ``1`` as a sorted list of ranks; a ValueError naming what is
    allowed for anything else or a rank outside the session."""
    out: set[int] = set()
    bad: list[str] = []
    try:
        for piece in text.split(","):
            lo, _, hi = piece.partition("-")
            first, last = int(lo), int(hi or lo)
            if first > last:
                raise ValueError(piece)
            if first < 0 or last >= world_size:
                bad.append(piece)
            else:
                out.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"ranks are written 0-3, 0,2 or 1; got {text!r}") from None
    if bad or not out:
        raise ValueError(f"rank(s) {','.join(bad) or text} are not in this session (0-{world_size - 1})")
    return sorted(out)


def _merged(answers: dict[int, str]) -> str:
    """Each answer once, prefixed by the ranks that gave it when several ranks answered."""
    if len(answers) == 1:
        return next(iter(answers.values()))
    groups: dict[str, list[int]] = {}
    for r, text in sorted(answers.items()):
        groups.setdefault(text, []).append(r)
    out = []
    for text, ranks in groups.items():
        label = f"[{rank_label(ranks)}]"
        out.append(f"{label}\n{text}" if text else f"{label} (nothing printed)\n")
    return "".join(out)


class _Holder(threading.Thread):
    """Tells the stopped ranks every ``HOLD_EVERY_S`` that the notebook is still there, for
    up to ``idle_s`` without a command (``typed`` marks one); then lets them go."""

    def __init__(self, ask: Ask, ranks: Callable[[], list[int]], idle_s: float):
        super().__init__(name="fsdp_nb-breakpoint-hold", daemon=True)
        self.ask, self.ranks, self.idle_s, self.done = ask, ranks, idle_s, threading.Event()
        self.last = time.monotonic()

    def typed(self) -> None:
        self.last = time.monotonic()

    def run(self) -> None:
        while not self.done.wait(_bp.HOLD_EVERY_S):
            idle = time.monotonic() - self.last > self.idle_s
            if idle:
                log.warning("fsdp_nb: no debugger command for %.0f s: the stopped ranks go on before the others' "
                            "collectives time out (interrupt the kernel to end the prompt)", self.idle_s)
            try:
                self.ask({r: _bp.RELEASE if idle else _bp.HOLD for r in self.ranks()})
            except Exception as exc:  # noqa: BLE001 - a watch link gone: the ranks' own hold time ends the stop
                log.warning("fsdp_nb: could not hold the stopped ranks: %s", exc)
            if idle:
                return


def _collect(ask: Ask, ranks: list[int], wait: float, before: dict[int, DebugState] | None = None,
             continuing: bool = False) -> dict[int, DebugState | None]:
    """Poll ``ranks`` until each has answered: pdb asks for its next line (more lines than
    it had asked for ``before``), or, ``continuing``, it left the stop (or stopped again
    since); or until ``wait`` s passed. Each rank's last state with everything it printed
    meanwhile."""
    texts: dict[int, list[str]] = {r: [] for r in ranks}
    last: dict[int, DebugState | None] = {}
    deadline = time.monotonic() + wait
    todo = list(ranks)
    while todo:
        for r, st in ask({r: _bp.POLL for r in todo}).items():
            last[r] = st
            if st is not None:
                texts[r].append(st.output)

        def answered(r: int) -> bool:
            st, was = last[r], (before or {}).get(r)
            if st is None:
                return True
            if continuing:
                return st.where is None or (was is not None and st.stops > was.stops)
            return st.waiting and st.reads > (was.reads if was is not None else 0)

        todo = [r for r in todo if not answered(r)]
        if not todo or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return {r: None if st is None else replace(st, output="".join(texts[r])) for r, st in last.items()}


def _stopped(states: dict[int, DebugState | None]) -> list[int]:
    """The ranks whose pdb waits for a command."""
    return sorted(r for r, st in states.items() if st is not None and st.waiting and st.where is not None)


def _told(states: dict[int, DebugState | None], ranks: list[int]) -> str:
    """Where each of ``ranks`` stopped, then what the ranks printed, merged."""
    return ("".join(f"fsdp_nb: rank {r} stopped at a breakpoint in {states[r].where}\n"  # type: ignore[union-attr]
                    for r in ranks) + _merged({r: st.output for r, st in states.items() if st and st.output}))


def console(ask: Ask, stopped: dict[int, str], world_size: int, read: Callable[[str], str] | None = None,
            show: Callable[[str], Any] = lambda text: print(text, end="", flush=True),
            script: Sequence[str] = (), idle_s: float = 1740.0) -> None:
    """Drive the stopped ranks until none waits for a command (see the module).

    After every command it asks every rank where it is, so a rank that stops while the
    prompt is open (a later breakpoint, the end of a step over a collective) joins it.

    Args:
        ask: sends debugger requests to ranks' watch threads.
        stopped: rank -> where it stopped, as the gather loop found them.
        world_size: the session's ranks (``ranks 0-3`` is checked against it).
        read: reads a command line after a prompt (None: ``input``, the kernel's input request).
        show: shows text under the cell.
        script: command lines taken, in order, before ``read`` is asked (``debug_commands=``),
            each shown after its prompt as if typed: a stop that ends them with ``c`` asks
            nothing. A rank that stops again after a ``c`` runs them again.
        idle_s: seconds without a command before the stopped ranks are let go (the
            prompt stays until it is answered or the kernel interrupted).
    """
    with _python_ctrl_c():
        _drive(ask, stopped, world_size, read, show, script, idle_s)


def _drive(ask: Ask, stopped: dict[int, str], world_size: int, read: Callable[[str], str] | None,
           show: Callable[[str], Any], script: Sequence[str], idle_s: float) -> None:
    """:func:`console`'s loop."""
    everyone = list(range(world_size))
    lines = list(script)
    states = _collect(ask, sorted(stopped), ANSWER_S)
    waiting = _stopped(states)
    show(_told(states, [r for r in sorted(states) if states[r] is not None and states[r].where]))  # type: ignore[union-attr]
    holder = _Holder(ask, lambda: everyone, idle_s)  # a rank that stops later is held too
    holder.start()
    current = waiting[0] if waiting else None
    try:
        while waiting:
            if current not in waiting:
                current = waiting[0]
            prompt = f"(Pdb rank {current}) "
            if lines:
                line = lines.pop(0)
                show(f"{prompt}{line}\n")
            else:
                try:
                    line = (read or input)(prompt)
                except (EOFError, NotImplementedError) as exc:  # a kernel that cannot ask (nbclient, papermill)
                    show(f"fsdp_nb: this kernel cannot read a debugger command ({type(exc).__name__}): every "
                         "stopped rank goes on. Give debug_commands= ending in 'c' to run breakpoints unattended.\n")
                    ask({r: _bp.RELEASE for r in everyone})
                    return
            holder.typed()
            targets, command = _route(line.strip(), current, waiting, world_size, show)
            if not targets:
                continue
            if command.split(" ")[0] in _QUIT:  # also as ``ranks 0-1 q``
                show("fsdp_nb: 'q' would end a rank's cell with BdbQuit while the other ranks wait in their "
                     "collective: 'c' continues every stopped rank; interrupting the kernel ends the cell.\n")
                continue
            if command.startswith("rank ") or command == "rank":
                current = targets[0]
                continue
            go_on = command.split(" ")[0] in _CONTINUE
            sent = ask({r: _bp.SEND + command.encode() for r in targets})
            got = _collect(ask, targets, ANSWER_S, {r: st for r, st in sent.items() if st is not None}, go_on)
            show(_merged({r: st.output for r, st in got.items() if st is not None and st.output}))
            for r in targets:
                st = got.get(r)
                if st is None:
                    show(f"rank {r} did not answer; it is left to its hold time\n")
                elif not st.waiting and not go_on:
                    show(f"rank {r} runs on ({command!r} has not stopped it again within {ANSWER_S:g} s)\n")
            now = ask({r: _bp.POLL for r in everyone})
            again = [r for r in _stopped(now) if r not in waiting or (go_on and r in targets)]
            show(_told(now, again))
            if again and go_on:
                lines = list(script)  # a new stop (a breakpoint in a loop): its script again
            waiting = _stopped(now)
    except BaseException:  # Ctrl-C, or anything else: no rank is left stopped behind the error
        ask({r: _bp.RELEASE for r in everyone})
        raise
    finally:
        holder.done.set()


@contextlib.contextmanager
def _python_ctrl_c() -> Iterator[None]:
    """Python's own Ctrl-C while the console runs: the gather loop's handler only notes a
    Ctrl-C for its next turn, and the kernel's input request ends only on KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, held)


def _route(line: str, current: int | None, waiting: list[int], world_size: int,
           show: Callable[[str], Any]) -> tuple[list[int], str]:
    """The ranks a line goes to and the pdb command it carries; ``([], "")`` for a line
    that was only answered here (an unknown rank)."""
    if current is None:
        return [], ""
    word, _, rest = line.partition(" ")
    try:
        if word == "rank":
            chosen = parse_ranks(rest.strip(), world_size)
            if len(chosen) != 1 or chosen[0] not in waiting:
                raise ValueError(f"rank {rest.strip()} is not stopped (stopped: {rank_label(waiting)})")
            return chosen, "rank"
        if word == "ranks":
            spec, _, command = rest.strip().partition(" ")
            chosen = parse_ranks(spec, world_size)
            gone = [r for r in chosen if r not in waiting]
            if gone:
                show(f"{rank_label(gone)} not stopped; asking {rank_label(waiting)}\n")
            chosen = [r for r in chosen if r in waiting]
            return (chosen, command) if chosen and command else ([], "")
    except ValueError as exc:
        show(f"{exc}\n")
        return [], ""
    if word in _CONTINUE:
        return list(waiting), line
    return [current], line
