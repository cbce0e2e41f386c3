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

from ..errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from .atomic import read_marker, validate_files
from .checksums import ChecksumMismatch, check_item, file_problem
from .dcp_reader import read_items
from .dtypes import tensor_bytes
from .fullfile import full_suffix, read_full_meta
from .info import CheckpointInfo, ChunkInfo, TensorInfo
from .keys import MODEL, OPTIM_STATE, nest_keys, optim_key
from .layouts import PARTS, Layout, find_layout
from .metadata import META_FILE
from .pickles import TRUST_HINT, refuse_code
from .restricted import RefusedGlobal, load_dcp_metadata, read_capped
from .run_state import RUN_STATE, rank_of_state_file
from .safetensors_layout import is_safetensors_folder
from .side_files import side_extra
from .storage import is_temporary, url_to_fs

__all__ = ["dcp_files_problem", "inspect", "read_dcp_metadata", "verify_checksums"]

def read_dcp_metadata(fs: Any, path: str, url: str, record: dict | None = None,
                      weights_only: bool = True) -> Any:
    """DCP ``Metadata`` of the folder ``path``; CorruptCheckpointError naming the file if
    unreadable, or if its bytes differ from the marker's ``record`` of it (when given);
    UnsafeCheckpointError if it is larger than fsdp_nb reads, holds other classes than
    metadata, or names files outside the folder. ``weights_only=False``: a trusted
    checkpoint, unpickled without restriction."""
    mpath = posixpath.join(path, ".metadata")
    try:
        data = read_capped(fs, mpath)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(
            f"checkpoint {url!r}: file '.metadata' is missing (not a DCP checkpoint, or unfinished)"
        ) from exc
    record = record or {}
    for off, length, crc in record.get("segments", ()):
        try:
            check_item(data[off:off + length], ".metadata", off, (length, crc, record.get("algorithm", "crc32")))
        except ChecksumMismatch as exc:
            raise CorruptCheckpointError(f"checkpoint {url!r}: {exc}") from exc
    try:
        return load_dcp_metadata(data, weights_only)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"checkpoint {url!r}: {exc}") from None
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"checkpoint {url!r}: {exc}") from None
    except RefusedGlobal as exc:
        raise UnsafeCheckpointError(f"checkpoint {url!r}: file '.metadata': {exc}; {TRUST_HINT}") from None
    except Exception as exc:  # any parse failure is a corrupt file, named
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


def dcp_files_problem(fs: Any, path: str, md: Any) -> str | None:
    """None if every file DCP's metadata ``md`` names is in folder ``path`` and long enough
    for the items it holds; else what is wrong (what can be checked without checksums)."""
    need: dict[str, int] = {}
    for si in (md.storage_data or {}).values():
        need[si.relative_path] = max(need.get(si.relative_path, 0), int(si.offset) + int(si.length))
    try:
        sizes = {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0)
                 for e in fs.ls(path, detail=True)}
    except FileNotFoundError:
        return f"folder {path!r} is missing"
    for name, n in sorted(need.items()):
        if name not in sizes:
            return f"file {name!r} is missing"
        if sizes[name] < n:
            return f"file {name!r} has {sizes[name]} bytes, its items need {n} (truncated)"
    return None


