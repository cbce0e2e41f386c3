"""``fsdp_nb.consolidate``: sharded <-> full conversion in one process, no process group.

- sharded folder -> one ``.pt`` / ``.safetensors`` file: DCP reads every chunk
  (``no_dist``) into full tensors (the whole model must fit in this process's memory).
- full file -> sharded folder (world size 1 as stored; ``sess.load`` reshards it
  onto any world size).

The output is written to a temporary sibling and committed like a save.
"""

from __future__ import annotations

import json
import posixpath
import time
import uuid
from typing import Any

from ..display.progress import Progress, check_progress, may_show
from ..errors import CheckpointError
from ..formats.atomic import commit_sharded, read_marker
from ..formats.checksums import record_writer
from ..formats.fullfile import full_suffix, read_full, write_full
from ..formats.info import CheckpointInfo
from ..formats.inspect import inspect
from ..formats.layouts import PARTS, choose_part
from ..formats.metadata import FORMAT, META_FILE
from ..formats.pickles import full_load_planner
from ..formats.reader import named_corruption, open_sharded
from ..formats.storage import dcp_writer, options_for, sibling, url_to_fs
from ..torch_compat import dcp_load_into

__all__ = ["consolidate", "read_sharded"]


def read_sharded(path: str, storage_options: dict | None = None,
                 on_read: Any = None, weights_only: bool = True, model: str | None = None,
                 ) -> tuple[dict, dict | None, dict]:
    """(model state dict, optimizer state dict or None, metadata) of a sharded checkpoint, in
    full; ``on_read(n)`` is told each item's size as it is read. ``weights_only=False``
    trusts its pickled items (they can run code); else one that could is refused.
    ``model``: of a checkpoint holding several models, the one to read (``choose_part``)."""
    so = options_for(path) if storage_options is None else storage_options
    fs, p = url_to_fs(path, so)
    p = p.rstrip("/")
    marker = read_marker(fs, p)
    if marker is None:
        raise CheckpointError(f"checkpoint {path!r} is incomplete (no completion marker); refusing to read it")
    try:
        meta = json.loads(fs.cat_file(posixpath.join(p, META_FILE)))
    except FileNotFoundError:
        meta = {}
    part = choose_part(path, meta.get(PARTS), model)
    _, reader = open_sharded(fs, p, path, marker, so, on_read=on_read, weights_only=weights_only)
    sd: dict[str, Any] = {}
    # the planner rebuilds the whole nested state dict from the metadata, into sd itself
    with named_corruption(path):
        dcp_load_into(sd, reader, full_load_planner(weights_only))
    if part is not None:  # one of several: its own keys, and what the metadata says of it
        sd = sd[part]
        meta = {k: v for k, v in meta.items() if k != PARTS} | meta[PARTS][part] | {"model": part}
    optim = sd.get("optim")
    if optim is not None:
        optim = _lists(optim)
    return sd.get("model", {}), optim, meta


def _lists(osd: dict) -> dict:
    """param_groups may come back as {"0": {...}}: turn it back into a list."""
    pg = osd.get("param_groups")
    if isinstance(pg, dict):
        osd["param_groups"] = [pg[k] for k in sorted(pg, key=int)]
    return osd


def consolidate(path: str, out: str, *, overwrite: bool = False, storage_options: dict | None = None,
                progress: bool | None = None, weights_only: bool = True, model: str | None = None) -> CheckpointInfo:
    """Convert the checkpoint at ``path`` into ``out`` and return ``out``'s CheckpointInfo.

    A sharded folder becomes one file (``out`` ends in ``.pt`` or ``.safetensors``);
    a full file becomes a sharded folder (``out`` without those suffixes).

    Args:
        path: the checkpoint (local path or fsspec URL).
        out: where to write the other form.
        overwrite: replace what is at ``out`` (else FileExistsError).
        storage_options: fsspec options for both (default: those of :func:`fsdp_nb.set_storage_options`).
        progress: a bar of the bytes read and written (default: in a notebook, above a
            few hundred MB).
        weights_only: unpickle the checkpoint's pickled items (optimizer
            ``param_groups``, a ``.pt`` file) only weights-only; one that could run code
            raises UnsafeCheckpointError before anything is written. False trusts the
            checkpoint: it can then run arbitrary code.
        model: of a sharded checkpoint holding several models, the one to write
            (required there; CheckpointError naming them otherwise).
    """
    import warnings

    check_progress(progress)
    if not isinstance(weights_only, bool):
        raise TypeError(f"weights_only must be True or False, got {weights_only!r}")
    # resolve the options once, so every reader and writer below uses the same ones
    so_in = options_for(path) if storage_options is None else storage_options
    so_out = options_for(out) if storage_options is None else storage_options
    fs, p = url_to_fs(path, so_in)
    ofs, o = url_to_fs(out, so_out)
    p, o = p.rstrip("/"), o.rstrip("/")
    if not fs.exists(p):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if ofs.exists(o) and not overwrite:
        raise FileExistsError(f"{out!r} already exists; pass overwrite=True to replace it")
    token = uuid.uuid4().hex[:12]
    src_sharded = fs.isdir(p)
    if src_sharded and not full_suffix(o):
        raise ValueError(f"consolidating a sharded checkpoint gives one file: {out!r} must end in .pt or .safetensors")
    if not src_sharded and not full_suffix(p):
        raise ValueError(f"{path!r} is neither a checkpoint folder nor a .pt / .safetensors file")
    if not src_sharded and full_suffix(o):
        raise ValueError(f"converting a full checkpoint gives a sharded folder: {out!r} must not end in {full_suffix(o)}")
    # the bar's total: only worth an extra look at the source when a bar may be drawn
    nbytes = inspect(path, storage_options=so_in).total_bytes if may_show(progress) else 0
    with Progress(2 * nbytes, f"consolidate {posixpath.basename(p)}", enabled=progress) as bar:
        if not src_sharded:
            choose_part(path, None, model)  # a full file holds one model
            return _to_sharded(fs, p, path, ofs, o, out, token, so_out, bar, weights_only)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model_sd, optim_sd, meta = read_sharded(path, so_in, on_read=bar.update, weights_only=weights_only,
                                                    model=model)
        meta = dict(meta, kind="full", consolidated_from=path, consolidated=time.time())
        ofs.makedirs(posixpath.dirname(o) or ".", exist_ok=True)
        write_full(ofs, o, token, model_sd, optim_sd, meta)
        bar.update(nbytes)
    return inspect(out, storage_options=so_out)


def _to_sharded(
    fs: Any, p: str, url: str, ofs: Any, o: str, out: str, token: str, so_out: dict[str, Any], bar: Progress,
    weights_only: bool,
) -> CheckpointInfo:
    import warnings

    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd, meta = read_full(fs, p, url, weights_only)
    bar.update(bar.total // 2)
    sd: dict[str, Any] = {"model": model_sd}
    if optim_sd:
        sd["optim"] = optim_sd
    tmp = sibling(o, "tmp", token)
    writer = dcp_writer(ofs, tmp, so_out)
    files = record_writer(writer, bar.update).records  # checksums taken as the bytes are written
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, storage_writer=writer, no_dist=True)
        meta = dict(meta or {}, kind="sharded", converted_from=url, converted=time.time())
        meta.setdefault("format", FORMAT)
        meta["world_size"] = 1
        commit_sharded(ofs, tmp, o, meta, files, token)
    except BaseException:  # remove the unfinished output, then re-raise
        if ofs.exists(tmp):
            ofs.rm(tmp, recursive=True)
        raise
    return inspect(out, storage_options=so_out)
