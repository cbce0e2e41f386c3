"""A cell's debugging, notebook side: check ``debug=``, ``debug_commands=`` and
``check_collectives=`` and arm them on the ranks ahead of the cell
(``fsdp_nb.debugging.rank_cell_debug``).

Nothing is sent for a cell that asks for none of them (and the session does not check
every cell): an ordinary cell costs what it did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import rank_cell_debug as _rank

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["CHECK_LIMIT_S", "armed_cell", "check_collectives_option", "check_debug", "check_debug_commands"]

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


def check_debug_commands(value: Any) -> tuple[str, ...]:
    """``debug_commands=``: pdb command lines as a list, or one string of them separated
    by ``;;`` as pdb separates them (``"p loss.item();; c"``); a ValueError naming those
    for anything else."""
    if value is None:
        return ()
    lines = value.split(";;") if isinstance(value, str) else value
    if not isinstance(lines, (list, tuple)) or not all(isinstance(c, str) and c.strip() for c in lines):
        raise ValueError("debug_commands takes pdb command lines: a list of them, or one string with ';;' "
                         f"between them (\"p loss.item();; c\"), each not empty; got {value!r}")
    return tuple(c.strip() for c in lines)


@contextlib.contextmanager
def armed_cell(ctx: SessionContext, ranks: Sequence[int], debug: list[int], check_limit: float | None,
               commands: tuple[str, ...] = ()) -> Iterator[None]:
    """While the cell runs (the ``with`` body): ``debug`` ranks stop at ``breakpoint()``,
    with ``check_limit`` its collectives are checked, and the debugger console runs
    ``commands`` at each stop before it asks.

    Args:
        ctx: the session's context (its dispatcher, its ``check_collectives``).
        ranks: the ranks the cell runs on.
        debug: the ranks whose ``breakpoint()`` stops them (``check_debug``).
        check_limit: seconds a checked collective waits for the others (None: not checked).
        commands: pdb lines sent at each stop before the prompt (``check_debug_commands``).
    """
    watch = ctx.dispatcher.watch
    if watch is not None:
        watch.script = commands
    try:
        _arm(ctx, ranks, debug, check_limit, bool(commands))
        yield
    finally:
        if watch is not None:
            watch.script = ()


def _arm(ctx: SessionContext, ranks: Sequence[int], debug: list[int], limit: float | None, commands: bool) -> None:
    """Send the ranks the cell's options and the notebook's number of the cell, ahead of
    the cell in the same queue, so they are in place when it runs; nothing for a cell
    that asks for no debugging (its stops say "the running cell", not its number)."""
    if not debug and limit is None and not commands:
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
