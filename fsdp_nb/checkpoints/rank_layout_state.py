"""A save in another trainer's layout: where its model, optimizer and other state go.

``sess.save(layout="lightning" | "torchtitan")`` writes what that trainer resumes from.
Its other state is the trainer's, one copy for the run (rank 0's), not one per rank:

- Lightning Fabric keeps everything that is not a model or an optimizer in ``meta.pt``,
  each stateful object's ``state_dict()`` under its name in ``fabric.save``'s dict: the
  ``extra`` entries and each object named in ``state=`` go there, under their names.
- torchtitan keeps its states as top-level DCP entries of the step folder:
  ``train_state``, ``lr_scheduler``, ``dataloader``. ``extra`` entries and the objects
  named in ``state=`` (an engine global named ``lr_scheduler`` or ``train_state``) go
  there; its ``CheckpointManager`` loads them into its own objects of those names.

A loader's position differs by rank. torchtitan keeps each data-parallel rank's loader
under ``dataloader``, pickled (``formats.titan_loader``): an engine global of that name
goes there, each rank's own. Lightning keeps no loader: an iterable named in ``state=``
is refused for it, as is any other iterable for torchtitan.
"""

from __future__ import annotations

import copy
from typing import Any

from ..engine.checkpoint_group import rank_and_world
from ..engine.namespace import user_ns
from ..formats.titan_loader import LOADER, decode, encode, is_encoded
from .rank_run_state import per_rank
from .wire_checkpoint import SaveSpec

__all__ = ["layout_state", "shared_state", "side_files", "trainer_states"]


def shared_state(spec: SaveSpec) -> dict[str, Any]:
    """Name -> ``state_dict()`` of each object named in ``spec.state``, taken now, when
    ``spec.layout`` is another trainer's (fsdp_nb's own keeps them per rank instead).
    torchtitan's ``dataloader`` is this rank's, in torchtitan's form, checked to read back
    weights-only. TypeError for any other iterable (a loader: its position is a rank's own,
    which the layout does not keep)."""
    if spec.layout == "fsdp_nb" or not spec.state:
        return {}
    ns = user_ns()
    titan_loader = spec.layout == "torchtitan" and LOADER in spec.state
    loaders = [n for n in spec.state if per_rank(ns[n]) and not (titan_loader and n == LOADER)]
    if loaders:
        raise TypeError(
            f"{', '.join(map(repr, loaders))} is iterable (a loader or sampler): its position is each rank's "
            f"own, which layout={spec.layout!r} does not keep; save it in fsdp_nb's layout"
        )
    out = {n: copy.deepcopy(ns[n].state_dict()) for n in spec.state}
    if titan_loader:
        rank, ws = rank_and_world()
        out[LOADER] = encode(out[LOADER], rank, ws)
        decode(out[LOADER], rank, ws, spec.url)  # what a load would refuse is refused now, by name
    return out


def layout_state(spec: SaveSpec, msd: dict[str, Any], osd: dict[str, Any] | None,
                 shared: dict[str, Any]) -> dict[str, Any]:
    """What DCP writes for ``spec.layout``: ``{"model", "optim"}`` (fsdp_nb's),
    ``{"model", "optimizer"}`` (Lightning Fabric's), or torchtitan's model keys at the
    top beside ``optimizer`` (flat) and each ``extra`` entry and ``shared`` state as one
    of its states."""
    if spec.layout == "lightning":
        return {"model": msd, **({"optimizer": osd} if osd is not None else {})}
    if spec.layout != "torchtitan":
        return {"model": msd, **({"optim": osd} if osd is not None else {})}
    states = {**spec.meta.get("extra", {}), **shared}
    clash = sorted({k.split(".", 1)[0] for k in msd} & (set(states) | {"optimizer"}))
    if clash:
        raise ValueError(
            f"the model's own names start with {', '.join(map(repr, clash))}, which torchtitan's layout "
            "keeps for the optimizer and the extra states; rename the extra entries"
        )
    return {**msd, **states, **({"optimizer": osd} if osd is not None else {})}


def side_files(spec: SaveSpec, shared: dict[str, Any]) -> dict[str, bytes]:
    """Lightning's ``meta.pt``: everything ``fabric.load`` returns besides the model and
    the optimizer (``extra``, and each ``shared`` state under its name), as
    ``torch.save`` writes it."""
    if spec.layout != "lightning":
        return {}
    import io

    import torch

    buf = io.BytesIO()
    torch.save({**spec.meta.get("extra", {}), **shared}, buf)
    return {"meta.pt": buf.getvalue()}


def trainer_states(extra: dict[str, Any], url: str, weights_only: bool) -> dict[str, Any]:
    """The named objects' states from a trainer's other state ``extra``, as this rank
    takes them: torchtitan's ``dataloader`` becomes this rank's own loader state (read
    with the restricted unpickler unless ``weights_only`` is False); the rest as saved.
    ``url`` names the checkpoint in errors."""
    entry = extra.get(LOADER)
    if entry is None or not is_encoded(entry):
        return extra
    return {**extra, LOADER: decode(entry, *rank_and_world(), url, weights_only)}
