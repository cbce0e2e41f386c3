"""What one engine says of itself before the group forms: :class:`EngineProbe`, read on the
engine (``fsdp_nb.engine.probe.describe``) and used by the notebook to order the ranks and
choose the backend (``fsdp_nb.runtime.rendezvous``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineProbe"]


@dataclass(frozen=True)
class EngineProbe:
    """One engine's host, process and devices, read on the engine."""

    host: str
    """``socket.gethostname()`` on the engine: engines are grouped by it."""
    pid: int
    """The engine's process id."""
    addr: str
    """The engine's address on the interface that routes to the controller (IPv4)."""
    ifname: str | None
    """Name of that interface (for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    launcher_rank: int | None
    """Rank given by the launcher (MPI / Slurm), if any."""
    launcher_var: str | None
    """Which variable gave ``launcher_rank``."""
    cuda_devices: int
    """CUDA devices visible to the engine (0 when torch has no CUDA)."""
    controller: str | None = None
    """The controller address this engine registered with (the route target)."""
    preset_env: tuple[tuple[str, str], ...] = ()
    """Socket-interface variables already set in the engine's environment."""
    visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` as the engine sees it (None when unset): engines that
    each see one different GPU (Slurm's ``--gpus-per-task=1``) all use ``cuda:0``."""
    started: float | None = None
    """The engine process's start time (``psutil``): with ``pid``, it names this one
    process, so the notebook signals it and no other that later gets the pid."""
    loopback_ifname: str | None = None
    """The loopback interface's name (``lo``): gloo binds there when every rank runs on
    one host."""
