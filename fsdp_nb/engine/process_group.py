"""Forming and tearing down the torch.distributed process group on an engine."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any


def free_port() -> int:
    """A TCP port free on this host right now (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", 0))
        return s.getsockname()[1]


def init(env: dict[str, str], backend: str, timeout_s: float, threads: int | None) -> str:
    """Set the rank's environment, pin its device and join the process group.

    Returns the device string this rank computes on (``"cuda:0"``, ``"cpu"``).
    """
    os.environ.update(env)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)
    if dist.is_initialized():
        dist.destroy_process_group()
    device = "cpu"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        local_rank = int(env["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    from .namespace import user_ns

    ns = user_ns()
    ns.setdefault("torch", torch)
    ns.setdefault("dist", dist)
    ns["rank"], ns["world_size"], ns["device"] = dist.get_rank(), dist.get_world_size(), device
    return device


def destroy() -> None:
    """Leave the process group if this rank is in one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_rank() -> float:
    """Sum of all ranks through the group: a collective every rank must join."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(dist.get_rank())], device=device)
    dist.all_reduce(t)
    return float(t.item())
