"""Read DCP's ``.metadata`` pickle without unpickling arbitrary objects.

``.metadata`` is a plain pickle of ``torch.distributed.checkpoint.metadata.Metadata``.
Unpickling an untrusted file can run any code, so only the classes that file is
made of are allowed (DCP metadata dataclasses, ``torch.Size``, dtypes, layouts,
memory formats, paths); anything else raises ``pickle.UnpicklingError``.

What it then says is checked too: every file it names must be a plain name inside
the checkpoint's folder (no absolute path, no ``..``), or a reader would be sent to
read any file the user can; and a ``.metadata`` larger than ``max_metadata_bytes()``
is refused before it is read.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from ..torch_compat import DCP_METADATA_GLOBALS

__all__ = [
    "ALLOWED", "MAX_METADATA_ENV", "RefusedGlobal", "check_paths", "load_dcp_metadata", "max_metadata_bytes", "read_capped",
]

MAX_METADATA_ENV = "FSDP_NB_MAX_METADATA_BYTES"
"""Environment variable that sets the largest ``.metadata`` read (bytes)."""
_MAX_METADATA_DEFAULT = 1 << 30
"""1 GiB: a 70B model saved by 2,048 ranks has about 50 MB of metadata."""


def max_metadata_bytes() -> int:
    """The largest ``.metadata`` fsdp_nb reads: ``FSDP_NB_MAX_METADATA_BYTES``, default 1 GiB."""
    raw = os.environ.get(MAX_METADATA_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else _MAX_METADATA_DEFAULT

ALLOWED: dict[str, frozenset[str]] = {
    **DCP_METADATA_GLOBALS,
    "collections": frozenset({"OrderedDict"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict", "slice"}),
}
"""module -> names the restricted unpickler may resolve (dtypes are allowed separately):
torch's metadata classes (``torch_compat.DCP_METADATA_GLOBALS``) and the plain containers.

Never a callable that allocates by a count: ``bytes`` and ``bytearray`` are left out
because ``bytearray(1610612736)``, a 30-byte pickle, fills 1.5 GiB before anything could
be checked (DCP's writers never name them: a pickle holds bytes as its own opcodes).
Everything here, called with a number, raises or builds a small object (a test calls
each one so), and a container is only as large as the pickle that lists its items."""


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a class or function the restricted unpickler does not allow."""


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            import torch

            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise RefusedGlobal(
            f"refusing to unpickle {module}.{name}: not a torch.distributed.checkpoint "
            "metadata class (the file may be corrupt, not a DCP checkpoint, or made to run code)"
        )


def read_capped(fs: Any, path: str) -> bytes:
    """The bytes of ``.metadata`` file ``path`` on fsspec ``fs``, at most one more than
    ``max_metadata_bytes()``: enough for ``load_dcp_metadata`` to refuse a larger file
    without reading it all."""
    with fs.open(path, "rb") as f:
        return f.read(max_metadata_bytes() + 1)


def load_dcp_metadata(data: bytes, weights_only: bool = True) -> Any:
    """DCP ``Metadata`` from ``.metadata`` bytes: unpickled with the restricted unpickler
    (plain ``pickle`` when ``weights_only`` is False: a trusted checkpoint), then its file
    names checked (``check_paths``).

    Args:
        data: the file's bytes (``read_capped``).
        weights_only: restricted unpickling (False: plain, which can run code).

    Raises ``UnsafeCheckpointError`` (too large, or files outside the folder),
    ``RefusedGlobal`` (a class or function it does not allow), ``CorruptCheckpointError``
    (it holds something other than DCP's ``Metadata``)."""
    if len(data) > max_metadata_bytes():
        raise UnsafeCheckpointError(
            f"file '.metadata' is over the {max_metadata_bytes()} bytes fsdp_nb reads; raise "
            f"{MAX_METADATA_ENV} if this checkpoint's metadata is really that large"
        )
    md = _Restricted(io.BytesIO(data)).load() if weights_only else pickle.loads(data)
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(
            f"file '.metadata' holds a {type(md).__module__}.{type(md).__qualname__}, not "
            "torch.distributed.checkpoint's Metadata (not a DCP checkpoint, or damaged)"
        )
    check_paths(md)
    return md


def check_paths(md: Any) -> None:
    """Raise ``UnsafeCheckpointError`` unless every file DCP metadata ``md`` names is a
    relative path inside the checkpoint's folder: not absolute, no ``..``, no drive."""
    for idx, si in (getattr(md, "storage_data", None) or {}).items():
        path = getattr(si, "relative_path", None)
        if not _inside(path):
            raise UnsafeCheckpointError(
                f"file '.metadata' places item {getattr(idx, 'fqn', idx)!r} in {path!r}, which is "
                "not a file inside the checkpoint's folder (absolute, or with '..'): refused"
            )


def _inside(path: Any) -> bool:
    if not isinstance(path, str) or not path or "\x00" in path:
        return False
    if path.startswith(("/", "\\")) or ":" in path:
        return False
    return ".." not in path.replace("\\", "/").split("/")
