"""Safetensors checkpoints: where each tensor is, and reading any piece of one.

Three layouts are read the same way (``read_layout``), from headers only:

- fsdp_nb's full file ``X.safetensors``: the model's weights under their own names
  (what ``safetensors`` + ``load_state_dict`` and Hugging Face tools read), the fsdp_nb
  metadata in the header; the optimizer state beside it in ``X.optim.safetensors``
  (tensors ``state.<fqn>.<key>``; param groups and scalar states in its header), tied
  to its model file by the save's token.
- a Hugging Face folder: ``model.safetensors``, or ``model.safetensors.index.json``
  with its ``weight_map`` over ``model-0000k-of-0000n.safetensors`` files.
- fsdp_nb's older full file: ``model.<fqn>`` and ``optim.state.<fqn>.<key>`` in one file.

``PieceReader`` reads one rectangular piece of a stored tensor (rows: one ranged
read into the new tensor; any other piece: ``safe_open(...).get_slice``). So a rank
reads only the part of each tensor it owns.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError
from .dtypes import from_safetensors
from .keys import MODEL, OPTIM_STATE
from .storage import is_local, read_into

__all__ = [
    "INDEX", "OPTIM_SUFFIX", "PieceReader", "SafetensorsCheckpoint", "Stored", "is_optim_file",
    "is_safetensors_folder", "optim_file", "optim_state", "read_header", "read_layout",
]

INDEX = "model.safetensors.index.json"
"""A sharded Hugging Face export's index: ``{"metadata": {...}, "weight_map": {name: file}}``."""
SINGLE = "model.safetensors"
"""A Hugging Face export that fits one file."""
OPTIM_SUFFIX = ".optim.safetensors"
"""The optimizer file beside a full ``X.safetensors`` checkpoint: ``X.optim.safetensors``."""
OPTIM_TENSOR = "state."
"""Prefix of tensors in the optimizer file (``state.<fqn>.<key>``)."""
MAX_HEADER = 100 << 20


def optim_file(path: str) -> str:
    """``X.optim.safetensors`` for the full checkpoint ``X.safetensors``."""
    return path[: -len(".safetensors")] + OPTIM_SUFFIX


def is_optim_file(name: str) -> bool:
    """True for the optimizer file that sits beside a full checkpoint (not a checkpoint itself)."""
    return name.rstrip("/").endswith(OPTIM_SUFFIX)


@dataclass(frozen=True)
class Stored:
    """Where one tensor is stored."""

    file: str
    """Path of the file on its filesystem."""
    key: str
    """The tensor's name inside that file."""
    shape: tuple[int, ...]
    """Its shape."""
    dtype: str
    """torch dtype name (``"float32"``)."""
    offset: int
    """Byte offset of its data in the file."""
    length: int
    """Bytes of data."""


@dataclass
class SafetensorsCheckpoint:
    """Every tensor of a safetensors checkpoint, by the name loading uses."""

    model: dict[str, Stored]
    """Model state-dict key (the model's own FQN) -> where it is."""
    optim: dict[str, Stored] = field(default_factory=dict)
    """``optim.state.<fqn>.<key>`` -> where it is (empty without optimizer state)."""
    optim_other: dict[str, Any] | None = None
    """The optimizer's ``param_groups`` and non-tensor ``scalars`` (None: no optimizer state)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """fsdp_nb's metadata (empty for a file fsdp_nb did not write)."""
    files: dict[str, int] = field(default_factory=dict)
    """Path of each file read -> its size."""


def optim_state(other: dict[str, Any], tensors: Iterable[tuple[str, str, Any]]) -> dict[str, Any]:
    """An optimizer state dict from a checkpoint's ``optim_other`` (param groups, scalar
    states) and its tensors, given as (fqn, key, tensor)."""
    state: dict[str, dict[str, Any]] = {fqn: dict(vals) for fqn, vals in other.get("scalars", {}).items()}
    for fqn, key, t in tensors:
        state.setdefault(fqn, {})[key] = t
    return {"state": state, "param_groups": other.get("param_groups", [])}


