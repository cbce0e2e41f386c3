"""A cell's debugging, rank side: the options ``%%px --debug 1,3 --check-collectives``
(or ``sess.execute(code, debug=..., check_collectives=...)``) arm for one cell.

Call order: ``install()`` once per engine (the hang watch starts it); ``arm(...)`` before
each cell that asks for any, sent ahead of the cell in the engine's queue (a call of its
own); the rank's step owner (``fsdp_nb.engine.step``) then tells the cell's end, which
ends them all for that cell (``cell_ended``). A rank listens to the owner only from an
armed cell or a stop to the cell's end: an engine that never debugs adds no listener.
"""

from __future__ import annotations

import logging

from ..engine.registry import Part, part
from ..engine.step import StepListener, owner
from . import rank_breakpoints, rank_collective_check
from .rank_cell_places import set_cell_number

__all__ = ["CellDebug", "CellEnd", "arm", "cell_ended", "install"]

log = logging.getLogger("fsdp_nb")


class CellEnd(StepListener):
    """Ends the debugging of the cell it was armed for, or stopped in, when that cell ends."""

    order = 5
    """Ahead of the other listeners' ``cell_ended`` (the owner's own "cell end" boundary
    comes before every listener's)."""

    def __init__(self) -> None:
        self.in_cell = False
        """The armed cell has started (the call that armed it ends first, and is not it)."""

    def cell_started(self) -> None:
        self.in_cell = True

    def cell_ended(self, failed: bool) -> None:
        if self.in_cell:
            try:
                cell_ended()
            except Exception as exc:  # noqa: BLE001 - the later listeners (autosave, the scaler) still hear the end
                log.warning("fsdp_nb: ending the cell's debugging failed: %s", exc)


class CellDebug(Part):
    """This rank's listener for the end of a debugged cell."""

    def __init__(self) -> None:
        self.end = CellEnd()

    def reformed(self, world: object) -> None:
        """A new group: the cell the re-form cut short is over (no IPython event says so)."""
        self.end.in_cell = False
        set_cell_number(None)
        owner().unlisten(self.end)

    def closed(self) -> None:
        owner().unlisten(self.end)


def _listen(in_cell: bool) -> None:
    end = part(CellDebug).end
    end.in_cell = end.in_cell or in_cell
    owner().listen(end)


def install() -> None:
    """Install the breakpoint hooks (once per engine); a stop listens for its cell's end."""
    rank_breakpoints.install(on_stop=lambda: _listen(True))


def arm(debug: list[int], check_limit: float | None, epoch: int, cell_number: int | None = None) -> None:
    """The next cell stops ``debug`` ranks at ``breakpoint()`` and, with ``check_limit``
    (seconds), checks its collectives (``epoch``: the session's count of armed cells;
    ``cell_number``: the notebook's number of the cell, None outside a notebook)."""
    set_cell_number(cell_number)
    rank_breakpoints.arm(debug)
    rank_collective_check.arm(check_limit, epoch)
    part(CellDebug).end.in_cell = False
    _listen(False)


def cell_ended() -> None:
    """A cell ended: its breakpoints' choice, its collective check and its number end with it."""
    rank_breakpoints.cell_ended()
    rank_collective_check.cell_ended()
    set_cell_number(None)
    end = part(CellDebug).end
    end.in_cell = False
    owner().unlisten(end)
