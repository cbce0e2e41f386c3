"""What an engine knows about itself before it has a rank."""

from __future__ import annotations

import logging
import os
import socket

from ..wire.probe import EngineProbe

LAUNCHER_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
"""Environment variables through which MPI or Slurm tell a process its rank."""

log = logging.getLogger("fsdp_nb")

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Variables naming the network interface gloo / NCCL bind to; never overridden if set."""


def describe(controller_ip: str | None) -> EngineProbe:
    """Probe this engine: host, pid, routable address, launcher rank, GPU count.

    The address is the one on the interface that routes to the controller as this
    engine reached it (its registration url); ``controller_ip`` (the notebook
    client's view) is the fallback for engines not started by ``ipengine``.
    """
    launcher_rank = launcher_var = None
    for var in LAUNCHER_RANK_VARS:
        if os.environ.get(var, "").isdigit():
            launcher_rank, launcher_var = int(os.environ[var]), var
            break
    target = registered_controller() or controller_ip
    addr = route_address(target)
    return EngineProbe(
        host=socket.gethostname(),
        pid=os.getpid(),
        addr=addr,
        ifname=interface_of(addr),
        launcher_rank=launcher_rank,
        launcher_var=launcher_var,
        cuda_devices=_cuda_count(),
        controller=target,
        preset_env=tuple((v, os.environ[v]) for v in SOCKET_IFNAME_VARS if os.environ.get(v)),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        started=process_started(),
        loopback_ifname=interface_of(LOOPBACK),
    )


LOOPBACK = "127.0.0.1"
"""Where every socket of a session whose ranks share the notebook's host listens."""


def process_started() -> float | None:
    """This process's start time (``psutil``), or None where it cannot be read."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception as exc:  # noqa: BLE001 - then the pid alone names the engine
        log.debug("could not read this engine's start time: %s", exc)
        return None


def registered_controller() -> str | None:
    """The controller's ip as this engine connected to it, or None outside ``ipengine``."""
    try:
        from ipyparallel.engine.app import IPEngine

        if not IPEngine.initialized():
            return None
        url = IPEngine.instance().registration_url or ""
    except Exception as exc:  # noqa: BLE001 - any failure means: not inside ipengine
        log.debug("no ipengine registration url: %s", exc)
        return None
    return url_host(url)


def url_host(url: str) -> str | None:
    """The host of a zmq url (``tcp://10.0.0.5:4242`` -> ``10.0.0.5``, IPv6 brackets
    stripped), or None for a wildcard (``*``, ``0.0.0.0``) or a url without a host."""
    if "://" not in url:
        return None
    host = url.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
    return None if host in ("*", "0.0.0.0", "") else host


def route_address(target: str | None) -> str:
    """This host's address on the interface that routes to ``target``.

    ``gethostbyname(gethostname())`` may give 127.0.0.1 or fail inside containers and
    network namespaces; a UDP socket "connected" to the target (no packet is sent)
    reports the source address the kernel would use.
    """
    if not target or target in ("*", "0.0.0.0", ""):
        target = "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def route_to(target: str) -> tuple[str, str | None]:
    """This host's address toward ``target`` (another rank's IPv4 address), and the name
    of the interface holding it (None where it cannot be found)."""
    addr = route_address(target)
    return addr, interface_of(addr)


def interface_of(addr: str) -> str | None:
    """The network interface holding ``addr``, or None."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == addr for a in addrs):
                return name
    except Exception as exc:  # noqa: BLE001 - no interface name is a valid answer: the caller falls back to the address
        log.debug("no interface found for the address: %s", exc)
    return None


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU, as torch.cuda.is_available does
        return 0
