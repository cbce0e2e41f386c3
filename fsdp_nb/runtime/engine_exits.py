"""How an engine ended: the exit status its launcher saw, and the last lines it wrote.

A local launcher starts the engines as children of the notebook and reaps them, so its
process handle keeps each one's exit code (negative: the signal that ended it), and its
output file holds what the engine wrote to stdout and stderr: a C++ abort's message, a
traceback printed as the interpreter went down. Other launchers (mpiexec, Slurm) do not
see the process: nothing is known there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cluster import EngineCluster

__all__ = ["EngineExit", "exit_status", "last_words"]

TAIL_LINES = 12
"""Lines of an engine's output a death report quotes at most (its last ones)."""

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
    """The last ``limit`` lines of an engine's ``output`` that are not ipyparallel's
    routine log (its registration and heartbeat lines at INFO and WARNING), which would
    push a crash's own message out of the tail."""
    lines = [ln.rstrip() for ln in output.splitlines() if ln.strip() and not _ROUTINE.match(ln)]
    return lines[-limit:]


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
    """How ``rank``'s engine ended, waiting up to ``wait`` seconds for it to be reaped.

    Reads, never signals: the code comes from the launcher's own process handle (psutil
    keeps the code its reaping thread got) or the launcher's stop record."""
    import psutil

    launcher = _launcher(engines.cluster, engines.pids[rank]) if engines.cluster is not None else None
    process = getattr(launcher, "process", None)
    if launcher is None or process is None:
        return EngineExit(None, False, [])
    code: int | None = None
    running = False
    try:
        code = process.wait(timeout=wait)
    except psutil.TimeoutExpired:
        running = True
    except (psutil.Error, ChildProcessError):
        pass
    if code is None and not running:
        stopped = getattr(launcher, "stop_data", None) or {}
        code = stopped.get("exit_code") if isinstance(stopped.get("exit_code"), int) else None
    return EngineExit(code, running, last_words(_output(launcher)))
