"""What an autosave refuses on a rank before it arms, by name: an object it cannot place in
the iteration, and an optimizer of the saved model that it would leave out.

An autosave takes each object at a moment of the loop (``rank_autosave``): a loader at
the step's end, before the loop draws the next batch; the rest at the boundary, after the
scheduler and the scaler stepped. It cannot tell a loader from its class unless it is
torch's own (a ``DataLoader``, a ``Sampler``), and a loader taken at the boundary is
taken after the next batch was drawn: a resume would skip that batch. So an object of
another class in ``state=`` that draws batches (``next()``, ``__iter__``, ...) is refused
rather than guessed at; ``loaders=`` says it is one.

An optimizer whose parameters belong to the saved model but that the autosave does not
name would not be saved: a resume would bring the model back with that optimizer's state
from another step, silently. It is refused by name too.
"""

from __future__ import annotations

from typing import Any

from ..checkpoints.rank_run_state import is_torch_loader, loader_method
from ..engine.namespace import user_ns
from .wire_autosave import AutosaveSpec

__all__ = ["left_out_optimizers", "loader_lookalikes", "refusal"]


def loader_lookalikes(names: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, the batch-drawing method it has) of each engine global in ``names`` that
    looks like a loader and is not one of torch's (``is_torch_loader``)."""
    ns = user_ns()
    found = []
    for name in names:
        obj = ns[name]
        method = None if is_torch_loader(obj) else loader_method(obj)
        if method is not None:
            found.append((name, method))
    return found


def left_out_optimizers(model: Any, optims: list[Any], spec: AutosaveSpec) -> list[str]:
    """The engine globals (not ``_``-named: IPython's output cache) holding an optimizer
    of ``model``'s parameters that is none of ``optims`` (the ones ``spec`` names)."""
    import torch

    params = {id(p) for p in model.parameters()}
    named = {id(o) for o in optims}
    found: list[str] = []
    for name, obj in list(user_ns().items()):
        if name.startswith("_") or name in spec.optimizers or not isinstance(obj, torch.optim.Optimizer):
            continue
        if id(obj) in named:
            continue
        if any(id(p) in params for group in obj.param_groups for p in group["params"]):
            found.append(name)
    return sorted(found)


def refusal(spec: AutosaveSpec, lookalikes: list[tuple[str, str]], left_out: list[str]) -> Exception | None:
    """The error that refuses ``spec`` (None: nothing to refuse), saying what was wrong,
    what is allowed, and that nothing changed."""
    if lookalikes:
        said = ", ".join(f"{n!r} (a {type(user_ns()[n]).__name__} with {m}())" for n, m in lookalikes)
        return TypeError(
            f"autosave: state= names {said}, which looks like a data loader: autosave cannot tell when the loop "
            "draws from it, and taking it at the iteration's boundary (with the scheduler) would take it after "
            "the next batch was drawn, so a resume would skip that batch. If the loop draws batches from it, name "
            "it in loaders=[...] instead: its state is then taken at each step's end, before the next batch "
            "(a torch DataLoader or Sampler in state= is placed so without asking). If the loop does not draw from "
            "it, leave it out of the autosave. Nothing changed: the autosave that was running, if any, goes on"
        )
    if left_out:
        named = ", ".join(map(repr, spec.optimizers))
        return ValueError(
            f"autosave of model {spec.model!r}: engine global(s) {', '.join(map(repr, left_out))} hold an optimizer "
            f"of its parameters too, and optimizer= names only {named}: a resume would bring back the model without "
            "that optimizer's state (its moments, its step count). Name every optimizer of the model, "
            f"optimizer=[{', '.join(map(repr, (*spec.optimizers, *left_out)))}], or del one the loop no longer "
            "steps. Nothing changed: the autosave that was running, if any, goes on"
        )
    return None
