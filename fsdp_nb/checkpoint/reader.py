"""Opening a committed sharded checkpoint for reading, with every check in one place.

Load, consolidate and export read a DCP folder the same way: what can be checked up
front is checked (the files' sizes; an older marker's whole-file CRC-32s, each rank a
share), ``.metadata`` is read once and checked, and the DCP reader checks each item's
checksum as it reads it. ``named_corruption`` turns DCP's wrapped failure of such a
check back into one ``CorruptCheckpointError`` that names the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .atomic import validate_files
from .checksums import ChecksumMismatch, item_checksums
from .dcp_reader import safe_reader
from .info import CorruptCheckpointError
from .inspect import read_dcp_metadata, verify_checksums

__all__ = ["named_corruption", "open_sharded"]


def open_sharded(fs: Any, p: str, url: str, marker: dict, storage_options: dict | None,
                 *, share: list[str] | None = None, on_read: Any = None,
                 before_commit: Any = None) -> tuple[Any, Any]:
    """(DCP metadata, storage reader) of the folder ``p``; CorruptCheckpointError naming
    the file when a check fails. ``share``: of an older marker's files, those this
    process verifies in full before reading (default: all). ``on_read(n)``: told
    each item's size as it is read. ``before_commit``: read everything, then agree,
    then copy (``dcp_reader.safe_reader``)."""
    files = marker.get("files", {})
    per_item = bool(files) and all("segments" in rec for rec in files.values())
    if per_item:
        problem = validate_files(fs, p, marker)
        if problem:
            raise CorruptCheckpointError(f"checkpoint {url!r}: {problem}")
    else:
        verify_checksums(fs, p, url, marker, names=share)
    md = read_dcp_metadata(fs, p, url, files.get(".metadata"))
    reader = safe_reader(fs, p, storage_options or {}, metadata=md,
                         checks=item_checksums(files) if per_item else None, on_read=on_read,
                         before_commit=before_commit)
    return md, reader


@contextmanager
def named_corruption(url: str) -> Iterator[None]:
    """Inside: a DCP read whose item check failed (on any rank) raises CorruptCheckpointError."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        causes = [e for e, _tb in getattr(exc, "failures", {}).values()] or [exc]
        bad = next((e for e in causes if isinstance(e, ChecksumMismatch)), None)
        if bad is None:
            raise
        raise CorruptCheckpointError(f"checkpoint {url!r}: {bad}") from exc
