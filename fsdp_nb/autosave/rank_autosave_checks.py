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

from ..checkpoints.rank_run_state import capture, check_objects, is_torch_loader, loader_method
from ..checkpoints.rank_save import named_objects
from ..engine.checkpoint_group import gathered, rank_and_world
from ..engine.namespace import user_ns
from ..formats.run_state import decode, encode, state_file
from ..memory.rank_memory_kinds import copy_bytes
from .wire_autosave import AutosaveSpec

__all__ = ["MARGIN", "agreed", "checked", "copies_refusal", "left_out_optimizers", "loader_lookalikes", "refusal"]

MARGIN = 0.2
"""The share of a host's available memory the in-memory autosave leaves free: its copies
may take the rest, and no more (the room a loader's workers, a save's staging and the
kernel's page cache need)."""


def checked(spec: AutosaveSpec) -> tuple[Any, list[Any], tuple[str, ...]]:
    """(the model, its optimizers, the engine globals taken as loaders) that ``spec`` names
    on this rank, each checked: NameError / TypeError naming what is missing or wrong, the
    refusals of :func:`refusal`, and UnsafeCheckpointError for a ``state=`` object whose
    ``state_dict`` a load would refuse (every save would fail)."""
    model = named_objects(spec.model, None)[0]
    optims = [named_objects(spec.model, o)[1] for o in spec.optimizers]
    check_objects((*spec.loaders, *spec.state))
    ns = user_ns()
    if problem := refusal(spec, loader_lookalikes(spec.state), left_out_optimizers(model, optims, spec)):
        raise problem
    loaders = (*spec.loaders, *(n for n in spec.state if is_torch_loader(ns[n])))
    # not a loader's: a StatefulDataLoader's state_dict() can start an iterator, which moves it
    plain = [n for n in spec.state if n not in loaders]
    decode(encode(capture(plain, False, None)), spec.root or "memory", state_file(rank_and_world()[0]))
    return model, optims, loaders


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


def _gib(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def copies_refusal(spec: AutosaveSpec, model: Any | None, optims: list[Any]) -> tuple[Exception | None, int]:
    """Whether the in-memory autosave fits, agreed by every rank (a collective; ``model``
    None: this rank refused already, and takes part). Each rank keeps two generations of
    its own state and two of its ward's; the ranks of one host together may take its
    available memory less :data:`MARGIN`. (The error naming the host, what the copies need
    and what it has, None where they fit; the largest rank's state in bytes.)"""
    import socket

    import psutil

    _, world = rank_and_world()
    if world < 2:
        return ValueError("autosave(in_memory=True) keeps each rank's state in a peer's memory, and this session "
                          "has one rank: there is no peer. Use sess.autosave(root, every=N) to save to disk, or "
                          "resize to 2 ranks or more first. Nothing changed"), 0
    if len(spec.buddies) != world:
        return ValueError(f"the buddy map {spec.buddies} names {len(spec.buddies)} ranks and the group has {world}"), 0
    mine = copy_bytes(model, optims) if model is not None else 0
    # a GPU rank's own copies are pinned: the caching host allocator rounds each up to a
    # power of two; a ward's copies are received into plain host memory
    pinned = model is not None and any(p.is_cuda for p in model.parameters())
    said = gathered((socket.gethostname(), mine, pinned, psutil.virtual_memory().available))
    need: dict[str, int] = {}
    avail: dict[str, int] = {}
    for r, (host, own, own_pinned, free) in enumerate(said):
        wards = [w for w, b in enumerate(spec.buddies) if b == r and w != r]
        need[host] = need.get(host, 0) + 2 * own * (2 if own_pinned else 1) + 2 * sum(said[w][1] for w in wards)
        avail[host] = free
    for host, n in need.items():
        room = int(avail[host] * (1 - MARGIN))
        if n > room:
            return MemoryError(
                f"autosave(in_memory=True): the copies in memory need {_gib(n)} on host {host} (two "
                f"generations of each of its ranks' state and of the state each keeps for its buddy) and it has "
                f"{_gib(avail[host])} available, of which the copies may take {_gib(room)} "
                f"({int(MARGIN * 100)}% is left free). Save to disk only (in_memory=False), shard over more ranks, "
                "or free host memory. Nothing changed"
            ), 0
    return None, max(own for _, own, _, _ in said)


def agreed(held: list[tuple[str, int, bool, int] | None]) -> tuple[bool, int, bool, int]:
    """What the ranks agree on, from each rank's ``(run, step, due, branch)`` (None: no
    autosave armed there): (whether every rank holds the same autosave; the step to count
    on from, the highest any reached; whether a save stays due, only where it is due on
    every rank at one step; the branch, the highest). Ranks that hold different autosaves
    (a rank that joined holds none) all stop theirs, for the notebook to arm again."""
    if len({h[0] if h else None for h in held}) > 1 or any(h is None for h in held):
        return False, 0, False, 0
    steps = {h[1] for h in held if h}
    return (True, max(steps), len(steps) == 1 and all(h[2] for h in held if h),
            max(h[3] for h in held if h))
