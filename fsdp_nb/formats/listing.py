"""The checkpoints under a folder or fsspec URL, and removing one.

``list_checkpoints(root)`` is what the checkpoint browser shows: every checkpoint
directly under ``root`` (and ``root`` itself when it is one), described by
``fsdp_nb.inspect`` and ordered by step, then time. ``remove_checkpoint`` deletes one.
"""

from __future__ import annotations

import logging

from ..errors import CheckpointError
from .atomic import remove
from .info import CheckpointInfo
from .inspect import inspect
from .safetensors_layout import is_optim_file
from .storage import url_to_fs

__all__ = ["list_checkpoints", "remove_checkpoint"]

log = logging.getLogger("fsdp_nb")


def _is_candidate(leaf: str) -> bool:
    """Hidden names, ``_``-prefixed ones, unfinished saves' temporaries and the optimizer
    files beside full checkpoints are never listed on their own."""
    return not (leaf.startswith((".", "_")) or ".tmp" in leaf or is_optim_file(leaf))


def list_checkpoints(root: str, *, storage_options: dict | None = None) -> list[CheckpointInfo]:
    """Checkpoints directly under ``root`` (and ``root`` itself if it is one), by step and time.

    An unfinished or damaged checkpoint is listed with ``valid=False``; a folder or file
    that is no checkpoint at all is left out. A missing ``root`` lists nothing.

    Args:
        root: a local folder or fsspec URL (``s3://bucket/run``).
        storage_options: passed to fsspec for a URL (credentials, an endpoint).
    """
    fs, base = url_to_fs(root, storage_options)
    if not fs.exists(base):
        return []
    candidates = [root]
    if fs.isdir(base):
        for child in sorted(fs.ls(base, detail=False)):
            if _is_candidate(child.rstrip("/").rsplit("/", 1)[-1]):
                candidates.append(child if "://" not in root else fs.unstrip_protocol(child))
    out = []
    for c in candidates:
        try:
            info = inspect(str(c), storage_options=storage_options)
        except (FileNotFoundError, CheckpointError) as exc:  # gone, or a plain file
            log.debug("not a checkpoint: %s (%s)", c, exc)
            continue
        # a damaged full file, or a folder with DCP metadata or rank files, is a checkpoint
        # that failed; a folder with neither is just a folder
        damaged = info.kind == "full" or bool(info.tensors or info.world_size)
        if info.valid or (c is not root and damaged):
            out.append(info)
        else:
            log.debug("not listed (no checkpoint data): %s", c)
    out.sort(key=lambda i: (i.step is None, i.step or 0, i.created or 0, i.name))
    return out


def remove_checkpoint(path: str, *, storage_options: dict | None = None) -> None:
    """Delete the checkpoint at ``path`` (a folder, or a full file with its optimizer file)."""
    fs, p = url_to_fs(path, storage_options)
    remove(fs, p.rstrip("/"))
