"""A DCP tensor item as a tensor over the bytes already read, without another copy.

DCP stores each tensor item as a ``torch.save`` archive (an uncompressed zip). The
checked reader has the item's bytes in memory anyway (it checksums them), so rather
than ``torch.load`` copying them into a new storage, the tensor is built over them:
the zip's directory locates the storage record, the pickle (read with torch's
weights-only unpickler) gives dtype, shape and strides. Anything unusual (a
compressed record, big-endian data) falls back to ``torch.load`` of a copy.
"""

from __future__ import annotations

import io
import struct
import zipfile
from typing import Any

from ...torch_compat import weights_only_unpickler

__all__ = ["tensor_from_item"]

_LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip local file header: signature, then (after 22 bytes) name and extra lengths."""


class _ViewFile(io.RawIOBase):
    """A seekable read-only file over a memoryview (what ``zipfile`` needs), no copy."""

    def __init__(self, view: memoryview):
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


def tensor_from_item(view: memoryview) -> Any:
    """The tensor ``torch.save`` wrote into ``view`` (one DCP item); it shares ``view``'s
    memory when it can (copy it out before the buffer is reused)."""
    import torch

    try:
        return _over(view)
    except (zipfile.BadZipFile, KeyError, ValueError, NotImplementedError):
        return torch.load(io.BytesIO(bytes(view)), map_location="cpu", weights_only=True)


def _over(view: memoryview) -> Any:
    import torch

    Unpickler = weights_only_unpickler()  # noqa: N806 - the class, by its name

    zf = zipfile.ZipFile(_ViewFile(view))
    pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
    prefix = pkl[: -len("data.pkl")]
    if prefix + "byteorder" in zf.namelist() and zf.read(prefix + "byteorder") != b"little":
        raise NotImplementedError("big-endian item")

    def storage(saved_id: Any) -> Any:
        _, storage_type, key, _location, _numel = saved_id
        info = zf.getinfo(f"{prefix}data/{key}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise NotImplementedError("compressed record")
        sig, name_len, extra_len = _LOCAL_HEADER.unpack_from(view, info.header_offset)
        if sig != b"PK\x03\x04":
            raise zipfile.BadZipFile("no local header where the directory points")
        start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        data = view[start:start + info.file_size]
        raw = (torch.frombuffer(data, dtype=torch.uint8) if len(data)
               else torch.empty(0, dtype=torch.uint8)).untyped_storage()
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        return torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)

    up = Unpickler(io.BytesIO(zf.read(pkl)), encoding="utf-8")
    up.persistent_load = storage
    tensor = up.load()
    if not isinstance(tensor, torch.Tensor):
        raise ValueError("the item is not a tensor")
    return tensor
