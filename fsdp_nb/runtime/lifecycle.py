"""A session's state as a small state machine.

``starting`` -> ``ready`` (group formed) or ``failed``; ``ready`` <-> ``degraded`` (a
rank died or recovery failed; ``restart()`` brings it back); any -> ``closed``. The
session, its failure policy and restart move the state through ``Lifecycle.to``,
which refuses every other move, so no layer sets a state it should not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["Lifecycle"]


class Lifecycle:
    """A session's state and the moves allowed between states.

    ``starting`` -> ``ready`` (group formed) or ``failed``; ``ready`` <-> ``degraded``
    (a rank died or recovery failed; ``restart()`` brings it back); any -> ``closed``.
    Recovery and restart move the state through ``to``, which refuses other moves.
    """

    MOVES = {
        "starting": {"ready", "failed", "closed"},
        "ready": {"ready", "degraded", "closed"},
        "degraded": {"ready", "degraded", "closed"},
        "failed": {"closed"},
        "closed": set(),
    }

    def __init__(self) -> None:
        self.state = "starting"
        """The current state."""
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the session closes (a memory feed stops its receiver)."""
        self._on_close.append(fn)

    def to(self, new: str) -> None:
        """Move to ``new``; RuntimeError if that move is not allowed."""
        if new not in self.MOVES[self.state]:
            raise RuntimeError(f"a session cannot go from {self.state!r} to {new!r}")
        self.state = new
        if new == "closed":
            hooks, self._on_close = self._on_close, []
            for fn in hooks:
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - one broken hook must not keep the others open
                    logging.getLogger("fsdp_nb").warning("a close hook failed: %s", exc)
