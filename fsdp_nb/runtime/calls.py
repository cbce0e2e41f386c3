"""Running the user's code on every rank: functions, source code, names in and out.

What ``sess.run``, ``execute``, ``push``, ``pull`` and ``%%px`` do once the façade has
checked their arguments: ship what is sent by value (``shipping``), send it to the
ranks through a :class:`~fsdp_nb.runtime.dispatch.Dispatcher` and gather the answers
in rank order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..engine import namespace as _ns
from ..engine import process_group as _pg
from ..errors import hide_frame
from .dispatch import Dispatcher, Pending
from .shipping import by_value

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["after_call", "all_reduce_check", "execute", "pull", "push", "run"]

log = logging.getLogger("fsdp_nb")


def run(d: Dispatcher, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
        timeout: float | None, hang_after: float | None = None, merged: bool = True,
        ctx: SessionContext | None = None) -> list[Any]:
    """``fn(*args, **kwargs)`` on every rank, shipped by value; results in rank order.
    ``merged``: lines the ranks print alike show once; ``ctx``: the session whose
    ``after_call`` hooks hear how the call ended (:func:`after_call`)."""
    __tracebackhide__ = hide_frame  # left out of a rank error's traceback
    what = f"run({getattr(fn, '__qualname__', type(fn).__name__)})"
    payload = (by_value(fn), by_value(args), by_value(kwargs))
    pending = d.apply(what, _ns.call, args=payload, fast=True, cell=True)
    pending.merged = merged
    return after_call(ctx, d, pending, timeout, hang_after)


def execute(d: Dispatcher, code: str, timeout: float | None, *, ranks: Sequence[int] | None,
            echoed: Any, silent: bool, hang_after: float | None = None, merged: bool = True,
            ctx: SessionContext | None = None) -> list[Any]:
    """``code`` on ``ranks`` (None: every rank); each rank's ExecuteReply, in rank order.
    ``merged``: lines the ranks print alike show once; ``ctx``: the session whose
    ``after_call`` hooks hear how the call ended (:func:`after_call`)."""
    __tracebackhide__ = hide_frame  # left out of a rank error's traceback
    pending = d.execute(code, ranks=ranks, echoed=echoed, silent=silent, merged=merged)
    return after_call(ctx, d, pending, timeout, hang_after)


def after_call(ctx: SessionContext | None, d: Dispatcher, pending: Pending, timeout: float | None,
               hang_after: float | None) -> list[Any]:
    """Gather the user call ``pending``, then, while the session is ready, run each of
    ``ctx.after_call`` with whether it succeeded on every rank. A hook that fails after a
    call that succeeded raises (its failure is the session's news); after a call that
    failed it is logged, and the call's own error goes on."""
    __tracebackhide__ = hide_frame  # left out of a rank error's traceback
    try:
        out = d.gather(pending, timeout, hang_after)
    except Exception:
        if ctx is not None and ctx.after_call and ctx.state == "ready":
            for hook in list(ctx.after_call):
                try:
                    hook(ctx, False)
                except Exception as exc:  # noqa: BLE001 - the call's own error is the one to raise
                    log.warning("fsdp_nb: after the failed call, %s failed: %s", getattr(hook, "__qualname__", hook),
                                exc)
        raise
    if ctx is not None and ctx.state == "ready":
        for hook in list(ctx.after_call):
            hook(ctx, True)
    return out


def push(d: Dispatcher, mapping: Mapping[str, Any]) -> None:
    """Bind ``mapping``'s names on every rank."""
    __tracebackhide__ = hide_frame  # left out of a rank error's traceback
    d.gather(d.apply("push", _ns.assign, args=(by_value(dict(mapping)),), fast=True))


def pull(d: Dispatcher, name: str) -> list[Any]:
    """Engine global ``name`` on every rank, in rank order."""
    __tracebackhide__ = hide_frame  # left out of a rank error's traceback
    return d.gather(d.apply(f"pull({name!r})", _ns.get, args=(name,), fast=True))


def all_reduce_check(d: Dispatcher) -> float:
    """One collective (the sum of the ranks) on every rank; its result."""
    __tracebackhide__ = hide_frame  # left out of a rank error's traceback
    return d.gather(d.apply("all_reduce", _pg.all_reduce_rank, fast=True))[0]
