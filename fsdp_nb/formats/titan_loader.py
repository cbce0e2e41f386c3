"""torchtitan's ``dataloader`` state: each data-parallel rank's loader, pickled.

torchtitan's ``ParallelAwareDataloader.state_dict()`` is
``{"dp_rank_<r>": pickle.dumps(<StatefulDataLoader state_dict>), "world_size": <W>}``,
and its ``CheckpointManager`` saves it as the top-level DCP state ``dataloader``: each
rank writes its own ``dataloader.dp_rank_<r>``, and ``dataloader.world_size`` once. Its
load refuses another data-parallel world size.

fsdp_nb writes that form for an engine global named ``dataloader`` in
``sess.save(layout="torchtitan", state=["dataloader"])``, with each rank its own
data-parallel rank (FSDP alone: the rank and the world size), and reads it back into a
``StatefulDataLoader`` (``decode``).

The inner bytes are a plain pickle, not a ``torch.save`` archive. A plain unpickler would
run whatever code the writer put there. ``decode`` reads it with an unpickler that
resolves only plain containers and tensors: a tensor's storage comes back through torch's
weights-only unpickler, never through ``torch.storage._load_from_bytes``, which would
unpickle anything. Anything else is refused (``UnsafeCheckpointError``), unless the
caller trusts the checkpoint (``weights_only=False``).
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

from ..errors import CheckpointError, UnsafeCheckpointError
from ..torch_compat import PICKLED_TENSOR
from .pickle_counts import count_problem

__all__ = ["LOADER", "decode", "encode", "is_encoded"]

LOADER = "dataloader"
"""The name torchtitan's loader state goes by, top-level in its step folder."""
_RANK_KEY = re.compile(r"^dp_rank_\d+$")


def encode(state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """torchtitan's form of one rank's loader state.

    Args:
        state: the loader's ``state_dict()`` (a ``StatefulDataLoader``'s).
        rank: this rank's data-parallel rank.
        world_size: the data-parallel world size.
    """
    return {f"dp_rank_{rank}": pickle.dumps(state), "world_size": world_size}


def is_encoded(entry: Any) -> bool:
    """Whether ``entry`` is in torchtitan's form (``world_size`` and ``dp_rank_<r>`` keys)."""
    return (isinstance(entry, dict) and "world_size" in entry
            and any(isinstance(k, str) and _RANK_KEY.match(k) for k in entry))


def decode(entry: dict[str, Any], rank: int, world_size: int, url: str, weights_only: bool = True) -> dict[str, Any]:
    """Rank ``rank``'s loader state from torchtitan's ``entry``.

    Args:
        entry: the ``dataloader`` state as stored (``is_encoded``).
        rank: this rank's data-parallel rank.
        world_size: this session's data-parallel world size; another one is refused, as
            torchtitan refuses it: a loader's position belongs to the rank that read it.
        url: the checkpoint, for errors.
        weights_only: read the pickle with the restricted unpickler (False: plain
            ``pickle``, for a checkpoint from someone the user trusts).

    Raises CheckpointError (another world size, or no entry for this rank) and
    UnsafeCheckpointError (the pickle names something besides containers and tensors).
    """
    saved = entry.get("world_size")
    if saved != world_size:
        raise CheckpointError(
            f"checkpoint {url!r} keeps torchtitan's 'dataloader' for {saved} data-parallel ranks and this "
            f"session has {world_size}: a loader's position belongs to the rank that read it and cannot be "
            "resharded; leave 'dataloader' out of state= and make a loader for this world size"
        )
    key = f"dp_rank_{rank}"
    data = entry.get(key)
    if not isinstance(data, bytes | bytearray):
        raise CheckpointError(f"checkpoint {url!r}: its 'dataloader' holds no {key!r} (it has {sorted(entry)})")
    if not weights_only:
        return pickle.loads(data)  # noqa: S301 - the caller trusts this checkpoint (weights_only=False)
    try:
        return _LoaderUnpickler(io.BytesIO(bytes(data))).load()
    except _Refused as exc:
        raise UnsafeCheckpointError(
            f"checkpoint {url!r}: 'dataloader.{key}' {exc}. If you trust whoever wrote it, load with "
            "weights_only=False, which unpickles it as torchtitan does and can run arbitrary code"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {url!r}: 'dataloader.{key}' is not a readable pickle ({exc})") from None


class _Refused(pickle.UnpicklingError):
    """The pickle names a class or function outside the allowed few."""


def _storage(data: bytes) -> Any:
    """A tensor's storage, as ``pickle.dumps`` of a tensor keeps it (``torch.save`` bytes),
    read by torch's weights-only unpickler."""
    import torch

    if not isinstance(data, bytes):
        raise _Refused(f"gives a tensor's storage a {type(data).__name__}, not its bytes")
    call = count_problem(data)
    if call is not None:
        raise _Refused(f"holds a tensor storage whose pickle asks for memory by a count ({call})")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise _Refused(f"holds a tensor storage that torch's weights-only unpickler refuses ({first})") from None


class _LoaderUnpickler(pickle.Unpickler):
    """Plain containers, ``OrderedDict`` and CPU tensors: what a ``StatefulDataLoader``'s
    state holds (counts, flags, a sampler's generator state)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in PICKLED_TENSOR:  # the storage read weights-only, not by torch's own call
            return _storage if module == "torch.storage" else super().find_class(module, name)
        if (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        # not bytes or bytearray: called with a number, they allocate that many bytes
        if module == "builtins" and name in {"set", "frozenset", "tuple", "list", "dict"}:
            return super().find_class(module, name)
        raise _Refused(f"names {module}.{name}, which is neither a plain container nor a tensor")
