"""Checkpoints: sharded (DCP, one file per rank) or full (one .pt / .safetensors), atomic,
async, reshardable, inspectable offline, on local paths or fsspec URLs.

``sess.save`` / ``sess.load`` call ``save`` / ``load`` here; ``fsdp_nb.inspect`` and
``fsdp_nb.consolidate`` and ``fsdp_nb.list_checkpoints`` work in one process with no
process group.
"""

from __future__ import annotations

from .consolidate import consolidate
from .export import export_safetensors
from .info import (
    CheckpointError,
    CheckpointInfo,
    ChunkInfo,
    CorruptCheckpointError,
    TensorInfo,
    UnsafeCheckpointError,
)
from .inspect import inspect
from .listing import list_checkpoints
from .load import load
from .pending import AsyncCheckpoint
from .save import save
from .storage import set_storage_options

__all__ = [
    "AsyncCheckpoint",
    "CheckpointError",
    "CheckpointInfo",
    "ChunkInfo",
    "CorruptCheckpointError",
    "TensorInfo",
    "UnsafeCheckpointError",
    "consolidate",
    "export_safetensors",
    "inspect",
    "list_checkpoints",
    "load",
    "save",
    "set_storage_options",
]
