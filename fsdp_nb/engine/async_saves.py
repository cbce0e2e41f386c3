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
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.contract import Outcome, SaveProgress

__all__ = ["async_done", "async_progress", "async_wait", "drain", "stager", "submit"]

log = logging.getLogger("fsdp_nb")

_EXEC: ThreadPoolExecutor | None = None
_STAGER: Any = None


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
        _EXEC = ThreadPoolExecutor(1, thread_name_prefix="fsdp_nb-ckpt")
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
        except BaseException as exc:
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
