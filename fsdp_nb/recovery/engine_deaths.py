"""Why a rank's engine is gone: the lines a ``DeadRankError`` gives after its first.

Called by the session's failure policy (``on_dead``) before the dead ranks are replaced,
while their launchers still hold what they saw. For each dead rank, from what its
launcher saw (``runtime.engine_exits``):

- ended by SIGKILL, which fsdp_nb did not send: the kernel's out-of-memory killer when
  the kernel's count of such kills rose, with the memory the rank last held
  (``sess.memory()``'s feed) and the cheapest change that fits from the last plan;
- ended by another signal (SIGSEGV, SIGABRT, ...): named as a crash, not blamed on memory;
- exited by itself: its exit code;
- still running: the controller dropped it (its heartbeat went silent), it did not exit.

Each but the SIGKILL quotes the last lines the engine wrote (a C++ abort's message, a
fatal error's traceback), which otherwise only the launcher's log file held.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING

from ..display.tables import fmt_bytes
from ..memory.memory_report import cheapest_change
from ..runtime.engine_exits import EngineExit, exit_status

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["explain_deaths", "kernel_oom_kills", "lines_for_exit"]

log = logging.getLogger("fsdp_nb")


def kernel_oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended since boot
    (``oom_kill`` in ``/proc/vmstat``, memory cgroups' kills included); None off Linux."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def lines_for_exit(rank: int, ended: EngineExit) -> list[str]:
    """The lines for one engine that did not die by SIGKILL (a pure function); [] when
    nothing is known of it."""
    if ended.running:
        head = (f"rank {rank}'s engine process still runs, but the controller dropped it: its heartbeat "
                "went unanswered (the process stopped, or starved of CPU); sess.restart() replaces it")
    elif ended.signal is not None:
        sig = ended.signal
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "an unnamed signal"
        head = f"rank {rank}'s engine was ended by {name} (signal {sig}): it crashed or something signalled it"
    elif ended.code is not None:
        head = f"rank {rank}'s engine exited by itself with code {ended.code}"
    elif ended.output:
        head = f"rank {rank}'s engine ended (its exit code is unknown)"
    else:
        return []
    if not ended.output:
        return [head]
    return [head + "; the last it wrote:", *(f"    {line}" for line in ended.output)]


def explain_deaths(ctx: SessionContext, dead: list[int], oom_kills_before: int | None) -> list[str]:
    """Lines that say how each rank in ``dead`` ended, as far as its launcher knows.

    ``oom_kills_before`` is ``kernel_oom_kills()`` as the call started: a rise since
    then blames a SIGKILL on the kernel's out-of-memory killer; no rise clears it."""
    out: list[str] = []
    sigkilled = False
    now = kernel_oom_kills()
    oom = None if now is None or oom_kills_before is None else now > oom_kills_before
    for r in dead:
        try:
            ended = exit_status(ctx.cluster, r)
        except Exception as exc:  # noqa: BLE001 - the death itself must still be reported
            log.debug("fsdp_nb: reading how rank %d ended failed: %s", r, exc)
            continue
        if ended.signal != signal.SIGKILL:
            out += lines_for_exit(r, ended)
            continue
        last = ctx.last_memory.get(r)
        of = f" of {fmt_bytes(last.budget)}" if last is not None and last.budget else ""
        held = (f"its last memory sample, {time.time() - (last.received or last.t):.0f} s before, showed "
                f"{fmt_bytes(last.used)}{of}" if last is not None else
                "no memory samples were kept (sess.memory() keeps each rank's history)")
        who = ("the kernel's out-of-memory killer ended it (the kernel's count of such kills rose)" if oom else
               "not the kernel's out-of-memory killer (its count of kills did not change): another process"
               if oom is False else "on Linux most often the kernel's out-of-memory killer")
        out.append(f"rank {r} was killed by SIGKILL, which fsdp_nb did not send: {who}; {held}")
        sigkilled = True
    if sigkilled and oom is not False:
        out.append(cheapest_change(ctx.last_plan, "the last plan"))
    return out
