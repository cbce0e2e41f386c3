"""The ipyparallel side: start or connect, the stable rank <-> engine map, liveness,
and process control (signal, kill, replace, wait).

Ranks never depend on ipyparallel engine ids: an engine that restarts comes back
with a new id, and ``EngineCluster.engine_ids`` (indexed by rank) is updated to it.
Processes are only signalled or killed by pid when this session started them on this
host; other engines are reached through the controller.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

import ipyparallel as ipp
import psutil

from .engine.health import whoami
from .phases import PhaseClock
from .session_record import handle_alive, process_alive
from .standby import Standby, find_standby, launch_standby

log = logging.getLogger("fsdp_nb")

__all__ = [
    "EngineCluster", "engine_launcher_class", "ipp_log_level", "launcher_names", "split_cluster_kwargs",
]

_RESERVED = {"n", "engines", "engine_launcher_class"}
"""Cluster arguments that Session sets itself (from ``n`` and ``launcher``)."""


def launcher_names() -> list[str]:
    """Engine launchers ipyparallel knows by name (``local``, ``mpi``, ``slurm``...)."""
    return sorted({e.name for e in entry_points(group="ipyparallel.engine_launchers")})


def engine_launcher_class(launcher: str) -> type:
    """The ipyparallel engine-set launcher class named ``launcher`` (``"mpi"``, ``"slurm"``...)."""
    from ipyparallel.cluster.launcher import find_launcher_class

    return find_launcher_class(launcher, "engine")


def split_cluster_kwargs(launcher: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Sort ``Session(**cluster_kwargs)`` into ``ipyparallel.Cluster`` arguments.

    ``Cluster`` takes its own traits (``controller_ip``, ``controller_args``,
    ``profile``, ``cluster_id``, ``delay``, ``config``...) as keywords, but an engine
    launcher's settings (``mpi_args``, ``mpi_cmd``, ``batch_template``, ``queue``,
    ``account``, ``timelimit``, ``options``, ``engine_args``, ``ssh_args``...) only as
    config traits (``c.MPIEngineSetLauncher.mpi_args``): those are moved into a
    traitlets ``Config`` under the launcher's class name. Anything else is a
    ``ValueError`` naming what each side accepts, raised before anything starts.
    """
    from traitlets.config import Config

    out = dict(kwargs)
    bad = sorted(_RESERVED & set(out))
    if bad:
        raise ValueError(
            f"{', '.join(bad)} cannot be given as cluster settings: use Session(n, launcher=...)"
        )
    config = out.pop("config", None)
    config = Config(config) if config is not None else Config()
    cls = engine_launcher_class(launcher)
    cluster_traits = set(ipp.Cluster.class_trait_names()) | {"controller", "parent"}
    launcher_traits = set(cls.class_traits(config=True))
    unknown = []
    for key in list(out):
        if key in cluster_traits:
            continue
        if key in launcher_traits:
            config[cls.__name__][key] = out.pop(key)
        else:
            unknown.append(key)
    if unknown:
        cluster_side = sorted(
            k for k, t in ipp.Cluster.class_traits(config=True).items() if not k.startswith("_")
        )
        raise ValueError(
            f"unknown setting(s) {', '.join(sorted(unknown))} for launcher {launcher!r}. "
            f"Cluster settings: {', '.join(cluster_side)}; {cls.__name__} settings: "
            f"{', '.join(sorted(launcher_traits))}"
        )
    out["config"] = config
    return out


def _batch_file_in_profile(cluster: ipp.Cluster, launcher: str) -> None:
    """Write a batch launcher's job script into the profile's log folder.

    ipyparallel writes it relative to the current directory, i.e. into the
    notebook's folder; a ``batch_file_name`` the user configured is left alone.
    """
    from ipyparallel.cluster.launcher import BatchSystemLauncher

    cls = engine_launcher_class(launcher)
    if not issubclass(cls, BatchSystemLauncher):
        return
    if "batch_file_name" in cluster.config.get(cls.__name__, {}):
        return
    log_dir = os.path.join(cluster.profile_dir, "log")
    os.makedirs(log_dir, exist_ok=True)
    default = cls.class_traits()["batch_file_name"].default_value
    config = copy.deepcopy(cluster.config)  # never edit the IPython session's config
    config[cls.__name__].batch_file_name = os.path.join(log_dir, f"{cluster.cluster_id}-{default}")
    cluster.config = config


