"""Forming and tearing down the torch.distributed process group on an engine.

An NCCL group is formed as ``"cpu:gloo,cuda:nccl"``: CUDA tensors go through NCCL,
CPU tensors (DCP's async save, object collectives, CPU-offloaded state) through
gloo in the same group. Every group a session forms (``Session``, ``connect``,
recovery's re-form, ``restart``) comes through ``listen`` then ``init``.

The group's store (a ``TCPStore`` served by rank 0) listens where the ranks reach it
and nowhere else: ``env://`` would have it listen on every interface of rank 0's
host, whatever ``MASTER_ADDR`` says. So rank 0 first binds a socket on
``MASTER_ADDR`` itself (``listen``: the port is taken as it is chosen, so nothing can
take it between the choice and the bind), and its store is built on that socket
(``master_listen_fd``).
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import Any

from ..torch_compat import FLIGHT_RECORDER_ENV
from .registry import Part, part
from .retired_groups import retire_groups


class StoreSocket(Part):
    """The socket ``listen`` bound for the next group's store (rank 0), until ``init``
    (the registry's part for it)."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None

    def take(self) -> socket.socket | None:
        """The socket, which the caller now owns (None: none is bound)."""
        sock, self.sock = self.sock, None
        return sock

    def closed(self) -> None:
        sock = self.take()
        if sock is not None:
            sock.close()


def listen(addr: str) -> int:
    """Bind a listening socket on ``addr`` (rank 0's ``MASTER_ADDR``) for the next
    group's store; its port. Only the store's rank calls it."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    held = part(StoreSocket)
    old = held.take()
    if old is not None:
        old.close()
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((addr, 0))
        s.listen(socket.SOMAXCONN)
    except OSError:
        s.close()
        raise
    held.sock = s
    return s.getsockname()[1]


def _store(env: dict[str, str], timeout: timedelta) -> Any:
    """The group's store: served from ``listen``'s socket on rank 0, a client elsewhere."""
    import torch.distributed as dist

    addr, port, world = env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"])
    if int(env["RANK"]) != 0:
        return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    sock = part(StoreSocket).take()
    if sock is None or sock.getsockname()[1] != port:
        raise RuntimeError(f"rank 0 holds no listening socket on port {port} for the group's "
                           "store (process_group.listen was not called first)")
    store = dist.TCPStore(addr, port, world, is_master=True, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=sock.fileno())
    sock.detach()  # the store's server owns the descriptor now and closes it
    return store


NCCL_ERROR_HANDLING = "2"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING`` for NCCL ranks unless the user set it: on a
failed or timed-out collective the watchdog aborts the communicators and the
waiting call raises (CleanUpOnly) instead of tearing the engine down (3, the
default), so a rank keeps its variables and the session can re-form the group."""


FLIGHT_RECORDER_ENTRIES = "256"
"""Collectives torch's flight recorder keeps per rank on a gloo session
(``TORCH_FR_BUFFER_SIZE``) unless the user set it: the hang watch (``hang_watch``)
reads the op, tensors and start of a collective in flight from it. A ring of records:
one in flight is among the newest, and reading 256 of them takes a few ms (2000: 27 ms,
measured), paid only while a collective stays in flight between two questions.

An NCCL session leaves the recorder off: each record captures the Python stack on the
launching thread, and with it on a 368M GPT trained at 0.785-0.804 of torchrun's speed
on an H200, 0.998 with it off. There the watch reads each group's count of issued
collectives instead (``hang_watch.RankWatch.issued``), which costs nothing per collective. A
user who wants the records anyway sets ``TORCH_FR_BUFFER_SIZE`` before the session:
fsdp_nb keeps a user's value."""


def init_backend(backend: str) -> str:
    """The backend string ``init_process_group`` gets for a session backend.

    ``"nccl"`` becomes ``"cpu:gloo,cuda:nccl"``: DCP's async save needs a CPU
    backend in the group it runs on, and object collectives on CPU tensors work.
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def init(
    env: dict[str, str],
    backend: str,
    timeout_s: float,
    threads: int | None,
    gpu: int | None = None,
) -> str:
    """Set the rank's environment, pin its device and join the process group through
    the store rank 0 serves on ``env["MASTER_ADDR"]`` (rank 0 called ``listen`` first).

    ``gpu``: the CUDA device index an NCCL rank pins (``rendezvous.gpu_indexes``;
    default its local rank). Returns the device string this rank computes on
    (``"cuda:0"``, ``"cpu"``).
    """
    os.environ.update(env)
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERROR_HANDLING)
    else:  # free on gloo; on NCCL each record costs the step (FLIGHT_RECORDER_ENTRIES)
        os.environ.setdefault(FLIGHT_RECORDER_ENV, FLIGHT_RECORDER_ENTRIES)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)
    if dist.is_initialized():
        retire_groups()
        dist.destroy_process_group()
    device = "cpu"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        index = int(env["LOCAL_RANK"]) if gpu is None else gpu
        torch.cuda.set_device(index)
        device = f"cuda:{index}"
        kwargs["device_id"] = torch.device(device)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=init_backend(backend),
        store=_store(env, timeout),
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        timeout=timeout,
        **kwargs,
    )
    from .namespace import Placement, user_ns
    from .registry import part

    part(Placement).device = device
    ns = user_ns()
    ns.setdefault("torch", torch)
    ns.setdefault("dist", dist)
    ns.setdefault("fsdp_nb", sys.modules["fsdp_nb"])  # fsdp_nb.log(...) in a %%px loop, no import needed
    ns["rank"], ns["world_size"], ns["device"] = dist.get_rank(), dist.get_world_size(), device
    return device


def destroy() -> None:
    """Leave the session: close this rank's parts (``registry``), then leave the process
    group if this rank is in one."""
    import torch.distributed as dist

    from .registry import RANK

    RANK.close()
    if dist.is_available() and dist.is_initialized():
        retire_groups()
        dist.destroy_process_group()


def all_reduce_rank() -> float:
    """Sum of all ranks through the group: a collective every rank must join."""
    import torch
    import torch.distributed as dist

    from .namespace import rank_device

    # the rank's compute device, as init pinned it (get_backend() gives the whole
    # "cpu:gloo,cuda:nccl" string for an NCCL group)
    t = torch.tensor([float(dist.get_rank())], device=rank_device())
    dist.all_reduce(t)
    return float(t.item())


def membership() -> tuple[int | None, int | None, int]:
    """(rank, world size, pid) of this engine's process group (None, None, pid when it
    is in none): how ``Session.attach`` tells whether the group outlived the kernel."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None, os.getpid()
    return dist.get_rank(), dist.get_world_size(), os.getpid()
