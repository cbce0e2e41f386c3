"""The watchdog: a small process that stops a session's engines when its kernel dies.

``python -m fsdp_nb.lifetime.watchdog RECORD`` runs beside every session fsdp_nb starts, in a
session of its own (so the signal that kills a kernel's process group spares it). It
reads the session record (``fsdp_nb.lifetime.record``) every ``POLL`` seconds:

- record gone: the session was shut down (or the cluster stopped): exit;
- owner kernel alive: nothing to do;
- owner gone and ``keep_alive`` false: stop the controller, its schedulers and the
  engines (SIGTERM, then SIGKILL for any still there after ``KILL_AFTER``): the
  processes the record names, each through a handle checked against its start time,
  so a pid reused since is never signalled (ipyparallel's own ``stop_cluster`` would
  signal the pids in its cluster file unchecked, and misses the schedulers of a
  controller killed with SIGKILL); remove the cluster's files and the record, exit:
  no orphans holding memory;
- owner gone and ``keep_alive`` a number of seconds: once no kernel has held it and
  no rank has run anything for that long, stop it the same way;
- ``keep_alive=True``: keep it for the next ``Session.attach()``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from typing import TYPE_CHECKING

from ..engine.process_handles import stop_processes
from .record import SessionRecord

if TYPE_CHECKING:
    import ipyparallel as ipp

log = logging.getLogger("fsdp_nb.lifetime.watchdog")

POLL = 0.5
"""Seconds between looks at the record and the owner."""
KILL_AFTER = 10.0
"""Seconds the session's processes get to exit after SIGTERM before they are killed."""


class _Idle:
    """Whether a kept-alive session is idle: no rank has a task queued or running
    (asked of the controller through a client made on first use)."""

    def __init__(self, record: SessionRecord):
        self.record = record
        self.client: ipp.Client | None = None
        self.since: float | None = None

    def busy(self) -> bool:
        try:
            if self.client is None:
                import ipyparallel as ipp

                self.client = ipp.Cluster.from_file(
                    self.record.connection["cluster_file"]
                ).connect_client_sync()
            status = self.client.queue_status()
        except Exception as exc:  # noqa: BLE001 - an unreachable controller counts as idle
            log.warning("cannot ask the controller whether ranks are busy: %s", exc)
            return False
        return any(
            isinstance(v, dict) and (v.get("queue") or v.get("tasks")) for v in status.values()
        ) or bool(status.get("unassigned"))

    def expired(self, seconds: float) -> bool:
        now = time.monotonic()
        if self.busy():
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= seconds

    def reset(self) -> None:
        self.since = None
        if self.client is not None:
            self.client.close()
            self.client = None


def _forget(path: str) -> None:
    """Remove the file at ``path``, if there (the record by path: ``SessionRecord.path``
    would import IPython to find the folder, which this small process never needs)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def stop(record: SessionRecord, path: str, why: str) -> None:
    """Stop ``record``'s controller and engines, then remove the record at ``path``."""
    log.warning("stopping session %s: %s", record.cluster_id, why)
    killed = stop_processes([*record.engine_pids, *record.controller_pids], KILL_AFTER, term=True)
    if killed:
        log.warning("killed pid(s) %s, which did not exit %g s after SIGTERM", killed, KILL_AFTER)
    cluster_file = record.connection.get("cluster_file")
    if cluster_file:  # the cluster file and the controller's connection files beside it
        folder = os.path.dirname(cluster_file)
        for name in (os.path.basename(cluster_file), f"ipcontroller-{record.cluster_id}-client.json",
                     f"ipcontroller-{record.cluster_id}-engine.json"):
            _forget(os.path.join(folder, name))
    if record.stack_folder:
        shutil.rmtree(record.stack_folder, ignore_errors=True)
    _forget(path)


def watch(path: str) -> None:
    """Watch the session whose record is ``path`` until it ends (see the module doc)."""
    idle: _Idle | None = None
    while True:
        record = SessionRecord.read(path)
        if record is None:
            return
        cluster_file = record.connection.get("cluster_file")
        if cluster_file and not os.path.exists(cluster_file):
            _forget(path)  # the cluster was stopped by other means
            return
        if record.owner_alive:
            if idle is not None:
                idle.reset()
                idle = None
        elif record.keep_alive is False:
            stop(record, path, f"the kernel that held it (pid {record.owner_pid}) is gone")
            return
        elif record.keep_alive is not True:
            idle = idle or _Idle(record)
            if idle.expired(float(record.keep_alive)):
                stop(record, path, f"no kernel and no work for keep_alive={record.keep_alive} s")
                return
        time.sleep(POLL)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m fsdp_nb.lifetime.watchdog SESSION_RECORD.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a notebook's Ctrl-C is not for us
    watch(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
