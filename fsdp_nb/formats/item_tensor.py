"""A DCP tensor item as a tensor over the bytes already read, without another copy.

DCP stores each tensor item as a ``torch.save`` archive (an uncompressed zip). The
checked reader has the item's bytes in memory anyway (it checksums them), so rather
than ``torch.load`` copying them into a new storage, the tensor is built over them:
the zip's directory locates the storage record, the pickle (read with torch's
weights-only unpickler, once ``pickle_counts`` found no call by a count in it) gives
dtype, shape and strides. Anything unusual (a
compressed record, big-endian data, a zip64 archive) falls back to ``zipfile``, then
to ``torch.load`` of a copy.

The directory is read straight from the archive's last bytes, and what a pickle says
is kept by its bytes (``item_layout``): a model's items repeat a few shapes, and
parsing each again (``zipfile`` and the unpickler) would be most of the Python time of
a load's check pass, under the GIL its reading threads share.
"""

from __future__ import annotations

import functools
import io
import logging
import struct
import zipfile
from typing import Any

from ..errors import UnsafeCheckpointError
from ..torch_compat import weights_only_unpickler
from .pickle_counts import count_problem

__all__ = ["MAX_LAYOUTS", "item_layout", "kept_edges_suffice", "tensor_from_item"]

log = logging.getLogger("fsdp_nb")

_LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip local file header: signature, then (after 22 bytes) name and extra lengths."""
_END = struct.Struct("<4s4xHHLLH")
"""A zip's end of central directory (no comment): signature, entries here and in all,
the directory's size and offset, the comment's length."""
_ENTRY = struct.Struct("<4s6xH8xLLHHH8xL")
"""A zip central directory entry: signature, method, compressed and uncompressed
sizes, name, extra and comment lengths, local header offset."""
MAX_LAYOUTS = 4096
"""``item_layout`` keeps what this many pickles say (the most recently used)."""


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
        records = _records(view)
        if records is not None:
            return _over_records(view, records)
    except UnsafeCheckpointError:
        raise
    except (KeyError, ValueError, NotImplementedError, RuntimeError, struct.error) as exc:
        log.debug("an item's zip read again by zipfile (%s: %s)", type(exc).__name__, exc)
    try:
        return _over(view)
    except (zipfile.BadZipFile, KeyError, ValueError, NotImplementedError, struct.error):
        _refuse_counts(view)
        return torch.load(io.BytesIO(bytes(view)), map_location="cpu", weights_only=True)


def _refuse_counts(data: Any) -> None:
    """UnsafeCheckpointError when the item's pickle asks torch's weights-only unpickler for
    memory by a count (``pickle_counts``), before it is unpickled."""
    call = count_problem(data)
    if call is not None:
        raise UnsafeCheckpointError(f"a stored tensor item holds a pickle that asks for memory by a count ({call}), "
                                    "which no tensor needs: refused before anything was allocated")


def kept_edges_suffice(view: memoryview, edge: int) -> bool:
    """Whether ``tensor_from_item`` builds the item's tensor from nothing but the first
    and last ``edge`` bytes of ``view``: a plain zip whose only record between them is
    its tensor's bytes (what ``item_scan`` keeps of an item it checks)."""
    gap = (edge, len(view) - edge)
    try:
        records = _records(view, gap)
    except (struct.error, UnicodeDecodeError):
        return False
    if records is None:
        return False
    return all("/data/" in name or start + size <= gap[0] or start >= gap[1]
               for name, (start, size) in records.items())


