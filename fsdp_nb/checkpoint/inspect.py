"""``fsdp_nb.inspect(path)``: describe a checkpoint offline, in one process.

No process group, no engines, no tensor data read: a sharded checkpoint's DCP
``.metadata`` is read with a restricted unpickler (global shapes, dtypes, chunk
offsets and the ``__{rank}_{i}.distcp`` file holding each chunk) plus our JSON
metadata and marker; a full checkpoint's safetensors header or ``.pt`` (memory
mapped) gives the same.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from ..dtypes import tensor_bytes
from .atomic import read_marker, validate_files
from .checksums import ChecksumMismatch, check_item, file_problem
from .fullfile import full_suffix, read_full_meta
from .info import CheckpointInfo, ChunkInfo, CorruptCheckpointError, TensorInfo
from .metadata import META_FILE
from .restricted import load_dcp_metadata
from .storage import url_to_fs

__all__ = ["inspect", "read_dcp_metadata", "verify_checksums"]

def read_dcp_metadata(fs: Any, path: str, url: str, record: dict | None = None) -> Any:
    """DCP ``Metadata`` of the folder ``path``; CorruptCheckpointError naming the file if
    unreadable, or if its bytes differ from the marker's ``record`` of it (when given)."""
    mpath = posixpath.join(path, ".metadata")
    try:
        data = fs.cat_file(mpath)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(
            f"checkpoint {url!r}: file '.metadata' is missing (not a DCP checkpoint, or unfinished)"
        ) from exc
    for off, length, crc in (record or {}).get("segments", ()):
        try:
            check_item(data[off:off + length], ".metadata", off, (length, crc, record.get("algorithm", "crc32")))
        except ChecksumMismatch as exc:
            raise CorruptCheckpointError(f"checkpoint {url!r}: {exc}") from exc
    try:
        return load_dcp_metadata(data)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"checkpoint {url!r}: file '.metadata' is corrupt or truncated ({type(exc).__name__}: {exc})"
        ) from exc


def verify_checksums(fs: Any, path: str, url: str, marker: dict, names: list[str] | None = None) -> None:
    """Raise CorruptCheckpointError naming the first file whose size or checksums differ."""
    problem = validate_files(fs, path, marker)
    if problem:
        raise CorruptCheckpointError(f"checkpoint {url!r}: {problem}")
    for name, rec in marker.get("files", {}).items():
        if names is not None and name not in names:
            continue
        problem = file_problem(fs, posixpath.join(path, name), name, rec)
        if problem:
            raise CorruptCheckpointError(f"checkpoint {url!r}: {problem}")


def _dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


def inspect(path: str, *, verify: bool = False, storage_options: dict | None = None) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` (local path or fsspec URL) without loading it.

    ``valid`` is False (with ``problem``) for an unfinished or damaged checkpoint;
    ``verify=True`` also reads every file and checks the checksums taken as it was written.
    Raises FileNotFoundError when nothing is at ``path``.
    """
    fs, p = url_to_fs(path, storage_options)
    p = p.rstrip("/")
    if not fs.exists(p):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if fs.isdir(p):
        return _inspect_sharded(fs, p, path, verify)
    if full_suffix(p):
        return _inspect_full(fs, p, path)
    raise CorruptCheckpointError(
        f"{path!r} is neither a checkpoint folder nor a .pt / .safetensors file"
    )


def _inspect_full(fs: Any, p: str, url: str) -> CheckpointInfo:
    name = posixpath.basename(p)
    size = fs.size(p)
    try:
        meta, tensors = read_full_meta(fs, p)
    except Exception as exc:
        return CheckpointInfo(
            path=url, kind="full", valid=False, files={name: size},
            problem=f"file {name!r} is corrupt or truncated ({type(exc).__name__}: {exc})",
        )
    infos: dict[str, TensorInfo] = {}
    for k, (shape, dtype, off, length) in tensors.items():
        infos[k] = TensorInfo(
            k, shape, dtype, length,
            (ChunkInfo((0,) * len(shape), shape, name, off, length),),
        )
    return _with_meta(url, "full", True, None, meta, infos, {name: size})


def _inspect_sharded(fs: Any, p: str, url: str, verify: bool) -> CheckpointInfo:
    marker = read_marker(fs, p)
    problem = None
    if marker is None:
        problem = "not committed (no completion marker): an unfinished or interrupted save"
    else:
        problem = validate_files(fs, p, marker)
        if problem is None and verify:
            try:
                verify_checksums(fs, p, url, marker)
            except CorruptCheckpointError as exc:
                problem = str(exc)
    try:
        meta = json.loads(fs.cat_file(posixpath.join(p, META_FILE)))
    except Exception:
        meta = {}
    infos: dict[str, TensorInfo] = {}
    try:
        md = read_dcp_metadata(fs, p, url)
    except CorruptCheckpointError as exc:
        problem = problem or str(exc)
        md = None
    if md is not None:
        storage = md.storage_data or {}
        by_fqn: dict[str, list[Any]] = {}
        for idx, si in storage.items():
            by_fqn.setdefault(idx.fqn, []).append((idx, si))
        for fqn, tmd in md.state_dict_metadata.items():
            if not hasattr(tmd, "chunks"):
                continue  # bytes (non-tensor) entries: param groups etc.
            shape = tuple(tmd.size)
            dtype = _dtype_name(tmd.properties.dtype)
            chunks = []
            for idx, si in sorted(by_fqn.get(fqn, []), key=lambda x: tuple(x[0].offset or ())):
                sizes = next(
                    (tuple(c.sizes) for c in tmd.chunks if tuple(c.offsets) == tuple(idx.offset or ())),
                    (),
                )
                chunks.append(ChunkInfo(
                    tuple(idx.offset or ()), sizes, si.relative_path, si.offset, si.length
                ))
            infos[fqn] = TensorInfo(fqn, shape, dtype, tensor_bytes(shape, dtype), tuple(chunks))
    files = {k: int(v["size"]) for k, v in (marker or {}).get("files", {}).items()}
    if not files:
        try:
            files = {posixpath.basename(e["name"]): int(e.get("size") or 0) for e in fs.ls(p, detail=True)}
        except Exception:
            files = {}
    return _with_meta(url, "sharded", problem is None, problem, meta, infos, files)


def _with_meta(url, kind, valid, problem, meta, infos, files) -> CheckpointInfo:
    ws = meta.get("world_size")
    if ws is None and kind == "sharded":
        ranks = {f.split("_")[2] for f in files if f.startswith("__") and f.endswith(".distcp")}
        ws = len(ranks) or None
    return CheckpointInfo(
        path=url,
        kind=kind,
        valid=valid,
        problem=problem,
        world_size=ws,
        tensors=infos,
        extra=meta.get("extra", {}),
        versions=meta.get("versions", {}),
        total_bytes=sum(t.bytes for t in infos.values()),
        created=meta.get("created"),
        model_class=meta.get("model_class"),
        param_count=meta.get("param_count"),
        mesh=meta.get("mesh", {}),
        files=files,
        has_optimizer=any(k.startswith("optim.") for k in infos) or bool(meta.get("optimizer")),
    )




