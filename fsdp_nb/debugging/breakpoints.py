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

import logging
import threading
import time
from collections.abc import Callable, Sequence
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
    try:
        for piece in text.split(","):
            lo, _, hi = piece.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"ranks are written 0-3, 0,2 or 1; got {text!r}") from None
    bad = sorted(r for r in out if not 0 <= r < world_size)
    if bad or not out:
        raise ValueError(f"rank(s) {bad or text} are not in this session (0-{world_size - 1})")
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
            if time.monotonic() - self.last > self.idle_s:
                log.warning("fsdp_nb: no debugger command for %.0f s: the stopped ranks go on before the others' "
                            "collectives time out (interrupt the kernel to end the prompt)", self.idle_s)
                self.ask({r: _bp.RELEASE for r in self.ranks()})
                return
            self.ask({r: _bp.HOLD for r in self.ranks()})


def _collect(ask: Ask, ranks: list[int], wait: float, after: dict[int, int] | None = None,
             continuing: bool = False) -> dict[int, DebugState | None]:
    """Poll ``ranks`` until each has answered: pdb asks for its next line (more lines than
    ``after`` said it had asked for), or, ``continuing``, it left the stop; or until
    ``wait`` s passed. Each rank's last state with everything it printed meanwhile."""
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
            st = last[r]
            if st is None:
                return True
            if continuing:
                return st.where is None
            return st.waiting and st.reads > (after or {}).get(r, 0)

        todo = [r for r in todo if not answered(r)]
        if not todo or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return {r: None if st is None else DebugState(where=st.where, waiting=st.waiting, reads=st.reads,
                                                  output="".join(texts[r])) for r, st in last.items()}


def console(ask: Ask, stopped: dict[int, str], world_size: int, read: Callable[[str], str] | None = None,
            show: Callable[[str], Any] = lambda text: print(text, end="", flush=True),
            script: Sequence[str] = (), idle_s: float = 1740.0) -> None:
    """Drive the stopped ranks until none waits for a command (see the module).

    Args:
        ask: sends debugger requests to ranks' watch threads.
        stopped: rank -> where it stopped, as the gather loop found them.
        world_size: the session's ranks (``ranks 0-3`` is checked against it).
        read: reads a command line after a prompt (None: ``input``, the kernel's input request).
        show: shows text under the cell.
        script: command lines taken, in order, before ``read`` is asked (``debug_commands=``),
            each shown after its prompt as if typed: a stop that ends them with ``c`` asks nothing.
        idle_s: seconds without a command before the stopped ranks are let go (the
            prompt stays until it is answered or the kernel interrupted).
    """
    lines = list(script)
    states = _collect(ask, sorted(stopped), ANSWER_S)
    waiting = sorted(r for r, st in states.items() if st is not None and st.waiting)
    show("".join(f"fsdp_nb: rank {r} stopped at a breakpoint in {st.where}\n" for r, st in sorted(states.items())
                 if st is not None and st.where) + _merged({r: st.output for r, st in states.items() if st}))
    holder = _Holder(ask, lambda: list(waiting), idle_s)
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
                    ask({r: _bp.RELEASE for r in range(world_size)})
                    show(f"fsdp_nb: this kernel cannot read a debugger command ({type(exc).__name__}): every "
                         "stopped rank goes on. Give debug_commands= ending in 'c' to run breakpoints unattended.\n")
                    return
            holder.typed()
            if line.strip() in _QUIT:
                show("fsdp_nb: 'q' would end the rank's cell with BdbQuit while the other ranks wait in their "
                     "collective: 'c' continues every stopped rank; interrupting the kernel ends the cell.\n")
                continue
            targets, command = _route(line.strip(), current, waiting, world_size, show)
            if not targets:
                continue
            if command.startswith("rank ") or command == "rank":
                current = targets[0]
                continue
            sent = ask({r: _bp.SEND + command.encode() for r in targets})
            after = {r: st.reads for r, st in sent.items() if st is not None}
            got = _collect(ask, targets, ANSWER_S, after, continuing=command.split(" ")[0] in _CONTINUE)
            show(_merged({r: st.output for r, st in got.items() if st is not None and st.output}))
            for r in targets:
                st = got.get(r)
                if st is None:
                    show(f"rank {r} did not answer; it is left to its hold time\n")
                elif not st.waiting and command.split(" ")[0] not in _CONTINUE:
                    show(f"rank {r} runs on ({command!r} has not stopped it again within {ANSWER_S:g} s)\n")
            waiting = sorted(r for r, st in ask({r: _bp.POLL for r in waiting}).items()
                             if st is not None and st.waiting and st.where is not None)
            if waiting and command.split(" ")[0] in _CONTINUE:
                lines = list(script)  # stopped again (a breakpoint in a loop): a new stop, its script again
    except KeyboardInterrupt:
        ask({r: _bp.RELEASE for r in range(world_size)})
        raise
    finally:
        holder.done.set()


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
