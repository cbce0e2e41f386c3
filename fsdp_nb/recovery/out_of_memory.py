"""A rank out of memory explains itself: the error's first lines name the rank, what it
held by category, the allocation that failed and the cheapest change from the last
plan (``sess.plan``) that fits; then the rank frees what the failure left behind.

Called by the session's failure policy (``summarize``) once the failed ranks answered,
through the plain dispatcher (reports, never recovers). Asking must not stand in the
way of the error: any trouble is logged and the error goes on without these lines.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING

from ..display.tables import fmt_bytes
from ..engine import out_of_memory as _oom
from ..errors import RankFailure
from ..runtime.engine_exits import exit_signal
from ..wire.memory_plan import Held, failed_allocation, is_out_of_memory

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["explain", "kernel_oom_kills", "killed", "lines_for"]

log = logging.getLogger("fsdp_nb")


def lines_for(failure: RankFailure, held: Held, freed: int, cheapest: str | None) -> list[str]:
    """The error's lines for one rank out of memory (a pure function)."""
    asked = failed_allocation(failure.evalue)
    of = f" of {fmt_bytes(held.limit)}" if held.limit else ""
    rest = "activations, temporaries" + (", the process itself" if held.device == "cpu" else "")
    return [
        f"rank {failure.rank} ran out of memory: it could not allocate "
        f"{fmt_bytes(asked) if asked is not None else 'more'} while holding {fmt_bytes(held.total)}{of} "
        f"({held.device}):",
        f"  parameters {fmt_bytes(held.parameters)}, gradients {fmt_bytes(held.gradients)}, "
        f"optimizer state {fmt_bytes(held.optimizer)}, the rest ({rest}) {fmt_bytes(held.rest)}",
        f"  cheapest change that fits, from the last plan: {cheapest}" if cheapest else
        "  no plan says what fits: sess.plan(Model, ..., batch=..., what_if='auto') does, before allocating",
        f"  the failing frames were dropped and caches emptied ({fmt_bytes(freed)} given back); models "
        "and variables are kept: the next cell runs",
    ]


def explain(ctx: SessionContext, failures: list[RankFailure]) -> list[str]:
    """The lines for every rank in ``failures`` that ran out of memory ([] if none)."""
    oom = [f for f in failures if is_out_of_memory(f.ename, f.evalue)]
    if not oom:
        return []
    cheapest = _cheapest(ctx)
    ranks = [f.rank for f in oom]
    d = ctx.plain_dispatcher
    try:
        held = d.gather(d.apply("what the ranks hold", _oom.held, ranks=ranks), 30)
        freed = d.gather(d.apply("free after out of memory", _oom.release, ranks=ranks), 60)
    except Exception as exc:  # noqa: BLE001 - the error itself must still reach the user
        log.warning("fsdp_nb: could not ask rank(s) %s what they hold: %s", ranks, exc)
        return []
    return [line for f, h, n in zip(oom, held, freed) for line in lines_for(f, h, n, cheapest)]


def _cheapest(ctx: SessionContext) -> str | None:
    best = ctx.last_plan.cheapest_fit if ctx.last_plan is not None else None
    return f"{best.label} (peak {fmt_bytes(best.peak)}; cost: {best.cost})" if best else None


def kernel_oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended since boot
    (``oom_kill`` in ``/proc/vmstat``, memory cgroups' kills included); None off Linux."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def killed(ctx: SessionContext, dead: list[int], oom_kills_before: int | None) -> list[str]:
    """Lines for the ranks in ``dead`` that SIGKILL ended, which fsdp_nb did not send (it
    reports its own kills as such): the kernel's out-of-memory killer when the kernel's
    count of such kills rose since ``oom_kills_before``. Each names the memory the rank
    last held (``sess.memory()``'s feed)."""
    out = []
    now = kernel_oom_kills()
    oom = None if now is None or oom_kills_before is None else now > oom_kills_before
    for r in dead:
        try:
            sig = exit_signal(ctx.cluster, r)
        except Exception as exc:  # noqa: BLE001 - the death itself must still be reported
            log.debug("fsdp_nb: reading how rank %d ended failed: %s", r, exc)
            continue
        if sig is None:
            continue
        if sig != signal.SIGKILL:  # a crash (SIGSEGV, SIGABRT, ...) is named too, not blamed on memory
            out.append(f"rank {r}'s engine was ended by {signal.Signals(sig).name} (signal {sig}): it crashed "
                       "or something signalled it; its log (the launcher's output) may say more")
            continue
        last = ctx.last_memory.get(r)
        held = (f"its last memory sample, {time.time() - last[0]:.0f} s before, showed "
                f"{fmt_bytes(last[1])} of {fmt_bytes(last[2])}" if last else
                "no memory samples were kept (sess.memory() keeps each rank's history)")
        who = ("the kernel's out-of-memory killer ended it (the kernel's count of such kills rose)" if oom else
               "not the kernel's out-of-memory killer (its count of kills did not change): another process"
               if oom is False else "on Linux most often the kernel's out-of-memory killer")
        out.append(f"rank {r} was killed by SIGKILL, which fsdp_nb did not send: {who}; {held}")
    if any("SIGKILL" in line for line in out) and oom is not False:
        cheapest = _cheapest(ctx)
        out.append(f"cheapest change that fits, from the last plan: {cheapest}" if cheapest else
                   "sess.plan(Model, ..., batch=..., what_if='auto') says what fits before allocating")
    return out
