"""The rank half of ``regroup``: what every rank does when the session tells its parts
that the group formed again, or that the rank leaves (``fsdp_nb.engine.registry``).

The notebook gathers the kinds of part every rank holds (:func:`kinds`), then calls
:func:`reformed` on every rank at once. Each rank first makes the parts it lacks; the
ranks agree, in one collective on the checkpoint group, that every one of them could, so
that none is told its parts (some of which run collectives there) while another is not;
then each rank tells its parts, in one order.
"""

from __future__ import annotations

from ..engine.checkpoint_group import any_rank
from ..engine.registry import RANK, World

__all__ = ["close", "kinds", "reformed"]


def kinds() -> list[str]:
    """The kinds of the parts this rank holds (``module:qualname``)."""
    return RANK.kinds()


def reformed(rank: int, size: int, joined: tuple[int, ...], every_kind: list[str]) -> list[str]:
    """Tell this rank's parts its group formed again; the kinds told, in order.

    Args:
        rank: this rank in the new group.
        size: the new group's size.
        joined: the ranks that joined with it (new engines).
        every_kind: the kinds of part any rank holds, in one order on every rank.

    Raises:
        RuntimeError: some rank could not make a part another holds (every rank raises,
            before any part is told), or a part failed (named, after every part was told).
    """
    problem = None
    try:
        RANK.make(every_kind)
    except Exception as exc:  # noqa: BLE001 - agreed by every rank, then raised on each
        problem = f"{type(exc).__name__}: {exc}"
    if any_rank(problem is not None):
        raise RuntimeError("a rank could not make the parts the other ranks hold, so none was told the group "
                           f"formed again{': ' + problem if problem else ' (see that rank)'}")
    return RANK.reformed(World(rank, size, tuple(joined)))


def close() -> None:
    """This rank leaves the session: close its parts (``Registry.close``)."""
    RANK.close()
