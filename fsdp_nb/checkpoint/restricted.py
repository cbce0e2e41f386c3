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

__all__ = ["ALLOWED", "load_dcp_metadata"]

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
