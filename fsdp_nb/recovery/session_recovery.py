"""``sess.status``, ``restart``, ``resize`` and ``debug``: the façade's recovery methods,
checked and delegated.

Mixed into :class:`fsdp_nb.Session`; each method hands the session context to the module
of this package that does the work, imported at the first call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..context import SessionContext
    from .resize import ResizeReport
    from .restart_report import RestartReport
    from .status import SessionStatus

__all__ = ["SessionRecovery"]


class SessionRecovery:
    """The recovery methods of a ``Session``."""

    _ctx: SessionContext

    def status(self) -> SessionStatus:
        """Which rank is busy, idle or dead, and where a busy rank is (its stack)."""
        from .status import read_status

        return read_status(self._ctx)

    def restart(self, restore: str | None = None, *, drop: Sequence[str] = (),
                setup: Callable[[], Any] | None = None) -> RestartReport:
        """Bring back the same ranks (dead engines replaced), rebuild the group and wraps;
        returns what was replaced, rebuilt from initialisation, restored and kept.

        Args:
            restore: a checkpoint, or ``"latest"`` (the newest ``autosave`` wrote; with
                ``in_memory=True``, the ranks' copies in memory when they are whole for
                every rank at a step no older, a new rank's taken from its buddy, and the
                report says which served and why), loaded last into the model it was
                saved from, with its optimizer, the per-rank state it keeps and each
                rank's random state: the training cell goes on from it bit for bit. Without it a model comes back at its
                initial weights (one wrapped from a notebook instance, not at all).
            drop: names of wrapped models not to rebuild.
            setup: a function run on every rank after the rebuild, before the load, that
                makes what the training cell uses (``global opt; opt = AdamW(model...)``):
                a replaced rank has nothing a cell made.

        A running autosave is re-armed from the restored step with ``restore=``; without
        it, where the models were rebuilt at their initial weights, it is suspended until a
        restart restores. A ``"16-mixed"`` scaler keeps the survivors' scale on every rank.
        A restart that fails once it began to change the session leaves it ``unfinished``:
        every call is refused (``SessionUnfinishedError``), naming the step that failed,
        until a restart runs to its end.
        """
        from .restart import restart

        if isinstance(drop, str) or not all(isinstance(n, str) for n in drop):
            raise TypeError(f"drop must be a list of wrapped model names, got {drop!r}")
        return restart(self._ctx, restore=restore, drop=tuple(drop), setup=setup)

    def resize(self, n: int, *, staging: str | None = None) -> ResizeReport:
        """Grow or shrink the world to ``n`` ranks, keeping every wrapped model and its
        optimizers, re-sharded in place, and the other variables of the ranks that stay.

        Growing adds engines (the standby first); shrinking retires the highest ranks.
        New ranks get the session's imports, classes and functions, and the optimizers.
        Anything that stops it (a mesh that does not fit ``n``, too little room to stage)
        is refused before anything changes. A ``"16-mixed"`` scaler carries over, with one
        scale on every rank; a running autosave is stopped (its checkpoints keep the old
        world's per-rank state: arm it again), except one with ``in_memory=True``, armed
        again on the new world with every rank's state copied to its new buddy, where
        every rank has what it names (the report says which it did); a profile under way
        ends; the step view's windows start afresh.

        Args:
            n: the new number of ranks.
            staging: a folder in memory the state passes through (default ``/dev/shm``;
                ranks on several hosts need one every host mounts).
        """
        from .resize import resize

        return resize(self._ctx, n, staging)

    def debug(self, rank: int | None = None, commands: Sequence[str] | None = None) -> str | None:
        """Post-mortem pdb on the frame where ``rank`` failed.

        Each rank keeps its last failure until the next one.

        Args:
            rank: whose failure (default: the first rank that failed in the last
                ``RankError``).
            commands: pdb commands to run there, e.g. ``["p y", "up", "p x"]``, whose
                output is returned; None: interactive (commands read with ``input()``).
        """
        from .postmortem import debug

        self._ctx.check_open()
        return debug(self._ctx, rank, commands)
