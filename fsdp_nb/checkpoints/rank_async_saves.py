"""Async checkpoint saves on a rank: the background jobs, the staging buffers, and
the gate that keeps training from changing what is still being copied.

``checkpoint_save`` hands its state dict to DCP with this engine's stager
(:meth:`AsyncSaves.stager`, one per engine, so buffers are reused), which copies it to
CPU in a background thread; the call returns at once. Until that copy is taken, the
gate holds training back (:class:`AsyncSaves`, the step owner's listener of order 10):
every optimizer's step waits for it, and so does a forward of a saved model whose
persistent buffers are being copied (a forward may update them, as BatchNorm's running
stats do). Training overlaps the copy, but never changes a tensor before it is copied.
The write and the commit then run in order in one background thread per engine, at a
lower CPU priority (:func:`submit`).

Each job belongs to whoever started it, named by its token: the notebook's handle of a
``sess.save(..., async_save=True)``, or the autosave. Only its owner collects its outcome
(:func:`async_wait`); a token this rank does not know is an error that says so. The next
save or load on the rank first waits for every job still running (:func:`drain`), so that
their collectives end before its own begin, and leaves their outcomes to their owners.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from ..engine.gates import waited
from ..engine.registry import Part, World, part
from ..engine.step import StepListener, owner
from ..formats.helper_threads import lower_priority
from ..torch_compat import kept_open_stager
from .wire_checkpoint import Outcome, SaveProgress

__all__ = [
    "AsyncSaves", "abandoned", "async_done", "async_progress", "async_wait", "copied", "drain", "hold_until_staged",
    "orphan", "stager", "submit", "wait_staged",
]

log = logging.getLogger("fsdp_nb")

BACKGROUND_NICE = 10
"""How much lower the CPU priority of the write-and-commit thread is (and of the threads
it starts: DCP's copy and upload, the write helpers) than the engine's: where cores are
shared, ranks still answering the save's call and training steps come first (4 ranks
on 2 cores, 805 MB: the notebook blocked 13 ms instead of 18, medians of 6 runs)."""
REFORM_WAIT_S = 60.0
"""How long a rank whose group formed again waits for its async saves of the old group
to end (they fail at their next collective there, whose peers left)."""


@dataclass
class _Job:
    """One async save on this rank: its background future and what it reports."""

    future: Future
    progress: SaveProgress = field(default_factory=SaveProgress)
    """Phase (updated by the job) and the bytes it stages."""
    written: Callable[[], int] = lambda: 0
    """Bytes written so far."""
    orphan: bool = False
    """Its owner will not collect it (an autosave stopped while it wrote): the next
    :meth:`AsyncSaves.drain` drops it once done, logging a failure."""
    abandoned: bool = False
    """It was still running when the group formed again: its collectives belong to a group
    that is gone, so no later save waits for it."""


class AsyncSaves(Part, StepListener):
    """This rank's async saves (the registry's part) and their staging gate (the step
    owner's listener, order 10: told first, before anything changes a tensor)."""

    order = 10

    def __init__(self) -> None:
        self.executor: ThreadPoolExecutor | None = None
        """The write-and-commit thread (one, so jobs run in the order they were started)."""
        self.copier: Any = None
        """DCP's stager, kept for the engine's life (:meth:`stager`)."""
        self.staging: Future | None = None
        """The copy of the latest async save, while the stager's thread takes it."""
        self.buffered: weakref.WeakSet[Any] = weakref.WeakSet()
        """The saved models with persistent buffers that copy is taking."""
        self.jobs: dict[str, _Job] = {}
        """Token -> each job not yet collected by its owner."""
        self.waited_s = 0.0
        """Seconds training on this rank has waited for staging, in total."""

    # -- the gate (what the step owner tells) ----------------------------------------

    def optimizer_stepping(self, optimizer: Any) -> None:
        self.wait_staged()

    def forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        if module in self.buffered:
            self.wait_staged()

    def eval_forward(self, module: Any) -> None:
        if module in self.buffered:
            self.wait_staged()

    def hold(self, staging: Future, models: Iterable[tuple[Any, bool]]) -> None:
        """Make training wait for ``staging`` (the copy of an async save) before it
        changes a saved tensor: every optimizer's step, and a forward of each
        ``(model, buffers)`` whose persistent ``buffers`` are copied."""
        owner().listen(self)
        self.staging = staging
        self.buffered = weakref.WeakSet()
        for model, buffers in models:
            owner().watch(model)
            if buffers:
                self.buffered.add(model)

    def wait_staged(self) -> None:
        """Block until the latest async save's copy is taken (a failed copy fails that save,
        reported by its owner, not here)."""
        self.waited_s += waited(self.staging)

    # -- the jobs -------------------------------------------------------------------

    def submit(self, token: str, job: Callable[[], Outcome], progress: SaveProgress | None = None,
               written: Callable[[], int] | None = None) -> None:
        """Run ``job`` (write and commit) in this engine's checkpoint thread, as ``token``."""
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="fsdp_nb-ckpt",
                                               initializer=lower_priority, initargs=(BACKGROUND_NICE,))
        self.jobs[token] = _Job(self.executor.submit(job), progress or SaveProgress(), written or (lambda: 0))

    def drain(self) -> None:
        """Wait until every async save still running on this rank has finished (committed
        or failed). Their outcomes stay for their owners; an orphan's is logged and dropped."""
        for token, job in list(self.jobs.items()):
            if job.abandoned:
                continue
            wait_futures([job.future])
            if job.orphan:
                self._drop(token)

    def wait(self, token: str) -> Outcome:
        """Block until this rank's part of async save ``token`` finished; its outcome,
        collected (a failed outcome saying so when this rank does not know ``token``)."""
        job = self.jobs.get(token)
        if job is None:
            return Outcome.failed(
                f"this rank knows no async save {token!r}: its outcome was collected already, or this rank's "
                "engine is not the one that started it (a restart replaced it)", LookupError)
        if job.abandoned and not job.future.done():  # its collectives belong to a group that is gone
            self.jobs.pop(token, None)
            return Outcome.failed(f"the async save {token!r} was still running when the group formed again: "
                                  "abandoned, it cannot commit")
        out = _outcome(job.future)
        self.jobs.pop(token, None)
        return out

    def orphan(self, token: str) -> None:
        """Nobody will collect ``token`` (its owner stopped): drop it once it is done."""
        job = self.jobs.get(token)
        if job is None:
            return
        job.orphan = True
        if job.future.done():
            self._drop(token)

    def _drop(self, token: str) -> None:
        job = self.jobs.pop(token)
        out = _outcome(job.future)
        if not out.ok:
            log.warning("an async checkpoint save failed on this rank: %s", out.message)

    def stager(self, cuda: bool) -> Any:
        """This engine's stager, one for its lifetime, so staging buffers are reused.

        DCP's ``DefaultStager`` keeps a CPU copy per source storage and refreshes it with
        ``copy_`` on later saves (FSDP2 shards and optimizer state keep their storages
        between steps): the first async save allocates, the next ones only copy. It copies
        in its own thread (``use_async_staging``); from ``cuda`` tensors into pinned
        memory, with non-blocking copies on a side stream.
        """
        if self.copier is None:
            self.copier = kept_open_stager(cuda)
        return self.copier

    # -- the lifecycle --------------------------------------------------------------

    def reformed(self, world: World) -> None:
        """A save of the old group cannot go on in the new one: each still running is
        waited for (it ends at its next collective there, whose peers left), its outcome
        kept for its owner; one that outlasts :data:`REFORM_WAIT_S` is abandoned."""
        running = [j for j in self.jobs.values() if not j.future.done() and not j.abandoned]
        if running:
            _, late = wait_futures([j.future for j in running], timeout=REFORM_WAIT_S)
            for job in running:
                if job.future in late:
                    job.abandoned = True
                    log.warning("an async checkpoint save of the old process group was still running %.0f s after "
                                "the group formed again: abandoned (it cannot commit)", REFORM_WAIT_S)
            if late and self.executor is not None:
                # its thread may stay blocked in a collective of the old group (a peer that
                # left it mid-ring) until that group's timeout: the new group's saves get a
                # thread of their own instead of queueing behind it
                self.executor.shutdown(wait=False)
                self.executor = None
        self.staging = None
        self.buffered = weakref.WeakSet()

    def closed(self) -> None:
        """The rank leaves: its saves still running finish first (bounded), then the thread
        stops; a later session starts all of it again."""
        running = [j.future for j in self.jobs.values() if not j.future.done() and not j.abandoned]
        if running:
            _, late = wait_futures(running, timeout=REFORM_WAIT_S)
            if late:
                log.warning("%d async checkpoint save(s) still running as this rank leaves: abandoned", len(late))
        owner().unlisten(self)
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        self.executor, self.staging, self.copier = None, None, None  # the stager's buffers go with it
        self.buffered = weakref.WeakSet()
        self.jobs.clear()


