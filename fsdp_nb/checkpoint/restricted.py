"""Read DCP's ``.metadata`` pickle without unpickling arbitrary objects.

``.metadata`` is a plain pickle of ``torch.distributed.checkpoint.metadata.Metadata``.
Unpickling an untrusted file can run any code, so only the classes that file is
made of are allowed (DCP metadata dataclasses, ``torch.Size``, dtypes, layouts,
memory formats, paths); anything else raises ``pickle.UnpicklingError``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from .checksums import ChecksumMismatch

__all__ = ["ALLOWED", "load_dcp_metadata", "safe_reader"]

ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"ExtensionRegistry"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "device", "layout", "memory_format", "strided", "sparse_coo"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "bytes", "bytearray", "slice"},
}
"""module -> names the restricted unpickler may resolve (dtypes are allowed separately)."""


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            import torch

            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name}: not a torch.distributed.checkpoint "
            "metadata class (the file may be corrupt or not a DCP checkpoint)"
        )


def load_dcp_metadata(data: bytes) -> Any:
    """Unpickle DCP ``.metadata`` bytes with the restricted unpickler."""
    return _Restricted(io.BytesIO(data)).load()


def safe_reader(fs: Any, path: str, so: dict[str, Any], *, metadata: Any = None,
                checks: dict[tuple[str, int], tuple[int, int, str]] | None = None,
                on_read: Any = None) -> Any:
    """A DCP storage reader for folder ``path`` on ``fs`` that unpickles ``.metadata`` safely.

    ``metadata``: the ``.metadata`` already read (and checked), so it is not read again.
    ``checks``: ``(file, offset) -> (length, checksum, algorithm)`` of the stored items
    (``checksums.item_checksums``): each item is checked as it is read, and one without
    a record is refused. ``on_read(n)`` is told each item's size as it is read.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from .storage import is_local, read_into, to_url

    if is_local(fs):
        base: Any = FileSystemReader
        args: tuple = (path,)
        kw: dict[str, Any] = {}
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        base, args, kw = FsspecReader, (to_url(fs, path),), dict(so)

    class SafeReader(base):  # type: ignore[misc, valid-type]
        """DCP reader whose ``.metadata`` goes through the restricted unpickler."""

        def read_metadata(self, *a: Any, **k: Any) -> Any:
            if metadata is not None and k.get("rank") is None:
                md = metadata
            else:
                mpath = self._get_metadata_path(k.get("rank"))
                with self.fs.create_stream(mpath, "rb") as f:
                    md = load_dcp_metadata(f.read())
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def read_data(self, plan: Any, planner: Any) -> Any:
            """As DCP's, but each checked item is read into one reused buffer and its
            tensor built over it (``item_tensor``): one copy less than ``torch.load``
            of the checked bytes, and no new allocation per item."""
            items = [(req, self.storage_data[req.storage_index]) for req in plan.items]
            if checks is None or any(md.transform_descriptors for _, md in items):
                return super().read_data(plan, planner)
            from torch.distributed._shard._utils import narrow_tensor_by_index
            from torch.distributed.checkpoint.planner import LoadItemType
            from torch.futures import Future

            from .item_tensor import tensor_from_item

            per_file: dict[str, list[tuple[Any, Any]]] = {}
            for req, md in items:
                per_file.setdefault(md.relative_path, []).append((req, md))
            buf = bytearray()
            for relative_path, reqs in per_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                    for req, md in sorted(reqs, key=lambda rm: rm[1].offset):
                        if len(buf) < md.length:
                            buf = bytearray(md.length)
                        view = self._checked_item(stream, md, memoryview(buf)[:md.length])
                        if req.type == LoadItemType.BYTE_IO:
                            planner.load_bytes(req, io.BytesIO(bytes(view)))
                            continue
                        tensor = narrow_tensor_by_index(tensor_from_item(view), req.storage_offsets, req.lengths)
                        target = planner.resolve_tensor(req).detach()
                        if target.size() != tensor.size():
                            raise ChecksumMismatch(
                                f"file {relative_path!r}: the item at byte {md.offset} holds {tuple(tensor.size())}, "
                                f"not the {tuple(target.size())} its metadata promised")
                        target.copy_(tensor)
                        del tensor
                        planner.commit_tensor(req, target)
            fut: Future = Future()
            fut.set_result(None)
            return fut

        def _checked_item(self, file: Any, sinfo: Any, into: memoryview) -> memoryview:
            """Item ``sinfo`` read into ``into`` and checked against its record."""
            from .checksums import check_item

            assert checks is not None
            if on_read is not None:
                on_read(int(sinfo.length))
            key = (sinfo.relative_path, int(sinfo.offset))
            want = checks.get(key)
            if want is None:
                raise ChecksumMismatch(f"file {key[0]!r}: no checksum was recorded for the item at byte {key[1]}")
            file.seek(sinfo.offset)
            check_item(into[:read_into(file, into)], key[0], key[1], want)
            return into

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            if checks is None:
                if on_read is not None:
                    on_read(int(sinfo.length))
                return super()._slice_file(file, sinfo)
            data = bytearray(sinfo.length)
            self._checked_item(file, sinfo, memoryview(data))
            return io.BytesIO(data)

    return SafeReader(*args, **kw)
