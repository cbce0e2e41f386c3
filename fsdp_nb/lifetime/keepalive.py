"""A session's life beyond its kernel: its record, its watchdog, and listing sessions.

Every session fsdp_nb starts gets a ``Keeper``: it writes the session record
(``fsdp_nb.lifetime.record``) and starts the watchdog (``fsdp_nb.lifetime.watchdog``), which
stops the controller and engines when the kernel dies, unless ``keep_alive``. A
kept-alive session's record is what ``Session.attach()`` reads in the next kernel;
``sessions()`` lists them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine.private_files import private_file
from ..engine.process_handles import process_alive, process_stamp
from .record import SessionRecord, list_records

if TYPE_CHECKING:
    from ..context import SessionContext

log = logging.getLogger("fsdp_nb")

__all__ = ["Keeper", "SessionSummary", "check_keep_alive", "sessions"]


def check_keep_alive(keep_alive: Any) -> bool | float:
    """``keep_alive``: False, True, or seconds > 0 (stop after that long unattended)."""
    if isinstance(keep_alive, bool):
        return keep_alive
    if isinstance(keep_alive, (int, float)) and keep_alive > 0:
        return float(keep_alive)
    raise ValueError(
        f"keep_alive must be False, True or a number of seconds > 0 (how long the engines "
        f"may stay idle with no kernel attached), got {keep_alive!r}"
    )


def _engine_pids(ctx: SessionContext) -> list[tuple[int, float | None]]:
    here = socket.gethostname()
    c = ctx.cluster
    return [(pid, started if started is not None else process_stamp(pid))
            for pid, host, started in zip(c.pids, c.hosts, c.started) if pid and host == here]


class Keeper:
    """The notebook's side of one session's record and watchdog."""

    def __init__(self, record: SessionRecord):
        self.record = record
        """The session record as last written."""
        self._watchdog: subprocess.Popen | None = None

    @classmethod
    def begin(cls, ctx: SessionContext, keep_alive: bool | float, connection: dict[str, Any]) -> Keeper:
        """Write ``sess``'s record; start its watchdog when fsdp_nb started the engines."""
        owns = ctx.cluster.owns_engines
        started = ctx.cluster.cluster
        if owns and started is not None:
            cluster_id = started.cluster_id
        else:  # a connected cluster may have no id (a url file): make one
            cluster_id = connection.get("cluster_id") or f"connected-{int(time.time())}-{os.getpid()}"
        record = SessionRecord(
            cluster_id=cluster_id,
            owns_engines=owns,
            connection=connection,
            backend=str(ctx.backend),
            launcher=ctx.launcher,
            pg_timeout=ctx.pg_timeout,
            omp_threads=ctx.omp_threads,
            keep_alive=keep_alive,
            standby=ctx.cluster.wants_standby,
        )
        keeper = cls(record)
        keeper.take(ctx)  # the owner, the ranks and their pids
        return keeper

    @property
    def keep_alive(self) -> bool | float:
        """The session's ``keep_alive`` setting."""
        return self.record.keep_alive

    def take(self, ctx: SessionContext) -> None:
        """Make this kernel the owner (start or attach), with ``sess``'s ranks; start a
        watchdog if none runs."""
        rec = self.record
        rec.owner_pid, rec.owner_stamp, rec.attached = os.getpid(), process_stamp(os.getpid()), time.time()
        self.refresh(ctx)
        if rec.owns_engines and not process_alive(rec.watchdog_pid, rec.watchdog_stamp):
            self._start_watchdog()

    def refresh(self, ctx: SessionContext) -> None:
        """Write the record again with ``sess``'s current ranks (after a restart)."""
        self.record.ranks = [dataclasses.asdict(r) for r in ctx.ranks]
        self.record.engine_pids = _engine_pids(ctx)
        self.record.controller_pids = ctx.cluster.controller_pids
        old = self.record.stack_folder
        if old and old != ctx.health.folder:  # an earlier kernel's: its engines moved on
            shutil.rmtree(old, ignore_errors=True)
        self.record.stack_folder = ctx.health.folder
        self.record.write()

    @property
    def _logfile(self) -> str:
        return self.record.path.removesuffix(".json") + ".watchdog.log"

    def _start_watchdog(self) -> None:
        rec = self.record
        log_fd = private_file(self._logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        with os.fdopen(log_fd, "ab") as out, open(os.devnull, "rb") as devnull:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-m", "fsdp_nb.lifetime.watchdog", rec.path],
                stdin=devnull, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # a kernel's process-group kill must spare it
            )
        rec.watchdog_pid, rec.watchdog_stamp = self._watchdog.pid, process_stamp(self._watchdog.pid)
        rec.write()  # again: the watchdog reads the record, so it was written first

    def end(self) -> None:
        """The session is over: remove the record and stop the watchdog (one a previous
        kernel started sees the record gone and exits by itself)."""
        self.record.remove()
        if self._watchdog is not None:  # it has nothing left to watch: no need to wait a poll
            self._watchdog.terminate()
            self._watchdog.wait()
            self._watchdog = None
        try:
            os.remove(self._logfile)
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class SessionSummary:
    """One session that ``Session.attach`` could reach (``fsdp_nb.sessions()``)."""

    cluster_id: str
    """``Session.attach(cluster_id=...)`` takes it."""
    world_size: int
    """Number of ranks."""
    backend: str
    """The process group's backend."""
    keep_alive: bool | float
    """Its ``keep_alive`` setting."""
    started: str
    """When it was started (local time)."""
    owner_pid: int
    """The kernel that holds it (or last held it)."""
    attached: bool
    """That kernel still runs; ``attach`` from another kernel is refused meanwhile."""

    def __str__(self) -> str:
        held = f"held by kernel pid {self.owner_pid}" if self.attached else "no kernel attached"
        if isinstance(self.keep_alive, bool):  # not a dict lookup: 1.0 == True
            keep = "keep_alive" if self.keep_alive else "stops with its kernel"
        else:
            keep = f"keep_alive={self.keep_alive:g} s"
        return (
            f"{self.cluster_id}: {self.world_size} ranks ({self.backend}), started "
            f"{self.started}, {held}, {keep}"
        )


def _controller_alive(record: SessionRecord) -> bool:
    """For a session fsdp_nb started: its cluster file is there and names a live
    controller process (connected clusters are not ours to judge: True)."""
    if not record.owns_engines:
        return True
    try:
        with open(record.connection["cluster_file"]) as f:
            pid = json.load(f)["controller"]["state"]["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return process_alive(pid)


def live_records() -> list[SessionRecord]:
    """Records whose cluster is still there, newest first (stale ones are removed)."""
    out = []
    for rec in list_records():
        if _controller_alive(rec):
            out.append(rec)
        else:
            log.info("removing the record of stopped session %s", rec.cluster_id)
            rec.remove()
    return out


def sessions() -> list[SessionSummary]:
    """The sessions of this user that are still running, newest first."""
    return [
        SessionSummary(
            r.cluster_id, len(r.ranks), r.backend, r.keep_alive,
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started)),
            r.owner_pid, r.owner_alive,
        )
        for r in live_records()
    ]
