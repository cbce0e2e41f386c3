"""The process groups this rank has left, as torch's flight recorder names them.

The recorder keeps a destroyed group's status (each group's last enqueued and last
completed collective), under a key the groups formed next never reuse. A collective a
failure cut short stays "in flight" there for good, and the hang watch
(``hang_watch``) would name it as where this rank waits at every later question. So
whatever leaves the groups (``process_group.join`` and ``destroy``,
``health.leave_group``) calls :func:`retire_groups` first, and the watch skips those keys.
"""

from __future__ import annotations

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

    def __init__(self, recorder: Callable[[bool], dict[str, Any] | None] = flight_recorder):
        self.recorder = recorder
        self.keys: set[str] = set()
        """The status keys retired so far."""

    def retire(self) -> None:
        """Called just before this rank destroys its process groups: their recorder status
        keys join ``keys`` (nothing where the recorder is off or absent)."""
        status = self.recorder(False) or {}
        self.keys.update(str(k) for k in status.get("pg_status") or {})


def retired() -> RetiredGroups:
    """This engine's retired groups (the hang watch reads them)."""
    return part(RetiredGroups)


def retire_groups() -> None:
    """This engine's groups retired (:meth:`RetiredGroups.retire` of :func:`retired`)."""
    retired().retire()
