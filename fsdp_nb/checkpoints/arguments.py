"""The notebook side of a save or load's arguments and answers.

``model_name`` and ``check_optimizer`` turn what the user passed into engine global
names before anything is sent; ``raise_outcomes`` turns the ranks' agreed
:class:`~fsdp_nb.checkpoints.wire_checkpoint.Outcome` into one error in the notebook.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from .wire_checkpoint import Outcome

__all__ = [
    "check_layout", "check_optimizer", "check_shared_state", "check_state", "check_titan_loader", "model_name", "models_and_optimizers",
    "optimizer_group", "raise_outcomes", "several_optimizers",
]


def raise_outcomes(outs: list[Outcome]) -> None:
    """Raise the first failed rank's error as its own class (they agree by construction)."""
    for out in outs:
        if not out.ok:
            cls = out.error if isinstance(out.error, type) and issubclass(out.error, Exception) else CheckpointError
            raise cls(out.message or "checkpoint operation failed")


def model_name(model: Any) -> str:
    """The engine global name of ``model`` (a ShardedModel or a str)."""
    if isinstance(model, str):
        if not model.isidentifier():
            raise ValueError(f"model name {model!r} is not a Python identifier")
        return model
    name = getattr(model, "name", None)
    if isinstance(name, str) and name:
        return name
    raise TypeError(
        f"model must be a ShardedModel (from sess.wrap) or the engine global name of an FSDP2 "
        f"module (str), got {type(model).__name__}"
    )


def models_and_optimizers(model: Any, optimizer: Any) -> tuple[str, str | None, tuple[tuple[str, str | None], ...]]:
    """(the first model's name, its optimizer's, every (model, optimizer) pair when there
    are several) of what a save or load was given: one model and optimizer, one model and
    a list of its optimizers (the first here; :func:`several_optimizers` gives them all),
    or a list of models with a list of as many optimizers (None where a model has none)."""
    from ..formats.layouts import check_part_names

    if not isinstance(model, (list, tuple)):
        if isinstance(optimizer, (list, tuple)):  # several optimizers of the one model (optimizer_group)
            return model_name(model), optimizer_group(optimizer)[0], ()
        return model_name(model), check_optimizer(optimizer), ()
    names = [model_name(m) for m in model]
    if not names:
        raise ValueError("model is an empty list: pass a model, or a list of them")
    if len(set(names)) != len(names):
        raise ValueError(f"model names a model twice: {names}")
    if optimizer is None:
        optims: list[str | None] = [None] * len(names)
    elif isinstance(optimizer, (list, tuple)) and len(optimizer) == len(names):
        optims = [check_optimizer(o) for o in optimizer]
    else:
        raise TypeError(
            f"with {len(names)} models, optimizer is a list of as many engine global names (None for a model "
            f"without one), in the models' order; got {optimizer!r}"
        )
    taken = [o for o in optims if o is not None]
    if len(set(taken)) != len(taken):
        raise ValueError(f"optimizer names an optimizer twice: {optims}")
    if len(names) == 1:
        return names[0], optims[0], ()
    check_part_names(names)
    return names[0], optims[0], tuple(zip(names, optims))


def several_optimizers(model: Any, optimizer: Any) -> tuple[str, ...]:
    """Of one ``model`` given a list of optimizers (its parameters split among several, as
    an embedding's and the rest's): their names, checked (``SaveSpec.optimizers``); else
    ``()``: one optimizer, or a list of models (``models_and_optimizers``)."""
    if isinstance(model, (list, tuple)) or not isinstance(optimizer, (list, tuple)):
        return ()
    names = optimizer_group(optimizer)
    return names if len(names) > 1 else ()


def optimizer_group(optimizer: list[Any] | tuple[Any, ...]) -> tuple[str, ...]:
    """A list of optimizers of one model as engine global names: TypeError / ValueError
    naming an entry that is not one, or a name given twice, before any rank is asked."""
    if not optimizer:
        raise ValueError("optimizer is an empty list: name the model's optimizer, or each of them")
    if any(o is None for o in optimizer):
        raise TypeError(f"optimizer holds None, {list(optimizer)!r}: for one model, name each of its optimizers")
    names = tuple(o for o in (check_optimizer(o) for o in optimizer) if o is not None)
    if len(set(names)) != len(names):
        raise ValueError(f"optimizer names an optimizer twice: {list(names)}")
    return names


