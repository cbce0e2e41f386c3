"""Async checkpoint saves on a rank: the background jobs and the staging buffers.

``checkpoint_io`` stages a rank's state into CPU buffers (:func:`stager`, one per
engine, so buffers are reused), then hands the write and the commit to :func:`submit`:
one background thread per engine runs them in order. The notebook polls a job with
:func:`async_done` and collects its outcome with :func:`async_wait`; the next save or
load on the rank drains every job first (:func:`drain`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..checkpoint.contract import Outcome, SaveProgress

__all__ = ["async_done", "async_progress", "async_wait", "drain", "stager", "submit"]

log = logging.getLogger("fsdp_nb")

_EXEC: ThreadPoolExecutor | None = None
_JOBS: dict[str, Future] = {}
_PROGRESS: dict[str, tuple[SaveProgress, Callable[[], int]]] = {}
_STAGER: Any = None


def submit(token: str, job: Callable[[], Outcome], progress: SaveProgress | None = None,
           written: Callable[[], int] | None = None) -> None:
    """Run ``job`` (write and commit) in this engine's checkpoint thread, as ``token``.

    ``progress``: the job's phase, which it updates; ``written``: bytes written so far.
    """
    global _EXEC
    if _EXEC is None:
        _EXEC = ThreadPoolExecutor(1, thread_name_prefix="fsdp_nb-ckpt")
    if progress is not None:
        _PROGRESS[token] = (progress, written or (lambda: 0))
    _JOBS[token] = _EXEC.submit(job)


def async_progress(token: str) -> SaveProgress:
    """This rank's part of async save ``token``: phase and bytes written (a job already
    collected, or unknown here, reads as done)."""
    fut = _JOBS.get(token)
    if fut is None:
        return SaveProgress(phase="done")
    p, written = _PROGRESS.get(token, (SaveProgress(), lambda: 0))
    phase = p.phase
    if fut.done():
        phase = "done" if fut.result().ok else "failed"
    return SaveProgress(phase=phase, written=written(), total=p.total)


def drain() -> None:
    """Finish (and commit) every async save still running on this rank."""
    for token, fut in list(_JOBS.items()):
        try:
            out = fut.result()
            if not out.ok:
                log.warning("an async checkpoint save failed on this rank: %s", out.message)
        except BaseException as exc:
            log.warning("an async checkpoint save failed on this rank: %s", exc)
        _JOBS.pop(token, None)
        _PROGRESS.pop(token, None)


def async_done(token: str) -> bool:
    """Whether this rank's part of async save ``token`` has finished (committed on rank 0)."""
    fut = _JOBS.get(token)
    return fut is None or fut.done()


def async_wait(token: str) -> Outcome:
    """Block until this rank's part of async save ``token`` finished; its outcome."""
    fut = _JOBS.get(token)
    if fut is None:
        return Outcome()
    out = fut.result()
    _JOBS.pop(token, None)
    _PROGRESS.pop(token, None)
    return out


def stager() -> Any:
    """This engine's stager, one for its lifetime, so staging buffers are reused.

    DCP's ``DefaultStager`` keeps a CPU copy per source storage and refreshes it with
    ``copy_`` on later saves (FSDP2 shards and optimizer state keep their storages
    between steps): the first async save allocates, the next ones only copy. On CUDA
    the copies are pinned and made with non-blocking copies.
    """
    global _STAGER
    if _STAGER is None:
        import torch
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        _STAGER = DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False,
            use_async_staging=False, use_non_blocking_copy=cuda,
        ))
    return _STAGER
