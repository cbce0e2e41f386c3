"""Forming the process group: rank order, local ranks, address, port, environment.

Pure functions decide (testable without engines); ``form_group`` runs them against a
cluster: probe every engine, order them, find rank 0's reachable address and a free
port on its host, then call ``init_process_group`` on every engine at once.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, replace

from ..engine import probe as _probe
from ..engine import process_group as _pg
from ..wire.probe import EngineProbe
from .cluster import EngineCluster
from .dispatch import Dispatcher
from .phases import PhaseClock

log = logging.getLogger("fsdp_nb")

__all__ = [
    "RankInfo",
    "choose_backend",
    "form_group",
    "gpu_indexes",
    "local_ranks",
    "rank_env",
    "loopback_routes",
    "rank_order",
    "with_routes",
]


@dataclass(frozen=True)
class RankInfo:
    """Where one rank lives."""

    rank: int
    """Global rank in the process group."""
    engine_id: int
    """Current ipyparallel engine id (changes when the engine restarts)."""
    host: str
    """Host name of the engine."""
    pid: int
    """Engine process id on its host."""
    device: str
    """Device the rank computes on: ``"cuda:0"``, ``"cpu"``."""
    local_rank: int
    """Rank among the engines on the same host (picks the GPU)."""
    local_world_size: int
    """Number of engines on the same host."""
    addr: str
    """The engine's address on the interface that routes to the controller (for a rank that
    reached it over loopback on a group of several hosts: toward the other hosts)."""


def rank_order(engine_ids: list[int], probes: list[EngineProbe]) -> list[int]:
    """Indexes into ``engine_ids`` in rank order.

    Launcher ranks (MPI / Slurm) win when every engine has a distinct one; otherwise
    engines are ordered by host (in order of each host's first engine) and engine id,
    so ranks on one host are contiguous.
    """
    lr = [p.launcher_rank for p in probes]
    known = [r for r in lr if r is not None]
    if len(known) == len(lr) and len(set(known)) == len(known):
        return sorted(range(len(probes)), key=lambda i: known[i])
    by_id = sorted(range(len(probes)), key=lambda i: engine_ids[i])
    first_seen: dict[str, int] = {}
    for i in by_id:
        first_seen.setdefault(probes[i].host, len(first_seen))
    return sorted(by_id, key=lambda i: (first_seen[probes[i].host], engine_ids[i]))


def local_ranks(hosts: list[str]) -> list[tuple[int, int]]:
    """(local_rank, local_world_size) for each rank, given each rank's host."""
    count: dict[str, int] = {}
    seen: dict[str, int] = {}
    for h in hosts:
        count[h] = count.get(h, 0) + 1
    out = []
    for h in hosts:
        out.append((seen.get(h, 0), count[h]))
        seen[h] = seen.get(h, 0) + 1
    return out


def gpu_indexes(probes: list[EngineProbe]) -> list[int] | None:
    """The CUDA device index each rank (``probes`` in rank order) would pin, or None
    when some rank has no GPU of its own.

    On a host whose engines see every GPU, local rank ``i`` takes ``cuda:i`` (it needs
    ``i`` < the devices it sees). Engines that each see one GPU through distinct
    ``CUDA_VISIBLE_DEVICES`` (a launcher giving each task its GPU) all take ``cuda:0``.
    """
    if not probes:
        return None
    locals_ = local_ranks([p.host for p in probes])
    visible: dict[str, list[str | None]] = {}
    for p in probes:
        visible.setdefault(p.host, []).append(p.visible_devices)
    out = []
    for p, (local, _) in zip(probes, locals_):
        if p.cuda_devices > local:
            out.append(local)
            continue
        own = visible[p.host]
        if p.cuda_devices == 1 and None not in own and len(set(own)) == len(own):
            out.append(0)
            continue
        return None
    return out


def choose_backend(requested: str | None, probes: list[EngineProbe]) -> str:
    """The backend for these engines (``probes`` in rank order).

    ``requested`` wins when given (``"nccl"`` is refused if a rank has no GPU of its
    own); otherwise ``"nccl"`` when every rank has one (``gpu_indexes``), else
    ``"gloo"``: a cluster attached with ``Session.connect`` trains on its GPUs without
    the user naming the backend.
    """
    if requested == "gloo":
        return "gloo"
    if gpu_indexes(probes) is not None:
        return "nccl"
    if requested == "nccl":
        short = sorted(
            {f"{p.host} ({p.cuda_devices} GPU(s))" for p in probes}
        )
        raise RuntimeError(
            f"backend 'nccl' needs a GPU of its own for every rank, but the engines on "
            f"{', '.join(short)} do not have one each; use backend='gloo', or start one "
            "engine per GPU"
        )
    return "gloo"


def rank_env(
    rank: int,
    world_size: int,
    local: tuple[int, int],
    master_addr: str,
    master_port: int,
    ifname: str | None = None,
    preset: tuple[tuple[str, str], ...] | dict[str, str] = (),
    ifname_vars: tuple[str, ...] = _probe.SOCKET_IFNAME_VARS,
) -> dict[str, str]:
    """The torch.distributed environment for one rank.

    ``ifname`` becomes each of ``ifname_vars`` (GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME), except for those already set on the engine (``preset``):
    the user's choice wins.
    """
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local[0]),
        "LOCAL_WORLD_SIZE": str(local[1]),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
    if ifname:
        keep = dict(preset)
        for var in ifname_vars:
            if var not in keep:
                env[var] = ifname
    return env


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name, not an address: never loopback by itself
        return False


