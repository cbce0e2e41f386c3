"""What a session leaves on disk so that its engines can be found again, or stopped.

One JSON file per session that fsdp_nb started (and per ``connect(keep_alive=...)``
session) in ``$IPYTHONDIR/fsdp_nb/sessions/``: the ipyparallel cluster file, the rank
order, the backend, and the kernel that owns it. The watchdog
(``fsdp_nb.watchdog``) reads it to stop the engines when the owning kernel dies; a
new kernel reads it to ``Session.attach()``. Written atomically (a rename), removed
by ``shutdown()``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

log = logging.getLogger("fsdp_nb")

__all__ = [
    "SessionRecord", "folder", "handle_alive", "list_records", "process_alive", "process_stamp",
]


def folder() -> str:
    """Where session records live: ``$IPYTHONDIR/fsdp_nb/sessions`` (one per user)."""
    from IPython.paths import get_ipython_dir

    return os.path.join(get_ipython_dir(), "fsdp_nb", "sessions")


def process_stamp(pid: int) -> float | None:
    """The start time of process ``pid`` (with the pid, it names one process even
    after the pid is reused); None if it cannot be read (then only the pid is checked)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def process_alive(pid: int | None, stamp: float | None = None) -> bool:
    """True if ``pid`` runs (a zombie does not count) and, given ``stamp``, is the process
    it was taken from. A process we may not look at counts as alive."""
    if not pid:
        return False
    try:
        return handle_alive(psutil.Process(pid), stamp)
    except psutil.NoSuchProcess:
        return False


def handle_alive(p: psutil.Process, stamp: float | None = None) -> bool:
    """:func:`process_alive` for a process handle already held (one status read)."""
    try:
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return stamp is None or abs(p.create_time() - stamp) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


@dataclass
class SessionRecord:
    """One session on disk (plain data, JSON)."""

    cluster_id: str
    """The ipyparallel cluster id: ``Session.attach(cluster_id=...)`` names it."""
    owns_engines: bool
    """fsdp_nb started the controller and engines (``Session(n)``), so it may stop them."""
    connection: dict[str, Any]
    """How to reach the cluster: ``cluster_file`` (started) or the ``connect`` arguments."""
    backend: str
    """The process group's backend."""
    launcher: str
    """The engine launcher, or ``"connected"``."""
    pg_timeout: float
    """The group's collective timeout (seconds)."""
    omp_threads: int | None
    """``OMP_NUM_THREADS`` given to CPU ranks."""
    keep_alive: bool | float
    """False: stopped when the owner dies; True: kept; seconds: kept, then stopped
    after that long with no kernel attached and no rank busy."""
    standby: bool = True
    """Whether the session keeps a standby engine (``Session(standby=...)``)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """``RankInfo`` of each rank, in rank order, as dicts."""
    owner_pid: int = 0
    """The kernel process that holds the session now."""
    owner_stamp: float | None = None
    """That process's start time (``process_stamp``)."""
    engine_pids: list[tuple[int, float | None]] = field(default_factory=list)
    """(pid, start time) of each engine on this host, for the watchdog's last resort."""
    watchdog_pid: int | None = None
    """The watchdog process, if one runs."""
    started: float = field(default_factory=time.time)
    """When the session was started (Unix time)."""
    attached: float = field(default_factory=time.time)
    """When its owner last took it (start or attach)."""

    @property
    def path(self) -> str:
        """This record's file."""
        return os.path.join(folder(), f"{self.cluster_id}.json")

    @property
    def owner_alive(self) -> bool:
        """The kernel that holds the session still runs."""
        return process_alive(self.owner_pid, self.owner_stamp)

    def write(self) -> None:
        """Write (or replace) the record atomically."""
        os.makedirs(folder(), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
        os.replace(tmp, self.path)

    def remove(self) -> None:
        """Delete the record (the session is over)."""
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    @classmethod
    def read(cls, path: str) -> SessionRecord | None:
        """The record in ``path``; None if it is gone or unreadable (logged)."""
        try:
            with open(path) as f:
                data = json.load(f)
            names = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in names})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as exc:
            log.warning("unreadable fsdp_nb session record %s: %s", path, exc)
            return None


def list_records() -> list[SessionRecord]:
    """Every session record of this user, newest first."""
    try:
        names = [n for n in os.listdir(folder()) if n.endswith(".json")]
    except FileNotFoundError:
        return []
    found = [SessionRecord.read(os.path.join(folder(), n)) for n in names]
    return sorted((r for r in found if r is not None), key=lambda r: -r.started)
