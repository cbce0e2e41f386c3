"""The ipyparallel side: start or connect, the stable rank <-> engine map, liveness,
and process control (signal, kill, replace, wait); how a start is configured is in
``launch_settings``.

Ranks never depend on ipyparallel engine ids: an engine that restarts comes back
with a new id, and ``EngineCluster.engine_ids`` (indexed by rank) is updated to it.
Processes are only signalled or killed directly when this session started them on
this host, and then through a process handle checked against the start time the
engine reported (never a bare pid, which may name another process by then); other
engines are reached through the controller.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Sequence
from typing import Any

import ipyparallel as ipp

from ..engine.health import whoami
from ..engine.probe import LOOPBACK
from ..engine.process_handles import ProcessHandle, process_tree, stop_processes, tcp_sockets
from ..engine.signing import cluster_key
from .launch_settings import (
    boot_with_torch,
    engine_launcher_class,
    ipp_log_level,
    prepare_batch_job,
    quick_heartbeat,
    split_cluster_kwargs,
)
from .phases import PhaseClock
from .standby import Standby, find_standby, launch_standby

log = logging.getLogger("fsdp_nb")

__all__ = ["EngineCluster", "wait_until"]

STOP_WAIT = 5.0
"""Seconds the controller's processes get to exit after ipyparallel stopped the cluster
before the ones still there are killed."""

class EngineCluster:
    """An ipyparallel client plus, when we started it, the ``ipyparallel.Cluster``."""

    def __init__(self, client: ipp.Client, cluster: ipp.Cluster | None = None):
        self.client = client
        self.cluster = cluster
        self.key = cluster_key(client)
        """The cluster's key (its ipyparallel session's): what fsdp_nb's own channels sign with."""
        self.owns_engines = cluster is not None
        self.engine_ids: list[int] = sorted(client.ids)
        self.pids: list[int | None] = [None] * len(self.engine_ids)
        self.hosts: list[str | None] = [None] * len(self.engine_ids)
        self.started: list[float | None] = [None] * len(self.engine_ids)
        """Each rank's engine process start time, as the engine reported it."""
        self.ranks: list[Any] = []
        """Per-rank ``rendezvous.RankInfo`` of the group last formed (``join_group``)."""
        self._views: dict[Any, Any] = {}
        """Kept views: engine id, or a tuple of them."""
        self._procs: dict[tuple[int | None, float | None], ProcessHandle | None] = {}
        """(pid, start time) -> its verified handle (None: that process is gone)."""
        self._launched: dict[int, int] = {}
        """Rank -> the dead engine id a replacement was launched for (``start_replacements``)."""
        self._known: set[int] | None = None
        """Engine ids there were before the first replacement still to be adopted."""
        self._retired: set[int] = set()  # engine ids replaced (dead, maybe still listed): never adopted
        self.standby: Standby | None = None
        """The engine waiting to replace the next dead rank (``keep_standby``)."""
        self.controller_pids: list[tuple[int, float | None]] = []
        """(pid, start time) of the controller this session started and of its children
        (ipyparallel's schedulers), taken once it is up: ``stop`` ends them all, even
        after the controller itself was killed."""
        self.wants_standby = False
        """Whether ``keep_standby`` keeps one (``Session(standby=...)``)."""

    # -- start / connect / stop -------------------------------------------------

    @classmethod
    def start(
        cls,
        n: int,
        launcher: str,
        *,
        timeout: float,
        environment: dict[str, str] | None = None,
        clock: PhaseClock | None = None,
        **cluster_kwargs: Any,
    ) -> EngineCluster:
        """Start a controller and ``n`` engines with ``launcher``; wait for all of them.

        ``cluster_kwargs`` go through :func:`split_cluster_kwargs`: ``Cluster`` traits
        as keywords, engine-launcher settings (``mpi_args``, ``batch_template``...)
        as config. ``environment`` is added to every launcher's environment; values
        the user configured win. ``clock`` marks the phases.

        Local engines start with the controller rather than after it (ipyparallel
        waits one fixed second, then for the controller's files) and import torch
        while it comes up (``fsdp_nb.engine.boot``); the controller beats every
        ``launch_settings.HEARTBEAT_MS``, so registrations complete soon after the engines are up.
        """
        cluster_kwargs = split_cluster_kwargs(launcher, cluster_kwargs)
        config = cluster_kwargs["config"]
        cluster_kwargs.setdefault("delay", 0)
        quick_heartbeat(cluster_kwargs)
        if environment:
            env = dict(environment)
            env.update(config.BaseLauncher.get("environment", {}))
            config.BaseLauncher.environment = env
            lname = engine_launcher_class(launcher).__name__
            if "environment" in config[lname]:
                config[lname].environment = {**env, **config[lname].environment}
        if not config:  # keep inheriting the IPython session's config as Cluster does
            del cluster_kwargs["config"]
        cluster_kwargs.setdefault("log_level", ipp_log_level())
        cluster = ipp.Cluster(n=n, engines=launcher, **cluster_kwargs)
        prepare_batch_job(cluster, launcher)
        if launcher == "local":
            boot_with_torch(cluster, overlap="send_engines_connection_env" not in cluster_kwargs)
        clock = clock or PhaseClock()
        try:
            cluster.start_cluster_sync()
            clock.mark("controller and engines launched")
            client = cluster.connect_client_sync()
            client.wait_for_engines(n, timeout=timeout, interactive=False)
            clock.mark("engines registered")
        except BaseException as exc:  # stop what started, then raise (Ctrl-C included)
            try:
                cluster.stop_cluster_sync()
            except Exception as stop_exc:  # noqa: BLE001 - cleanup of a failed start: the start's own error is raised below
                log.warning("stopping the cluster after a failed start failed too: %s", stop_exc)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(
                    f"only {len(getattr(locals().get('client'), 'ids', []))} of {n} engines "
                    f"registered within {timeout:g} s with launcher {launcher!r}; raise "
                    "`timeout` or check the launcher's output (cluster_kwargs log_level=10)."
                ) from exc
            raise
        out = cls(client, cluster)
        out.controller_pids = process_tree(getattr(cluster.controller, "pid", None))
        return out

    @classmethod
    def connect(
        cls,
        url_file: str | None = None,
        *,
        profile: str | None = None,
        cluster_id: str | None = None,
        n: int | None = None,
        timeout: float = 60.0,
    ) -> EngineCluster:
        """Attach to a running cluster; we will never stop its engines."""
        kwargs: dict[str, Any] = {}
        if profile is not None:
            kwargs["profile"] = profile
        if cluster_id is not None:
            kwargs["cluster_id"] = cluster_id
        # ipyparallel 9.2 ignores url_file= as a keyword: pass it positionally.
        client = ipp.Client(url_file, **kwargs) if url_file else ipp.Client(**kwargs)
        try:
            cluster_key(client)  # before waiting for engines: an unsigned cluster is refused
            client.wait_for_engines(n or 1, timeout=timeout, interactive=False)
        except BaseException:  # close the client, then re-raise
            client.close()
            raise
        return cls(client)

    def stop(self) -> None:
        """Stop what we started (controller, its schedulers, engines); only close the
        client otherwise."""
        try:
            if self.cluster is not None:
                self.ask_to_exit()
                self.cluster.stop_cluster_sync()
                killed = stop_processes(self.controller_pids, wait=STOP_WAIT)
                if killed:
                    log.debug("killed the controller's processes %s, still there after its stop", killed)
        finally:
            try:
                self.client.close()
            except Exception as exc:  # noqa: BLE001 - stopping anyway: the client's sockets close with the process
                log.debug("closing the ipyparallel client: %s", exc)

    def ask_to_exit(self, ranks: list[int] | None = None, wait: float = 5.0) -> list[int]:
        """Shut ``ranks``' engines down through their control channel (None: every
        registered engine) and wait up to ``wait`` s for those on this host to exit; the
        ranks among them still running. Engines asked so exit with status 0 and the
        launcher stays quiet, instead of printing the log of every engine it had to kill."""
        targets = list(self.client.ids) if ranks is None else [self.engine_ids[r] for r in ranks]
        try:
            self.client.shutdown(targets=targets, block=False)
        except Exception:  # noqa: BLE001 - engines already gone or unreachable: the caller kills them by handle
            return []
        here = socket.gethostname()
        local = [r for r in (range(self.world_size) if ranks is None else ranks)
                 if self.pids[r] and self.hosts[r] == here]
        wait_until(lambda: not any(self._alive(r) for r in local), wait)
        return [r for r in local if self._alive(r)]

    # -- ranks -------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.engine_ids)

    def set_rank_order(self, engine_ids: list[int], pids: list[int], hosts: list[str],
                       started: Sequence[float | None] | None = None) -> None:
        """Fix which engine serves which rank (index = rank).

        Args:
            engine_ids: each rank's ipyparallel engine id.
            pids: each rank's engine process id (on its host).
            hosts: each rank's host name.
            started: each engine process's start time as the engine read it, so that
                its pid is only ever taken for that process (None: not known).
        """
        self.engine_ids, self.pids, self.hosts = list(engine_ids), list(pids), list(hosts)
        self.started = list(started) if started is not None else [None] * len(self.pids)

    def listen_address(self, rank: int) -> str:
        """Where ``rank``'s engine binds the sockets the notebook connects to: loopback
        when it runs on the notebook's host, else its address on the interface that
        routes to the controller (``RankInfo.addr``)."""
        if self.hosts[rank] == socket.gethostname():
            return LOOPBACK
        return self.ranks[rank].addr

    def view(self, ranks: list[int] | None = None) -> ipp.DirectView:
        """A blocking-off DirectView whose targets are the given ranks' engines, in rank order."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        v = self.client.direct_view(targets=[self.engine_ids[r] for r in ranks])
        v.block = False
        return v

    # -- liveness ----------------------------------------------------------------

    def ranks_view(self, ranks: Sequence[int]) -> Any:
        """One kept view of these ranks' engines, in rank order: a call to all of them
        leaves as ipyparallel's own multi-engine call does (one send)."""
        if len(ranks) == 1:
            return self.rank_view(ranks[0])  # one engine: its results are not lists
        eids = tuple(self.engine_ids[r] for r in ranks)
        v = self._views.get(eids)
        if v is None:
            v = self._views[eids] = self.client.direct_view(targets=list(eids))
        return v

    def rank_view(self, rank: int) -> Any:
        """The ipyparallel view of ``rank``'s engine alone (kept: a view costs traitlets
        set-up, and every call sends to each rank through one)."""
        eid = self.engine_ids[rank]
        v = self._views.get(eid)
        if v is None:
            v = self._views[eid] = self.client[eid]
        return v

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine process is gone.

        Engines on this host are checked by pid at once; others by the controller's
        registry, which notices a dead engine only after its heartbeat times out.
        """
        here = socket.gethostname()
        registered = set(self.client.ids)
        dead = []
        for rank, eid in enumerate(self.engine_ids):
            if self.pids[rank] is not None and self.hosts[rank] == here and not self._alive(rank):
                dead.append(rank)
            elif eid not in registered:
                dead.append(rank)
        return dead

    def _handle(self, rank: int) -> ProcessHandle | None:
        """``rank``'s engine process (on this host), checked against the start time the
        engine reported; None if it was gone when first asked. Kept: this is on every
        call's path."""
        key = (self.pids[rank], self.started[rank])
        if key not in self._procs:
            self._procs[key] = ProcessHandle.open(*key)
        return self._procs[key]

    def _alive(self, rank: int) -> bool:
        """``rank``'s engine (on this host) runs: a poll of its kept handle."""
        proc = self._handle(rank)
        return proc is not None and proc.alive()

    def stopped_ranks(self, ranks: list[int]) -> list[int]:
        """Of ``ranks``, those whose engine (on this host) is stopped (SIGSTOP)."""
        here = socket.gethostname()
        return [r for r in ranks if self.pids[r] is not None and self.hosts[r] == here
                and (proc := self._handle(r)) is not None and proc.stopped()]

    def owned_here(self, rank: int) -> bool:
        """Whether this session started ``rank``'s engine on this host (alive or not)."""
        return self.owns_engines and self.pids[rank] is not None and self.hosts[rank] == socket.gethostname()

    # -- process control -----------------------------------------------------------

    def signal(self, ranks: list[int], sig: int) -> None:
        """Send ``sig`` to the engines of ``ranks``: by pid for engines this session
        started on this host, otherwise through the controller (``send_signal``)."""
        remote = []
        for r in ranks:
            if not self.owned_here(r):
                remote.append(self.engine_ids[r])
                continue
            proc = self._handle(r)
            if proc is None or not proc.send_signal(sig):
                log.debug("engine of rank %d already gone when signalled", r)
        if remote:
            try:
                self.client.send_signal(sig, targets=remote, block=False)
            except Exception as exc:  # noqa: BLE001 - no nanny, old controller
                log.warning("could not signal engines %s through the controller: %s", remote, exc)

    def kill(self, ranks: list[int], wait: float = 10.0) -> None:
        """SIGKILL the engines of ``ranks`` (``signal``: by verified handle on this host, through
        the controller on others) and wait until they count as dead. Only engines this
        session started are killed; an engine of a cluster attached to raises, naming it."""
        if ranks and not self.owns_engines:
            r = ranks[0]
            raise RuntimeError(
                f"rank {r} (engine {self.engine_ids[r]}, pid {self.pids[r]} on "
                f"{self.hosts[r]}) is wedged and is not an engine this session started, "
                "so fsdp_nb will not kill it; restart it with the launcher that started "
                "it, then call sess.restart()."
            )
        self.signal(ranks, signal.SIGKILL)
        if ranks:
            wait_until(lambda: set(ranks) <= set(self.dead_ranks()), wait)

    def start_replacements(self, dead: list[int]) -> None:
        """Launch one engine per rank in ``dead`` now, without waiting, so that a
        ``restart()`` finds it registered or on its way: called where a death is
        found. Local launchers only (it starts processes on this host, where another
        launcher would submit a job nobody asked for yet). Never raises: the death is
        what the caller reports."""
        if self.cluster is None or not self._local_launcher():
            return
        try:
            self._launch(self.cluster, dead)
        except Exception as exc:  # noqa: BLE001 - restart() starts them then
            log.warning("could not start replacement engine(s) for rank(s) %s yet: %s", dead, exc)

    def replace(self, dead: list[int], timeout: float = 120.0) -> None:
        """Map one new engine to each rank in ``dead`` (its pid and host read from it): those
        ``start_replacements`` launched, new ones for the rest (attached: any not a rank)."""
        if self.cluster is not None:
            self._launch(self.cluster, dead)
        elif len(spare := set(self.client.ids) - set(self.engine_ids) - self._retired) < len(dead):
            raise RuntimeError(
                f"rank(s) {dead} died, and this session attached to a running cluster "
                f"(Session.connect), so it cannot start engines: start {len(dead) - len(spare)} with "
                "the cluster's launcher, then call sess.restart()."
            )
        known = (self._known or set(self.engine_ids)) | self._retired
        if not wait_until(lambda: len(set(self.client.ids) - known) >= len(dead), timeout, 0.1):
            raise TimeoutError(f"replacement engine(s) for rank(s) {dead} did not register within {timeout:g} s")
        new = sorted(set(self.client.ids) - known, reverse=True)  # attached: the newest started
        for r, eid in zip(dead, new):
            self._retired.add(self.engine_ids[r])
            pid, host, started = self.client[eid].apply_sync(whoami)  # a one-off view
            self.engine_ids[r], self.pids[r], self.hosts[r], self.started[r] = eid, pid, host, started
        self._launched.clear()
        self._known = None

    def _launch(self, cluster: ipp.Cluster, dead: list[int]) -> None:
        """Start an engine for each rank in ``dead`` that has none on its way yet (once per dead
        engine): the standby first, new ones on ``cluster`` for the rest; the ids known before
        are kept, to tell the new engines apart."""
        todo = [r for r in dead if self._launched.get(r) != self.engine_ids[r]]
        if not todo:
            return
        if self._known is None:
            self._known = set(self.client.ids) | set(self.engine_ids)
        fresh = list(todo)
        if self.standby is not None and self.standby.alive():
            self.standby.release()
            log.info("rank %d: the standby engine takes its place", fresh.pop(0))
        self.standby = None
        if fresh:
            cluster.start_engines_sync(n=len(fresh), **self._replacement_settings())
            log.info("rank(s) %s: replacement engine(s) starting", fresh)
        for r in todo:
            self._launched[r] = self.engine_ids[r]

    def keep_standby(self, adopt: bool = False) -> None:
        """Have a standby engine waiting (``fsdp_nb.runtime.standby``): keep the one there is,
        or launch one; ``adopt``: first take one an earlier kernel launched into this
        cluster (``Session.attach``). Local launchers of clusters this session started
        only; never raises (a restart then starts its engines itself)."""
        if not (self.wants_standby and self._local_launcher()):
            return
        if self.standby is not None and self.standby.alive():
            return
        try:
            self.standby = (find_standby(self.cluster) if adopt else None) or launch_standby(
                self.cluster, self._replacement_settings()["environment"])
        except Exception as exc:  # noqa: BLE001 - only restarts get slower
            log.warning("no standby engine: %s", exc)
            self.standby = None

    def _local_launcher(self) -> bool:
        """Whether this session started its engines with a local launcher (on this host,
        as ``fsdp_nb.engine.boot``)."""
        from ipyparallel.cluster.launcher import LocalEngineSetLauncher

        return self.cluster is not None and issubclass(self.cluster.engine_launcher_class, LocalEngineSetLauncher)

    def _replacement_settings(self) -> dict[str, Any]:
        """For local engines: the launcher's environment plus the flag that has a
        replacement import what the restart needs while it registers."""
        from ..engine.boot import PRELOAD_ENV

        c = self.cluster
        if c is None or not self._local_launcher():
            return {}
        launcher = c.engine_launcher_class(parent=c, log=c.log, profile_dir=c.profile_dir,
                                           cluster_id=c.cluster_id)
        return {"environment": {**launcher.environment, PRELOAD_ENV: "1"}}

    def tcp_endpoints(self) -> dict[int, list[tuple[str, int]]]:
        """Each local engine's TCP socket addresses, read from its pid (no engine round
        trip, so it answers while ranks are blocked)."""
        here = socket.gethostname()
        found = {r: tcp_sockets(pid) for r, (pid, host) in enumerate(zip(self.pids, self.hosts))
                 if pid is not None and host == here}
        return {r: socks for r, socks in found.items() if socks is not None}



def wait_until(pred, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``pred`` until it is true or ``timeout`` passes; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