def loopback_routes(probes: list[EngineProbe]) -> dict[int, str]:
    """Ranks of a group on several hosts whose address is loopback, each with the address
    of a rank on another host to route toward.

    Any engine on the controller's own host registers over 127.0.0.1 when the
    controller listens on ``*`` / 0.0.0.0 with that host's address as its location (or
    ``controller_ip`` is a name that resolves to 127.0.1.1 there). Its address is then no
    use to the other hosts as ``MASTER_ADDR`` or as gloo's interface.

    Args:
        probes: every engine's probe, in rank order.

    Returns:
        rank -> the routable address of a rank on another host; empty where no rank has
        one (hosts that share one network namespace reach each other over loopback).
    """
    out = {}
    for r, p in enumerate(probes):
        if _is_loopback(p.addr):
            peer = next((q for q in probes if q.host != p.host and not _is_loopback(q.addr)), None)
            if peer is not None:
                out[r] = peer.addr
    return out


def with_routes(probes: list[EngineProbe], answers: dict[int, tuple[str, str | None]]) -> list[EngineProbe]:
    """``probes`` with each asked rank's address and interface replaced by its answer.

    Args:
        probes: every engine's probe, in rank order.
        answers: rank -> (its address toward another host, that address's interface or
            None), as ``engine.probe.route_to`` answered for ``loopback_routes``.

    Raises:
        RuntimeError: a rank's route to the other hosts is loopback too (no interface
            reaches them), naming the rank and its host, before any rank joins a group.
    """
    out = list(probes)
    for r, (addr, ifname) in answers.items():
        if _is_loopback(addr):
            raise RuntimeError(
                f"rank {r} on {probes[r].host} reached the controller over loopback and has no "
                "route to the other hosts' ranks; give controller_ip= this host's address on the "
                "network the hosts share"
            )
        log.info("fsdp_nb: rank %d on %s reached the controller over loopback; it uses %s (%s) "
                 "toward the other hosts", r, probes[r].host, addr, ifname or "no interface name")
        out[r] = replace(probes[r], addr=addr, ifname=ifname)
    return out


def controller_ip(cluster: EngineCluster) -> str | None:
    """The controller's address as the notebook's client reached it.

    Only a fallback for the route probe: for a controller listening on 0.0.0.0 on
    this host the client writes 127.0.0.1, which engines on other hosts cannot
    use; each engine's own registration url (``probe.registered_controller``) is
    tried first.
    """
    return _probe.url_host(getattr(cluster.client, "_config", {}).get("registration", "") or "")


