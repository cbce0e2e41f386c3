"""A cell's debugging, notebook side: check ``debug=`` and ``check_collectives=`` and arm
them on the ranks ahead of the cell (``fsdp_nb.debugging.rank_cell_debug``).

Nothing is sent for a cell that asks for neither (and the session does not check every
cell): an ordinary cell costs what it did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import rank_cell_debug as _rank

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["CHECK_LIMIT_S", "arm_cell", "check_collectives_option", "check_debug"]

CHECK_LIMIT_S = 60.0
"""Seconds a rank's collective waits for the others' calls before it names the ranks that
did not reach it (``check_collectives=True``; a number sets another limit)."""


def check_debug(debug: Any, world_size: int) -> list[int]:
    """``debug=`` as a sorted list of ranks (None or empty: none); a ValueError naming the
    allowed ranks for anything else."""
    if debug is None:
        return []
    picked = [debug] if isinstance(debug, int) and not isinstance(debug, bool) else debug
    if isinstance(picked, (str, bytes)) or not isinstance(picked, (Sequence, range, set, frozenset)) or not all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size for r in picked):
        raise ValueError(f"debug= takes ranks to stop at breakpoint(), each one of 0..{world_size - 1} "
                         f"(a rank or a list of ranks), got {debug!r}")
    return sorted(set(picked))


def check_collectives_option(value: Any) -> float | None:
    """``check_collectives=``: True (wait ``CHECK_LIMIT_S`` for the others), seconds > 0,
    or False/None (off); a ValueError naming those for anything else."""
    if value is None or value is False:
        return None
    if value is True:
        return CHECK_LIMIT_S
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise ValueError(f"check_collectives must be True, False or seconds > 0 to wait for the other ranks, got {value!r}")


def arm_cell(ctx: SessionContext, ranks: Sequence[int], debug: list[int], check_limit: float | None) -> None:
    """Arm the next cell on ``ranks``: ``debug`` ranks stop at ``breakpoint()``, and with
    ``check_limit`` (or the session's ``check_collectives``) its collectives are checked.
    Sent before the cell, through the same queue, so it is in place when the cell runs."""
    limit = check_limit if check_limit is not None else ctx.check_collectives
    if not debug and limit is None:
        return
    ctx.debugged_cells += 1
    d = ctx.dispatcher
    d.gather(d.apply("arm the cell's debugging", _rank.arm, args=(debug, limit, ctx.debugged_cells, _cell_number()),
                     ranks=list(ranks)), 60)


def _cell_number() -> int | None:
    """The number the notebook shows for the running cell (``[12]``); None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    result = getattr(getattr(get_ipython(), "displayhook", None), "exec_result", None)  # the running cell's
    number = getattr(result, "execution_count", None)
    return number if isinstance(number, int) else None
