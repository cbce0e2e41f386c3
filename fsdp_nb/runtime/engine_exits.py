"""How an engine ended: the exit status its launcher saw.

A local launcher starts the engines as children of the notebook and reaps them, so its
process handle keeps each one's exit code (negative: the signal that ended it). Other
launchers (mpiexec, Slurm) do not see the process: nothing is known there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cluster import EngineCluster

__all__ = ["exit_signal"]


def _launcher(cluster: Any, pid: int | None) -> Any:
    """The local launcher that started process ``pid``, if any."""
    for engine_set in (getattr(cluster, "engines", None) or {}).values():
        for launcher in (getattr(engine_set, "launchers", None) or {}).values():
            if getattr(launcher, "pid", None) == pid:
                return launcher
    return None


def exit_signal(engines: EngineCluster, rank: int, wait: float = 2.0) -> int | None:
    """The signal that ended ``rank``'s engine, waiting up to ``wait`` seconds for it to
    be reaped; None if it exited by itself, is unknown, or still runs."""
    import psutil

    launcher = _launcher(engines.cluster, engines.pids[rank]) if engines.cluster is not None else None
    process = getattr(launcher, "process", None)
    if process is None:
        return None
    try:  # the launcher's own thread reaps its child; psutil keeps the code it got
        code = process.wait(timeout=wait)
    except (psutil.TimeoutExpired, psutil.Error, ChildProcessError):
        return None
    return -code if isinstance(code, int) and code < 0 else None
