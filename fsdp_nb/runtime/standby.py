"""The standby engine: one engine process started ahead, registered only to replace a dead rank.

A replacement engine started at a rank's death spends seconds importing torch before
it can register (most of ``restart()``'s time on few cores). A standby did that
already: it was launched after the session became ready, imported torch and what a
rank needs (``fsdp_nb.engine.boot.PRELOAD``), and waits unregistered, so ``%%px``,
``client.ids`` and ``Session.connect`` never see it. Releasing it (its go file) makes
it start ipyparallel's engine and register in about a second.

Local launchers only. It is an engine set of the ipyparallel cluster (named
``SET_PREFIX`` + a token), so stopping the cluster stops it and a later kernel that
attaches finds it; it exits by itself once the controller is gone.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ipyparallel as ipp

from ..engine.boot import STANDBY_ENV, WAITING, WATCH_ENV
from ..engine.process_handles import process_alive

log = logging.getLogger("fsdp_nb")

__all__ = ["SET_PREFIX", "Standby", "find_standby", "launch_standby"]

SET_PREFIX = "fsdp_nb-standby-"
"""Engine-set ids of standby engines start with this."""


@dataclass
class Standby:
    """One standby engine: its engine set, process and go file."""

    engine_set: str
    """The ipyparallel engine-set id it was launched as (``SET_PREFIX`` + a token)."""
    pid: int
    """Its process (on this host)."""
    go_file: str
    """Created to release it; it removes the file as it starts its engine."""

    def alive(self) -> bool:
        return process_alive(self.pid)

    def waiting(self) -> bool:
        """Its imports done, it waits for the go file (the moment it is most useful)."""
        return self.alive() and os.path.exists(self.go_file + WAITING)

    def release(self) -> None:
        """Have it start ipyparallel's engine and register, as any new engine would."""
        with open(self.go_file, "w"):
            pass
        log.info("standby engine (pid %d) released", self.pid)


def _go_file(cluster: ipp.Cluster, engine_set: str) -> str:
    return os.path.join(cluster.profile_dir, "security", f"{cluster.cluster_id}-{engine_set}.go")


def _pid(cluster: ipp.Cluster, engine_set: str) -> int | None:
    launchers = getattr(cluster.engines.get(engine_set), "launchers", {})
    pids = [getattr(el, "pid", -1) for el in launchers.values()]
    return pids[0] if len(pids) == 1 and pids[0] > 0 else None


def launch_standby(cluster: ipp.Cluster, environment: dict[str, str]) -> Standby:
    """Start a standby engine in ``cluster`` (an ``ipyparallel.Cluster`` with a local
    engine launcher) with the launcher's ``environment``; it returns at once."""
    engine_set = SET_PREFIX + uuid.uuid4().hex[:8]
    go_file = _go_file(cluster, engine_set)
    controller = getattr(cluster.controller, "pid", -1)
    env = {**environment, STANDBY_ENV: go_file}
    if controller > 0:
        env[WATCH_ENV] = str(controller)
    cluster.start_engines_sync(n=1, engine_set_id=engine_set, environment=env)
    pid = _pid(cluster, engine_set)
    if pid is None:
        raise RuntimeError(f"the standby engine set {engine_set} has no local process")
    log.info("standby engine launched (pid %d)", pid)
    return Standby(engine_set, pid, go_file)


def find_standby(cluster: ipp.Cluster) -> Standby | None:
    """A standby engine launched into ``cluster`` by an earlier kernel that still waits
    for its go file (one released but not yet gone has its go file: not that one)."""
    for engine_set in list(cluster.engines):
        pid = _pid(cluster, engine_set) if engine_set.startswith(SET_PREFIX) else None
        if pid is not None:
            found = Standby(engine_set, pid, _go_file(cluster, engine_set))
            if found.waiting() and not os.path.exists(found.go_file):
                return found
    return None
