"""Where checkpoints live: local paths and fsspec URLs (s3://, gs://, memory://...).

Engines open the same URLs as the notebook, so the options a filesystem needs
(an S3 endpoint, keys) travel with every save/load call: they are the notebook's
``fsspec.config.conf`` for that protocol (which fsspec fills from ``FSSPEC_S3_*``
environment variables at import) updated by ``set_storage_options``. Engines
also see their own environment (``AWS_*``), as s3fs/botocore read it.
``memory://`` lives inside one process: use it offline (inspect / consolidate),
not across engines.
"""

from __future__ import annotations

import logging
import os
import posixpath
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..torch_compat import fsspec_writer

log = logging.getLogger("fsdp_nb")

__all__ = ["fsync_dir", "options_for", "set_storage_options", "url_to_fs"]

_OPTIONS: dict[str, dict[str, Any]] = {}


def set_storage_options(protocol: str, **options: Any) -> None:
    """Options for every filesystem of ``protocol``: the default ``storage_options`` of
    saves, loads, ``inspect``, ``consolidate`` and the checkpoint browser.

    ``fsdp_nb.set_storage_options("s3", endpoint_url="http://127.0.0.1:9000", key=..., secret=...)``
    points every ``s3://`` checkpoint at that endpoint. They are sent to the engines with
    each save and load (values must be picklable), over fsspec's own configuration for
    the protocol (``FSSPEC_S3_*`` variables). Calling it again replaces that protocol's
    options; no options clears them. A call's own ``storage_options=`` wins over both.

    Args:
        protocol: the URL scheme, such as ``"s3"``, ``"gs"`` or ``"memory"``.
        **options: the fsspec filesystem's keyword arguments.
    """
    if not isinstance(protocol, str) or not protocol:
        raise ValueError(f"protocol must be a non-empty str such as 's3', got {protocol!r}")
    if options:
        _OPTIONS[protocol] = dict(options)
    else:
        _OPTIONS.pop(protocol, None)


def protocol_of(url: str) -> str:
    """``"s3"`` for ``s3://b/k``, ``"file"`` for a plain path."""
    if "://" in url:
        return url.split("://", 1)[0]
    return "file"


def options_for(url: str) -> dict[str, Any]:
    """The storage options for ``url`` that this process would use (shipped to engines)."""
    proto = protocol_of(url)
    if proto == "file":
        return {}
    opts = dict(fsspec.config.conf.get(proto, {}))
    opts.update(_OPTIONS.get(proto, {}))
    return opts


def url_to_fs(url: str, options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a local path or fsspec URL."""
    if not isinstance(url, str) or not url:
        raise TypeError(f"checkpoint path must be a non-empty str (local path or URL), got {url!r}")
    opts = options_for(url) if options is None else options
    fs, path = fsspec.core.url_to_fs(url, **opts)
    if not is_local(fs):
        # Other processes (engines, the notebook) write here too: never trust a cached listing.
        fs.invalidate_cache()
    return fs, path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True for the local filesystem (where renames are atomic)."""
    return isinstance(fs, LocalFileSystem)


def to_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A URL other processes can open for ``path`` on ``fs``."""
    if is_local(fs):
        return path
    return fs.unstrip_protocol(path)


def sibling(path: str, prefix: str, token: str) -> str:
    """A hidden name beside ``path``: ``dir/.<name>.<prefix>-<token>``."""
    path = path.rstrip("/")
    head, name = posixpath.split(path)
    return posixpath.join(head, f".{name}.{prefix}-{token}") if head else f".{name}.{prefix}-{token}"


def is_temporary(path: str) -> bool:
    """True for a save's temporary sibling (``.<name>.tmp-<token>``): an unfinished save,
    never a checkpoint of its own, even once DCP has written its ``.metadata``."""
    name = posixpath.basename(path.rstrip("/"))
    return name.startswith(".") and ".tmp-" in name


def read_into(f: Any, view: memoryview) -> int:
    """Fill ``view`` from file ``f`` at its position, in as many reads as it takes; the
    bytes read (fewer than ``len(view)`` only where the file ends)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def dcp_writer(fs: fsspec.AbstractFileSystem, path: str, options: dict[str, Any]) -> Any:
    """A torch.distributed.checkpoint writer for folder ``path`` on ``fs``."""
    from torch.distributed.checkpoint import FileSystemWriter

    if is_local(fs):
        return FileSystemWriter(path, sync_files=True)
    return fsspec_writer()(to_url(fs, path), sync_files=False, **options)


def fsync_dir(path: str) -> None:
    """Flush a local folder's entries (a rename into it) to disk; a folder that cannot be
    opened or flushed is logged, not raised: the data itself was flushed already."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        log.debug("could not fsync folder %s: %s", path, exc)
    finally:
        os.close(fd)
