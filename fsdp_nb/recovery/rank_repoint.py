"""Optimizers made for a model that ``restart`` built again, pointed at its new parameters.

When engines are replaced, every rank builds each wrapped model anew, so the optimizers
a surviving rank's cells made still hold the old parameters: ``step()`` would update
tensors no model uses. :func:`remember` notes, before the rebuild, which model and
name each parameter had; :func:`repoint` then swaps every engine global optimizer's
parameters (and the state kept under them) for the rebuilt model's of the same name.
The state it keeps is from before the restart, and ``restart(restore=)`` replaces it; a
model rebuilt from initialisation with nothing restored loses its parameters' state.
"""

from __future__ import annotations

from typing import Any

from ..engine.namespace import user_ns
from ..engine.registry import Part, part
from ..models.rank_wrap import wrapped

__all__ = ["remember", "repoint"]

class Remembered(Part):
    """Which wrapped model and name each parameter had before ``restart`` rebuilt the models
    (the registry's part for re-pointing optimizers)."""

    def __init__(self) -> None:
        self.before: dict[int, tuple[str, str]] = {}
        """id(parameter) -> (model, parameter name)."""

"""id(parameter) -> (model, parameter name), of the models about to be rebuilt. The
optimizers hold those parameters, so the ids stay theirs until :func:`repoint`."""


def remember() -> None:
    """Note which wrapped model and name each of this rank's parameters has."""
    part(Remembered).before.clear()
    for model, w in wrapped().items():
        for fqn, p in w.module.named_parameters():
            part(Remembered).before[id(p)] = (model, fqn)


def repoint(fresh: tuple[str, ...] = ()) -> list[str]:
    """Point every engine global optimizer that held a remembered parameter at the
    rebuilt one of the same model and name; the names of those re-pointed.

    Args:
        fresh: models rebuilt from initialisation, with nothing restored into them: the
            optimizer state of their parameters is dropped, as a replaced rank has none
            (trained moments applied to initial weights would differ from rank to rank).
    """
    import torch

    new = {(model, fqn): p for model, w in wrapped().items() for fqn, p in w.module.named_parameters()}
    done = []
    for name, obj in list(user_ns().items()):
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        swap: dict[int, Any] = {}
        for group in obj.param_groups:
            for i, p in enumerate(group["params"]):
                key = part(Remembered).before.get(id(p))
                if key is not None and key in new:
                    swap[id(p)] = new[key]
                    group["params"][i] = new[key]
        if swap:
            kept = {id(p) for p in obj.state if id(p) in swap and part(Remembered).before[id(p)][0] not in fresh}
            obj.state.update({swap[id(p)]: s for p, s in list(obj.state.items()) if id(p) in kept})
            for p in [p for p in list(obj.state) if id(p) in swap]:
                del obj.state[p]
            done.append(name)
    part(Remembered).before.clear()
    return sorted(done)