def _outcome(future: Future) -> Outcome:
    """A finished job's outcome; one that raised becomes a failed outcome naming it."""
    try:
        return future.result()
    except BaseException as exc:  # noqa: BLE001 - a background save's failure, whatever it is, is its owner's outcome
        return Outcome.failed(f"the async save failed: {type(exc).__name__}: {exc}")


def _saves() -> AsyncSaves:
    return part(AsyncSaves)


def submit(token: str, job: Callable[[], Outcome], progress: SaveProgress | None = None,
           written: Callable[[], int] | None = None) -> None:
    """Run ``job`` (write and commit) in this engine's checkpoint thread, as ``token``.

    ``progress``: the job's phase, which it updates; ``written``: bytes written so far.
    """
    _saves().submit(token, job, progress, written)


def async_progress(token: str) -> SaveProgress:
    """This rank's part of async save ``token``: phase and bytes written (a job already
    collected, or unknown here, reads as done)."""
    job = _saves().jobs.get(token)
    if job is None:
        return SaveProgress(phase="done")
    phase = job.progress.phase
    if job.future.done():
        phase = "done" if _outcome(job.future).ok else "failed"
    return SaveProgress(phase=phase, written=job.written(), total=job.progress.total)


def drain() -> None:
    """Wait for every async save still running on this rank (``AsyncSaves.drain``)."""
    _saves().drain()


