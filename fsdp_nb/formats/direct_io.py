"""Checkpoint files written past the page cache (``O_DIRECT``), the disk taking one
block while the next is filled.

A buffered write copies every byte into the page cache, and the kernel then has to
find, dirty, throttle and write back those pages: on the 2-core host, two ranks
writing 403 MB each took 1.4 s that way (even with early writeback), and 0.6 s with
``O_DIRECT`` through a few aligned 8 MiB blocks, against 1.0 s for ``dd`` of the
805 MB. A :class:`DirectFile` copies what it is given into the current block; a full
block goes to the disk in a helper thread (``os.pwrite`` releases the GIL) while the
writer fills the next. A last partial block is written through the page cache (its
length is not a multiple of the block size ``O_DIRECT`` needs), and the caller's
fsync makes all of it durable, as before. Checkpoint bytes also no longer stay in
the page cache.

Linux only. A filesystem that refuses ``O_DIRECT`` (at open, or at the first write)
gets buffered writes, as before; ``FSDP_NB_DIRECT_IO=0`` in the engines' environment
turns it off.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from .helper_threads import LazyPool
from .writeback import WrittenBackFile

__all__ = ["ALIGN", "BLOCK_BYTES", "DirectFile", "create", "durable", "enabled", "open_direct"]

log = logging.getLogger("fsdp_nb")

ALIGN = 4096
"""What ``O_DIRECT`` needs of a write's memory, offset and length (the page size, a
multiple of every common logical block size)."""

BLOCK_BYTES = 8 << 20
"""The size of one write to the disk (large enough to keep it streaming)."""

BLOCKS = 3
"""Blocks per open file: one being filled, the others on their way to the disk."""

_GIL_FREE_BYTES = 64 << 10
"""Writes at least this large are copied with ``ctypes.memmove``, which releases the
GIL (an async save's copy then leaves training's thread alone); smaller ones by slice."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_pool = LazyPool("fsdp_nb-write")
_SPARE: list[mmap.mmap] = []  # blocks of closed files, reused (their pages already mapped)
_LOCK = threading.Lock()


def enabled() -> bool:
    """True where files can be opened with ``O_DIRECT`` and ``FSDP_NB_DIRECT_IO`` is not 0."""
    return bool(_O_DIRECT) and os.environ.get("FSDP_NB_DIRECT_IO", "1") != "0"


def _take_block() -> mmap.mmap:
    with _LOCK:
        if _SPARE:
            return _SPARE.pop()
    return mmap.mmap(-1, BLOCK_BYTES)  # anonymous maps start page-aligned


def _give_block(block: mmap.mmap) -> None:
    with _LOCK:
        if len(_SPARE) < 4 * BLOCKS:
            _SPARE.append(block)
            return
    block.close()


def create(path: str) -> DirectFile | WrittenBackFile:
    """Local checkpoint file ``path``, created (or truncated) for writing: past the page
    cache where the filesystem allows it, else through it with early writeback."""
    return open_direct(path) or WrittenBackFile(path)


@contextmanager
def durable(path: str) -> Iterator[DirectFile | WrittenBackFile]:
    """:func:`create` ``path`` for the block's writes; on leaving it without an error,
    every byte is on the disk (fsync) before the file closes."""
    with create(path) as f:
        yield f
        os.fsync(f.fileno())  # a DirectFile writes out its last block first


def open_direct(path: str) -> DirectFile | None:
    """``path`` created (or truncated) for writing past the page cache; None where that
    is off or the filesystem refuses ``O_DIRECT`` (write it the ordinary way then)."""
    if not enabled():
        return None
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | _O_DIRECT, 0o666)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        log.debug("%s: this filesystem refuses O_DIRECT (%s); writing through the page cache",
                  path, exc.strerror)
        return None
    return DirectFile(fd)


