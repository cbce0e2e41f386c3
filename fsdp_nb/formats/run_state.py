"""Each rank's own part of a run in a sharded checkpoint: ``train/rank{r}.pt``.

The model and optimizer are sharded (DCP reshards them to any world size), but part of
a run belongs to one rank and has no global shape: its random state (dropout, a
shuffled sampler), a data loader's position in its share of the data, an LR scheduler
or a gradient scaler (the same on every rank, kept per rank all the same). As OLMo's
checkpointer does, each rank ``torch.save``\\ s that part into ``train/rank{r}.pt``
beside the shards. The file is written into the save's temporary folder before the
commit and listed in the completion marker with its size and checksum, so it is
committed, verified and removed with the rest; it is read back only through torch's
weights-only unpickler.

A file holds ``{"rng": {...}, "state": {name: state_dict}}``: ``rng`` is the rank's
random state (``"python"``, ``"numpy"``, ``"torch"``, ``"cuda"``), ``state`` each
named engine global's ``state_dict()``. The checkpoint's ``fsdp_nb.json`` records the
names (``RUN_STATE``), so ``inspect`` lists them offline without opening a file.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
from typing import Any

from ..errors import CorruptCheckpointError
from .checksums import ALGORITHM, check_item, checksum
from .pickles import load_bytes
from .storage import fsync_dir, is_local

__all__ = [
    "RNG", "RUN_STATE", "decode", "encode", "rank_of_state_file", "read", "run_meta", "state_file", "write",
]

RUN_STATE = "run_state"
"""The key of ``fsdp_nb.json`` that lists what each rank's file holds: ``"rng"`` first
when the random state was kept, then the names passed as ``state=``."""
RNG = "rng"
"""The name the random state goes by in ``RUN_STATE`` and in ``state=`` errors."""
_FILE = re.compile(r"^train/rank(\d+)\.pt$")


def run_meta(names: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """What ``fsdp_nb.json`` says of a save in fsdp_nb's layout that keeps each rank's
    random state and the objects ``names``: its layout, and what each rank's file holds."""
    return {"layout": "fsdp_nb", RUN_STATE: [RNG, *names]}


def state_file(rank: int) -> str:
    """The name, relative to the checkpoint folder, of rank ``rank``'s file."""
    return f"train/rank{rank}.pt"


def rank_of_state_file(name: str) -> int | None:
    """The rank whose file ``name`` is (relative to the folder), or None for any other file."""
    m = _FILE.match(name)
    return int(m.group(1)) if m else None


def encode(part: dict[str, Any]) -> bytes:
    """``part`` as the bytes of a ``torch.save`` file: taken when the save is called, so
    what the rank does next (another step, the loader moving on) is not in it."""
    import torch

    buf = io.BytesIO()
    torch.save(part, buf)
    return buf.getvalue()


def decode(data: bytes, url: str, name: str, weights_only: bool = True) -> dict[str, Any]:
    """The part a rank's file held, unpickled weights-only (UnsafeCheckpointError naming
    the file when refused: a user's object whose ``state_dict`` holds a class)."""
    part = load_bytes(data, f"checkpoint {url!r}: file {name!r}", weights_only)
    if not isinstance(part, dict) or not isinstance(part.get("state", {}), dict):
        raise CorruptCheckpointError(f"checkpoint {url!r}: file {name!r} does not hold a rank's run state")
    return part


def write(fs: Any, folder: str, rank: int, data: bytes) -> tuple[str, dict[str, Any]]:
    """Write rank ``rank``'s file into ``folder`` (the save's temporary folder), synced
    where local; (its name, its record for the completion marker: size and checksum)."""
    name = state_file(rank)
    path = posixpath.join(folder, name)
    if is_local(fs):
        os.makedirs(posixpath.dirname(path), mode=0o700, exist_ok=True)  # a rank's own state: this user's
        with open(path, "wb", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(posixpath.dirname(path))  # the file's entry too, before the commit
    else:
        fs.pipe_file(path, data)
    crc = checksum(data)
    return name, {"size": len(data), "algorithm": ALGORITHM, "segments": [[0, len(data), crc]]}


def read(fs: Any, folder: str, url: str, rank: int, record: dict[str, Any] | None,
         weights_only: bool = True) -> dict[str, Any]:
    """Rank ``rank``'s part of the checkpoint in ``folder``, checked against its marker
    ``record`` (size and checksum) before it is unpickled; CorruptCheckpointError naming
    the file when it is missing or differs."""
    name = state_file(rank)
    try:
        data = fs.cat_file(posixpath.join(folder, name))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint {url!r}: file {name!r} is missing") from None
    record = record or {}
    for off, length, crc in record.get("segments", ()):
        try:
            check_item(data[off:off + length], name, off, (length, crc, record.get("algorithm", "crc32")))
        except ValueError as exc:
            raise CorruptCheckpointError(f"checkpoint {url!r}: {exc}") from None
    return decode(data, url, name, weights_only)
