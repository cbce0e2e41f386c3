"""Freeing a rank blocked in an NCCL collective, engine side.

A rank blocked in gloo returns when its peers shut their sockets
(``health.leave_group``). A rank blocked in NCCL waits on a GPU kernel that only an
abort of its own communicators ends, and its main thread is stuck in C (a CUDA
synchronisation), where neither a task nor a Python signal handler reaches it. So
``start`` (called once per engine through the task queue, on NCCL sessions) runs a
daemon thread with a zmq PULL socket on the address the notebook gives (loopback when
the notebook is on this host); on an abort request it aborts every NCCL backend of
every process group on this rank (``ncclCommAbort``): the blocked kernel exits, the
waiting call raises, and the rank is back in Python with its variables. The notebook
then re-forms the group as after a gloo failure.

A request is one frame, ``ABORT`` signed with the cluster's key (``signing.Link``,
the listener's nonce in its key): one that is unsigned, forged, replayed or cut short
is dropped and logged, and anything over ``MAX_FRAME_BYTES`` is refused by zmq
before it is read. Nobody without the key can abort the rank's communicators.

``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is set to CleanUpOnly (``process_group``) so the
watchdog aborts rather than kills the engine when an NCCL error or timeout is seen.
"""

from __future__ import annotations

import logging
from typing import Any

from ..torch_compat import group_backend, process_groups
from .registry import part
from .signing import Link, ListenerState, Refused, start_listener

__all__ = ["ABORT", "MAX_FRAME_BYTES", "abort_nccl", "received", "start"]

log = logging.getLogger("fsdp_nb")

ABORT = b"abort"
"""The payload of an abort request."""
MAX_FRAME_BYTES = 4096
"""The largest frame the listener takes (a signed request is under 100 bytes)."""



class AbortListener(ListenerState):
    """The abort listener's socket and what it has done: ``received`` and ``aborted``
    counts beside ``signing.start_listener``'s endpoint, nonce and link."""


def _is_nccl(backend: Any) -> bool:
    """Whether a c10d backend object is NCCL's (by type name: CPU builds lack the class)."""
    return type(backend).__name__ == "ProcessGroupNCCL"


def _nccl_backends() -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    found = []
    for pg in process_groups():
        try:
            backend = group_backend(pg, "cuda")
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


def _handle(sock: Any, link: Link, endpoint: str, frames: list[Any]) -> None:
    """One message to the listener (``signing.start_listener`` runs the loop): a checked
    abort request aborts; anything else is dropped and counted."""
    try:
        if len(frames) != 1:
            raise Refused(f"{len(frames)} frames where an abort request has 1")
        if link.unpack(frames[0]) != ABORT:
            raise Refused("a signed message that is not an abort request")
    except Refused as why:
        link.refused(why, endpoint)
        return
    log.warning("fsdp_nb: aborting NCCL communicators (asked by the notebook)")
    state = part(AbortListener).state
    state["aborted"] = state.get("aborted", 0) + abort_nccl()
    state["received"] = state.get("received", 0) + 1


def start(addr: str) -> tuple[str, bytes]:
    """Start (once per engine) the abort listener.

    Args:
        addr: the address to bind: loopback when the notebook runs on this host, else
            the engine's address on the interface that routes to the controller.

    Returns its zmq endpoint and nonce (for the notebook's ``signing.Link``).
    """
    return start_listener(part(AbortListener).state, addr, "nccl-abort", "PULL", MAX_FRAME_BYTES, _handle, "fsdp_nb-nccl-abort")


def received() -> tuple[int, int, int]:
    """(abort requests received, NCCL backends aborted, messages refused) by this
    engine's listener."""
    state = part(AbortListener).state
    link = state.get("link")
    return state.get("received", 0), state.get("aborted", 0), link.dropped if link else 0
