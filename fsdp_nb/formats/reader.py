"""Opening a committed sharded checkpoint for reading, with every check in one place.

Load, consolidate and export read a DCP folder the same way: what can be checked up
front is checked (the files' sizes; an older marker's whole-file CRC-32s, each rank a
share), ``.metadata`` is read once and checked, every pickled item must unpickle
weights-only (``pickles.refuse_code``), and the DCP reader checks each item's checksum
as it reads it. ``named_corruption`` turns DCP's wrapped failure of such a check back
into one ``CorruptCheckpointError`` that names the file (or the
``UnsafeCheckpointError`` of a refused pickle).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from .atomic import validate_files
from .checksums import ChecksumMismatch, item_checksums
from .dcp_reader import safe_reader
from .inspect import read_dcp_metadata, verify_checksums
from .pickles import refuse_code

__all__ = ["named_corruption", "open_sharded", "refuse_unsafe"]


def open_sharded(fs: Any, p: str, url: str, marker: dict, storage_options: dict | None,
                 *, share: list[str] | None = None, on_read: Any = None,
                 before_commit: Any = None, weights_only: bool = True) -> tuple[Any, Any]:
    """(DCP metadata, storage reader) of the folder ``p``; CorruptCheckpointError naming
    the file when a check fails, UnsafeCheckpointError naming the item when one could
    run code. ``share``: of an older marker's files, those this process verifies in
    full before reading (default: all). ``on_read(n)``: told each item's size as it is
    read. ``before_commit``: read everything, then agree, then copy
    (``dcp_reader.safe_reader``). ``weights_only=False``: a trusted checkpoint, whose
    pickles are unpickled as DCP does (they can run code)."""
    files = marker.get("files", {})
    per_item = bool(files) and all("segments" in rec for rec in files.values())
    if per_item:
        problem = validate_files(fs, p, marker)
        if problem:
            raise CorruptCheckpointError(f"checkpoint {url!r}: {problem}")
    else:
        verify_checksums(fs, p, url, marker, names=share)
    md = read_dcp_metadata(fs, p, url, files.get(".metadata"), weights_only)
    checks = item_checksums(files) if per_item else None
    if weights_only:
        refuse_code(fs, p, url, md, checks)
    reader = safe_reader(fs, p, storage_options or {}, metadata=md, checks=checks, on_read=on_read,
                         before_commit=before_commit, weights_only=weights_only)
    return md, reader


def refuse_unsafe(path: str, storage_options: dict | None = None) -> None:
    """Raise UnsafeCheckpointError if the checkpoint at ``path`` holds a pickle that could
    run code when loaded (its ``.metadata``, a BYTE_IO item, a ``.pt`` file), before a
    caller that reads only part of it (an export of the weights) writes anything."""
    from .fullfile import full_suffix
    from .pickles import load_pt
    from .storage import url_to_fs

    fs, p = url_to_fs(path, storage_options)
    p = p.rstrip("/")
    if fs.isdir(p):
        if fs.exists(posixpath.join(p, ".metadata")):
            refuse_code(fs, p, path, read_dcp_metadata(fs, p, path))
    elif full_suffix(p) == ".pt":
        load_pt(fs, p, path)


@contextmanager
def named_corruption(url: str) -> Iterator[None]:
    """Inside: a DCP read whose item check failed (on any rank) raises CorruptCheckpointError;
    one whose pickled item was refused, UnsafeCheckpointError."""
    try:
        yield
    except UnsafeCheckpointError:
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        causes = [e for e, _tb in getattr(exc, "failures", {}).values()] or [exc]
        unsafe = next((e for e in causes if isinstance(e, UnsafeCheckpointError)), None)
        if unsafe is not None:
            raise UnsafeCheckpointError(f"checkpoint {url!r}: {unsafe}") from None
        bad = next((e for e in causes if isinstance(e, ChecksumMismatch)), None)
        if bad is None:
            raise
        raise CorruptCheckpointError(f"checkpoint {url!r}: {bad}") from exc
