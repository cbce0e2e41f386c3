"""Freeing a rank blocked in an NCCL collective, engine side.

A rank blocked in gloo returns when its peers shut their sockets
(``health.leave_group``). A rank blocked in NCCL waits on a GPU kernel that only an
abort of its own communicators ends, and its main thread is stuck in C (a CUDA
synchronisation), where neither a task nor a Python signal handler reaches it. So
``start`` (called once per engine through the task queue, on NCCL sessions) runs a
daemon thread with a zmq PULL socket on the engine's routable address; on a message
it aborts every NCCL backend of every process group on this rank (``ncclCommAbort``):
the blocked kernel exits, the waiting call raises, and the rank is back in Python
with its variables. The notebook then re-forms the group as after a gloo failure.

``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is set to CleanUpOnly (``process_group``) so the
watchdog aborts rather than kills the engine when an NCCL error or timeout is seen.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["abort_nccl", "received", "start"]

log = logging.getLogger("fsdp_nb")

_LISTENER: dict[str, Any] = {}


def _is_nccl(backend: Any) -> bool:
    """Whether a c10d backend object is NCCL's (by type name: CPU builds lack the class)."""
    return type(backend).__name__ == "ProcessGroupNCCL"


def _nccl_backends() -> list[Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return []
    found = []
    for pg in list(c10d._world.pg_map):
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except RuntimeError:  # no CUDA backend in this group
            continue
        if _is_nccl(backend):
            found.append(backend)
    return found


def abort_nccl() -> int:
    """Abort the communicators of every NCCL backend on this rank; how many.

    Safe from any thread: it is what unblocks the main thread waiting in a collective.
    The groups stay registered; ``health.leave_group`` destroys them afterwards.
    """
    n = 0
    for backend in _nccl_backends():
        try:
            backend.abort()
            n += 1
        except RuntimeError as exc:  # already aborted or torn down
            log.debug("NCCL abort: %s", exc)
    return n


def _serve(sock: Any) -> None:
    """The listener thread: lives as long as the engine (a daemon), one request at a
    time; ends, closing its socket, when the engine's zmq context is terminated."""
    import zmq

    try:
        while True:
            if sock.recv() == b"abort":
                log.warning("fsdp_nb: aborting NCCL communicators (asked by the notebook)")
                _LISTENER["aborted"] = _LISTENER.get("aborted", 0) + abort_nccl()
                _LISTENER["received"] = _LISTENER.get("received", 0) + 1
    except zmq.ContextTerminated:
        log.debug("NCCL abort listener: the engine is exiting")
    finally:
        sock.close(linger=0)


def start() -> str:
    """Start (once per engine) the abort listener on the address that routes to the
    controller; return its zmq endpoint."""
    if "endpoint" in _LISTENER:
        return _LISTENER["endpoint"]
    import zmq

    from .probe import registered_controller, route_address

    addr = route_address(registered_controller())
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{addr}")
    threading.Thread(target=_serve, args=(sock,), name="fsdp_nb-nccl-abort", daemon=True).start()
    _LISTENER["endpoint"] = f"tcp://{addr}:{port}"
    return _LISTENER["endpoint"]


def received() -> tuple[int, int]:
    """(abort requests received, NCCL backends aborted) by this engine's listener."""
    return _LISTENER.get("received", 0), _LISTENER.get("aborted", 0)
