"""Atomic commit, validity and retention of checkpoints.

Every save writes into a hidden sibling (``.<name>.tmp-<token>``) and commits
only after every rank finished:

- sharded (a folder): ``fsdp_nb.json`` then the marker ``.fsdp_nb_complete``
  (each file's size and per-item checksums) are written last. On a local filesystem the
  marker goes into the temporary folder, which is then renamed over the target
  (the old one moved aside first and removed after): the target is always either
  the old or the new complete checkpoint. On object stores (no rename) the folder
  is copied, and the marker is written at the target last: a folder without it
  never passes as valid.
- full (one file): written to a temporary sibling file, fsynced, renamed.

A folder without the marker, or whose files do not have the recorded sizes, is
invalid: ``inspect`` says so and ``load`` refuses it.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from typing import Any

from .fullfile import full_suffix, read_full_meta
from .metadata import MARKER, META_FILE, dumps
from .safetensors_layout import is_optim_file, optim_file
from .storage import fsync_dir, is_local, sibling

log = logging.getLogger("fsdp_nb")

__all__ = [
    "commit_sharded", "read_marker", "remove", "replace_folder", "retain_last",
    "validate_files",
]


def _write(fs: Any, path: str, data: bytes) -> None:
    if is_local(fs):
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    else:
        fs.pipe_file(path, data)


def commit_sharded(
    fs: Any, tmp: str, target: str, meta: dict, files: dict[str, dict[str, int]], token: str,
    side: dict[str, bytes] | None = None,
) -> None:
    """Write metadata and marker, then make ``tmp`` the checkpoint at ``target``.
    ``side``: files another trainer reads beside the shards (Lightning's ``meta.pt``),
    name -> bytes, written (and synced) first."""
    for name, data in (side or {}).items():
        _write(fs, posixpath.join(tmp, name), data)
    _write(fs, posixpath.join(tmp, META_FILE), dumps(meta))
    marker = dumps({"format": meta["format"], "token": token, "files": files})
    old = sibling(target, "old", token)
    if is_local(fs):
        _write(fs, posixpath.join(tmp, MARKER), marker)
        replace_folder(tmp, target, token)
        return
    had_old = fs.exists(target)
    if had_old:
        _move_tree(fs, target, old)
    _move_tree(fs, tmp, target)
    _write(fs, posixpath.join(target, MARKER), marker)
    if had_old:
        fs.rm(old, recursive=True)


def replace_folder(tmp: str, target: str, token: str) -> None:
    """Make the fully written local folder ``tmp`` the folder ``target``, atomically.

    An existing ``target`` is renamed aside first and removed in the background (it
    is out of sight already; the process waits for the removal before it exits).
    """
    import shutil
    import threading

    fsync_dir(tmp)
    old = sibling(target, "old", token)
    had_old = os.path.exists(target)
    if had_old:
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_dir(os.path.dirname(target) or ".")
    if not had_old:
        return

    def rm() -> None:
        try:
            shutil.rmtree(old)
        except OSError as exc:
            log.warning("could not remove the replaced folder %s: %s", old, exc)

    threading.Thread(target=rm, name="fsdp_nb-remove-old").start()


def _move_tree(fs: Any, src: str, dst: str) -> None:
    """Copy every file under ``src`` to ``dst`` (object stores have no rename), then remove ``src``."""
    for f in fs.find(src):
        fs.copy(f, posixpath.join(dst, posixpath.relpath(f, src)))
    fs.rm(src, recursive=True)


def read_marker(fs: Any, path: str) -> dict | None:
    """The marker of a sharded checkpoint folder, or None if it has none (not committed)."""
    try:
        return json.loads(fs.cat_file(posixpath.join(path, MARKER)))
    except FileNotFoundError:
        return None
    except ValueError:
        return None


def validate_files(fs: Any, path: str, marker: dict) -> str | None:
    """None if every recorded file exists with its size; else what is wrong (naming the file)."""
    try:
        listing = {posixpath.basename(e["name"].rstrip("/")): e for e in fs.ls(path, detail=True)}
    except FileNotFoundError:
        return f"folder {path!r} is missing"
    for name, rec in marker.get("files", {}).items():
        e = listing.get(name) if "/" not in name else _info(fs, posixpath.join(path, name))
        if e is None:
            return f"file {name!r} is missing"
        if int(e.get("size") or 0) != int(rec["size"]):
            return f"file {name!r} has {e.get('size')} bytes, {rec['size']} were written (truncated or changed)"
    return None


def _info(fs: Any, path: str) -> dict | None:
    """What ``fs`` says of the file at ``path`` (a file in a subfolder, ``train/rank0.pt``), or None."""
    try:
        return fs.info(path)
    except FileNotFoundError:
        return None


def _created(fs: Any, p: str) -> float | None:
    """Creation time of a valid checkpoint at ``p``, or None when ``p`` is not one."""
    try:
        if fs.isdir(p):
            if read_marker(fs, p) is None:
                return None
            return float(json.loads(fs.cat_file(posixpath.join(p, META_FILE))).get("created", 0))
        if full_suffix(p):
            meta = read_full_meta(fs, p)[0]
            if meta.get("format", "").startswith("fsdp_nb"):
                return float(meta.get("created", 0))
    except Exception:  # noqa: BLE001 - any unreadable entry is simply not a checkpoint to keep or drop
        return None
    return None


def retain_last(fs: Any, target: str, k: int) -> list[str]:
    """Keep the newest ``k`` checkpoints beside ``target`` (itself included); remove the rest.

    Only valid fsdp_nb checkpoints of the same kind as ``target`` count (folders for a
    sharded one, files with the same suffix for a full one) and are removed, oldest
    first by their recorded time; other files are never touched. Returns the removed paths.
    """
    parent = posixpath.dirname(target.rstrip("/"))
    suffix = full_suffix(target)
    found = []
    for e in fs.ls(parent, detail=False):
        name = posixpath.basename(e.rstrip("/"))
        if name.startswith(".") or full_suffix(name) != suffix or is_optim_file(name):
            continue
        t = _created(fs, e.rstrip("/"))
        if t is not None:
            found.append((t, name, e.rstrip("/")))
    found.sort()
    keep = {p for _, _, p in found[-k:]}
    keep.add(target.rstrip("/"))
    removed = []
    for _, _, p in found:
        if p not in keep and posixpath.basename(p) != posixpath.basename(target.rstrip("/")):
            remove(fs, p)
            removed.append(p)
    return removed


def remove(fs: Any, p: str) -> None:
    """Delete the checkpoint at ``p``: a folder, or a full file with its optimizer file."""
    isdir = fs.isdir(p)
    fs.rm(p, recursive=isdir)
    if not isdir and full_suffix(p) == ".safetensors" and fs.exists(optim_file(p)):
        fs.rm(optim_file(p))