class DirectFile(io.RawIOBase):
    """A write-only file on descriptor ``fd`` (opened with ``O_DIRECT``), written in
    aligned blocks by helper threads. ``fileno()`` and ``close()`` first write out
    everything given so far, so an fsync of ``fileno()`` covers every byte."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd
        self._blocks = [_take_block() for _ in range(BLOCKS)]
        self._addrs = [_address(memoryview(b)) for b in self._blocks]
        self._pending: list[Future | None] = [None] * BLOCKS
        self._cur = 0  # the block being filled
        self._fill = 0  # bytes in it
        self._off = 0  # where it starts in the file
        self._direct = True  # False once a partial block went through the page cache
        self._error: BaseException | None = None  # a failed write: the file is lost

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        if self._error is not None:
            raise self._error
        view = memoryview(b).cast("B")
        if not self._direct:
            return self._write_at(view, self._off)
        src = _address(view) if len(view) >= _GIL_FREE_BYTES else None
        done = 0
        while done < len(view):
            k = min(BLOCK_BYTES - self._fill, len(view) - done)
            if src is None:
                self._blocks[self._cur][self._fill:self._fill + k] = view[done:done + k]
            else:  # a foreign call: the copy runs without the GIL (training goes on)
                ctypes.memmove(self._addrs[self._cur] + self._fill, src + done, k)
            self._fill += k
            done += k
            if self._fill == BLOCK_BYTES:
                self._send()
        return done

    def _write_at(self, view: memoryview, off: int) -> int:
        n = 0
        while n < len(view):
            n += os.pwrite(self._fd, view[n:], off + n)
        self._off = off + n
        return n

    def _send(self) -> None:
        """Hand the current (full, or aligned) block to a helper and move to the next."""
        i, n, off = self._cur, self._fill, self._off
        self._pending[i] = _pool().submit(_put, self._fd, self._blocks[i], n, off)
        self._off += n
        self._cur = (i + 1) % BLOCKS
        self._fill = 0
        self._wait(self._cur)

    def _wait(self, i: int) -> None:
        fut, self._pending[i] = self._pending[i], None
        if fut is None:
            return
        try:
            fut.result()  # the helper's error (a full disk) is raised in the writer
        except BaseException as exc:  # kept for the writer's close, then re-raised
            self._error = exc
            raise

    def _drain(self) -> None:
        """Every byte given so far into the file: whole blocks directly, the last
        partial block through the page cache (from then on, every write does)."""
        if self._direct and self._fill:
            whole = self._fill - self._fill % ALIGN
            tail = bytes(self._blocks[self._cur][whole:self._fill])
            if whole:
                self._fill = whole
                self._send()
            if tail:
                for i in range(BLOCKS):
                    self._wait(i)
                _buffered(self._fd)
                self._direct = False
                self._write_at(memoryview(tail), self._off)
        for i in range(BLOCKS):
            self._wait(i)

    def flush(self) -> None:
        """Nothing: a partial block waits to fill (``fileno()`` and ``close()`` write it)."""

    def fileno(self) -> int:
        if self._error is not None:
            raise self._error
        self._drain()
        return self._fd

    def close(self) -> None:
        """Write out what is left and release the file; after a failed write, only
        release it (that error was raised already)."""
        if self.closed:
            return
        try:
            if self._error is None:
                self._drain()
        finally:
            for i in range(BLOCKS):
                fut = self._pending[i]
                if fut is not None:  # an earlier error left it: let it end before reuse
                    fut.exception()
            for block in self._blocks:
                _give_block(block)
            self._blocks = []
            os.close(self._fd)
            super().close()


def _address(view: memoryview) -> int:
    """Where the bytes of contiguous ``view`` start in memory (read-only ones too)."""
    import numpy as np

    return int(np.frombuffer(view, np.uint8).ctypes.data)


def _buffered(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def _put(fd: int, block: mmap.mmap, n: int, off: int) -> None:
    view = memoryview(block)[:n]
    retried = False
    try:
        done = 0
        while done < n:
            try:
                done += os.pwrite(fd, view[done:], off + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or retried:
                    raise
                # the filesystem took the flag at open but not this write (a larger
                # block size, say): the file is written through the page cache from
                # here on (another helper may have switched it already)
                retried = True
                if fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT:
                    log.debug("O_DIRECT write refused (%s); writing through the page cache", exc.strerror)
                    _buffered(fd)
    finally:
        view.release()