def read_header(fs: Any, path: str) -> tuple[dict[str, Any], int]:
    """(header JSON, byte offset where tensor data starts) of a safetensors file."""
    with fs.open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("file shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER:
            raise ValueError(f"safetensors header claims {n} bytes")
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError("safetensors header is truncated")
    return json.loads(raw), 8 + n


def _entries(fs: Any, path: str) -> tuple[dict[str, Stored], dict[str, str], int]:
    """(name -> Stored, the header's ``__metadata__``, file size); ValueError if damaged."""
    js, start = read_header(fs, path)
    header = js.pop("__metadata__", None) or {}
    out = {}
    for k, v in js.items():
        a, b = v["data_offsets"]
        out[k] = Stored(path, k, tuple(v["shape"]), from_safetensors(v["dtype"]), start + a, b - a)
    size = fs.size(path)
    need = max((s.offset + s.length for s in out.values()), default=start)
    if size < need:
        raise ValueError(f"file is truncated: {size} bytes, its tensors need {need}")
    return out, header, size


def _damaged(url: str, path: str, exc: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {url!r}: file {posixpath.basename(path)!r} is corrupt or truncated "
        f"({type(exc).__name__}: {exc})"
    )


def is_safetensors_folder(fs: Any, path: str) -> bool:
    """True when folder ``path`` holds a Hugging Face export (an index, or ``model.safetensors``)
    and no DCP checkpoint (``.metadata``), which would be read first."""
    if fs.exists(posixpath.join(path, ".metadata")):
        return False
    return fs.exists(posixpath.join(path, INDEX)) or fs.exists(posixpath.join(path, SINGLE))


def read_layout(fs: Any, path: str, url: str) -> SafetensorsCheckpoint:
    """The layout of the safetensors file or Hugging Face folder at ``path`` (headers only).

    CorruptCheckpointError names the file when a header is unreadable, a file is shorter
    than its tensors need, a file the index names is missing, or the optimizer file
    belongs to another save.
    """
    if fs.isdir(path):
        return _folder(fs, path, url)
    try:
        entries, header, size = _entries(fs, path)
        meta = json.loads(header.get("fsdp_nb", "{}"))
    except FileNotFoundError:
        raise
    except Exception as exc:  # any parse failure is a damaged file, named
        raise _damaged(url, path, exc) from exc
    if "fsdp_nb.optim" in header:  # the older layout: everything in one file, prefixed
        return SafetensorsCheckpoint(
            model={k[len(MODEL):]: s for k, s in entries.items() if k.startswith(MODEL)},
            optim={k: s for k, s in entries.items() if k.startswith(OPTIM_STATE)},
            optim_other=json.loads(header["fsdp_nb.optim"]), meta=meta, files={path: size},
        )
    ck = SafetensorsCheckpoint(model=entries, meta=meta, files={path: size})
    if meta.get("optimizer_file"):
        _add_optim(fs, posixpath.join(posixpath.dirname(path), meta["optimizer_file"]), url, ck)
    return ck


def _add_optim(fs: Any, opath: str, url: str, ck: SafetensorsCheckpoint) -> None:
    name = posixpath.basename(opath)
    try:
        entries, header, size = _entries(fs, opath)
        other = json.loads(header["fsdp_nb.optim"])
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(
            f"checkpoint {url!r}: its optimizer file {name!r} is missing"
        ) from exc
    except Exception as exc:  # any parse failure is a damaged file, named
        raise _damaged(url, opath, exc) from exc
    if header.get("fsdp_nb.token") != ck.meta.get("token"):
        raise CorruptCheckpointError(
            f"checkpoint {url!r}: optimizer file {name!r} was written by another save "
            "(its token differs from the model file's)"
        )
    ck.optim = {"optim." + k: s for k, s in entries.items() if k.startswith(OPTIM_TENSOR)}
    ck.optim_other = other
    ck.files[opath] = size


def _folder(fs: Any, path: str, url: str) -> SafetensorsCheckpoint:
    index = posixpath.join(path, INDEX)
    if not fs.exists(index):
        single = posixpath.join(path, SINGLE)
        if not fs.exists(single):
            raise CorruptCheckpointError(
                f"{url!r} holds neither {SINGLE!r} nor {INDEX!r} (nor a DCP checkpoint)"
            )
        return read_layout(fs, single, url)
    try:
        weight_map = json.loads(fs.cat_file(index))["weight_map"]
        if not isinstance(weight_map, dict):
            raise ValueError("weight_map is not an object")
    except Exception as exc:  # any parse failure is a damaged file, named
        raise _damaged(url, index, exc) from exc
    ck = SafetensorsCheckpoint(model={})
    for fname in sorted(set(weight_map.values())):
        fpath = posixpath.join(path, fname)
        try:
            entries, _, size = _entries(fs, fpath)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"checkpoint {url!r}: file {fname!r} named by the index is missing") from exc
        except Exception as exc:  # any parse failure is a damaged file, named
            raise _damaged(url, fpath, exc) from exc
        ck.files[fpath] = size
        for name, st in entries.items():
            if weight_map.get(name) == fname:
                ck.model[name] = st
    lost = sorted(n for n, f in weight_map.items() if n not in ck.model)
    if lost:
        raise CorruptCheckpointError(
            f"checkpoint {url!r}: the index names {len(lost)} tensor(s) its files do not hold: {', '.join(lost[:10])}"
        )
    return ck


