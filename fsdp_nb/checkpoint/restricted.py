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


def safe_reader(fs: Any, path: str, so: dict[str, Any]) -> Any:
    """A DCP storage reader for folder ``path`` on ``fs`` that unpickles ``.metadata`` safely."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from .storage import is_local, to_url

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
            mpath = self._get_metadata_path(k.get("rank"))
            with self.fs.create_stream(mpath, "rb") as f:
                md = load_dcp_metadata(f.read())
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader(*args, **kw)
