"""The process groups this rank has left, as torch's flight recorder names them.

The recorder keeps a destroyed group's status (each group's last enqueued and last
completed collective), under a key the groups formed next never reuse. A collective a
failure cut short stays "in flight" there for good, and the hang watch
(``hang_watch``) would name it as where this rank waits at every later question. So
whatever leaves the groups (``process_group.join`` and ``destroy``,
``health.leave_group``) calls :func:`retire_groups` first, and the watch skips those keys.
"""

from __future__ import annotations

from ..torch_compat import flight_recorder

__all__ = ["RETIRED", "retire_groups"]

RETIRED: set[str] = set()
"""The flight recorder's status keys of the groups this rank has left."""


def retire_groups() -> None:
    """Called just before this rank destroys its process groups: their recorder status
    keys join ``RETIRED`` (nothing where the recorder is off or absent)."""
    status = flight_recorder(False) or {}
    RETIRED.update(str(k) for k in status.get("pg_status") or {})
