"""The collectives of checkpoint calls: their own gloo group, and agreeing on an outcome.

A save or load checks everything it can on every rank first; each rank's finding is then
agreed (:func:`agree`) so that every rank goes on, or every rank stops with the same
outcome, and none is left alone in a collective. They run on a gloo group of their own
(:func:`checkpoint_group`), as torchtitan's checkpointer does.

An async save's write and commit run in a background thread, so one rank may issue the
commit's collective on this group long before another (its files took longer). That is
the checkpoint's own business, not the training's: the hang watch names the group as
the checkpoint group (:data:`DESC`) and never counts its collectives as ones the training
waits in (``fsdp_nb.hangs``).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from .registry import RANK, Part, World, part


class _Answer(Protocol):
    ok: bool


A = TypeVar("A", bound=_Answer)

__all__ = [
    "BACKGROUND", "COPIES", "DESC", "agree", "any_rank", "background_groups", "checkpoint_group", "copy_group", "current_group",
    "gathered", "rank_and_world",
]

DESC = "checkpoint"
"""The checkpoint group's description (``group_desc``): how the hang watch knows it and
names it."""
COPIES = "memory copies"
"""The description of the group the in-memory autosave's copies travel on
(:func:`copy_group`), a background group like the checkpoint group."""
BACKGROUND = (DESC, COPIES)
"""The descriptions of the background groups (:func:`background_groups`): their
collectives run in threads of their own, never one the training waits in."""


def rank_and_world() -> tuple[int, int]:
    """(rank, world size), or (0, 1) outside a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: one all-reduce on the checkpoint group."""
    import torch
    import torch.distributed as dist

    _, ws = rank_and_world()
    if ws == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=checkpoint_group())
    return bool(t.item())


def agree(mine: A | None) -> A | None:
    """Every rank learns every rank's outcome so far (None: nothing to report; an outcome
    is anything with ``ok``, a checkpoint call's ``Outcome`` for one) and
    returns the same one: the first failure, else the first report, else None. Run
    before anything is written or changed, so no rank goes on alone into a collective.

    When no rank has anything to report (every call that goes ahead) this is one
    all-reduce of a flag; the outcomes are gathered only when some rank has one.
    """
    if not any_rank(mine is not None):
        return None
    reported: list[A] = [p for p in gathered(mine) if p is not None]
    return next((p for p in reported if not p.ok), reported[0] if reported else None)


def gathered(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order: one ``all_gather_object`` on the checkpoint
    group (none for one rank, or outside a group). Every rank must call it, in the same
    order as its other checkpoint-group collectives."""
    import torch.distributed as dist

    _, ws = rank_and_world()
    if ws == 1:
        return [mine]
    every: list[Any] = [None] * ws
    dist.all_gather_object(every, mine, group=checkpoint_group())
    return every


def checkpoint_group() -> Any:
    """A gloo group of all ranks for checkpoint collectives (made once per world).

    Saves run their collectives here, as torchtitan's checkpointer does: DCP's async
    save refuses a group without a CPU backend (a plain NCCL world), and the
    background write and commit must not interleave with training collectives on
    the default group. Also for one rank: that world may be NCCL too.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    held = part(CheckpointGroup)
    world = dist.group.WORLD
    if held.world is not world:
        held.world, held.group, held.copies = world, dist.new_group(backend="gloo", group_desc=DESC), None
    return held.group


def copy_group() -> Any:
    """A gloo group of all ranks for the in-memory autosave's copies between peers (made
    once per world, by every rank at once: the first call is a collective). Its sends run
    in a background thread, apart from the checkpoint group's collectives and the
    training's; the hang watch counts it with the checkpoint group (:func:`background_groups`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    held = part(CheckpointGroup)
    checkpoint_group()  # the world's checkpoint group first, on every rank in one order
    if held.copies is None:
        held.copies = dist.new_group(backend="gloo", group_desc=COPIES)
    return held.copies


def background_groups() -> tuple[Any, ...]:
    """The groups whose collectives run in the background, not the training's: the
    checkpoint group and the copy group, those this world made. Never makes one."""
    held = RANK.find(CheckpointGroup)
    return () if held is None else tuple(g for g in (held.group, held.copies) if g is not None)


def current_group() -> Any:
    """The checkpoint group this world made (None: none yet). Never makes one: another
    thread than the main one asks (the hang watch's), and making a group is a collective
    of every rank."""
    held = RANK.find(CheckpointGroup)
    return None if held is None else held.group


class CheckpointGroup(Part):
    """This rank's checkpoint group and the world it was made in (the registry's part:
    a new world makes a new one, on the first checkpoint collective there)."""

    def __init__(self) -> None:
        self.world: Any = None
        self.group: Any = None
        self.copies: Any = None

    def reformed(self, world: World) -> None:
        import torch.distributed as dist

        if self.world is not (dist.group.WORLD if dist.is_initialized() else None):  # one of the old group's
            self.world = self.group = self.copies = None

    def closed(self) -> None:
        self.world = self.group = self.copies = None
