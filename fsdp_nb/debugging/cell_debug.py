"""A cell's debugging, notebook side: check ``debug=``, ``debug_commands=`` and
``check_collectives=`` and arm them on the ranks ahead of the cell
(``fsdp_nb.debugging.rank_cell_debug``).

Nothing is sent for a cell that asks for none of them (and the session does not check
every cell): an ordinary cell costs what it did.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import rank_cell_debug as _rank

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["CHECK_LIMIT_S", "armed_cell", "check_collectives_option", "check_debug", "check_debug_commands"]

log = logging.getLogger("fsdp_nb")

CHECK_LIMIT_S = 60.0
"""Seconds a rank's collective waits for the others' calls before it names the ranks that
did not reach it (``check_collectives=True``; a number sets another limit)."""


def check_debug(debug: Any, world_size: int, running: Sequence[int] | None = None) -> list[int]:
    """``debug=`` as a sorted list of ranks (None or empty: none); a ValueError naming the
    allowed ranks for anything else, or a rank not among ``running`` (the cell's ``ranks=``)."""
    if debug is None:
        return []
    picked = [debug] if isinstance(debug, int) and not isinstance(debug, bool) else debug
    if isinstance(picked, (str, bytes)) or not isinstance(picked, (Sequence, range, set, frozenset)) or not all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size for r in picked):
        raise ValueError(f"debug= takes ranks to stop at breakpoint(), each one of 0..{world_size - 1} "
                         f"(a rank or a list of ranks), got {debug!r}")
    chosen = sorted(set(picked))
    idle = [r for r in chosen if running is not None and r not in running]
    if idle:
        raise ValueError(f"debug= names rank(s) {idle} that do not run this code (ranks={list(running or [])})")
    return chosen


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
    armed = bool(debug) or check_limit is not None or bool(commands)
    try:
        if armed:
            _arm(ctx, ranks, debug, check_limit)
        yield
    except BaseException:
        if armed:  # the cell may never have run (not sent, a dead rank): no rank stays armed for the next
            _disarm(ctx, ranks)
        raise
    finally:
        if watch is not None:
            watch.script = ()


def _arm(ctx: SessionContext, ranks: Sequence[int], debug: list[int], limit: float | None) -> None:
    """Send the ranks the cell's options and the notebook's number of the cell, ahead of
    the cell in the same queue, so they are in place when it runs (a cell that asks for
    no debugging sends nothing: its stops say "the running cell", not its number)."""
    ctx.debugged_cells += 1
    d = ctx.dispatcher
    d.gather(d.apply("arm the cell's debugging", _rank.arm, args=(debug, limit, ctx.debugged_cells, _cell_number()),
                     ranks=list(ranks)), 60)


def _disarm(ctx: SessionContext, ranks: Sequence[int]) -> None:
    """End the cell's debugging on ``ranks`` as its end would: the call failed, maybe
    before the cell ran (a rank that armed and never ran it would stop, or check, the next
    cell). A rank that cannot be reached (dead) is left to the restart that replaces it."""
    d = ctx.plain_dispatcher
    live = [r for r in ranks if r not in set(ctx.cluster.dead_ranks())]  # a dead rank's is gone with it
    try:
        d.gather(d.apply("end the cell's debugging", _rank.cell_ended, ranks=live), 5)
    except Exception as exc:  # noqa: BLE001 - the call's own error is what the user needs; this one is said
        log.warning("fsdp_nb: the failed cell's debugging could not be ended on every rank: %s", exc)


def _cell_number() -> int | None:
    """The number the notebook shows for the running cell (``[12]``); None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    result = getattr(getattr(get_ipython(), "displayhook", None), "exec_result", None)  # the running cell's
    number = getattr(result, "execution_count", None)
    return number if isinstance(number, int) else None