def _boot_with_torch(cluster: ipp.Cluster, overlap: bool) -> None:
    """Launch local engines as ``fsdp_nb.engine.boot`` (torch imported first) unless
    the user set an engine command; ``overlap``: start them with the controller, not
    once its connection files exist (they wait for the files themselves)."""
    from ipyparallel.cluster.launcher import LocalEngineSetLauncher

    name = LocalEngineSetLauncher.__name__
    if "engine_cmd" in cluster.config.get(name, {}):
        return
    config = copy.deepcopy(cluster.config)  # never edit the IPython session's config
    config[name].engine_cmd = [sys.executable, "-m", "fsdp_nb.engine.boot"]
    cluster.config = config
    if overlap:
        cluster.send_engines_connection_env = False


HEARTBEAT_MS = 200
"""The controller's heartbeat period for clusters fsdp_nb starts (ipyparallel's: 3000).

The controller counts an engine as registered only on the beat after its heart first
answers: 1-2 periods after the engine connects (3-6 s with ipyparallel's period; at
200 ms a 2-rank session was ready 0.8 s sooner than at 500, median of 5 starts each)."""
HEARTBEAT_MISSES = 150
"""Beats an engine may miss before the controller drops it: 30 s, as ipyparallel's.
(Engines quit after 50 of their checks without a beat; local ones, started by
``fsdp_nb.engine.boot``, after 260: about 3 minutes, as with ipyparallel's period.)"""


def _quick_heartbeat(cluster_kwargs: dict[str, Any]) -> None:
    """Add the heartbeat period and misses to ``controller_args`` unless the user set them."""
    args = list(cluster_kwargs.get("controller_args") or [])
    if not any(a.startswith("--HeartMonitor.") for a in args):
        args += [f"--HeartMonitor.period={HEARTBEAT_MS}",
                 f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}"]
    cluster_kwargs["controller_args"] = args


def ipp_log_level() -> int:
    """ipyparallel's log level for the clusters fsdp_nb starts: the ``fsdp_nb`` logger's
    when that is set to INFO or DEBUG (to see the launchers and engines), else ERROR.

    Not WARNING: at WARNING the launcher pastes every engine's whole log into the
    notebook whenever an engine exits non-zero, which stopping it (SIGTERM) counts as.
    ``cluster_kwargs={"log_level": ...}`` still overrides it.
    """
    level = logging.getLogger("fsdp_nb").getEffectiveLevel()
    return level if level <= logging.INFO else logging.ERROR


