"""What a session leaves on disk so that its engines can be found again, or stopped.

One JSON file per session that fsdp_nb started (and per ``connect(keep_alive=...)``
session) in ``$IPYTHONDIR/fsdp_nb/sessions/``: the ipyparallel cluster file, the rank
order, the backend, the kernel that owns it, and every process of the session
(engines, controller and the controller's children) with its start time. The watchdog
(``fsdp_nb.lifetime.watchdog``) reads it to stop them all when the owning kernel dies; a
new kernel reads it to ``Session.attach()``. Written atomically (a rename), removed
by ``shutdown()``.

Records name pids, addresses and cluster files: the folder is 0700 and each file 0600
(``engine.private_files``), created without following a link someone may have planted
in their place.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine.private_files import private_file, private_folder
from ..engine.process_handles import process_alive

log = logging.getLogger("fsdp_nb")

__all__ = ["SessionRecord", "folder", "list_records"]


def folder() -> str:
    """Where session records live: ``$IPYTHONDIR/fsdp_nb/sessions`` (one per user)."""
    from IPython.paths import get_ipython_dir

    return os.path.join(get_ipython_dir(), "fsdp_nb", "sessions")


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
    controller_pids: list[tuple[int, float | None]] = field(default_factory=list)
    """(pid, start time) of the controller and its children (its schedulers), which
    the watchdog and ``shutdown`` stop even when the controller itself was killed."""
    watchdog_pid: int | None = None
    """The watchdog process, if one runs."""
    watchdog_stamp: float | None = None
    """That process's start time (``process_stamp``)."""
    stack_folder: str | None = None
    """Where the engines write their stack dumps (removed when the session stops)."""
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
        private_folder(folder())
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with os.fdopen(private_file(tmp), "w") as f:
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