class PieceReader:
    """Reads rectangular pieces of stored tensors; a context manager closing its files.
    ``on_read(n)`` is told the bytes of each piece read (a progress count).

    A piece of whole rows (FSDP's dim-0 shards, whole tensors) is one contiguous byte
    range, read straight into a new tensor: nothing else of the file enters memory (a
    memory map would keep every page it touched resident until closed). Other pieces
    (a tensor-parallel column shard) go through ``safe_open(...).get_slice`` on a local
    disk, or through the covering rows elsewhere.
    """

    def __init__(self, fs: Any, on_read: Any = None) -> None:
        self._on_read = on_read
        self._fs = fs
        self._local = is_local(fs)
        self._files: dict[str, Any] = {}
        self._slicers: dict[str, Any] = {}

    def __enter__(self) -> PieceReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in self._files.values():
            f.close()
        for h in self._slicers.values():
            h.__exit__(None, None, None)
        self._files.clear()
        self._slicers.clear()

    def _file(self, path: str) -> Any:
        if path not in self._files:
            self._files[path] = open(path, "rb", buffering=0) if self._local else self._fs.open(path, "rb")
        return self._files[path]

    def read(self, st: Stored, offsets: tuple[int, ...] | None = None,
             sizes: tuple[int, ...] | None = None) -> Any:
        """The piece of ``st`` at ``offsets`` with shape ``sizes`` (default: all of it), a new tensor."""
        out = self._read(st, offsets, sizes)
        if self._on_read is not None:
            self._on_read(out.numel() * out.element_size())
        return out

    def _read(self, st: Stored, offsets: tuple[int, ...] | None, sizes: tuple[int, ...] | None) -> Any:
        if not st.shape:
            return self._rows(st, 0, 1).reshape(())
        if offsets is None or sizes is None:
            offsets, sizes = (0,) * len(st.shape), st.shape
        if tuple(offsets[1:]) == (0,) * (len(st.shape) - 1) and tuple(sizes[1:]) == tuple(st.shape[1:]):
            return self._rows(st, offsets[0], sizes[0])
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        if self._local:
            if st.file not in self._slicers:
                from safetensors import safe_open

                self._slicers[st.file] = safe_open(st.file, framework="pt").__enter__()
            return self._slicers[st.file].get_slice(st.key)[index]
        return self._rows(st, offsets[0], sizes[0])[(slice(None),) + index[1:]].clone()

    def _rows(self, st: Stored, first: int, count: int) -> Any:
        """Rows ``first .. first+count`` of ``st`` (whole trailing dimensions): one read
        of that byte range into a new tensor."""
        import torch

        out = torch.empty((count,) + tuple(st.shape[1:]), dtype=getattr(torch, st.dtype))
        n = out.numel() * out.element_size()
        if n == 0:
            return out
        view = out.view(-1).view(torch.uint8).numpy().data
        f = self._file(st.file)
        f.seek(st.offset + first * (n // count))
        if read_into(f, view) < n:
            raise ValueError(f"file {posixpath.basename(st.file)!r} ended inside tensor {st.key!r}")
        return out
