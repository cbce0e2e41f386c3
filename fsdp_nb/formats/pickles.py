"""Pickles inside checkpoints: read only by the weights-only unpickler, unless trusted.

A DCP checkpoint stores what is not a tensor (an optimizer's ``param_groups``: lr,
betas, eps...) as BYTE_IO items, each a ``torch.save`` pickle, and DCP's own planner
hands them to ``torch.load(weights_only=False)``: whoever wrote the checkpoint runs
code in the process that loads it. A valid completion marker and checksums prove only
that the files are whole, not who wrote them. So every fsdp_nb read of such an item
goes through torch's weights-only unpickler (plain values, containers and tensors;
no other class, no function):

- ``refuse_code`` reads every BYTE_IO item of a folder once, before anything else
  happens, and raises :class:`UnsafeCheckpointError` naming the first item that
  weights-only loading refuses (and its file), so a load changes no model and a
  consolidation writes nothing;
- the planners (``load_planner``, ``full_load_planner``) load BYTE_IO items
  weights-only too, whichever reader reads them;
- ``.metadata`` goes through the restricted unpickler (``restricted``), its size is
  capped and the file names it gives must stay inside the folder;
- before torch's weights-only unpickler takes a pickle, ``refuse_counts`` refuses one
  that asks it for memory by a count (``bytearray(1610612736)``, ``torch.ByteTensor(n)``:
  ``pickle_counts``), which it would otherwise allocate.

``weights_only=False`` (``sess.load``, ``consolidate``, ``export_safetensors``,
``restart(restore=...)``) is the explicit opt-in for a checkpoint from someone the
user trusts: DCP's own planners and plain unpickling, which can run arbitrary code.
"""

from __future__ import annotations

import io
import posixpath
import re
from typing import Any

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from ..torch_compat import empty_state_dict_planner, set_element

__all__ = [
    "TRUST_HINT", "full_load_planner", "is_weights_only", "load_bytes", "load_item", "load_planner", "load_pt",
    "refuse_code", "refuse_counts",
]

TRUST_HINT = ("if you trust whoever wrote this checkpoint, pass weights_only=False "
              "(--trust-pickles on the command line), which unpickles it as plain torch.load "
              "does and can run arbitrary code")
"""How to go on with a refused checkpoint; every refusal ends with it."""


