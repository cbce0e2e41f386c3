"""Engine-side health and recovery: stack dumps on a signal, leaving and re-forming groups.

Everything here runs inside an engine. The notebook never asks a busy engine for its
stack through the task queue (a request waits behind the running cell); instead
``install`` registers ``faulthandler`` on SIGUSR1, which writes every thread's Python
stack to a per-engine file from C, even while the main thread is blocked inside a
gloo / NCCL collective. The notebook truncates the file, signals the pid and reads it.

The recovery steps (``leave_group``, ``rebind_groups``) run on engines between the
notebook's destroy / re-init dance; see ``fsdp_nb.recovery.restart``. Ranks blocked in NCCL
are freed through ``fsdp_nb.engine.nccl_abort``.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import types
import warnings
from typing import Any

from ..torch_compat import (
    default_group,
    fsdp_roots,
    mesh_group_names,
    process_groups,
    repoint_fsdp_groups,
    reset_fsdp_iteration,
    set_mesh_group_names,
)
from .registry import Part, part
from .retired_groups import retire_groups

log = logging.getLogger("fsdp_nb")

__all__ = [
    "STACK_SIGNAL",
    "close_connections_to",
    "install",
    "leave_group",
    "mesh_partitions",
    "rebind_groups",
    "reset_fsdp_iterations",
    "stack_file",
    "whoami",
]

STACK_SIGNAL = signal.SIGUSR1
"""The signal that makes an engine dump every thread's stack to its stack file."""



class StackFile(Part):
    """Where this engine writes its stacks on SIGUSR1 (the registry's part for it)."""

    def __init__(self) -> None:
        self.file: Any = None
        """The open file faulthandler writes to (None: none registered yet)."""
        self.path: str | None = None
        """Its path."""


def stack_file(folder: str, pid: int) -> str:
    """Where engine ``pid`` writes its stacks (one file per engine process)."""
    return os.path.join(folder, f"stack-{pid}.txt")


def install(folder: str) -> str:
    """Dump all threads' stacks to ``stack_file(folder, pid)`` on SIGUSR1; return its path.
    Also guard the kernel's request bookkeeping against SIGINT (``interrupts``).

    The file is opened for appending, so the notebook can truncate it before each
    request and read only the new dump. It is 0600 in a 0700 folder of this user's
    (``private_files``); a new folder (a new kernel's session) replaces the old file,
    which is removed.
    """
    from . import interrupts
    from .private_files import private_file, private_folder

    interrupts.install()
    private_folder(folder)
    path = stack_file(folder, os.getpid())
    held = part(StackFile)
    old = held.file
    if old is not None and held.path == path:
        return path
    fd = private_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    f = os.fdopen(fd, "a", buffering=1)  # lives as long as the engine
    faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)
    old_path = held.path
    held.file, held.path = f, path
    if old is not None and old_path is not None:
        old.close()
        try:
            os.unlink(old_path)
        except OSError as exc:
            log.debug("the previous stack file could not be removed: %s", exc)
    return path


def whoami() -> tuple[int, str, float | None]:
    """(pid, host, process start time) of this engine."""
    import socket

    from .probe import process_started

    return os.getpid(), socket.gethostname(), process_started()


def leave_group(peer_endpoints: list[tuple[str, int]] | None = None) -> bool:
    """Destroy this rank's process group (all of its groups); True if there was one.

    Ranks still blocked in a collective with this one must see their peer's
    connections close to return to Python. Gloo closes a group's sockets only when
    the group is freed, and FSDP2, DeviceMeshes and C++ state keep it alive (measured:
    ``destroy_process_group`` and ``abort`` then leave the peer blocked). So after the
    destroy, this rank shuts down its TCP connections to ``peer_endpoints`` (the other
    engines' socket addresses, read from their pids by the notebook): the blocked
    peer's gloo read fails with "Connection closed by peer" and returns.
    References to the old groups held in dicts, lists and attributes are dropped too.
    """
    import torch.distributed as dist

    had = dist.is_available() and dist.is_initialized()
    if had:
        from .nccl_abort import abort_nccl

        # an NCCL communicator's destroy may wait for peers that will never come:
        # abort it first (gloo groups are unaffected)
        abort_nccl()
        groups = process_groups()
        retire_groups()
        dist.destroy_process_group()
        _drop_references(groups)
        del groups
        gc.collect()
    if peer_endpoints:
        close_connections_to(peer_endpoints)
    return bool(had)


def close_connections_to(peer_endpoints: list[tuple[str, int]]) -> int:
    """``shutdown`` this process's TCP connections whose remote end is in ``peer_endpoints``."""
    import socket

    import psutil

    peers = {(ip, int(port)) for ip, port in peer_endpoints}
    n = 0
    for c in psutil.Process().net_connections("tcp"):
        if c.raddr and (c.raddr.ip, c.raddr.port) in peers and c.fd not in (-1, None):
            try:
                s = socket.socket(fileno=os.dup(c.fd))
            except OSError:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError as exc:
                log.debug("could not shut a socket down: %s", exc)
            finally:
                s.close()
    return n


