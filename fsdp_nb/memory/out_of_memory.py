"""A rank out of memory explains itself: the error's first lines name the rank, what it
held by category, the allocation that failed and the cheapest change from the last
plan (``sess.plan``) that fits; then the rank frees what the failure left behind.

Called by the session's failure policy (``summarize``) once the failed ranks answered,
through the plain dispatcher (reports, never recovers). Asking must not stand in the
way of the error: any trouble is logged and the error goes on without these lines.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from ..display.tables import fmt_bytes
from ..errors import RankFailure
from . import rank_out_of_memory as _oom
from .memory_report import cheapest_change
from .wire_memory_sample import MemorySample

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["explain", "failed_allocation", "is_out_of_memory", "lines_for"]

log = logging.getLogger("fsdp_nb")

_OOM = re.compile(r"out of memory|can't allocate memory|Cannot allocate memory|MemoryError", re.I)
_TRIED = re.compile(r"(?:Tried to allocate|tried to allocate) ([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB)", re.I)
_UNITS = {"bytes": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def is_out_of_memory(ename: str, evalue: str) -> bool:
    """Whether a rank's failure (exception name and message) is an allocation that
    failed: ``torch.OutOfMemoryError`` (CUDA), the CPU allocator's failure, ``MemoryError``."""
    return ename in ("OutOfMemoryError", "MemoryError") or bool(_OOM.search(evalue))


def failed_allocation(evalue: str) -> int | None:
    """The bytes the failed allocation asked for, read from its message (CUDA's "Tried
    to allocate 2.00 GiB", the CPU allocator's "you tried to allocate 123 bytes")."""
    m = _TRIED.search(evalue)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m else None


def lines_for(failure: RankFailure, held: MemorySample, freed: int, cheapest: str) -> list[str]:
    """The error's lines for one rank out of memory (a pure function); ``cheapest`` is
    the line ``cheapest_change`` gives."""
    asked = failed_allocation(failure.evalue)
    of = f" of {fmt_bytes(held.budget)}" if held.budget else ""
    rest = "activations, temporaries" + ("" if held.on_device else ", the process itself")
    return [
        f"rank {failure.rank} ran out of memory: it could not allocate "
        f"{fmt_bytes(asked) if asked is not None else 'more'} while holding {fmt_bytes(held.used)}{of} "
        f"({held.device}):",
        f"  parameters {fmt_bytes(held.parameters or 0)}, gradients {fmt_bytes(held.gradients or 0)}, "
        f"optimizer state {fmt_bytes(held.optimizer or 0)}, the rest ({rest}) {fmt_bytes(held.rest)}",
        f"  {cheapest}",
        f"  the failing frames were dropped and caches emptied ({fmt_bytes(freed)} given back); models "
        "and variables are kept: the next cell runs",
    ]


def explain(ctx: SessionContext, failures: list[RankFailure]) -> list[str]:
    """The lines for every rank in ``failures`` that ran out of memory ([] if none)."""
    oom = [f for f in failures if is_out_of_memory(f.ename, f.evalue)]
    if not oom:
        return []
    best = cheapest_change(ctx.last_plan, "the last plan")
    ranks = [f.rank for f in oom]
    d = ctx.plain_dispatcher
    try:
        held = d.gather(d.apply("what the ranks hold", _oom.held, [(r,) for r in ranks], ranks=ranks), 30)
        freed = d.gather(d.apply("free after out of memory", _oom.release, ranks=ranks), 60)
    except Exception as exc:  # noqa: BLE001 - the error itself must still reach the user
        log.warning("fsdp_nb: could not ask rank(s) %s what they hold: %s", ranks, exc)
        return []
    return [line for f, h, n in zip(oom, held, freed) for line in lines_for(f, h, n, best)]