def check_optimizer(optimizer: Any) -> str | None:
    """``optimizer`` as an engine global name (str) or None; TypeError otherwise."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, str) or not optimizer.isidentifier():
        raise TypeError(
            f"optimizer must be the engine global name of a torch.optim.Optimizer (str), got {optimizer!r}"
        )
    return optimizer


def check_state(state: Any) -> tuple[str, ...]:
    """``state`` (engine global names, or None) as a tuple of names; TypeError / ValueError
    naming the entry that is not one, before any rank is asked."""
    from ..formats.run_state import RNG

    if state is None:
        return ()
    if isinstance(state, str) or not isinstance(state, (list, tuple)):
        raise TypeError(
            f"state must be a list of engine global names (state=['scheduler', 'loader']), got {state!r}"
        )
    for name in state:
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"state= holds {name!r}, which is not the engine global name of an object (str)")
        if name == RNG:
            raise ValueError(
                f"state= names {name!r}, which is what each rank's random state goes by: it is kept by every "
                "save and put back by load(rng=...); name your object otherwise"
            )
    if len(set(state)) != len(state):
        raise ValueError(f"state= names an object twice: {list(state)}")
    return tuple(state)


def check_shared_state(names: tuple[str, ...], layout: str, sharded: bool, extra: dict[str, Any]) -> None:
    """Refuse ``state=`` names a save cannot keep, before any work.

    fsdp_nb's layout keeps them per rank in a sharded folder; a full file has no place
    for them. Lightning's keeps rank 0's ``state_dict()`` of each in ``meta.pt`` beside
    ``extra``, torchtitan's as its own states, which are ``train_state``, ``lr_scheduler``
    and ``dataloader`` (``checkpoints.rank_layout_state``): a name may not be an ``extra`` key too.
    """
    from ..formats.layouts import TITAN_STATES

    if not names:
        return
    if not sharded:
        raise ValueError(
            "state= is kept in a sharded checkpoint; sharded=False writes one file for every rank: "
            "save it sharded (nothing was written)"
        )
    if layout == "torchtitan" and (odd := [n for n in names if n not in TITAN_STATES]):
        raise ValueError(
            f"with layout='torchtitan', state= names torchtitan's own states, {', '.join(TITAN_STATES)} "
            f"(engine globals of those names, which its CheckpointManager loads by name); got {odd} "
            "(nothing was written)"
        )
    if layout != "fsdp_nb" and (both := sorted(set(names) & set(extra))):
        raise ValueError(f"{both} is named in both state= and extra=; layout={layout!r} keeps them side by side")


def check_titan_loader(names: tuple[str, ...], layout: str, model: Any) -> None:
    """Refuse torchtitan's ``dataloader`` for a model with more than one mesh dimension,
    before any work: torchtitan keys each loader by its data-parallel rank, and ranks of
    one tensor-parallel group share one; fsdp_nb writes one per rank (its rank and world
    size), which is torchtitan's key only where every rank is its own data-parallel rank.

    Args:
        names: the engine globals ``state=`` names.
        layout: the save's layout.
        model: the ``ShardedModel`` saved (None: not known here).
    """
    from ..formats.titan_loader import LOADER

    dims = getattr(getattr(model, "summary", None), "mesh_dims", ()) or ()
    if layout == "torchtitan" and LOADER in names and len(dims) > 1:
        raise ValueError(
            f"torchtitan keeps its 'dataloader' per data-parallel rank, and this model's mesh is {dims}: ranks "
            "of one tensor- or context-parallel group share a data-parallel rank, which fsdp_nb does not write "
            "yet; leave 'dataloader' out of state= (nothing was saved or loaded)"
        )


def check_layout(layout: Any, path: str, sharded: bool, extra: dict[str, Any]) -> None:
    """Refuse a ``sess.save(layout=)`` its trainer could not resume from, before any work.

    ``"lightning"`` and ``"torchtitan"`` are DCP folders (``sharded=True``). torchtitan
    resumes from ``<folder>/step-<N>`` and loads each top-level entry of the folder as
    one of its states (``train_state``, ``lr_scheduler``, ``dataloader``): each ``extra``
    entry must be a dict, and none may be named ``optimizer``.
    """
    import posixpath
    import re

    from ..formats.layouts import WRITABLE

    if layout not in WRITABLE:
        raise ValueError(f"layout must be one of {', '.join(map(repr, WRITABLE))}, got {layout!r}")
    if layout == "fsdp_nb":
        return
    if not sharded:
        raise ValueError(f"layout={layout!r} is a sharded folder; sharded=False writes fsdp_nb's own full file")
    if layout != "torchtitan":
        return
    name = posixpath.basename(path.rstrip("/"))
    if not re.fullmatch(r"step-\d+", name):
        raise ValueError(
            f"torchtitan resumes from a folder named step-<N> (its checkpoint folder holds one per step); "
            f"{path!r} ends in {name!r}: name it like .../checkpoint/step-100"
        )
    for key, value in extra.items():
        if key == "optimizer" or not isinstance(value, dict):
            raise ValueError(
                f"with layout='torchtitan' each extra entry is one state of the trainer, a dict under "
                f"its own name (extra={{'train_state': {{'step': 100, 'ntokens_seen': 0}}}}); "
                f"extra[{key!r}] is {'a name torchtitan keeps for the optimizer' if key == 'optimizer' else type(value).__name__}"
            )
