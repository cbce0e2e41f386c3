"""A rank's own part of a run: its random state and the named objects' ``state_dict``.

``sess.save(state=[...])`` names engine globals that have ``state_dict()`` and
``load_state_dict()``: an LR scheduler, a gradient scaler, a ``StatefulDataLoader``, a
user's own object. :func:`capture` takes their states and this rank's random state
(Python's ``random``, NumPy's global generator, torch's CPU generator and the rank's
own CUDA device's) at the moment the save is called; :func:`restore` puts them back after a load
has set the model and optimizer, so the next step draws the same dropout masks and
batches as the run that was saved. The file format is ``fsdp_nb.formats.run_state``.
"""

from __future__ import annotations

import logging
import posixpath
import random
from collections.abc import Iterable
from typing import Any

from ..engine.namespace import user_ns
from ..errors import CheckpointError, CorruptCheckpointError
from ..formats.metadata import META_FILE
from ..formats.run_state import RNG, RUN_STATE, read, state_file
from .wire_checkpoint import LoadSpec

__all__ = [
    "LOADER_METHODS", "capture", "check_objects", "cuda_rng_problem", "is_torch_loader", "loader_method",
    "per_rank", "read_part", "restore", "rng_state", "set_rng_state",
]

log = logging.getLogger("fsdp_nb")

def check_objects(names: Iterable[str]) -> None:
    """NameError / TypeError naming the first of ``names`` that is not an engine global
    with ``state_dict`` and ``load_state_dict`` on this rank."""
    ns = user_ns()
    for name in names:
        if name not in ns:
            raise NameError(
                f"no engine global named {name!r} on this rank (state= names objects a %%px cell made, "
                "such as a scheduler, a scaler or a data loader)"
            )
        obj = ns[name]
        missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
        if missing:
            raise TypeError(
                f"engine global {name!r} is a {type(obj).__name__}, which has no {' or '.join(missing)}: "
                "state= takes objects that give and take their state (an LR scheduler, a GradScaler, "
                "a StatefulDataLoader, or your own class with both methods)"
            )


LOADER_METHODS = ("__iter__", "__next__", "next", "next_batch", "get_batch")
"""The methods a loop draws batches through: an object with one of them may be a data
loader, whose position a resume must take before the loop draws the next batch."""


def per_rank(obj: Any) -> bool:
    """Whether ``obj`` is iterable as a data loader or sampler is: its position is its
    rank's own (another trainer's layout, which keeps one copy, refuses it). A module (an
    EMA kept in an ``nn.ModuleList``) or a plain container is iterable too, and is not one."""
    import torch

    return hasattr(obj, "__iter__") and not isinstance(obj, torch.nn.Module | dict | list | tuple | set)


def is_torch_loader(obj: Any) -> bool:
    """Whether ``obj`` is a torch ``DataLoader`` (torchdata's ``StatefulDataLoader`` is
    one) or ``Sampler``: a loader by its class, whatever else it has."""
    from torch.utils.data import DataLoader, Sampler

    return isinstance(obj, DataLoader | Sampler)


def loader_method(obj: Any) -> str | None:
    """The first of :data:`LOADER_METHODS` that ``obj`` has (None: none, or ``obj`` is a
    module, an optimizer, a scheduler or a plain container, which a loop does not draw
    batches from: an EMA kept in an ``nn.ModuleList`` iterates too)."""
    import torch

    if isinstance(obj, torch.nn.Module | torch.optim.Optimizer | torch.optim.lr_scheduler.LRScheduler
                  | dict | list | tuple | set | str | bytes):
        return None
    return next((m for m in LOADER_METHODS if callable(getattr(obj, m, None))), None)