def _drop_references(groups: list[Any]) -> int:
    """Replace references to ``groups`` held in dicts, lists and instances by None."""
    ids = {id(g) for g in groups}
    skip = {id(groups)}
    n = 0
    for ref in gc.get_referrers(*groups):
        if id(ref) in skip or isinstance(ref, types.FrameType):
            continue
        if isinstance(ref, dict):
            for k, v in list(ref.items()):
                if id(v) in ids:
                    ref[k] = None
                    n += 1
        elif isinstance(ref, list):
            for i, v in enumerate(ref):
                if id(v) in ids:
                    ref[i] = None
                    n += 1
        elif hasattr(ref, "__dict__") and not isinstance(ref, (type, types.ModuleType)):
            for k, v in list(vars(ref).items()):
                if id(v) in ids:
                    try:
                        setattr(ref, k, None)
                        n += 1
                    except Exception as exc:  # noqa: BLE001 - read-only attribute: leave it
                        log.debug("left a read-only reference to an old group: %s", exc)
    return n


def _meshes() -> list[Any]:
    """This rank's live DeviceMeshes of the world as it is now: a mesh over ranks this
    world does not have belongs to a world a resize left (torch's caches of DTensor
    shardings keep such meshes alive after their models are gone), and has no group to
    be pointed at."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size() if dist.is_initialized() else None
    return [m for m in _instances(DeviceMesh) if world is None or int(m.mesh.max()) < world]


def _instances(*classes: type) -> list[Any]:
    """Live objects of any of ``classes``, each once, in one heap scan (by MRO, so no
    ``__instancecheck__`` hook runs)."""
    wanted = set(classes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if wanted.intersection(type(o).__mro__)]


def _rows(mesh: Any, dim: int) -> list[tuple[int, ...]]:
    """The rank groups of mesh dimension ``dim`` (one per slice), as rank tuples."""
    t = mesh.mesh
    moved = t.movedim(dim, -1).reshape(-1, t.size(dim))
    return [tuple(int(x) for x in row) for row in moved.tolist()]


def mesh_partitions() -> list[tuple[tuple[int, ...], ...]]:
    """Every distinct rank partition this rank's DeviceMeshes use (one per mesh dim),
    except the whole world (the default group); sorted."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else None
    found: set[tuple[tuple[int, ...], ...]] = set()
    for m in _meshes():
        if not mesh_group_names(m):
            continue
        for d in range(m.mesh.ndim):
            rows = tuple(_rows(m, d))
            if world is None or rows != (tuple(range(world)),):
                found.add(rows)
    return sorted(found)


def rebind_groups(partitions: list[tuple[tuple[int, ...], ...]] | None = None) -> dict[str, int]:
    """After a fresh ``init_process_group``: make every DeviceMesh and FSDP2 module usable.

    Meshes refer to their process groups by name. A 1-D mesh over the whole world
    names the default group, whose name the new group reuses. Sub-groups of 2-D
    meshes (and flattened / sliced meshes) were destroyed with the old group: they
    are re-created here with ``new_group`` and the meshes' group names re-pointed.
    ``new_group`` must be called by every rank for every group in one order, so the
    notebook passes the union of all ranks' ``mesh_partitions()`` (a replaced rank
    has no meshes but must still take part). FSDP2 keeps ProcessGroup objects in its
    mesh infos: those are refreshed from the meshes. Every FSDP2 root is then put back
    between iterations (``reset_fsdp_iteration``): a step a failure cut short on some
    ranks is dropped on all of them. Returns counts of what was done.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    default_name = default_group().group_name
    meshes = [m for m in _meshes() if mesh_group_names(m)]
    if partitions is None:
        partitions = mesh_partitions()
    partitions = sorted({tuple(tuple(int(x) for x in row) for row in rows) for rows in partitions})
    me = dist.get_rank()
    mine: dict[tuple[int, ...], str] = {tuple(range(world)): default_name}
    done = {tuple(range(world))}
    created = 0
    for rows in partitions:
        for row in rows:
            if row in done:  # the same on every rank, so new_group calls stay in step
                continue
            done.add(row)
            pg = dist.new_group(list(row))
            created += 1
            if me in row:
                mine[row] = pg.group_name
    rebound = 0
    for m in meshes:
        names = mesh_group_names(m)
        for d in range(min(len(names), m.mesh.ndim)):
            row = next((r for r in _rows(m, d) if me in r), ())
            if row and row in mine and names[d] != mine[row]:
                names[d] = mine[row]
                rebound += 1
        set_mesh_group_names(m, names)
    fsdp = repoint_fsdp_groups(_instances)
    return {"meshes": len(meshes), "groups_created": created, "names_rebound": rebound,
            "fsdp_groups": fsdp, "fsdp_roots_reset": reset_fsdp_iterations()}


def reset_fsdp_iterations() -> int:
    """Put every FSDP2 model on this rank back between iterations (``torch_compat.
    reset_fsdp_iteration``): a step a failure cut short leaves no unit unsharded and no
    iteration under way. Returns how many root modules were reset."""
    roots = fsdp_roots(_instances)
    for root in roots:
        reset_fsdp_iteration(root)
    return len(roots)
