"""Start a file's disk write while it is still being written.

Linux keeps written bytes in the page cache and starts writing them out only once
dirty pages pass a share of memory (10% by default: gigabytes on a GPU host) or are
30 s old. A save that writes its files and then fsyncs them therefore ran in two
phases, one after the other: copy and serialize every tensor, then wait for the disk
to take it all. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` asks the kernel to start
writing what the file holds so far and returns without waiting; asking every
``STEP_BYTES`` keeps the disk busy while the next tensors are produced, and the
closing fsync waits only for the tail. The bytes and the fsync are unchanged, so
durability is too. Linux only; elsewhere, or on a file that refuses it, nothing
changes.

Checkpoint files are written past the page cache where the filesystem allows
(``direct_io.create``); a :class:`WrittenBackFile` is what the others get.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = ["STEP_BYTES", "Writeback", "WrittenBackFile"]

log = logging.getLogger("fsdp_nb")

STEP_BYTES = 8 << 20
"""Bytes written between two requests to start writing (large enough that the calls
cost nothing, small enough that the disk starts early)."""

_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_START = _sync_file_range()


class Writeback:
    """Starts the disk write of ``fd``'s bytes every ``step`` bytes the writer reports."""

    def __init__(self, fd: int, step: int = STEP_BYTES):
        self.fd = fd
        self.step = step
        self.requests = 0
        """How many times it asked the kernel to start writing."""
        self._asked = 0  # the writer's count at the last request

    def wrote(self, pos: int) -> None:
        """The writer has now written ``pos`` bytes from the file's start."""
        if _START is None or pos - self._asked < self.step:
            return
        # from the last request's count to the end of the file (length 0)
        if _START(self.fd, self._asked, 0, _SYNC_FILE_RANGE_WRITE) != 0:
            err = ctypes.get_errno()
            log.debug("sync_file_range refused (%s): this file is written back at its fsync",
                      os.strerror(err))
            self.step = sys.maxsize
            return
        self.requests += 1
        self._asked = pos


class WrittenBackFile(io.FileIO):
    """``path`` created (or truncated) for writing, unbuffered, asking the kernel to start
    the disk write every ``STEP_BYTES`` written (on Linux)."""

    def __init__(self, path: str, step: int = STEP_BYTES):
        super().__init__(path, "wb")
        self._written = 0
        self.writeback = Writeback(self.fileno(), step) if _START is not None else None
        """None where the system has no ``sync_file_range``."""

    def write(self, b: ReadableBuffer) -> int:
        n = super().write(b)
        if n and self.writeback is not None:
            self._written += n
            self.writeback.wrote(self._written)
        return n