def rng_state() -> dict[str, Any]:
    """This rank's random state: Python's, NumPy's global generator (when NumPy is
    imported), torch's CPU generator and its own CUDA device's (when CUDA was initialised).

    The CUDA state is the rank's current device's alone, ``{"device": index, "state":
    ByteTensor}``, not every visible device's by index: a rank that loads it may see
    fewer devices, or another index (``CUDA_VISIBLE_DEVICES`` per task), and takes it
    onto its own current device (``set_rng_state``)."""
    import sys

    import torch

    out: dict[str, Any] = {"python": _python_state(), "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        out["numpy"] = _numpy_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        out["cuda"] = {"device": int(index), "state": torch.cuda.get_rng_state(index)}
    return out


def cuda_rng_problem(saved: dict[str, Any] | None, what: str) -> str | None:
    """Why the CUDA random state in ``saved`` (a state :func:`rng_state` took, or None)
    cannot be put back on this rank, or None when it can (or there is none to put back).

    A checkpoint written before the rank's own device was kept alone holds a list, one
    state per device its rank saw. One entry is the rank's; as many entries as this rank
    sees devices are the devices it saw (its current device's entry is taken). Any other
    count cannot say which device was the rank's: refused, rather than guessed.

    Args:
        saved: the random state read back (its ``"cuda"`` entry is looked at).
        what: the checkpoint and file it came from, for the message.
    """
    import torch

    cuda = (saved or {}).get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return None
    try:
        _cuda_entry(cuda)
    except (LookupError, TypeError) as exc:
        return (f"{what}: its CUDA random state cannot be put back on this rank ({exc}); load it with "
                "rng=False, which leaves this rank's random state as it is")
    return None


def _cuda_entry(cuda: Any) -> Any:
    """The one CUDA generator state in ``cuda`` (the ``"cuda"`` entry of a saved random
    state) that belongs on this rank's current device; LookupError when an old list
    cannot say which, TypeError when it is neither form."""
    import torch

    if isinstance(cuda, dict) and isinstance(cuda.get("state"), torch.Tensor):
        return cuda["state"]
    if isinstance(cuda, list | tuple) and cuda and all(isinstance(t, torch.Tensor) for t in cuda):
        if len(cuda) == 1:
            return cuda[0]
        seen = torch.cuda.device_count()
        if len(cuda) == seen:  # the devices its rank saw, as this rank sees them
            return cuda[torch.cuda.current_device()]
        raise LookupError(
            f"it holds one state for each of the {len(cuda)} devices its rank saw, as fsdp_nb wrote them before "
            f"it kept the rank's own device alone, and this rank sees {seen}: which one was the rank's "
            "is not recorded")
    raise TypeError(f"it is a {type(cuda).__name__}, neither one device's state nor a list of them")


def set_rng_state(saved: dict[str, Any]) -> None:
    """Put back a state :func:`rng_state` took. Its CUDA state goes onto this rank's
    current device, whichever index it was taken on (``cuda_rng_problem`` says first
    when it cannot)."""
    import torch

    if "python" in saved:
        version, internal, gauss = saved["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in saved:
        import numpy as np

        s = saved["numpy"]
        np.random.set_state((s["kind"], s["key"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["gauss"]))
    if "torch" in saved:
        torch.set_rng_state(saved["torch"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(_cuda_entry(saved["cuda"]), torch.cuda.current_device())


def _python_state() -> tuple[int, list[int], float | None]:
    version, internal, gauss = random.getstate()
    return version, list(internal), gauss


def _numpy_state() -> dict[str, Any]:
    """NumPy's legacy global state in values the weights-only unpickler takes (its key
    as a tensor, not an ndarray)."""
    import numpy as np
    import torch

    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {"kind": str(kind), "key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def capture(names: Iterable[str], rng: bool = True, taken: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's part of a save: ``{"rng": rng_state(), "state": {name: state_dict}}``.

    Each ``state_dict`` is deep-copied as it is taken (a loader's dict changes as it
    moves on), so an async save keeps the state of the moment it was called. ``taken``:
    states already taken and copied (name -> state_dict, and ``"rng"`` -> the random
    state: the autosave's ``Armed.early_state``), kept as they are instead of taking them
    now; an exception there (the taking failed) is raised.
    """
    import copy

    ns = user_ns()
    taken = taken or {}
    for value in taken.values():
        if isinstance(value, BaseException):
            raise value
    part: dict[str, Any] = {"state": {n: taken[n] if n in taken else copy.deepcopy(ns[n].state_dict())
                                      for n in names}}
    if rng:
        part[RNG] = taken[RNG] if RNG in taken else rng_state()
    return part


def restore(states: dict[str, Any], names: Iterable[str], rng: dict[str, Any] | None) -> None:
    """Give each named engine global its saved state (``states[name]``), then put back
    the random state ``rng`` (None: leave this rank's)."""
    ns = user_ns()
    for name in names:
        ns[name].load_state_dict(states[name])
    if rng is not None:
        set_rng_state(rng)


def read_part(spec: LoadSpec, fs: Any, p: str, isdir: bool, rank: int, ws: int,
              ) -> tuple[dict[str, Any] | None, bool]:
    """(rank ``rank``'s part of the checkpoint at ``p``, whether to put its random state
    back), or ``(None, False)`` when the load asks for nothing it keeps. ``isdir``: ``p``
    is a folder; ``ws``: this session's world size. A checkpoint in another trainer's
    layout gives ``{"state": None}``: the named objects' states are in the ``extra``
    its load reads.

    CheckpointError, before any model is touched, when ``spec.state`` names an object the
    checkpoint does not keep, or when per-rank state is asked for (``state=``,
    ``rng=True``) from a checkpoint another world size wrote: it belongs to ranks this
    session does not have, so it is refused by name rather than dealt out by a guess.
    """
    import json

    from ..formats.atomic import read_marker

    url, wanted = spec.url, list(spec.state)
    meta, marker = {}, None
    if isdir:
        marker = read_marker(fs, p)
        try:
            meta = json.loads(fs.cat_file(posixpath.join(p, META_FILE)))
        except (FileNotFoundError, ValueError):
            meta = {}
    kept = list(meta.get(RUN_STATE) or [])
    asked = wanted + ([RNG] if spec.rng else [])
    if not kept:
        if spec.rng:
            raise CheckpointError(
                f"checkpoint {url!r} keeps no per-rank state, so it has no 'rng' (a full file, another "
                "trainer's folder, or a save older than state=); load it without rng=True"
            )
        # another trainer's layout keeps one copy of its other state: the named objects take
        # theirs from what the load reads (the notebook checked they are there)
        return ({"state": None} if wanted else None), False
    missing = [n for n in asked if n not in kept]
    if missing:
        others = [n for n in kept if n != RNG]
        raise CheckpointError(
            f"checkpoint {url!r} keeps no {', '.join(map(repr, missing))}; each rank's file holds "
            f"{', '.join(map(repr, kept))} (state= may name {', '.join(map(repr, others)) or 'nothing'})"
        )
    saved_ws = meta.get("world_size")
    if saved_ws != ws:
        if asked:
            raise CheckpointError(
                f"checkpoint {url!r} was written by {saved_ws} ranks and this session has {ws}: each rank's "
                f"{', '.join(map(repr, asked))} belongs to one of those {saved_ws} ranks and cannot be "
                "resharded. The model and optimizer reshard: load them without it (leave it out of state=, "
                "rng=False), then make that state afresh for this world size"
            )
        log.info("%s was written by %s ranks: each rank keeps its own random state", url, saved_ws)
        return None, False
    # by default a resume (a load that names the optimizer or run state) takes the random
    # state back; a load of weights alone (to evaluate, to start from) leaves the ranks'
    resuming = bool(spec.optimizer or spec.state or spec.parts)
    restore_rng = RNG in kept and (spec.rng is True or (spec.rng is None and resuming))
    if not wanted and not restore_rng:
        return None, False
    name = state_file(rank)
    record = (marker or {}).get("files", {}).get(name) if spec.verify else None
    if spec.verify and marker is not None and record is None:  # every file a save wrote is listed
        raise CorruptCheckpointError(f"checkpoint {url!r}: its completion marker lists no {name!r}, which "
                                     "its metadata says each rank wrote; load it with verify=False to read it unchecked")
    return read(fs, p, url, rank, record, spec.weights_only), restore_rng