def _records(view: memoryview, gap: tuple[int, int] | None = None) -> dict[str, tuple[int, int]] | None:
    """Each stored record of the zip in ``view``: name -> (where its bytes start, how
    many); None unless it is a plain one (no comment, no zip64, nothing compressed).
    ``gap``: bytes ``[lo, hi)`` of ``view`` that are not the item's; None if the
    directory or a header lies there."""
    def outside(at: int, n: int) -> bool:
        return gap is None or at + n <= gap[0] or at >= gap[1]

    end = len(view) - _END.size
    if end < 0 or not outside(end, _END.size):
        return None
    sig, _, count, size, at, comment = _END.unpack_from(view, end)
    if sig != b"PK\x05\x06" or comment or at + size > end or not outside(at, size):
        return None
    out: dict[str, tuple[int, int]] = {}
    for _ in range(count):
        sig, method, csize, usize, nlen, elen, clen, header = _ENTRY.unpack_from(view, at)
        if sig != b"PK\x01\x02" or method != zipfile.ZIP_STORED or csize != usize or 0xFFFFFFFF in (csize, header):
            return None
        name = bytes(view[at + _ENTRY.size:at + _ENTRY.size + nlen]).decode("utf-8")
        at += _ENTRY.size + nlen + elen + clen
        if not outside(header, _LOCAL_HEADER.size):
            return None
        lsig, lnlen, lelen = _LOCAL_HEADER.unpack_from(view, header)
        if lsig != b"PK\x03\x04":
            return None
        start = header + _LOCAL_HEADER.size + lnlen + lelen
        if start + csize > end:
            return None
        out[name] = (start, csize)
    return out


def _over_records(view: memoryview, records: dict[str, tuple[int, int]]) -> Any:
    """The tensor over ``view`` from its zip ``records`` (``_records``)."""
    import torch

    pkl = next((n for n in records if n.endswith("/data.pkl")), None)
    if pkl is None:
        raise KeyError("data.pkl")
    prefix = pkl[: -len("data.pkl")]
    order = records.get(prefix + "byteorder")
    if order is not None and bytes(view[order[0]:order[0] + order[1]]) != b"little":
        raise NotImplementedError("big-endian item")
    start, n = records[pkl]
    key, dtype, offset, size, stride, nbytes = item_layout(bytes(view[start:start + n]))
    start, n = records[f"{prefix}data/{key}"]
    if n != nbytes:
        raise ValueError(f"the storage record holds {n} bytes, its pickle says {nbytes}")
    raw = torch.frombuffer(view[start:start + n], dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    return torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), offset, size, stride)


@functools.lru_cache(maxsize=MAX_LAYOUTS)
def item_layout(pickled: bytes) -> tuple[str, Any, int, tuple[int, ...], tuple[int, ...], int]:
    """What the pickle of a one-tensor item says: (its storage record's key, dtype,
    storage offset, size, stride, storage bytes). Unpickled weights-only over a storage
    on the meta device (no bytes); kept by the pickle's bytes, so each shape is parsed
    once (``item_layout.cache_info()`` counts parses as misses). ValueError unless the
    pickle is one tensor over one storage."""
    import torch

    _refuse_counts(pickled)
    Unpickler = weights_only_unpickler()  # noqa: N806 - the class, by its name
    keys: list[tuple[str, int]] = []

    def storage(saved_id: Any) -> Any:
        _, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = int(numel) * dtype.itemsize
        keys.append((str(key), nbytes))
        return torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(nbytes, device="meta"),
                                          dtype=dtype, _internal=True)

    up = Unpickler(io.BytesIO(pickled), encoding="utf-8")
    up.persistent_load = storage
    tensor = up.load()
    if not isinstance(tensor, torch.Tensor) or len(keys) != 1 or tensor.device.type != "meta":
        raise ValueError("the item is not one tensor over one storage")
    return (keys[0][0], tensor.dtype, int(tensor.storage_offset()), tuple(tensor.size()), tuple(tensor.stride()),
            keys[0][1])


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

    pickled = zf.read(pkl)
    _refuse_counts(pickled)
    up = Unpickler(io.BytesIO(pickled), encoding="utf-8")
    up.persistent_load = storage
    tensor = up.load()
    if not isinstance(tensor, torch.Tensor):
        raise ValueError("the item is not a tensor")
    return tensor
