"""A cell's debugging, rank side: the options ``%%px --debug 1,3 --check-collectives``
(or ``sess.execute(code, debug=..., check_collectives=...)``) arm for one cell.

Call order: ``install()`` once per engine (the hang watch starts it); ``arm(...)`` before
each cell that asks for either, sent ahead of the cell in the engine's queue; IPython's
``post_execute`` then calls ``cell_ended``, which ends both for that cell.
"""

from __future__ import annotations

from ..engine.registry import Part, part
from . import rank_breakpoints, rank_collective_check
from .rank_cell_places import set_cell_number

__all__ = ["arm", "cell_ended", "install"]


class CellDebug(Part):
    """Whether this engine's ``post_execute`` hook is registered."""

    def __init__(self) -> None:
        self.hooked = False


def install() -> None:
    """Install the breakpoint hooks and the end-of-cell hook (once per engine)."""
    rank_breakpoints.install()
    cell = part(CellDebug)
    if cell.hooked:
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is not None:
        ip.events.register("post_execute", cell_ended)
        cell.hooked = True


def arm(debug: list[int], check_limit: float | None, epoch: int, cell_number: int | None = None) -> None:
    """The next cell stops ``debug`` ranks at ``breakpoint()`` and, with ``check_limit``
    (seconds), checks its collectives (``epoch``: the session's count of armed cells;
    ``cell_number``: the notebook's number of the cell, None outside a notebook)."""
    set_cell_number(cell_number)
    rank_breakpoints.arm(debug)
    rank_collective_check.arm(check_limit, epoch)


def cell_ended() -> None:
    """A cell ended: its breakpoints' choice, its collective check and its number end with it."""
    rank_breakpoints.cell_ended()
    rank_collective_check.cell_ended()
    set_cell_number(None)
