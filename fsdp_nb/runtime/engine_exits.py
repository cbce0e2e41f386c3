"""How an engine ended: the exit status its launcher saw, and the last lines it wrote.

A local launcher starts the engines as children of the notebook and reaps them, so its
process handle keeps each one's exit code (negative: the signal that ended it), and its
output file holds what the engine wrote to stdout and stderr: a C++ abort's message, a
traceback printed as the interpreter went down. Other launchers (mpiexec, Slurm) do not
see the process: nothing is known there.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine.stacks import fold_stacks

if TYPE_CHECKING:
    from .cluster import EngineCluster

__all__ = ["EngineExit", "exit_status", "last_words"]

TAIL_LINES = 12
"""Lines of an engine's output a death report quotes at most (its last ones)."""

_BEFORE_FATAL = 3
"""Lines kept before faulthandler's "Fatal Python error" (what C++ printed as it aborted)."""
_ROUTINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:.]+ \[IPEngine[^\]]*\] (?!(ERROR|CRITICAL) \|)")
"""ipyparallel's own engine log lines below ERROR: registration, heartbeats, extensions."""


@dataclass(frozen=True)
class EngineExit:
    """What is known of one engine after it was found gone."""

    code: int | None
    """Its exit code as its launcher reaped it (negative: the signal that ended it);
    None when unknown (not started by a local launcher) or when it still runs."""
    running: bool
    """The process still runs: the controller dropped it (its heartbeat went silent),
    it did not exit."""
    output: list[str]
    """The last lines it wrote (``last_words``), oldest first; empty when unknown."""

    @property
    def signal(self) -> int | None:
        """The signal that ended it, if a signal did."""
        return -self.code if self.code is not None and self.code < 0 else None


def _launcher(cluster: Any, pid: int | None) -> Any:
    """The local launcher that started process ``pid``, if any."""
    for engine_set in (getattr(cluster, "engines", None) or {}).values():
        for launcher in (getattr(engine_set, "launchers", None) or {}).values():
            if getattr(launcher, "pid", None) == pid:
                return launcher
    return None


def last_words(output: str, limit: int = TAIL_LINES) -> list[str]:
    """What an engine's ``output`` says of how it ended, leaving out ipyparallel's
    routine log (registration and heartbeat lines below ERROR).

    After a crash, faulthandler's report: a few lines before its last "Fatal Python
    error" (a C++ abort's message comes just before it), that line, and the crashing
    thread's stack folded to the user's frames (``engine.stacks.fold_stacks``).
    Otherwise the last ``limit`` lines."""
    lines = [ln.rstrip() for ln in output.splitlines() if ln.strip() and not _ROUTINE.match(ln)]
    fatal = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error:")]
    if not fatal:
        return lines[-limit:]
    at = fatal[-1]
    said = lines[max(0, at - _BEFORE_FATAL):at + 1]
    starts = [i for i in range(at + 1, len(lines)) if lines[i].startswith("Current thread")]
    if starts:
        end = starts[0] + 1
        while end < len(lines) and lines[end].startswith("  "):
            end += 1
        said += fold_stacks("\n".join(lines[starts[0]:end])).splitlines()
    return said


def _output(launcher: Any) -> str:
    """The launcher's output file as it is now; what the launcher kept of it once it
    removed the file (it does when it sees the process stop)."""
    path = getattr(launcher, "output_file", "") or ""
    if path:
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            pass  # removed: the launcher read it first
    kept = getattr(launcher, "_output", None)
    return kept if isinstance(kept, str) else ""


def exit_status(engines: EngineCluster, rank: int, wait: float = 2.0) -> EngineExit:
    """How ``rank``'s engine ended, waiting up to ``wait`` seconds for its launcher to
    reap it.

    Reads, never signals, never reaps while the launcher's own thread may: two threads
    waiting on one child race, and the loser learns nothing (psutil then keeps None as
    the code). So this waits for the pid to be gone (reaped) and only then asks the
    launcher's process handle, which keeps the code its reaping thread got."""
    import psutil

    launcher = _launcher(engines.cluster, engines.pids[rank]) if engines.cluster is not None else None
    process = getattr(launcher, "process", None)
    if launcher is None or process is None:
        return EngineExit(None, False, [])
    deadline = time.monotonic() + wait
    while psutil.pid_exists(process.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    code: int | None = None
    running = False
    try:
        code = process.wait(timeout=0)  # the kept code; reaps it here only if nobody did
    except psutil.TimeoutExpired:
        running = True
    except (psutil.Error, ChildProcessError):
        pass
    if code is None and not running:
        stopped = getattr(launcher, "stop_data", None) or {}
        code = stopped.get("exit_code") if isinstance(stopped.get("exit_code"), int) else None
    return EngineExit(code, running, last_words(_output(launcher)))
