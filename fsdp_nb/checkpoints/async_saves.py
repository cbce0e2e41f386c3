"""Async saves still being written: the notebook's handle and the session's registry
(``SessionContext.saves``).

``sess.save(..., async_save=True)`` returns an :class:`AsyncCheckpoint` once every rank
handed its state dict to the background; the ranks copy, write and commit there. The next save, load
or ``shutdown`` of that session waits for it first (:func:`wait_pending`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ..formats.info import CheckpointInfo
from .arguments import raise_outcomes
from .wire_checkpoint import Outcome, SaveProgress

if TYPE_CHECKING:
    from ..context import SessionContext

log = logging.getLogger("fsdp_nb")

__all__ = ["AsyncCheckpoint", "register", "wait_pending"]

def wait_pending(ctx: SessionContext) -> None:
    """Finish every async save of ``sess`` still running (commits them), before a call
    whose collectives must not meet theirs. A save that failed is its handle's to raise
    (``wait()``, again and again): here it is logged, naming the save, and the call goes
    on, so a save that a dead engine cut short does not stand in the way of the
    ``restart`` that brings the run back."""
    for h in list(ctx.saves):
        try:
            h.wait()
        except CheckpointError as exc:
            log.warning("fsdp_nb: the async save to %s failed (its handle's wait() raises it): %s", h.path, exc)


class AsyncCheckpoint:
    """A checkpoint being copied and written in the background on the ranks.

    The handle comes back as soon as the ranks hold the state dict; the CPU copy
    (staging) runs in the background, and every optimizer's next step (and a forward of
    the model while its buffers are copied) waits for it. The save is this handle's: an
    autosave running meanwhile waits for it, and leaves its outcome to ``wait()``.

    ``done()`` and ``progress()`` (phase, bytes written) ask the ranks without blocking;
    ``wait()`` blocks until every rank finished and rank 0 committed, then returns the
    ``CheckpointInfo``. The next ``sess.save`` / ``sess.load`` waits for it too.

    ``sess.save(..., async_save=True)`` makes it, not user code: ``ctx`` is the session's
    context, ``path`` where it writes, ``token`` the save's name on the ranks and
    ``blocked`` the seconds the call held them.
    """

    def __init__(self, ctx: SessionContext, path: str, token: str, blocked: float):
        self._ctx = ctx
        self.path = path
        """Where the checkpoint is being written."""
        self.token = token
        """The save's name on the ranks (their background job's key)."""
        self.blocked_s = blocked
        """Seconds the save call held the ranks (the slowest rank's)."""
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._total = 0
        self._phase = "staging"

    def done(self) -> bool:
        """True when every rank finished writing (the commit happened or failed)."""
        if self._finished:
            return True
        from . import rank_async_saves as jobs

        d = self._ctx.dispatcher
        return all(d.gather(d.apply("checkpoint async_done", jobs.async_done, args=(self.token,))))

    def progress(self) -> SaveProgress:
        """Where the save is, asked of the ranks without blocking: ``phase`` (``"staging"``,
        ``"writing"``, ``"committing"``, ``"committed"`` or ``"failed"``) and the bytes
        written of the bytes staged, summed over the ranks."""
        if self._finished:
            return SaveProgress(phase="failed" if self._error else "committed",
                                written=self._total, total=self._total)
        from . import rank_async_saves as jobs

        d = self._ctx.dispatcher
        parts = d.gather(d.apply("checkpoint async_progress", jobs.async_progress, args=(self.token,)))
        self._total = sum(p.total for p in parts)
        phases = {p.phase for p in parts}
        phase = next((p for p in ("failed", "staging", "writing") if p in phases),
                     "committed" if phases == {"done"} else "committing")
        self._phase = phase
        return SaveProgress(phase=phase, written=sum(p.written for p in parts), total=self._total)

    @property
    def phase(self) -> str:
        """``"staging"``, ``"writing"`` or ``"committing"`` while in flight, then
        ``"committed"`` or ``"failed"``, as last seen from the notebook (``progress()``
        asks the ranks)."""
        if self._finished:
            return "failed" if self._error else "committed"
        return self._phase

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until committed; returns its CheckpointInfo (raises if the save failed).

        ``timeout``: seconds to wait for the ranks (None: as long as it takes); past it,
        a ``RankTimeoutError``."""
        if not self._finished:
            from . import rank_async_saves as jobs

            d = self._ctx.dispatcher
            try:
                outs = d.gather(d.apply("checkpoint async_wait", jobs.async_wait, args=(self.token,)), timeout)
                self._finished = True
                self._info = self._committed(outs)
            except BaseException as exc:  # kept for later wait() calls, then re-raised
                if self._finished:
                    self._error = exc
                raise
            finally:
                if self._finished:
                    if self in self._ctx.saves:
                        self._ctx.saves.remove(self)
        if self._error is not None:
            raise self._error
        if self._info is None:  # pragma: no cover - _committed gives one or raises
            raise CheckpointError(f"the async save to {self.path!r} has no description")
        return self._info

    def _committed(self, outs: list[Outcome]) -> CheckpointInfo:
        """The info of the committed save, from the ranks' outcomes: the first failure is
        raised; ranks that do not know the save (their engines were replaced by a restart)
        are answered by the checkpoint itself, complete or not."""
        unknown = [r for r, o in enumerate(outs) if not o.ok and o.error is LookupError]
        try:
            raise_outcomes([o for r, o in enumerate(outs) if r not in unknown])
        except CheckpointError as exc:  # a rank's own words may not name the save (a peer that died)
            if self.path in str(exc):
                raise
            raise type(exc)(f"the async save to {self.path!r}: {exc}") from exc
        info = next((o.info for o in outs if o.info is not None), None)
        if unknown and info is None:
            from ..formats.inspect import inspect
            from ..formats.storage import options_for

            try:
                found: CheckpointInfo | None = inspect(self.path, storage_options=options_for(self.path))
            except FileNotFoundError:
                found = None
            if found is None or not found.valid:
                raise CheckpointError(
                    f"the async save to {self.path!r} is lost: rank(s) {', '.join(map(str, unknown))} do not know it "
                    "(a restart replaced their engines while it was written, or it was collected already), and "
                    f"{self.path!r} is {'not there' if found is None else 'not complete: ' + str(found.problem)}"
                )
            info = found
        if info is None:
            raise CheckpointError(f"the async save to {self.path!r} finished, but rank 0 described no checkpoint")
        return info

    def __repr__(self) -> str:
        return f"<AsyncCheckpoint {self.path!r}: {self.phase}, the ranks were held {self.blocked_s:.3f} s>"


def register(ctx: SessionContext, handle: AsyncCheckpoint) -> AsyncCheckpoint:
    """Track ``handle`` as one of ``sess``'s pending saves."""
    ctx.saves.append(handle)
    return handle