def probe_engines(
    cluster: EngineCluster, dispatcher: Dispatcher, timeout: float | None = None
) -> list[EngineProbe]:
    """Every engine's probe, in ``cluster.engine_ids`` order."""
    ctrl = controller_ip(cluster)
    return dispatcher.gather(dispatcher.apply("probe engines", _probe.describe, args=(ctrl,)), timeout)


def join_group(
    cluster: EngineCluster,
    dispatcher: Dispatcher,
    probes: list[EngineProbe],
    backend: str,
    *,
    pg_timeout: float,
    threads: int | None,
    timeout: float | None = None,
) -> None:
    """Form the group on a fresh port; ``cluster.engine_ids`` and ``probes`` in rank order.

    Its store and gloo listen on loopback when every rank runs on one host, else on
    rank 0's address on the interface that routes to the controller (a rank that reached
    the controller over loopback is first asked for its route to the other hosts:
    ``loopback_routes``, ``with_routes``). IPv4 only, as the probes are.

    Used to form a session's group and to re-form it after a recovery or restart;
    the new per-rank info (``RankInfo``) becomes ``cluster.ranks``.
    """
    engine_ids = list(cluster.engine_ids)
    hosts = [p.host for p in probes]
    cluster.set_rank_order(engine_ids, [p.pid for p in probes], hosts, [p.started for p in probes])
    multi_host = len(set(hosts)) > 1
    if multi_host and (targets := loopback_routes(probes)):
        answers = dispatcher.gather(dispatcher.apply(
            "route to the other hosts", _probe.route_to, [(t,) for t in targets.values()], ranks=list(targets),
        ), timeout)
        probes = with_routes(probes, dict(zip(targets, answers)))
    locals_ = local_ranks(hosts)
    master_addr = probes[0].addr if multi_host else _probe.LOOPBACK
    (port,) = dispatcher.gather(
        dispatcher.apply("bind the group's store", _pg.listen, ranks=[0], args=(master_addr,)), timeout
    )
    # one host: the store and gloo on loopback; several: on the interface to rank 0
    ifname_vars = _probe.SOCKET_IFNAME_VARS if multi_host else ("GLOO_SOCKET_IFNAME",)
    envs = [
        rank_env(r, len(probes), locals_[r], master_addr, port,
                 p.ifname if multi_host else p.loopback_ifname, p.preset_env, ifname_vars)
        for r, p in enumerate(probes)
    ]
    gpus = gpu_indexes(probes) if backend == "nccl" else None
    devices = dispatcher.gather(
        dispatcher.apply(
            "init_process_group",
            _pg.init,
            [
                (env, backend, pg_timeout, threads, gpus[r] if gpus else None)
                for r, env in enumerate(envs)
            ],
        ),
        timeout,
    )
    cluster.ranks = [
        RankInfo(r, engine_ids[r], p.host, p.pid, devices[r], *locals_[r], p.addr)
        for r, p in enumerate(probes)
    ]


def form_group(
    cluster: EngineCluster,
    dispatcher: Dispatcher,
    backend: str | None,
    *,
    pg_timeout: float,
    threads: int | None,
    clock: PhaseClock | None = None,
) -> str:
    """Probe, order and rendezvous every engine (per-rank info in ``cluster.ranks``);
    return the backend: ``backend``, or the one the probes call for when None
    (``choose_backend``), decided before any rank joins a group. ``clock`` marks the
    phases."""
    clock = clock or PhaseClock()
    probes = probe_engines(cluster, dispatcher)
    clock.mark("probe engines (torch imported)")
    order = rank_order(cluster.engine_ids, probes)
    cluster.engine_ids = [cluster.engine_ids[i] for i in order]
    probes = [probes[i] for i in order]
    backend = choose_backend(backend, probes)
    join_group(cluster, dispatcher, probes, backend, pg_timeout=pg_timeout, threads=threads)
    clock.mark("process group formed")
    return backend
