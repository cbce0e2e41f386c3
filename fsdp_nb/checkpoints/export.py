"""``fsdp_nb.export_safetensors``: a checkpoint's model weights in Hugging Face's layout.

Offline, in one process, tensor by tensor: each weight is read alone (from a sharded
folder through DCP, only the chunks of that tensor; from a full file, only that
entry) and appended to the output file, whose header is written first from the
checkpoint's metadata, so no more than one tensor is in memory at a time. The output
is what ``safetensors`` and ``transformers`` read: the model's own parameter names (no
``model.`` prefix, no optimizer state), ``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json`` when
larger than ``max_shard_size``. The source is any checkpoint ``fsdp_nb.inspect`` finds
valid: fsdp_nb's sharded folders and full files, plain ``dcp.save`` folders, safetensors.

Why not DCP's Hugging Face writer: ``HuggingFaceStorageWriter`` and its consolidation
write a state dict held in memory (or merge shards that writer saved), while here the
source is read piece by piece.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from ..formats.atomic import replace_folder
from ..formats.direct_io import durable
from ..formats.dtypes import FLOATING, tensor_bytes, to_safetensors
from ..formats.fullfile import full_suffix
from ..formats.info import CheckpointInfo
from ..formats.inspect import inspect, read_dcp_metadata
from ..formats.keys import MODEL
from ..formats.layouts import choose_part, find_layout
from ..formats.pickles import load_planner, load_pt
from ..formats.safetensors_layout import PieceReader, read_layout
from ..formats.safetensors_write import header, raw_bytes
from ..formats.storage import sibling, url_to_fs

__all__ = ["export_safetensors", "parse_size"]

log = logging.getLogger("fsdp_nb")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

def parse_size(size: int | str) -> int:
    """Bytes of ``5_000_000_000``, ``"5GB"`` (10^9, as Hugging Face counts) or ``"2GiB"``."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = _SIZE.match(size) if isinstance(size, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes or a size such as "
                         f"'5GB', '500MB' or '2GiB', got {size!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def _check_dtype(dtype: Any) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "")
    if name not in FLOATING:
        raise ValueError(f"dtype must be a floating dtype (one of {list(FLOATING)}) or None, got {dtype!r}")
    return name


@dataclass(frozen=True)
class _Entry:
    key: str
    """Name in the checkpoint (``model.l1.weight``)."""
    name: str
    """Name in the export (``l1.weight``)."""
    shape: tuple[int, ...]
    dtype: str
    """dtype written (after the cast)."""

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.shape, self.dtype)


def _model_entries(info: CheckpointInfo, cast: str | None, part: str | None = None) -> list[_Entry]:
    """The model tensors to export (of model ``part`` of a checkpoint holding several)."""
    out = []
    prefix = MODEL if part is None else f"{part}.{MODEL}"
    for k, t in info.tensors.items():
        if not k.startswith(prefix):
            continue  # optimizer state stays behind
        dt = cast if cast and t.dtype in FLOATING else t.dtype
        if to_safetensors(dt) is None:
            raise CheckpointError(f"tensor {k!r} has dtype {t.dtype}, which safetensors cannot store")
        out.append(_Entry(k, k[len(prefix):], tuple(t.shape), dt))
    if not out:
        raise CheckpointError(f"checkpoint {info.path!r} holds no model tensors to export")
    return out


