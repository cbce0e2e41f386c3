"""What a ``restart`` will restore, checked before it starts, and what it did, in words.

:func:`restore_plan` reads the checkpoint offline (``fsdp_nb.inspect``): the model it
was saved from, its optimizer and the engine globals each rank kept. Anything a
replaced rank would lack for that load (its cells' optimizer, scheduler, loader) is
refused before any engine is touched, naming ``setup=`` as the way to make them.
:class:`RestartReport` is ``restart``'s result: which ranks were replaced, which models
were built again from initialisation, what came back from the checkpoint, what the
surviving ranks kept. A restart that fails part way says where it stopped and how to
mend it (:func:`stopped_at`), which the session keeps as its ``unfinished`` state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..autosave.memory_copies import MemoryRestore
from ..errors import CheckpointError, RankError
from ..formats.inspect import inspect
from ..formats.run_state import RNG
from ..formats.storage import options_for

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["Progress", "RestartReport", "RestorePlan", "restore_plan", "stopped_at"]

log = logging.getLogger("fsdp_nb")


@dataclass(frozen=True)
class RestorePlan:
    """What ``restart(restore=)`` loads, and into which engine globals."""

    path: str
    """The checkpoint (``"latest"`` resolved)."""
    model: str
    """The wrapped model it is loaded into: the one it was saved from, else the only one
    wrapped, else (a checkpoint that does not say) the last wrapped."""
    optimizer: str | tuple[str, ...] | None
    """Its optimizer's engine global, when the checkpoint keeps one; each of them, when it
    was saved with several (an autosave's ``optimizer=[...]``)."""
    state: tuple[str, ...]
    """Engine globals each rank takes back from its own file."""
    rng: bool
    """Whether each rank's random state comes back too."""
    step: int | None
    """The checkpoint's step (``extra["step"]``, or its name)."""
    parts: tuple[tuple[str, str | None], ...] = ()
    """Of a checkpoint holding several models: each wrapped one it loads, with its
    optimizer (``model`` / ``optimizer`` are the first)."""
    memory: MemoryRestore | None = None
    """Where the in-memory autosave's copies serve it (``path`` is then ``"memory"``)."""
    fallback: str = ""
    """Why the in-memory autosave's copies did not serve it, when there are such copies and
    the disk served instead."""

    def what(self) -> str:
        """The loaded parts, in words."""
        parts = []
        for model, optimizer in self.parts or ((self.model, self.optimizer),):
            parts.append(f"model {model!r}")
            if isinstance(optimizer, tuple):
                parts.append(f"optimizers {', '.join(map(repr, optimizer))}")
            elif optimizer:
                parts.append(f"optimizer {optimizer!r}")
        parts += [repr(n) for n in self.state]
        if self.rng:
            parts.append("each rank's random state")
        if self.memory is not None:
            return f"{', '.join(parts)}: {self.memory.what()}; nothing was read from disk"
        step = f" (step {self.step})" if self.step is not None else ""
        back = f"; from disk, because {self.fallback}" if self.fallback else ""
        return f"{', '.join(parts)} from {self.path}{step}{back}"


def restore_plan(ctx: SessionContext, restore: str | None, dead: list[int],
                 setup: Callable[[], Any] | None) -> RestorePlan | None:
    """The load ``restore`` asks for, checked before anything changes (None: no restore).

    CheckpointError when ``"latest"`` finds nothing or the checkpoint is not valid;
    ValueError when replaced ranks (``dead``) would lack an engine global the load
    needs and no ``setup`` makes it.
    """
    from ..autosave.autosave import latest

    if restore is None:
        return None
    if not isinstance(restore, str) or not restore:
        raise TypeError(f"restore must be a checkpoint path, or 'latest', got {restore!r}")
    fallback = ""
    if restore == "latest" and (spec := ctx.autosave or ctx.suspended_autosave or ctx.last_autosave):
        if spec.in_memory:
            plan, fallback = _from_memory(ctx, spec, dead, setup)
            if plan is not None:
                return plan
    path = latest(ctx) if restore == "latest" else restore
    info = inspect(path, storage_options=options_for(path))
    if not info.valid:
        raise CheckpointError(f"restart(restore={restore!r}): {path} cannot be loaded: {info.problem}")
    names = list(ctx.wraps)
    if not names:
        raise ValueError(
            f"restart(restore={restore!r}) needs a model to load into, but this session "
            "has no wrapped model; call sess.wrap(...) then sess.load(path, model)."
        )
    saved_model, saved_optim = info.saved_from
    if saved_model and saved_model not in names and len(names) > 1 and not info.models:
        raise CheckpointError(
            f"restart(restore={restore!r}): {path} was saved from model {saved_model!r}, which this session "
            f"has not wrapped; it wrapped {', '.join(map(repr, names))}: restart without restore=, then "
            "sess.load(path, model) into the one it belongs to"
        )
    model = saved_model if saved_model in names else names[-1]
    parts = tuple((n, m.get("optimizer")) for n, m in info.models.items() if n in names)
    if info.models and not parts:
        raise CheckpointError(
            f"restart(restore={restore!r}): {path} holds models {', '.join(map(repr, info.models))}, and this "
            f"session wrapped none of them (it wrapped {', '.join(map(repr, names))})"
        )
    if parts:
        (model, saved_optim), parts = parts[0], parts if len(parts) > 1 else ()
    kept = sorted({n for names_ in info.run_state.values() for n in names_})
    state = tuple(n for n in kept if n != RNG)
    optims: list[str | None] = [o for _, o in parts] if parts else [*info.optimizers] or [saved_optim]
    needed = [o for o in optims if o] + list(state)
    if state and info.world_size != ctx.world_size:
        raise CheckpointError(
            f"restart(restore={restore!r}): {path} was written by {info.world_size} ranks and this session has "
            f"{ctx.world_size}; each rank's {', '.join(map(repr, state))} belongs to one of those ranks and cannot "
            "be resharded: load the model and optimizer with sess.load after the restart. Nothing was changed."
        )
    if dead and needed and setup is None:
        raise ValueError(
            f"restart(restore={restore!r}) would load {', '.join(map(repr, needed))} on every rank, but rank(s) "
            f"{', '.join(map(str, dead))} will be new engines, which have none of what cells made there. "
            "Pass setup=fn, a function that makes them on every rank from the rebuilt model (def fn(): "
            f"global {needed[0]}; {needed[0]} = ...), and restart loads their saved state into them. "
            "Nothing was changed."
        )
    several = info.optimizers if info.optimizers and not parts else None  # one model's optimizers, loaded together
    return RestorePlan(path, model, several or saved_optim, state, RNG in kept and info.world_size == ctx.world_size,
                       info.step, parts, fallback=fallback)


def _from_memory(ctx: SessionContext, spec: Any, dead: list[int], setup: Callable[[], Any] | None,
                 ) -> tuple[RestorePlan | None, str]:
    """The plan of a restore from the in-memory autosave's copies, where every rank's state
    is whole in memory at a step no older than the newest disk autosave's; else (None, why
    not), and the disk serves."""
    from ..autosave.autosave import latest
    from ..autosave.memory_copies import find

    if spec.model not in ctx.wraps:
        return None, f"the copies in memory are of model {spec.model!r}, which this session no longer wraps"
    try:
        found = find(ctx, spec)
    except Exception as exc:  # noqa: BLE001 - the disk autosave still serves; the report says why
        log.warning("restart: could not ask the ranks what they hold in memory: %s", exc)
        if spec.root is None:
            raise
        return None, f"the ranks could not say what they hold in memory ({type(exc).__name__}: {exc})"
    if found.step is None:
        if spec.root is None:
            raise CheckpointError(f"restart(restore='latest'): {found.why}, and the autosave writes no disk "
                                  "checkpoint to fall back to (it was armed with in_memory=True and no root). "
                                  "Nothing was changed")
        return None, found.why
    disk = None
    if spec.root is not None:
        try:
            disk = inspect(latest(ctx), storage_options=options_for(spec.root)).step
        except CheckpointError as exc:  # no disk autosave yet: memory is the newest
            log.info("restart: no disk autosave to weigh against memory: %s", exc)
            disk = None
    if disk is not None and disk > found.step:
        return None, f"the disk autosave of step {disk} is newer than the copies in memory (step {found.step})"
    names = (*spec.loaders, *spec.state)
    fresh = sorted(set(dead) | set(found.sources))
    if fresh and setup is None:
        raise ValueError(
            f"restart(restore='latest') would restore {', '.join(map(repr, (*spec.optimizers, *names)))} from memory "
            f"on every rank, but rank(s) {', '.join(map(str, fresh))} are new engines or hold no copy of their own "
            "(a new engine has none of what cells made there). Pass setup=fn, a function that makes them on every rank from the rebuilt model (def fn(): "
            f"global {spec.optimizers[0]}; {spec.optimizers[0]} = ...), and restart restores their state into them. "
            "Nothing was changed."
        )
    optimizer = spec.optimizers if len(spec.optimizers) > 1 else spec.optimizers[0]
    return RestorePlan("memory", spec.model, optimizer, names, True, found.step, memory=found), ""


@dataclass(frozen=True)
class RestartReport:
    """What ``sess.restart()`` did: its repr says it, line by line."""

    replaced: tuple[int, ...]
    """Ranks whose dead engines were replaced by new ones."""
    rebuilt: tuple[str, ...]
    """Models built again from their class and seed on every rank: initial weights, not
    trained ones (a model restored from the checkpoint is not listed)."""
    restored: RestorePlan | None
    """What was loaded from a checkpoint (None: nothing)."""
    repointed: tuple[str, ...]
    """Surviving ranks' optimizers pointed at the rebuilt parameters: their state is from
    before the restart, unless the checkpoint replaced it; for a model in ``rebuilt`` it
    was dropped (its parameters are initial again)."""
    setup: bool
    """Whether ``setup`` ran on every rank."""
    autosave: str
    """What became of the session's autosave ("" when there is none)."""
    survivors: tuple[int, ...]
    """Ranks whose engines lived through it, with every variable their cells made."""

    def lines(self) -> list[str]:
        """What was replaced, rebuilt, restored and kept, one thing a line."""
        if not self.replaced:
            out = ["no engine had died: every rank kept its variables, models and optimizers; "
                   "the process group was re-formed"]
        else:
            ranks = ", ".join(map(str, self.replaced))
            out = [f"rank(s) {ranks} replaced by new engines: the session's imports, classes and functions "
                   "were replayed there; any other variable a cell made on them is gone"]
            if self.survivors:
                out.append(f"rank(s) {', '.join(map(str, self.survivors))} kept every variable their cells made")
        if self.rebuilt:
            out.append(f"rebuilt from initialisation (not the trained weights): {', '.join(self.rebuilt)}")
        if self.repointed:
            out.append(f"optimizers pointed at the rebuilt parameters: {', '.join(self.repointed)}")
        if self.setup:
            out.append("setup ran on every rank")
        if self.restored is not None:
            out.append(f"restored: {self.restored.what()}")
        if self.autosave:
            out.append(self.autosave)
        return out

    def line(self) -> str:
        """The report in one line (the status feed's note)."""
        return "; ".join(self.lines())

    def __repr__(self) -> str:
        return "<restart\n  " + "\n  ".join(self.lines()) + "\n>"


@dataclass
class Progress:
    """How far a ``restart`` got: the step it is in, for what a failure leaves behind."""

    step: str = ""
    """The step under way (``"setup"``, ``"restore"``, ``"rebuild the wrapped models"``...)."""
    changed: bool = False
    """Whether it began to change the session (every check before passed)."""

    def at(self, step: str) -> None:
        """The restart begins ``step``."""
        self.step, self.changed = step, True


def stopped_at(step: str, exc: BaseException, restore: str | None = None) -> str:
    """Where a failed restart stopped, why, and how to mend it, in one sentence: what the
    session's ``unfinished`` state says to every call it refuses.

    Args:
        step: the step that failed (:attr:`Progress.step`).
        exc: its error (a ``RankError`` names each failing rank).
        restore: the failed restart's ``restore=``, which the mending one needs again (the
            models it rebuilt are at their initial weights until it loads).
    """
    if isinstance(exc, RankError) and exc.failures:
        cause = "; ".join(f"{step} on rank {f.rank}: {f.ename}: {f.evalue}" for f in exc.failures[:4])
    else:
        cause = f"{step}: {type(exc).__name__}" + (f": {str(exc).splitlines()[0]}" if str(exc) else "")
    again = f"sess.restart(restore={restore!r}, setup=...)" if restore is not None else "sess.restart(setup=...)"
    if step == "setup":
        mend = (f"the ranks may lack what setup makes. Call {again} again, with a setup that runs "
                "on every rank: a new engine holds the session's imports, classes and functions, not the values "
                "cells made there (make them in setup)")
    else:
        mend = "call sess.restart() again (with the same restore= and setup=) to finish it"
    return f"sess.restart() stopped at its step {step!r} ({cause}); {mend}"