def async_done(token: str) -> bool:
    """Whether this rank's part of async save ``token`` has finished (committed on rank 0);
    True for a token it does not know (:func:`async_wait` then says why)."""
    job = _saves().jobs.get(token)
    return job is None or job.future.done()


def abandoned(token: str) -> bool:
    """Whether async save ``token`` was still running when the group formed again, and was
    left to end on its own (it cannot commit)."""
    job = _saves().jobs.get(token)
    return job is not None and job.abandoned and not job.future.done()


def async_wait(token: str) -> Outcome:
    """Block until this rank's part of async save ``token`` finished; its outcome
    (``AsyncSaves.wait``: only its owner collects it, once)."""
    return _saves().wait(token)


def orphan(token: str) -> None:
    """Nobody will collect async save ``token`` (``AsyncSaves.orphan``)."""
    _saves().orphan(token)


def stager(cuda: bool) -> Any:
    """This engine's stager (``AsyncSaves.stager``)."""
    return _saves().stager(cuda)


def hold_until_staged(staging: Future, saved: Iterable[tuple[Any, bool]]) -> None:
    """Make training wait for ``staging`` before it changes a saved tensor: each
    ``(model, buffers)`` saved, with whether its persistent buffers are copied
    (``AsyncSaves.hold``)."""
    _saves().hold(staging, saved)


def wait_staged() -> None:
    """Block until the latest async save's copy is taken (``AsyncSaves.wait_staged``)."""
    _saves().wait_staged()


def copied(copy: Future, staged: Future, progress: SaveProgress) -> None:
    """DCP's staging future ``copy`` is done: pass its outcome on to ``staged`` (what
    training waits on) and move ``progress`` on to writing."""
    exc = copy.exception()
    if exc is None:
        staged.set_result(None)
    else:
        staged.set_exception(exc)
    if progress.phase == "staging":
        progress.phase = "writing"
