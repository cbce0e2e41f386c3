"""A rank's bytes done in a save or load, published to the notebook as they go.

``start(total)`` opens a count for the call running now, ``add(n)`` adds the bytes
just written or read and publishes the running count at most every ``INTERVAL``
seconds (ipyparallel's data channel: the call's ``AsyncResult.data`` in the notebook,
where ``fsdp_nb.display.progress.follow`` sums the ranks into one bar). Only the engine's
main thread publishes: an async save's background writes belong to no call.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..engine.registry import Part, part
from ..wire.calls import PROGRESS_KEY as KEY

__all__ = ["INTERVAL", "add", "counted", "finish", "start"]

log = logging.getLogger("fsdp_nb")

INTERVAL = 0.2
"""Seconds between publications."""



class Progress(Part):
    """The count of the call running now (the registry's part for progress)."""

    def __init__(self) -> None:
        self.count: dict[str, Any] = {"done": 0, "total": 0, "at": 0.0, "on": False}
        """Bytes done and expected, when last published, and whether to publish."""


def start(total: int, publish: bool) -> None:
    """Begin counting this call's bytes (``total`` expected on this rank); ``publish``:
    the notebook may draw a bar (else nothing is sent)."""
    part(Progress).count.update(done=0, total=int(total), at=0.0,
                  on=publish and threading.current_thread() is threading.main_thread())
    _publish()


def counted(done: int, total: int, finished: bool = False) -> int:
    """The bytes done that a count shows against ``total`` (this rank's tensor bytes):
    ``done``, the bytes of files written or read so far, at most ``total``; ``total``
    once the rank's part is ``finished``.

    The files hold more than the tensors (each stored item's framing, pickled items such
    as an optimizer's ``param_groups``, ``.metadata``), and a resharded load reads whole
    stored items past its own shard: counted as they go, the bytes passed ``total`` near
    the end, and a save's progress showed more bytes written than its total. A rank
    whose replicated tensors another rank wrote writes fewer: ``finished`` says it is done.

    Args:
        done: file bytes written or read so far.
        total: the tensor bytes expected on this rank.
        finished: this rank's part is written (or read).
    """
    return int(total) if finished else max(0, min(int(done), int(total)))


def add(n: int) -> None:
    """``n`` more bytes written or read (counted up to the total: ``counted``)."""
    count = part(Progress).count
    count["done"] = counted(count["done"] + n, count["total"])
    if part(Progress).count["on"] and time.monotonic() - part(Progress).count["at"] >= INTERVAL:
        _publish()


def finish() -> None:
    """The call's work is done: publish the final count."""
    _publish()
    part(Progress).count["on"] = False


def _publish() -> None:
    if not part(Progress).count["on"] or threading.current_thread() is not threading.main_thread():
        return
    part(Progress).count["at"] = time.monotonic()
    try:
        from ipyparallel.datapub import publish_data

        publish_data({KEY: {"done": part(Progress).count["done"], "total": part(Progress).count["total"]}})
    except Exception as exc:  # noqa: BLE001 - not inside an engine (a plain process): nothing to tell
        log.debug("progress not published: %s", exc)
        part(Progress).count["on"] = False