def inspect(path: str, *, verify: bool = False, storage_options: dict | None = None,
            weights_only: bool = True) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` without loading it.

    Reads fsdp_nb checkpoints (sharded folders, full files), folders written by plain
    ``dcp.save`` and safetensors files or Hugging Face folders. ``valid`` is False (with
    ``problem``) for an unfinished or damaged checkpoint, or one whose metadata or
    ``.pt`` pickle is unsafe. Raises FileNotFoundError when nothing is at ``path``.

    Args:
        path: a local path or fsspec URL.
        verify: also read every file, check the checksums taken as it was written, and
            check that no pickled item could run code when loaded.
        storage_options: fsspec options (default: those of :func:`fsdp_nb.set_storage_options`).
        weights_only: unpickle ``.metadata`` and ``.pt`` files only with the restricted
            and weights-only unpicklers; False trusts them (they can run code).
    """
    fs, p = url_to_fs(path, storage_options)
    p = p.rstrip("/")
    if not fs.exists(p):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if fs.isdir(p):
        if is_safetensors_folder(fs, p):
            return _inspect_full(fs, p, path)
        return _inspect_sharded(fs, p, path, verify, weights_only)
    if full_suffix(p):
        return _inspect_full(fs, p, path, weights_only)
    raise CorruptCheckpointError(
        f"{path!r} is neither a checkpoint folder nor a .pt / .safetensors file"
    )


def _inspect_full(fs: Any, p: str, url: str, weights_only: bool = True) -> CheckpointInfo:
    try:
        meta, tensors, files = read_full_meta(fs, p, url, weights_only)
    except Exception as exc:  # noqa: BLE001 - any read failure of a full file is reported as the checkpoint's problem
        problem = str(exc) if isinstance(exc, CheckpointError) else (
            f"file {posixpath.basename(p)!r} is corrupt or truncated ({type(exc).__name__}: {exc})")
        size = fs.size(p) if full_suffix(p) else 0
        return CheckpointInfo(path=url, kind="full", valid=False, problem=problem,
                              files={posixpath.basename(p): size}, source="safetensors")
    infos: dict[str, TensorInfo] = {}
    for k, (shape, dtype, file, off, length) in tensors.items():
        infos[k] = TensorInfo(k, shape, dtype, length, (ChunkInfo((0,) * len(shape), shape, file, off, length),))
    ours = str(meta.get("format", "")).startswith("fsdp_nb")
    return _with_meta(url, "full", True, None, meta, infos, files, "fsdp_nb" if ours else "safetensors")


def _inspect_sharded(fs: Any, p: str, url: str, verify: bool, weights_only: bool = True) -> CheckpointInfo:
    read: dict[str, Any] = {}  # folder -> its DCP metadata, read once

    def keys(folder: str) -> Any:
        read[folder] = read_dcp_metadata(fs, folder, url, weights_only=weights_only)
        return read[folder].state_dict_metadata

    try:
        layout = find_layout(fs, p, keys, url)
    except (CorruptCheckpointError, UnsafeCheckpointError):
        layout = Layout("dcp", p)  # the same problem is met again below, and reported
    p = layout.folder
    marker = read_marker(fs, p)
    try:
        meta = json.loads(fs.cat_file(posixpath.join(p, META_FILE)))
    except Exception:  # noqa: BLE001 - unreadable metadata: inspected as a plain DCP folder
        meta = {}
    # written by dcp.save itself: no fsdp_nb files, and not one of our unfinished saves
    plain = marker is None and not meta and not is_temporary(p)
    # another trainer's files beside its shards (Lightning's meta.pt), whoever wrote them
    if (plain or layout.side_files) and (extra := side_extra(fs, layout, url, weights_only)) is not None:
        meta = {**meta, "extra": {**extra, **meta.get("extra", {})}}
    problem = _commit_problem(fs, p, url, marker, plain, verify)
    infos: dict[str, TensorInfo] = {}
    try:
        md = read.get(p) or read_dcp_metadata(fs, p, url, weights_only=weights_only)
    except (CorruptCheckpointError, UnsafeCheckpointError) as exc:
        problem = problem or str(exc)
        md = None
    if md is not None:
        if plain:
            problem = dcp_files_problem(fs, p, md)
        if problem is None and verify and weights_only:
            try:
                refuse_code(fs, p, url, md)
            except UnsafeCheckpointError as exc:
                problem = str(exc)
        infos = _tensor_infos(md, layout, bool(meta.get(PARTS)))
        if layout.optim_in_own_folder:
            optim_md = read.get(layout.optim_folder) or read_dcp_metadata(fs, layout.optim_folder, url,
                                                                          weights_only=weights_only)
            infos.update(_tensor_infos(optim_md, layout))
        if (plain or meta.get("layout") == "torchtitan") and problem is None and layout.extra_roots:
            try:
                if weights_only:  # every pickled item checked before any is unpickled
                    refuse_code(fs, p, url, md)
                meta = _with_folder_state(fs, layout, md, meta, weights_only)
            except (UnsafeCheckpointError, CorruptCheckpointError) as exc:
                problem = str(exc)
    return _with_meta(url, "sharded", problem is None, problem, meta, infos, _files(fs, p, marker),
                      "dcp" if plain else "fsdp_nb", layout.name)


def _commit_problem(fs: Any, p: str, url: str, marker: dict | None, plain: bool, verify: bool) -> str | None:
    """Why folder ``p`` is not a committed checkpoint (its marker, its files' sizes and,
    with ``verify``, their checksums), or None."""
    if marker is None:
        return None if plain else "not committed (no completion marker): an unfinished or interrupted save"
    problem = validate_files(fs, p, marker)
    if problem is None and verify:
        try:
            verify_checksums(fs, p, url, marker)
        except CorruptCheckpointError as exc:
            problem = str(exc)
    return problem


def _files(fs: Any, p: str, marker: dict | None) -> dict[str, int]:
    """File name -> size: as the marker recorded them, else as listed."""
    files = {k: int(v["size"]) for k, v in (marker or {}).get("files", {}).items()}
    if files:
        return files
    try:
        return {posixpath.basename(e["name"]): int(e.get("size") or 0) for e in fs.ls(p, detail=True)}
    except Exception:  # noqa: BLE001 - a listing that fails leaves the sizes unknown, not the inspection
        return {}


def _with_folder_state(fs: Any, layout: Layout, md: Any, meta: dict, weights_only: bool) -> dict:
    """``meta`` with the trainer state the layout keeps in the DCP folder itself
    (torchtitan's ``train_state``) added to its ``extra``."""
    kept = [k for k in md.state_dict_metadata if k.split(".", 1)[0] in layout.extra_roots]
    if not kept:
        return meta
    found = nest_keys(read_items(fs, layout.folder, md, kept, weights_only=weights_only), md.planner_data)
    return {**meta, "extra": {**meta.get("extra", {}), **found}}


def _tensor_infos(md: Any, layout: Layout, parts: bool = False) -> dict[str, TensorInfo]:
    """Each stored tensor of DCP metadata ``md``, with its chunks, named as fsdp_nb names
    them whatever the layout: ``model.<fqn>``, ``optim.state.<fqn>.<key>``; the rest (a
    trainer's other tensors) as stored, and all of them as stored in a checkpoint of
    several models (``parts``: ``<name>.model.<fqn>``)."""
    storage = md.storage_data or {}
    by_fqn: dict[str, list[Any]] = {}
    for idx, si in storage.items():
        by_fqn.setdefault(idx.fqn, []).append((idx, si))
    infos: dict[str, TensorInfo] = {}
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
            chunks.append(ChunkInfo(tuple(idx.offset or ()), sizes, si.relative_path, si.offset, si.length))
        name = fqn
        if not parts and (param := layout.fqn(fqn)) is not None:
            name = MODEL + param
        elif not parts and (entry := layout.optim_fqn(fqn)) is not None:
            name = optim_key(*entry)
        infos[name] = TensorInfo(name, shape, dtype, tensor_bytes(shape, dtype), tuple(chunks))
    return infos


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _with_meta(url, kind, valid, problem, meta, infos, files, source, layout=None) -> CheckpointInfo:
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
        has_optimizer=any(k.startswith(OPTIM_STATE) for k in infos) or bool(meta.get("optimizer"))
        or any(isinstance(m, dict) and m.get("optimizer") for m in (meta.get(PARTS) or {}).values()),
        models=dict(meta.get(PARTS) or {}),
        layout=meta.get("layout") or layout or ("fsdp_nb" if source == "fsdp_nb" else source),
        source=source,
        hf_config=meta.get("hf_config"),
        hf_generation_config=meta.get("hf_generation_config"),
        tied=dict(meta.get("tied") or {}),
        run_state={r: tuple(meta.get(RUN_STATE) or ()) for f in files if (r := rank_of_state_file(f)) is not None},
        saved_from=(_str_or_none(meta.get("model")), _str_or_none(meta.get("optimizer"))),
        optimizers=tuple(o for o in meta.get("optimizers") or () if isinstance(o, str)),
    )