class EngineCluster:
    """An ipyparallel client plus, when we started it, the ``ipyparallel.Cluster``."""

    def __init__(self, client: ipp.Client, cluster: ipp.Cluster | None = None):
        self.client = client
        self.cluster = cluster
        self.owns_engines = cluster is not None
        self.engine_ids: list[int] = sorted(client.ids)
        self.pids: list[int | None] = [None] * len(self.engine_ids)
        self.hosts: list[str | None] = [None] * len(self.engine_ids)
        self.ranks: list[Any] = []
        """Per-rank ``rendezvous.RankInfo`` of the group last formed (``join_group``)."""
        self._views: dict[Any, Any] = {}
        """Kept views: engine id, or a tuple of them."""
        self._procs: dict[int, psutil.Process] = {}
        self._launched: dict[int, int] = {}
        """Rank -> the dead engine id a replacement was launched for (``start_replacements``)."""
        self._known: set[int] | None = None
        """Engine ids there were before the first replacement still to be adopted."""
        self.standby: Standby | None = None
        """The engine waiting to replace the next dead rank (``keep_standby``)."""
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
        ``HEARTBEAT_MS``, so registrations complete soon after the engines are up.
        """
        cluster_kwargs = split_cluster_kwargs(launcher, cluster_kwargs)
        config = cluster_kwargs["config"]
        cluster_kwargs.setdefault("delay", 0)
        _quick_heartbeat(cluster_kwargs)
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
        _batch_file_in_profile(cluster, launcher)
        if launcher == "local":
            _boot_with_torch(cluster, overlap="send_engines_connection_env" not in cluster_kwargs)
        clock = clock or PhaseClock()
        try:
            cluster.start_cluster_sync()
            clock.mark("controller and engines launched")
            client = cluster.connect_client_sync()
            client.wait_for_engines(n, timeout=timeout, interactive=False)
            clock.mark("engines registered")
        except BaseException as exc:
            try:
                cluster.stop_cluster_sync()
            except Exception as exc:
                log.warning("stopping the cluster after a failed start failed too: %s", exc)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(
                    f"only {len(getattr(locals().get('client'), 'ids', []))} of {n} engines "
                    f"registered within {timeout:g} s with launcher {launcher!r}; raise "
                    "`timeout` or check the launcher's output (cluster_kwargs log_level=10)."
                ) from exc
            raise
        return cls(client, cluster)

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
        client.wait_for_engines(n or 1, timeout=timeout, interactive=False)
        return cls(client)

    def stop(self) -> None:
        """Stop what we started (controller and engines); only close the client otherwise."""
        try:
            if self.cluster is not None:
                self._ask_engines_to_exit()
                self.cluster.stop_cluster_sync()
        finally:
            try:
                self.client.close()
            except Exception as exc:
                log.debug("closing the ipyparallel client: %s", exc)

    def _ask_engines_to_exit(self, wait: float = 5.0) -> None:
        """Shut our engines down through their control channel first.

        They then exit with status 0 and the launcher stays quiet, instead of printing
        every engine's log into the notebook as it does for engines it had to kill.
        """
        try:
            self.client.shutdown(targets=list(self.client.ids), block=False)
        except Exception:
            return
        deadline = time.monotonic() + wait
        local = [p for p, h in zip(self.pids, self.hosts) if p and h == socket.gethostname()]
        while time.monotonic() < deadline and not all(_local_pid_dead(p) for p in local):
            time.sleep(0.05)

    # -- ranks -------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.engine_ids)

    def set_rank_order(self, engine_ids: list[int], pids: list[int], hosts: list[str]) -> None:
        """Fix which engine serves which rank (index = rank)."""
        self.engine_ids, self.pids, self.hosts = list(engine_ids), list(pids), list(hosts)

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
            pid, host = self.pids[rank], self.hosts[rank]
            if pid is not None and host == here and not self._pid_alive(pid):
                dead.append(rank)
            elif eid not in registered:
                dead.append(rank)
        return dead

    def _pid_alive(self, pid: int) -> bool:
        """``process_alive`` with the engine's process handle kept: this is on every
        call's path (one status read, no new handle)."""
        proc = self._procs.get(pid)
        if proc is None:
            try:
                proc = self._procs[pid] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                return False
        return handle_alive(proc)

    def owns_pid(self, pid: int) -> bool:
        """True if ``pid`` is one of the engines this session started on this host."""
        return self.owns_engines and pid in self.pids

    def _local_owned(self, rank: int) -> int | None:
        """The pid of ``rank``'s engine if this session started it on this host."""
        pid = self.pids[rank]
        if pid is not None and self.hosts[rank] == socket.gethostname() and self.owns_pid(pid):
            return pid
        return None

    # -- process control -----------------------------------------------------------

    def signal(self, ranks: list[int], sig: int) -> None:
        """Send ``sig`` to the engines of ``ranks``: by pid for engines this session
        started on this host, otherwise through the controller (``send_signal``)."""
        remote = []
        for r in ranks:
            pid = self._local_owned(r)
            if pid is None:
                remote.append(self.engine_ids[r])
                continue
            try:
                os.kill(pid, sig)
            except ProcessLookupError as exc:
                log.debug("engine of rank %d already gone when signalled: %s", r, exc)
        if remote:
            try:
                self.client.send_signal(sig, targets=remote, block=False)
            except Exception as exc:  # noqa: BLE001 - no nanny, old controller
                log.warning("could not signal engines %s through the controller: %s", remote, exc)

    def kill(self, ranks: list[int], wait: float = 10.0) -> None:
        """SIGKILL the engines of ``ranks`` and wait until they count as dead. Only
        engines this session started are killed; any other raises, naming it."""
        for r in ranks:
            pid = self._local_owned(r)
            if pid is None:
                raise RuntimeError(
                    f"rank {r} (engine {self.engine_ids[r]}, pid {self.pids[r]} on "
                    f"{self.hosts[r]}) is wedged and is not an engine this session started, "
                    "so fsdp_nb will not kill it; restart it with the launcher that started "
                    "it, then call sess.restart()."
                )
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError as exc:
                log.debug("wedged engine of rank %d already gone: %s", r, exc)
        if ranks:
            wait_until(lambda: set(ranks) <= set(self.dead_ranks()), wait)

    def start_replacements(self, dead: list[int]) -> None:
        """Launch one engine per rank in ``dead`` now, without waiting, so that a
        ``restart()`` finds it registered or on its way: called where a death is
        found. Local launchers only (it starts processes on this host, where another
        launcher would submit a job nobody asked for yet). Never raises: the death is
        what the caller reports."""
        if not self._local_launcher():
            return
        try:
            self._launch(dead)
        except Exception as exc:  # noqa: BLE001 - restart() starts them then
            log.warning("could not start replacement engine(s) for rank(s) %s yet: %s", dead, exc)

    def replace(self, dead: list[int], timeout: float = 120.0) -> None:
        """Map one new engine to each rank in ``dead`` (its pid and host read from it):
        those ``start_replacements`` launched when the deaths were found, and new ones
        for the rest."""
        if self.cluster is None:
            raise RuntimeError(
                f"rank(s) {dead} died, and this session attached to a running cluster "
                "(Session.connect), so it cannot start engines: restart them with the "
                "cluster's launcher, then call sess.restart()."
            )
        self._launch(dead)
        known = self._known or set()
        if not wait_until(lambda: len(set(self.client.ids) - known) >= len(dead), timeout, 0.1):
            raise TimeoutError(
                f"replacement engine(s) for rank(s) {dead} did not register within {timeout:g} s"
            )
        new = sorted(set(self.client.ids) - known)
        for r, eid in zip(dead, new):
            pid, host = self.client[eid].apply_sync(whoami)  # a one-off view
            self.engine_ids[r], self.pids[r], self.hosts[r] = eid, pid, host
        self._launched.clear()
        self._known = None

    def _launch(self, dead: list[int]) -> None:
        """Start an engine for each rank in ``dead`` that has none on its way yet (once
        per dead engine): the standby engine first, new ones for the rest. The engine
        ids known before the first such start are kept, to tell the new engines apart."""
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
            self.cluster.start_engines_sync(n=len(fresh), **self._replacement_settings())
            log.info("rank(s) %s: replacement engine(s) starting", fresh)
        for r in todo:
            self._launched[r] = self.engine_ids[r]

    def keep_standby(self, adopt: bool = False) -> None:
        """Have a standby engine waiting (``fsdp_nb.standby``): keep the one there is,
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
        from .engine.boot import PRELOAD_ENV

        c = self.cluster
        if not self._local_launcher():
            return {}
        launcher = c.engine_launcher_class(parent=c, log=c.log, profile_dir=c.profile_dir,
                                           cluster_id=c.cluster_id)
        return {"environment": {**launcher.environment, PRELOAD_ENV: "1"}}

    def tcp_endpoints(self) -> dict[int, list[tuple[str, int]]]:
        """Each local engine's TCP socket addresses, read from its pid (no engine round
        trip, so it answers while ranks are blocked)."""
        here = socket.gethostname()
        out: dict[int, list[tuple[str, int]]] = {}
        for r in range(self.world_size):
            pid = self.pids[r]
            if pid is None or self.hosts[r] != here:
                continue
            try:
                conns = psutil.Process(pid).net_connections("tcp")
            except (psutil.Error, OSError) as exc:
                log.debug("no sockets read for rank %d: %s", r, exc)
                continue
            out[r] = sorted({(x.laddr.ip, x.laddr.port) for x in conns if x.laddr})
        return out



def _local_pid_dead(pid: int) -> bool:
    return not process_alive(pid)


def wait_until(pred, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``pred`` until it is true or ``timeout`` passes; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
