"""Async checkpoint saves on a rank: the background jobs, the staging buffers, and
the gate that keeps training from changing what is still being copied.

``checkpoint_save`` hands its state dict to DCP with this engine's stager
(:func:`stager`, one per engine, so buffers are reused), which copies it to CPU in a
background thread; the call returns at once. Until that copy is taken, the saved
optimizer's next ``step`` (and the next forward of a model with persistent buffers)
waits for it (:func:`hold_until_staged`): training overlaps the copy, but never
changes a tensor before it is copied. The write and the commit then run in order in
one background thread per engine, at a lower CPU priority (:func:`submit`). The
notebook polls a job with :func:`async_done` / :func:`async_progress` and collects its
outcome with :func:`async_wait`; the next save or load on the rank drains every job
first (:func:`drain`).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from ..formats.helper_threads import lower_priority
from ..torch_compat import kept_open_stager
from .wire_checkpoint import Outcome, SaveProgress

__all__ = [
    "async_done", "async_progress", "async_wait", "copied", "drain", "gate", "hold_until_staged", "stager", "submit",
    "wait_staged",
]

log = logging.getLogger("fsdp_nb")

_EXEC: ThreadPoolExecutor | None = None
_STAGER: Any = None
_STAGING: Future | None = None
"""The copy of the latest async save, while the stager's thread takes it."""
_GATED: weakref.WeakSet = weakref.WeakSet()
"""Optimizers and models that already carry the gate hook (one each, for life)."""
BACKGROUND_NICE = 10
"""How much lower the CPU priority of the write-and-commit thread is (and of the threads
it starts: DCP's copy and upload, the write helpers) than the engine's: where cores are
shared, ranks still answering the save's call and training steps come first (4 ranks
on 2 cores, 805 MB: the notebook blocked 13 ms instead of 18, medians of 6 runs)."""
waited_s = 0.0
"""Seconds training on this rank has waited for staging, in total (benchmarks)."""


@dataclass
class _Job:
    """One async save on this rank: its background future and what it reports."""

    future: Future
    progress: SaveProgress = field(default_factory=SaveProgress)
    """Phase (updated by the job) and the bytes it stages."""
    written: Callable[[], int] = lambda: 0
    """Bytes written so far."""


_JOBS: dict[str, _Job] = {}


def submit(token: str, job: Callable[[], Outcome], progress: SaveProgress | None = None,
           written: Callable[[], int] | None = None) -> None:
    """Run ``job`` (write and commit) in this engine's checkpoint thread, as ``token``.

    ``progress``: the job's phase, which it updates; ``written``: bytes written so far.
    """
    global _EXEC
    if _EXEC is None:
        _EXEC = ThreadPoolExecutor(1, thread_name_prefix="fsdp_nb-ckpt",
                                   initializer=lower_priority, initargs=(BACKGROUND_NICE,))
    _JOBS[token] = _Job(_EXEC.submit(job), progress or SaveProgress(), written or (lambda: 0))


def async_progress(token: str) -> SaveProgress:
    """This rank's part of async save ``token``: phase and bytes written (a job already
    collected, or unknown here, reads as done)."""
    job = _JOBS.get(token)
    if job is None:
        return SaveProgress(phase="done")
    phase = job.progress.phase
    if job.future.done():
        phase = "done" if job.future.result().ok else "failed"
    return SaveProgress(phase=phase, written=job.written(), total=job.progress.total)


def drain() -> None:
    """Finish (and commit) every async save still running on this rank."""
    for token, job in list(_JOBS.items()):
        try:
            out = job.future.result()
            if not out.ok:
                log.warning("an async checkpoint save failed on this rank: %s", out.message)
        except BaseException as exc:  # noqa: BLE001 - a background save's failure, whatever it is, is logged on the rank; the notebook hears it from async_wait
            log.warning("an async checkpoint save failed on this rank: %s", exc)
        _JOBS.pop(token, None)


def async_done(token: str) -> bool:
    """Whether this rank's part of async save ``token`` has finished (committed on rank 0)."""
    job = _JOBS.get(token)
    return job is None or job.future.done()


def async_wait(token: str) -> Outcome:
    """Block until this rank's part of async save ``token`` finished; its outcome."""
    job = _JOBS.get(token)
    if job is None:
        return Outcome()
    out = job.future.result()
    _JOBS.pop(token, None)
    return out


def stager(cuda: bool) -> Any:
    """This engine's stager, one for its lifetime, so staging buffers are reused.

    DCP's ``DefaultStager`` keeps a CPU copy per source storage and refreshes it with
    ``copy_`` on later saves (FSDP2 shards and optimizer state keep their storages
    between steps): the first async save allocates, the next ones only copy. It copies
    in its own thread (``use_async_staging``); from ``cuda`` tensors into pinned
    memory, with non-blocking copies on a side stream.
    """
    global _STAGER
    if _STAGER is None:
        _STAGER = kept_open_stager(cuda)
    return _STAGER


def hold_until_staged(staging: Future, saved: list[tuple[Any, Any, bool]]) -> None:
    """Make training wait for ``staging`` (the copy of an async save) before it changes
    a saved tensor: for each ``(model, optim, buffers)`` saved, a pre-hook on
    ``optim.step`` (when there is one), and on ``model``'s forward when it has persistent
    ``buffers`` (a forward may update them, as BatchNorm's running stats do).

    The hooks are added once per object and do nothing once the copy is taken.
    """
    global _STAGING
    _STAGING = staging
    for model, optim, buffers in saved:
        gate(model if buffers else None, optim)


def gate(model: Any, optim: Any) -> None:
    """Put the staging gate on ``optim``'s step and ``model``'s forward (either may be
    None) ahead of any save: an autosave starts inside a forward whose hooks are already
    chosen. The hooks run eagerly under ``torch.compile`` and wait only while a copy is
    being taken."""
    import torch

    wait = torch.compiler.disable(lambda *_: wait_staged())
    if optim is not None and optim not in _GATED:
        optim.register_step_pre_hook(wait)
        _GATED.add(optim)
    if model is not None and model not in _GATED:
        model.register_forward_pre_hook(wait)
        _GATED.add(model)


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


def wait_staged() -> None:
    """Block until the latest async save's copy is taken (a failed copy fails that save,
    reported by its handle, not here)."""
    global waited_s
    f = _STAGING
    if f is not None and not f.done():
        t0 = time.perf_counter()
        wait_futures([f])
        waited_s += time.perf_counter() - t0
