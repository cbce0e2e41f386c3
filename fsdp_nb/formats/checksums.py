"""Checksums of checkpoint bytes, taken as they are written and checked as they are read.

A save never reads back what it wrote: DCP's writer streams go through
:class:`ChecksumStream`, which checksums every byte on its way to the file and cuts
the file into segments where DCP asks for its position (``tell()``, at each item's
start and end), so every stored item is one segment. The completion marker keeps,
per file, its size and its segments ``[offset, length, checksum]``; they tile the
file, so checking every segment checks every byte (``inspect(verify=True)``), and a
load checks exactly the items it reads, as it reads them (no extra pass over the data).

The checksum is CRC-32C in hardware (the ``crc32c`` package) where it imports, else
zlib's CRC-32; each record names its algorithm, and a checkpoint written with one is
checked with the same one. Old markers with one whole-file ``crc32`` still verify.
"""

from __future__ import annotations

import io
import logging
import posixpath
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .direct_io import create
from .helper_threads import LazyPool

__all__ = [
    "ALGORITHM", "ChecksumMismatch", "ChecksumStream", "RecordingFileSystem", "check_item",
    "checksum", "file_problem", "item_checksums", "mismatch", "record_writer",
]

log = logging.getLogger("fsdp_nb")

_UPDATE: dict[str, Callable[[Any, int], int]] = {"crc32": zlib.crc32}
try:
    import crc32c as _crc32c

    def _crc32c_update(data: Any, value: int = 0) -> int:
        return _crc32c.crc32c(data, value=value)

    _UPDATE["crc32c"] = _crc32c_update
except ImportError:  # pragma: no cover - crc32c is a dependency; zlib is the fallback
    log.warning("the crc32c package is missing: checkpoints are checksummed with zlib's slower CRC-32")

ALGORITHM = "crc32c" if "crc32c" in _UPDATE else "crc32"
"""The algorithm new checkpoints record."""


class ChecksumMismatch(ValueError):
    """Bytes read back differ from the bytes written (or the algorithm is unknown)."""


def checksum(data: Any, value: int = 0, algorithm: str = ALGORITHM) -> int:
    """The checksum of ``data`` (any bytes-like object), continuing from ``value``."""
    try:
        update = _UPDATE[algorithm]
    except KeyError:
        raise ChecksumMismatch(
            f"checksum algorithm {algorithm!r} is not available here (have: {sorted(_UPDATE)}); "
            "install the 'crc32c' package"
        ) from None
    return update(data, value)


OVERLAP_BYTES = 4 << 20
"""Writes at least this large are checksummed in a helper thread while the file takes
them (both release the GIL): the checksum overlaps the write instead of following it."""
_crc_pool = LazyPool("fsdp_nb-crc")


class ChecksumStream(io.RawIOBase):
    """A binary writer that checksums what passes through, one segment per ``tell()``."""

    def __init__(self, raw: Any, on_close: Callable[[dict[str, Any]], None],
                 on_write: Callable[[int], None] | None = None):
        super().__init__()
        self.raw = raw
        self._on_close = on_close
        self._on_write = on_write
        self._pos = 0
        self._start = 0
        self._crc = 0
        self.segments: list[list[int]] = []
        """``[offset, length, checksum]`` of each closed segment, in file order."""

    def _cut(self) -> None:
        if self._pos > self._start:
            self.segments.append([self._start, self._pos - self._start, self._crc])
        self._start, self._crc = self._pos, 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        # a large write is checksummed in a helper thread while the bytes go to the file
        ahead = _crc_pool().submit(checksum, view, self._crc) if len(view) >= OVERLAP_BYTES else None
        n = self.raw.write(view)
        n = len(view) if n is None else n
        self._crc = ahead.result() if ahead is not None and n == len(view) else checksum(view[:n], self._crc)
        self._pos += n
        if self._on_write is not None:
            self._on_write(n)
        return n

    def tell(self) -> int:
        self._cut()
        return self._pos

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if self.closed:
            return
        self._cut()
        try:
            super().close()  # flushes
            self.raw.close()
        finally:
            self._on_close({"size": self._pos, "algorithm": ALGORITHM, "segments": self.segments})