def _plan_files(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    files: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def _tensors(path: str, info: CheckpointInfo, entries: list[_Entry], storage_options: dict | None,
             weights_only: bool = True, part: str | None = None) -> Iterator[Any]:
    """Each entry's tensor, one at a time, in ``entries`` order."""
    fs, p = url_to_fs(path, storage_options)
    p = p.rstrip("/")
    if info.kind == "full":
        if full_suffix(p) == ".pt":
            obj = load_pt(fs, p, path, weights_only)
            for e in entries:
                yield obj["model"][e.name]
            return
        ck = read_layout(fs, p, path)
        with PieceReader(fs) as r:
            for e in entries:
                yield r.read(ck.model[e.name])
        return
    yield from _sharded_tensors(fs, p, path, info, entries, storage_options, weights_only, part)


def _sharded_tensors(fs: Any, p: str, url: str, info: CheckpointInfo, entries: list[_Entry],
                     storage_options: dict | None, weights_only: bool, part: str | None) -> Iterator[Any]:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from ..formats.atomic import read_marker
    from ..formats.reader import named_corruption, open_sharded

    layout = find_layout(fs, p, lambda f: read_dcp_metadata(fs, f, url, weights_only=weights_only)
                         .state_dict_metadata, url, part=part)  # whose keys: fsdp_nb's, or another trainer's
    p = layout.folder
    md, reader = open_sharded(fs, p, url, read_marker(fs, p) or {}, storage_options,
                              weights_only=weights_only)
    for e in entries:
        t = info.tensors[e.key]
        buf = torch.empty(t.shape, dtype=getattr(torch, t.dtype))
        with warnings.catch_warnings(), named_corruption(url):
            warnings.simplefilter("ignore")
            dcp.load({layout.model_key(e.name): buf}, storage_reader=reader,
                     planner=load_planner(weights_only, allow_partial_load=True), no_dist=True)
        yield buf


def _json_files(folder: str, docs: dict[str, Any]) -> list[str]:
    """Each of ``docs`` (file name -> JSON content; None: no such file) written into
    ``folder``, on the disk before it closes as the weights are; the names written."""
    written = []
    for name, content in docs.items():
        if content is not None:
            with durable(posixpath.join(folder, name)) as f:
                f.write(json.dumps(content, indent=2, sort_keys=True).encode())
            written.append(name)
    return written


def export_safetensors(
    path: str,
    out_dir: str,
    *,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    storage_options: dict | None = None,
    progress: bool | None = None,
    weights_only: bool = True,
    model: str | None = None,
) -> list[str]:
    """Write the model weights of checkpoint ``path`` to folder ``out_dir`` as safetensors.

    A checkpoint of a Hugging Face model also gets its ``config.json`` (and
    ``generation_config.json``) and leaves out tied duplicates, as ``save_pretrained``
    does, so ``from_pretrained(out_dir)`` reads it as it is. Checks every argument and
    the checkpoint before writing anything. Returns the files written.

    Args:
        path: a sharded checkpoint, a full ``.pt`` / ``.safetensors`` file, or a plain
            ``dcp.save`` folder (local or an fsspec URL).
        out_dir: the folder to write; it must not exist unless ``overwrite``.
        dtype: cast floating weights on the way (``"bfloat16"`` or a ``torch.dtype``).
        max_shard_size: the largest output file (``"5GB"`` or bytes); more than one file
            gets ``model.safetensors.index.json``, and a bigger tensor a file of its own.
        overwrite: replace ``out_dir`` if it exists.
        storage_options: passed to fsspec for URLs (credentials, an endpoint).
        progress: a bar of the bytes written (default: in a notebook, for more than a
            few hundred MB).
        weights_only: False unpickles what the checkpoint pickled as plain ``torch.load``
            does, which can run code: only for checkpoints from someone you trust (else a
            pickle that could run code is refused with ``UnsafeCheckpointError``).
        model: of a checkpoint holding several models, the one to export (required
            there; CheckpointError naming them otherwise).
    """
    import torch

    from ..display.progress import Progress
    from ..formats.reader import refuse_unsafe

    if not isinstance(weights_only, bool):
        raise TypeError(f"weights_only must be True or False, got {weights_only!r}")
    cast = _check_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    if not isinstance(out_dir, str) or not out_dir or "://" in out_dir:
        raise ValueError(f"out_dir must be a local folder path, got {out_dir!r}")
    out_dir = out_dir.rstrip("/")
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir!r} already exists; pass overwrite=True to replace it (nothing was written)")
    if weights_only:
        refuse_unsafe(path, storage_options)
    info = inspect(path, storage_options=storage_options, weights_only=weights_only)
    if not info.valid:
        raise CheckpointError(f"checkpoint {path!r} is not valid ({info.problem}); refusing to export it")
    part = choose_part(path, info.models, model)
    hf = info.models[part] if part is not None else {"hf_config": info.hf_config,
                                                    "hf_generation_config": info.hf_generation_config}
    tied = dict(hf.get("tied") or {}) if part is not None else info.tied
    entries = [e for e in _model_entries(info, cast, part) if e.name not in tied]
    plan = _plan_files(entries, max_bytes)
    n = len(plan)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    token = uuid.uuid4().hex[:12]
    tmp = sibling(out_dir, "tmp", token)
    os.makedirs(tmp)
    total = sum(e.nbytes for e in entries)
    try:
        tensors = _tensors(path, info, entries, storage_options, weights_only, part)
        with Progress(total, f"export {posixpath.basename(out_dir)}", enabled=progress) as bar:
            for name, group in zip(names, plan):
                with durable(posixpath.join(tmp, name)) as f:
                    f.write(header(((e.name, e.dtype, e.shape) for e in group), {"format": "pt"}))
                    for e in group:
                        t = next(tensors)
                        if cast and t.dtype.is_floating_point:
                            t = t.to(getattr(torch, cast))
                        f.write(raw_bytes(t))
                        bar.update(e.nbytes)
                        del t
        index = {"metadata": {"total_size": total},
                 "weight_map": {e.name: name for name, group in zip(names, plan) for e in group}}
        names += _json_files(tmp, {  # what from_pretrained reads beside the weights
            "model.safetensors.index.json": index if n > 1 else None,
            "config.json": hf.get("hf_config"),
            "generation_config.json": hf.get("hf_generation_config"),
        })
        replace_folder(tmp, out_dir, token)
    except BaseException:  # remove the unfinished export, then re-raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    written = [posixpath.join(out_dir, nm) for nm in names]
    log.debug("exported %s -> %s (%d files, %.1f MB)", path, out_dir, n, total / 1e6)
    return written