def load_item(data: bytes | memoryview, item: str, file: str, url: str | None = None) -> Any:
    """The object a BYTE_IO item's bytes hold, unpickled weights-only.

    Args:
        data: the item's bytes (a ``torch.save`` pickle).
        item: its key in the checkpoint (``optim.param_groups.0.lr``), for the error.
        file: the file holding it (``__0_0.distcp``), for the error.
        url: the checkpoint, for the error (None: not named).

    Raises :class:`UnsafeCheckpointError` when the weights-only unpickler refuses it,
    ``CorruptCheckpointError`` when it is no pickle at all (damaged).
    """
    import pickle

    import torch

    where = f"checkpoint {url!r}: " if url else ""
    refuse_counts(data, f"{where}item {item!r} in file {file!r}")
    try:
        return torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not _refused(exc):
            raise CorruptCheckpointError(f"{where}item {item!r} in file {file!r} is corrupt ({exc})") from None
        raise _unsafe(f"{where}item {item!r} in file {file!r}", exc) from None
    except (RuntimeError, EOFError, ValueError) as exc:  # not a torch.save archive
        raise CorruptCheckpointError(
            f"{where}item {item!r} in file {file!r} is corrupt ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None


def load_pt(fs: Any, path: str, url: str, weights_only: bool = True) -> Any:
    """The object a full ``.pt`` file holds (memory-mapped when local).

    Args:
        fs: the fsspec filesystem ``path`` is on.
        path: the file.
        url: the checkpoint as the user named it, for the error.
        weights_only: through torch's weights-only unpickler (False: a trusted file,
            unpickled as plain ``torch.load`` does, which can run code).

    Raises :class:`UnsafeCheckpointError` when the weights-only unpickler refuses it.
    """
    import pickle

    import torch

    from .storage import is_local

    if weights_only:
        with fs.open(path, "rb") as f:
            refuse_counts(f, f"checkpoint {url!r}: file {posixpath.basename(path)!r}")
    try:
        if is_local(fs):
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        with fs.open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if not (weights_only and _refused(exc)):
            raise
        raise _unsafe(f"checkpoint {url!r}: file {posixpath.basename(path)!r}", exc) from None


def load_bytes(data: bytes, what: str, weights_only: bool = True) -> Any:
    """The object the ``torch.save`` bytes ``data`` hold; :class:`UnsafeCheckpointError`
    naming ``what`` (``checkpoint '…': file 'train/rank0.pt'``) when the weights-only
    unpickler refuses it, CorruptCheckpointError when they are damaged."""
    import pickle

    import torch

    if weights_only:
        refuse_counts(data, what)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if weights_only and _refused(exc):
            raise _unsafe(what, exc) from None
        raise CorruptCheckpointError(f"{what} is corrupt ({exc})") from exc


def refuse_counts(data: Any, what: str) -> None:
    """Raise :class:`UnsafeCheckpointError` naming ``what`` when the pickle in ``data``
    (bytes, or a binary file at its start) asks torch's weights-only unpickler for memory
    by a count (``bytearray(1610612736)``: ``pickle_counts``), before it takes any."""
    from .pickle_counts import count_problem

    call = count_problem(data)
    if call is not None:
        raise UnsafeCheckpointError(
            f"{what} holds a pickle that asks for memory by a count ({call}), which no tensor or value "
            f"of a checkpoint needs: nothing was allocated or loaded; {TRUST_HINT}")


def _refused(exc: BaseException) -> bool:
    """Whether an ``UnpicklingError`` is the weights-only unpickler's refusal (not damage)."""
    return "WeightsUnpickler" in str(exc)


def _unsafe(what: str, exc: BaseException) -> UnsafeCheckpointError:
    """The error for a pickle the weights-only unpickler refused: what held it, the
    unpickler's reason (without torch's advice, which names the opposite opt-in), how to
    go on."""
    found = re.search(r"WeightsUnpickler error: ([^\n]*?)(?: Please use|$)", str(exc), re.M)
    why = (found.group(1) if found else str(exc).splitlines()[0]).strip().rstrip(".")
    return UnsafeCheckpointError(
        f"{what} holds a pickle that weights-only loading refuses ({why}): loading it could "
        f"run code, so nothing was loaded; {TRUST_HINT}"
    )


def refuse_code(fs: Any, path: str, url: str, md: Any,
                checks: dict[tuple[str, int], tuple[int, int, str]] | None = None) -> None:
    """Read every BYTE_IO item of the DCP folder ``path`` (metadata ``md``) and unpickle it
    weights-only; raise :class:`UnsafeCheckpointError` at the first one refused, before
    any caller reads anything else. ``checks``: the items' recorded checksums
    (``checksums.item_checksums``), checked first, so a damaged item is reported as
    such (``CorruptCheckpointError``). Items stored with a transform (compression) are
    left to the planner, which sees them decoded and loads them weights-only too."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from .checksums import ChecksumMismatch, check_item
    from .item_files import read_ranges
    from .storage import is_local

    byte_keys = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    items = sorted(((si.relative_path, int(si.offset), int(si.length), idx.fqn)
                    for idx, si in (md.storage_data or {}).items()
                    if idx.fqn in byte_keys and not getattr(si, "transform_descriptors", None)))
    opened: dict[str, Any] = {}
    remote = not is_local(fs)  # each item's exact range: a remote file's read-ahead fetches far past it
    fetched = {file: read_ranges(fs, posixpath.join(path, file), [(o, n) for f, o, n, _ in items if f == file])
               for file in {f for f, *_ in items}} if remote else {}
    try:
        for file, offset, length, fqn in items:
            if remote:
                data = fetched[file].pop(0)
            else:
                f = opened.get(file)
                if f is None:
                    f = opened[file] = fs.open(posixpath.join(path, file), "rb")
                f.seek(offset)
                data = f.read(length)
            try:
                if checks is not None:
                    want = checks.get((file, offset))
                    if want is None:
                        raise ChecksumMismatch(f"file {file!r}: no checksum was recorded for the item at byte {offset}")
                    check_item(data, file, offset, want)
                elif len(data) != length:
                    raise ChecksumMismatch(f"file {file!r}: {len(data)} bytes at byte {offset}, "
                                           f"{length} were written (truncated)")
            except ChecksumMismatch as exc:
                raise CorruptCheckpointError(f"checkpoint {url!r}: {exc}") from None
            load_item(data, fqn, file, url)
    finally:
        for f in opened.values():
            f.close()


class _WeightsOnlyBytes:
    """Planner mixin: BYTE_IO items are loaded weights-only (DCP's ``load_bytes`` calls
    ``torch.load(weights_only=False)``); a refusal names the item and its file."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        storage = getattr(getattr(self, "metadata", None), "storage_data", None) or {}
        info = storage.get(read_item.storage_index)
        obj = load_item(value.getbuffer(), fqn, getattr(info, "relative_path", "?"))
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            set_element(self.original_state_dict, self.mappings[fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[fqn] = obj  # type: ignore[attr-defined]


def load_planner(weights_only: bool = True, **kwargs: Any) -> Any:
    """A DCP load planner (``DefaultLoadPlanner(**kwargs)``) that loads BYTE_IO items
    weights-only; DCP's own when ``weights_only`` is False (trusted checkpoints)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    if not weights_only:
        return DefaultLoadPlanner(**kwargs)

    class WeightsOnlyLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
        pass

    return WeightsOnlyLoadPlanner(**kwargs)


def full_load_planner(weights_only: bool = True) -> Any:
    """The planner that rebuilds a whole checkpoint's nested state dict from its metadata
    (``torch_compat.empty_state_dict_planner``, as ``dcp_to_torch_save`` uses), loading
    BYTE_IO items weights-only unless ``weights_only`` is False."""
    base = empty_state_dict_planner()
    if not weights_only:
        return base()

    class WeightsOnlyFullPlanner(_WeightsOnlyBytes, base):  # type: ignore[valid-type,misc]  # a class known at run time
        pass

    return WeightsOnlyFullPlanner()


def is_weights_only(planner: Any) -> bool:
    """Whether ``planner`` loads BYTE_IO items weights-only."""
    return isinstance(planner, _WeightsOnlyBytes)
