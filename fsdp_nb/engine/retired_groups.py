"""The process groups this rank has left, as torch's flight recorder names them.

The recorder keeps a destroyed group's status (each group's last enqueued and last
completed collective), under a key the groups formed next never reuse. A collective a
failure cut short stays "in flight" there for good, and the hang watch
(``hang_watch``) would name it as where this rank waits at every later question. So
whatever leaves the groups (``process_group.join`` and ``destroy``,
``health.leave_group``) calls :func:`retire_groups` first, and the watch skips those keys.

The records are another matter: a group formed again takes the old one's name in them
(``["0", "default_pg"]`` again), and an old group's record of a collective cut short is
never marked retired. So the time of the last retirement is kept too (``since_ns``): a
record older than it is of a group left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..torch_compat import flight_recorder
from .registry import Part, part

__all__ = ["RetiredGroups", "retire_groups", "retired"]


class RetiredGroups(Part):
    """The recorder's status keys of the groups this rank has left (the registry's part:
    :func:`retired`; a test makes its own).

    Args:
        recorder: reads the flight recorder (``torch_compat.flight_recorder``).
    """

    def __init__(self, recorder: Callable[[bool], dict[str, Any] | None] = flight_recorder,
                 clock_ns: Callable[[], int] = time.time_ns):
        self.recorder, self.clock_ns = recorder, clock_ns
        self.keys: set[str] = set()
        """The status keys retired so far."""
        self.since_ns = 0
        """When (Unix ns, the recorder's clock) the groups were last retired: every record
        created before it is of a group this rank has left."""

    def retire(self) -> None:
        """Called just before this rank destroys its process groups: their recorder status
        keys join ``keys`` (nothing where the recorder is off or absent)."""
        status = self.recorder(False) or {}
        self.keys.update(str(k) for k in status.get("pg_status") or {})
        self.since_ns = self.clock_ns()


def retired() -> RetiredGroups:
    """This engine's retired groups (the hang watch reads them)."""
    return part(RetiredGroups)


def retire_groups() -> None:
    """This engine's groups retired (:meth:`RetiredGroups.retire` of :func:`retired`)."""
    retired().retire()