class RecordingFileSystem:
    """A DCP ``FileSystemBase`` whose write streams are :class:`ChecksumStream` s.

    ``records`` maps each written file's name (renames followed, so ``.metadata``
    and not its temporary name) to what the marker keeps of it; ``written`` counts
    the bytes written so far (a save's progress).
    """

    def __init__(self, inner: Any, on_write: Callable[[int], None] | None = None):
        self.inner = inner
        self.records: dict[str, dict[str, Any]] = {}
        self.written = 0
        self._on_write = on_write
        self._lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self._lock:
            self.written += n
        if self._on_write is not None:
            self._on_write(n)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with self.inner.create_stream(path, mode) as s:
                yield s
            return
        name = posixpath.basename(str(path))

        def keep(record: dict[str, Any]) -> None:
            with self._lock:
                self.records[name] = record

        with self._open_for_writing(path, mode) as raw:
            stream = ChecksumStream(raw, keep, self._count)
            try:
                yield stream
            finally:
                stream.close()

    @contextmanager
    def _open_for_writing(self, path: Any, mode: str) -> Iterator[Any]:
        from torch.distributed.checkpoint.filesystem import FileSystem

        if mode == "wb" and isinstance(self.inner, FileSystem):  # local: see direct_io.create
            with create(str(path)) as raw:
                yield raw
        else:
            with self.inner.create_stream(path, mode) as raw:
                yield raw

    def rename(self, path: Any, new_path: Any) -> None:
        self.inner.rename(path, new_path)
        with self._lock:
            rec = self.records.pop(posixpath.basename(str(path)), None)
            if rec is not None:
                self.records[posixpath.basename(str(new_path))] = rec

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def record_writer(writer: Any, on_write: Callable[[int], None] | None = None) -> RecordingFileSystem:
    """Make DCP storage ``writer`` checksum everything it writes; the records' holder.
    ``on_write(n)`` is told each write's size (a progress count)."""
    fs = RecordingFileSystem(writer.fs, on_write)
    writer.fs = fs
    return fs


def item_checksums(files: dict[str, dict[str, Any]]) -> dict[tuple[str, int], tuple[int, int, str]]:
    """``(file, offset) -> (length, checksum, algorithm)`` of every recorded segment."""
    out = {}
    for name, rec in files.items():
        for off, length, crc in rec.get("segments", ()):
            out[(name, int(off))] = (int(length), int(crc), rec.get("algorithm", "crc32"))
    return out


def mismatch(name: str, offset: int, length: int, algorithm: str, got: int, want: int) -> str:
    """What to say of bytes ``offset`` to ``offset + length`` of file ``name`` whose
    checksum is ``got`` where ``want`` was written."""
    return (f"file {name!r} is corrupt in bytes {offset}-{offset + length} "
            f"({algorithm} {got:08x}, {want:08x} was written)")


def file_problem(fs: Any, path: str, name: str, rec: dict[str, Any], block: int = 8 << 20) -> str | None:
    """None when the file at ``path`` has the recorded checksums; else what differs.

    Reads the file once, front to back: its segments tile it (an older record's one
    whole-file ``crc32`` is one segment).
    """
    if "segments" in rec:
        segments, algorithm = rec["segments"], rec.get("algorithm", "crc32")
    elif "crc32" in rec:
        segments, algorithm = [[0, rec["size"], rec["crc32"]]], "crc32"
    else:
        return None
    with fs.open(path, "rb") as f:
        for off, length, want in segments:
            f.seek(off)
            crc, left = 0, length
            while left > 0:
                b = f.read(min(block, left))
                if not b:
                    return f"file {name!r} is truncated at byte {off + length - left}"
                crc = checksum(b, crc, algorithm)
                left -= len(b)
            if crc != want:
                return mismatch(name, off, length, algorithm, crc, want)
    return None


def check_item(data: bytes, name: str, offset: int, want: tuple[int, int, str]) -> None:
    """Raise ChecksumMismatch unless ``data`` is the item written at ``offset`` of ``name``."""
    length, crc, algorithm = want
    if len(data) != length:
        raise ChecksumMismatch(f"file {name!r}: {len(data)} bytes at byte {offset}, {length} were written (truncated)")
    got = checksum(data, 0, algorithm)
    if got != crc:
        raise ChecksumMismatch(mismatch(name, offset, length, algorithm, got, crc))
