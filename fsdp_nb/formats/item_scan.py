"""Checking a stored item without keeping its bytes: the check pass of a load.

A load into a live model reads and checks every item of its share before it copies a
byte into the model (``dcp_reader``), then reads the items again, from the page cache,
into their targets. The check needs each item's checksum and what its tensor looks
like (dtype, shape, where its bytes start); it does not need the bytes afterwards. So
the item is read through a small window that stays in the CPU's cache, checksummed a
window at a time, and only its first and last ``EDGE`` bytes are kept: a DCP tensor
item is a ``torch.save`` zip whose pickle and headers sit at the front and whose
directory sits at the end, with the tensor's bytes between. They are kept at their
places in a buffer as long as the item whose middle is never written, so the kernel
never backs it with memory. Reading whole items into item-sized buffers instead would
write every byte into memory once more and read it back for the checksum, on ranks
that share the memory bus with each other and with the disk's transfers, and hold
buffers the size of the largest item (a large embedding's shard: hundreds of MB)
through the load. An item that is not a plain zip of one tensor (a pickled object, a
compressed record) is read whole.
"""

from __future__ import annotations

from typing import Any

from .checksums import ChecksumMismatch, checksum, mismatch
from .item_tensor import kept_edges_suffice

__all__ = ["CHUNK", "EDGE", "ItemScanner", "unwritten_buffer"]

EDGE = 64 << 10
"""The bytes kept at each end of an item: a ``torch.save`` zip's pickle, headers and
directory take about 1 KB."""
CHUNK = 512 << 10
"""The window the middle of an item is read through: small enough to stay in a core's
cache between the read and the checksum."""
_ZIP64 = 0xFFFFFFFF
"""Items this large are zip64 archives, which only ``zipfile`` reads: read whole."""


class ItemScanner:
    """Reads items one after another for a load's check pass (one per reading thread).

    Call order: ``scan`` for each item, in file order; the view it returns is valid
    until the next ``scan``.
    """

    def __init__(self) -> None:
        self._item = memoryview(b"")
        self._window = unwritten_buffer(CHUNK)

    def scan(self, file: Any, sinfo: Any, want: tuple[int, int, str] | None, whole: bool) -> memoryview:
        """Stored item ``sinfo`` read from ``file``, checked against its record ``want``
        (``(length, checksum, algorithm)``; None: only that it is complete). The view
        returned is the item's length; unless ``whole`` (or the item is small, a zip64
        archive, or not a plain tensor zip) only its first and last ``EDGE`` bytes are
        the item's."""
        from .storage import read_into

        length = int(sinfo.length)
        name, offset = sinfo.relative_path, int(sinfo.offset)
        if len(self._item) < length:
            self._item = unwritten_buffer(length)
        view = self._item[:length]
        file.seek(offset)
        crc = 0

        def take(into: memoryview) -> int:  # read into ``into``, checksum what came
            nonlocal crc
            n = read_into(file, into)
            if want is not None:
                crc = checksum(into[:n], crc, want[2])
            return n

        whole = whole or length <= 2 * EDGE + CHUNK or length >= _ZIP64
        if whole:
            got = take(view)
        else:
            got = take(view[:EDGE])
            while EDGE <= got < length - EDGE:
                n = take(self._window[:min(CHUNK, length - EDGE - got)])
                if not n:
                    break
                got += n
            if got == length - EDGE:
                got += take(view[got:])
        if got != length:
            raise ChecksumMismatch(f"file {name!r}: {got} bytes at byte {offset}, {length} were written (truncated)")
        if want is not None and crc != want[1]:
            raise ChecksumMismatch(mismatch(name, offset, length, want[2], crc, want[1]))
        if whole or kept_edges_suffice(view, EDGE):
            return view
        return self.scan(file, sinfo, want, whole=True)  # not a plain tensor zip: its middle matters


def unwritten_buffer(n: int) -> memoryview:
    """``n`` writable bytes, not written first: the pages a read never reaches are never
    backed by memory."""
    import torch

    return torch.empty(n, dtype=torch.uint8).numpy().data.cast("B")
