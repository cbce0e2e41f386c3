"""The files a load's stored items are in, opened for one read: each remote item fetched once.

A load into a live model reads its items twice (``dcp_reader``: check, then copy). From
a local folder the second pass comes from the page cache the first one filled. A remote
store (S3, GCS, HTTP) has no such cache: each pass would fetch every byte again, and an
fsspec file's read-ahead fetches up to a block past what was asked (50 MiB on S3: the
rest of a file whose pickled items alone this rank wants). So a remote file's items are
fetched once, in as few ranged requests as their ranges merge into (adjacent items in
one, at most ``MAX_BLOCK`` bytes each, sent at once where the store's client can), and
every pass reads them from memory: this process's share of the checkpoint is held until
the read ends, as a load into fresh tensors holds it. A streaming read (no second pass)
holds one file's items at a time.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["MAX_BLOCK", "Fetched", "ItemFiles", "fetch", "read_ranges"]

MAX_BLOCK = 64 << 20
"""The most bytes one ranged request of a remote file asks for (adjacent items merged)."""

Opened = tuple[Any, Any, tuple[str, int], list["ReadItem"]]
"""``(open file, stored item, its (file, offset), the requests for it)``."""


class ItemFiles:
    """Opens the files of a reader's folder for one ``read_data``.

    Args:
        reader: the DCP storage reader (``dcp_reader.reader_classes``): its ``fs``, ``path``,
            ``readers`` and ``remote``.
        keep: hold a remote file's fetched items for a later pass (until ``close``);
            False: each file's are dropped once its items were read.
    """

    def __init__(self, reader: Any, keep: bool) -> None:
        self.reader, self.keep = reader, keep
        self.readers: int = reader.readers
        """How many threads read at once (``dcp_reader._runs``)."""
        self._held: dict[str, Fetched] = {}

    def opened(self, items: list[tuple[ReadItem, Any]]) -> Iterator[Opened]:
        """``(open file, stored item, its (file, offset), the requests for it)`` for every
        stored item of ``items`` (request, stored item), file by file, each file front to back."""
        per_file: dict[str, dict[tuple[str, int], tuple[Any, list[ReadItem]]]] = {}
        for req, md in sorted(items, key=lambda rm: (rm[1].relative_path, rm[1].offset)):
            key = (md.relative_path, int(md.offset))
            per_file.setdefault(md.relative_path, {}).setdefault(key, (md, []))[1].append(req)
        fs, root = self.reader.fs, self.reader.path
        for relative_path, stored in per_file.items():
            path = fs.concat_path(root, relative_path)
            if not getattr(self.reader, "remote", False):
                with fs.create_stream(path, "rb") as stream:
                    for key, (md, reqs) in stored.items():
                        yield stream, md, key, reqs
                continue
            fetched = self._held.get(relative_path)
            if fetched is None:
                fetched = fetch(fs.fs, str(path), [(int(md.offset), int(md.length)) for md, _ in stored.values()])
                if self.keep:
                    self._held[relative_path] = fetched
            for key, (md, reqs) in stored.items():
                yield fetched, md, key, reqs

    def close(self) -> None:
        """Drop what is held."""
        self._held.clear()


class Fetched:
    """Ranges of one file, fetched, read like the file: ``seek`` and ``readinto``. A read
    outside them, or past a range the file ended in, gives 0 bytes (read as truncated).

    Args:
        blocks: ``(start, bytes)`` of each range fetched.
    """

    def __init__(self, blocks: list[tuple[int, bytes]]) -> None:
        self._blocks = sorted(blocks, key=lambda b: b[0])
        self._starts = [start for start, _ in self._blocks]
        self._pos = 0

    def seek(self, pos: int, whence: int = 0) -> int:
        """Move to byte ``pos`` of the file (``whence`` 0 only)."""
        if whence != 0:
            raise ValueError("a fetched file seeks from its start only")
        self._pos = int(pos)
        return self._pos

    def readinto(self, view: Any) -> int:
        """Fill ``view`` from the position, as far as the range holding it goes; the bytes read."""
        i = bisect.bisect_right(self._starts, self._pos) - 1
        if i < 0:
            return 0
        start, data = self._blocks[i]
        at = self._pos - start
        n = max(0, min(len(view), len(data) - at))
        if n:
            view[:n] = memoryview(data)[at:at + n]
            self._pos += n
        return n


def fetch(fs: Any, path: str, items: list[tuple[int, int]]) -> Fetched:
    """The items ``items`` (``(offset, length)``) of ``path`` on fsspec ``fs``, fetched in
    merged ranged requests (``MAX_BLOCK`` bytes at most each, one request per item larger)."""
    from fsspec.utils import merge_offset_ranges

    if not items:
        return Fetched([])
    _paths, starts, ends = merge_offset_ranges([path] * len(items), [o for o, _ in items],
                                               [o + n for o, n in items], max_gap=0, max_block=MAX_BLOCK)
    datas = read_ranges(fs, path, [(int(s), int(e) - int(s)) for s, e in zip(starts, ends) if e is not None])
    return Fetched(list(zip((int(s) for s in starts), datas)))


def read_ranges(fs: Any, path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """The bytes of each ``(offset, length)`` of ``path`` on fsspec ``fs``, each exactly its
    range (fewer where the file ends first), in ranged requests sent at once where the
    store's client can (``cat_ranges``). FileNotFoundError and the store's errors are raised."""
    if not ranges:
        return []
    out = fs.cat_ranges([path] * len(ranges), [o for o, _ in ranges], [o + n for o, n in ranges],
                        on_error="return")
    for got in out:
        if isinstance(got, BaseException):
            raise got
    return [bytes(got) for got in out]
