"""Checkpoints: sharded (DCP, one file per rank) or full (one .pt / .safetensors), atomic,
async, reshardable, inspectable offline, on local paths or fsspec URLs.

The notebook-side driver: ``save`` / ``load`` / ``async_saves`` (what ``sess.save`` / ``sess.load`` run) and the
offline conversions ``consolidate`` and ``export``. The file formats they write and read
are ``fsdp_nb.formats``, a package of its own below the engines, which use it too. The names a user needs are served by
the package root (``fsdp_nb.inspect``, ``fsdp_nb.CheckpointInfo``...); this package
re-exports only the errors (from ``fsdp_nb.errors``), so no name hides one of
its modules.
"""

from __future__ import annotations

# kept one release for code that caught them here; they live in fsdp_nb.errors
from ..errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["CheckpointError", "CorruptCheckpointError", "UnsafeCheckpointError"]
