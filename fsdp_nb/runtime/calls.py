"""Running the user's code on every rank: functions, source code, names in and out.

What ``sess.run``, ``execute``, ``push``, ``pull`` and ``%%px`` do once the façade has
checked their arguments: ship what is sent by value (``shipping``), send it to the
ranks through a :class:`~fsdp_nb.runtime.dispatch.Dispatcher` and gather the answers
in rank order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..engine import namespace as _ns
from ..engine import process_group as _pg
from ..errors import hide_frame
from .dispatch import Dispatcher
from .shipping import by_value

__all__ = ["all_reduce_check", "execute", "pull", "push", "run"]


def run(d: Dispatcher, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
        timeout: float | None, hang_after: float | None = None, merged: bool = True) -> list[Any]:
    """``fn(*args, **kwargs)`` on every rank, shipped by value; results in rank order.
    ``merged``: lines the ranks print alike show once."""
    __tracebackhide__ = hide_frame  # left out of a rank error's traceback
    what = f"run({getattr(fn, '__qualname__', type(fn).__name__)})"
    payload = (by_value(fn), by_value(args), by_value(kwargs))
    pending = d.apply(what, _ns.call, args=payload, fast=True)
    pending.merged = merged
    return d.gather(pending, timeout, hang_after)


def execute(d: Dispatcher, code: str, timeout: float | None, *, ranks: Sequence[int] | None,
            echoed: Any, silent: bool, hang_after: float | None = None, merged: bool = True) -> list[Any]:
    """``code`` on ``ranks`` (None: every rank); each rank's ExecuteReply, in rank order.
    ``merged``: lines the ranks print alike show once."""
    __tracebackhide__ = hide_frame  # left out of a rank error's traceback
    return d.gather(d.execute(code, ranks=ranks, echoed=echoed, silent=silent, merged=merged), timeout, hang_after)


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
