"""A session's state as a small state machine.

``starting`` -> ``ready`` (group formed) or ``failed``; ``ready`` <-> ``degraded`` (a
rank died or recovery failed; ``restart()`` brings it back); ``unfinished`` (a restart
failed part way: calls are refused until a restart runs to its end); any -> ``closed``.
The session, its failure policy and restart move the state through ``Lifecycle.to``,
which refuses every other move, so no layer sets a state it should not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..errors import SessionUnfinishedError

__all__ = ["Lifecycle"]


class Lifecycle:
    """A session's state and the moves allowed between states.

    ``starting`` -> ``ready`` (group formed) or ``failed``; ``ready`` <-> ``degraded``
    (a rank died or recovery failed; ``restart()`` brings it back); ``unfinished``
    (a restart failed part way: :meth:`check_usable` refuses every call, saying
    :attr:`why`, until a restart runs to its end); any -> ``closed``.
    Recovery and restart move the state through ``to``, which refuses other moves.
    """

    MOVES = {
        "starting": {"ready", "failed", "closed"},
        "ready": {"ready", "degraded", "unfinished", "closed"},
        "degraded": {"ready", "degraded", "unfinished", "closed"},
        "unfinished": {"ready", "degraded", "unfinished", "closed"},
        "failed": {"closed"},
        "closed": set(),
    }

    def __init__(self) -> None:
        self.state = "starting"
        """The current state."""
        self.why = ""
        """What left the session ``unfinished`` and how to mend it ("" in every other state)."""
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the session closes (a memory feed stops its receiver)."""
        self._on_close.append(fn)

    def to(self, new: str, why: str = "") -> None:
        """Move to ``new``; RuntimeError if that move is not allowed. ``why``: for
        ``unfinished``, the step that failed and how to mend it."""
        if new not in self.MOVES[self.state]:
            raise RuntimeError(f"a session cannot go from {self.state!r} to {new!r}")
        self.state = new
        self.why = why if new == "unfinished" else ""
        if new == "closed":
            hooks, self._on_close = self._on_close, []
            for fn in hooks:
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - one broken hook must not keep the others open
                    logging.getLogger("fsdp_nb").warning("a close hook failed: %s", exc)

    def check_usable(self, what: str) -> None:
        """Refuse call ``what`` (``SessionUnfinishedError``, saying :attr:`why`) while the
        session is ``unfinished``; the recovering dispatcher asks before it sends one."""
        if self.state == "unfinished":
            raise SessionUnfinishedError(f"{what} was not sent: {self.why}")
