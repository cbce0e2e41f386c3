"""``sess.autosave``: the ranks save the run themselves, every N optimizer steps.

Checked here before any rank is asked; then every rank arms it
(``fsdp_nb.autosave.rank_autosave``) and the spec is kept on the session context, so that
``restart`` re-arms it on the rebuilt objects, going on from the restored step, and
``restart(restore="latest")`` knows where to look (:func:`latest`). While it is armed,
the session calls :func:`finish_cell` after each user call (``SessionContext.after_call``),
so a save that fell due at a cell's last step is written at the cell's end.

A restart that rebuilds the models at their initial weights without restoring a
checkpoint (a plain ``sess.restart()`` after a dead engine, or the session's own restart
after a rank that did not return) suspends it (:func:`suspend`): saving the rebuilt
models would put initial weights over the run's checkpoints. The next
``restart(restore=...)`` arms it again from the restored step.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..checkpoints.arguments import (
    check_optimizer,
    check_state,
    model_name,
    optimizer_group,
    raise_outcomes,
)
from ..checkpoints.async_saves import wait_pending
from ..errors import CheckpointError
from ..formats.listing import list_checkpoints
from ..formats.metadata import base_metadata
from ..formats.storage import options_for, url_to_fs
from .memory_copies import buddy_map, in_memory_line
from .wire_autosave import AutosaveSpec, AutosaveState

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["Autosaving", "adopt", "arm", "autosave", "describe", "finish_cell", "latest", "stop", "suspend"]

log = logging.getLogger("fsdp_nb")

SUSPENDED = ("suspended: a restart rebuilt the models at their initial weights, which it must not save over the "
             "run's checkpoints; sess.restart(restore='latest', setup=...) restores the run and arms it again from "
             "the restored step (sess.stop_autosave() forgets it)")
"""What a suspended autosave says (``sess.autosave()``, the restart's report)."""


@dataclass(frozen=True)
class Autosaving:
    """What ``sess.autosave`` set going (its repr says it in one line)."""

    root: str | None
    """The folder of ``step-<N>`` checkpoints (None: copies in memory only)."""
    every: int | None
    """Optimizer steps between disk saves (None: copies in memory only)."""
    model: str
    """The model saved."""
    optimizers: tuple[str, ...]
    """Its optimizers, whose steps are counted."""
    state: tuple[str, ...]
    """Engine globals kept per rank with each rank's random state."""
    keep_last: int | None
    """How many checkpoints are kept under ``root`` (None: all)."""
    ranks: tuple[AutosaveState | None, ...] = ()
    """Each rank's step count, last committed save and save in flight when asked
    (``sess.autosave()``), by rank; None for a rank whose engine is dead."""
    loaders: tuple[str, ...] = ()
    """Engine globals the loop draws batches from, taken at each step's end."""
    suspended: bool = False
    """A restart rebuilt the models: no rank saves until ``restart(restore=...)`` arms it again."""
    in_memory: bool = False
    """Each step's state is also copied into host memory, each rank's own and its buddy's."""
    buddies: tuple[int, ...] = ()
    """With ``in_memory``: ``buddies[r]`` keeps rank r's copies."""

    def __repr__(self) -> str:
        kept = f", keeping the last {self.keep_last}" if self.keep_last else ""
        named = ", ".join([self.model, *self.optimizers, *self.loaders, *self.state, "each rank's random state"])
        to = f"to {self.root} every {self.every} optimizer steps{kept}" if self.root else ""
        if self.in_memory:
            to += (", and " if to else "") + "into memory after every step (each rank's own copy and its buddy's: " + (
                ", ".join(f"{r}->{b}" for r, b in enumerate(self.buddies))) + ")"
        where = ""
        if self.suspended:
            where = f"; {SUSPENDED}"
        elif self.ranks and self.ranks[0] is not None:
            r0 = self.ranks[0]
            where = f"; at step {r0.step}, last save {r0.saved or 'none yet'}"
            if r0.writing:
                where += f", writing {r0.writing}"
            failed = [r.failed for r in self.ranks if r is not None and r.failed]
            if failed:
                where += f"; a save FAILED: {failed[0]}"
            where += in_memory_line(self.ranks)
        return f"<autosave of {named} {to}{where}>"


def _positive(name: str, value: Any, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if none_ok else ''}, got {value!r}")


def _optimizers(optimizer: Any) -> tuple[str, ...]:
    if isinstance(optimizer, (list, tuple)):
        return optimizer_group(optimizer)
    optim = check_optimizer(optimizer)
    if optim is None:
        raise TypeError("autosave counts the optimizer's steps: pass optimizer='<its engine global name>' "
                        "(or a list of them, when several step the model's parameters)")
    return (optim,)


def _loaders(loaders: Any, state: tuple[str, ...]) -> tuple[str, ...]:
    if loaders is None:
        return ()
    if isinstance(loaders, str) or not isinstance(loaders, (list, tuple)):
        raise TypeError(f"loaders must be a list of engine global names (loaders=['loader']), got {loaders!r}")
    names = check_state(list(loaders))
    if both := [n for n in names if n in state]:
        raise ValueError(
            f"{', '.join(map(repr, both))} is named in both loaders= and state=: a loader is taken at the step's "
            "end, the rest at the iteration's boundary; name it once (loaders= if the loop draws batches from it)"
        )
    return names


def autosave(ctx: SessionContext, root: str | None, *, every: int | None, model: Any,
             optimizer: str | list[str] | tuple[str, ...], state: list[str] | tuple[str, ...] | None = None,
             loaders: list[str] | tuple[str, ...] | None = None, keep_last: int | None = None,
             in_memory: bool = False) -> Autosaving:
    """Arm the ranks to save ``model``, its ``optimizer`` (one or several), ``loaders`` and
    ``state`` under ``root`` after every ``every``-th optimizer step, and with
    ``in_memory`` to copy them into host memory after every step (``Session.autosave``);
    each argument is checked before any rank is asked, and each rank checks the names
    (and, in memory, the room) before it arms."""
    if not isinstance(in_memory, bool):
        raise TypeError(f"in_memory must be True or False, got {in_memory!r}")
    if root is not None or not in_memory:
        if not isinstance(root, str) or not root:
            raise TypeError(f"root must be a folder path or fsspec URL (str), got {root!r}")
        _positive("every", every)
    elif every is not None:
        raise TypeError("autosave(in_memory=True) with no root copies after every step: every= counts steps "
                        "between disk saves, so pass root= with it, or leave every= out")
    _positive("keep_last", keep_last, none_ok=True)
    name = model_name(model)
    optims = _optimizers(optimizer)
    names = check_state(state)
    loader_names = _loaders(loaders, names)
    if root is not None:
        url_to_fs(root)
    wait_pending(ctx)
    meta = {k: v for k, v in base_metadata({}, "sharded").items() if k in ("format", "kind", "versions")}
    spec = AutosaveSpec(root=root, storage_options=options_for(root) if root else {}, every=every or 1, model=name,
                        optimizers=optims, state=names, loaders=loader_names, keep_last=keep_last,
                        run=uuid.uuid4().hex[:8], meta=meta, in_memory=in_memory)  # arm() maps the buddies
    arm(ctx, spec)
    assert ctx.autosave is not None  # arm() adopted it
    return Autosaving(root, spec.every if root else None, name, optims, names, keep_last, loaders=loader_names,
                      in_memory=in_memory, buddies=ctx.autosave.buddies)


def arm(ctx: SessionContext, spec: AutosaveSpec) -> None:
    """Arm ``spec`` on every rank (each checks its names first), and keep it on ``ctx``."""
    from . import rank_autosave as engine_autosave

    if spec.in_memory:  # the hosts of the ranks now (a restart's or resize's new engines)
        hosts = ctx.cluster.hosts
        spec = dataclasses.replace(spec, buddies=buddy_map(hosts))
        if same := [(r, b) for r, b in enumerate(spec.buddies) if hosts[r] == hosts[b] and len(set(hosts)) > 1]:
            log.warning("autosave in memory: no buddy map puts every rank's copy on another host here; %s, so "
                        "that host's death takes both", ", ".join(f"rank {b} keeps rank {r}'s copy on its host"
                                                                 for r, b in same))
    d = ctx.dispatcher
    raise_outcomes(d.gather(d.apply("arm autosave", engine_autosave.arm, args=(spec,))))
    adopt(ctx, spec)


def adopt(ctx: SessionContext, spec: AutosaveSpec | None) -> None:
    """Keep ``spec``, armed on the ranks, as the session's autosave (None: none is), and
    finish each user call with :func:`finish_cell` while it is armed."""
    ctx.autosave = spec
    ctx.suspended_autosave = None
    if spec is None:
        _unhook(ctx)
        return
    ctx.last_autosave = spec
    if finish_cell not in ctx.after_call:
        ctx.after_call.append(finish_cell)


def _unhook(ctx: SessionContext) -> None:
    if finish_cell in ctx.after_call:
        ctx.after_call.remove(finish_cell)


def finish_cell(ctx: SessionContext, ok: bool) -> None:
    """After a user call (``SessionContext.after_call``): ``ok``, it succeeded on every
    rank, so a save that fell due at its last step is written now, and with
    ``in_memory`` the last step is copied, where every rank has it at one step (else it
    is dropped on every rank); after a failed call a due save and a pending copy are
    dropped on every rank (``rank_autosave.finish_cell``). One call to the ranks when
    nothing is due, two when something is."""
    from . import rank_autosave as engine_autosave

    if ctx.autosave is None:
        return
    d = ctx.dispatcher
    said = d.gather(d.apply("autosave at the cell's end", engine_autosave.finish_cell, args=(ok,), fast=True))
    held = [s for s in said if s is not None]
    if not held:
        return
    steps = {s[0] for s in held}
    if len(held) < len(said) or len(steps) > 1:  # a failure on one rank left the counts apart
        log.warning("fsdp_nb: the ranks' autosave counts differ after the call (%s): every rank counts on from %d",
                    [s[0] if s else None for s in said], max(steps))
        d.gather(d.apply("autosave count", engine_autosave.count_from, args=(max(steps),), fast=True))
        return
    due, copy = [s[1] for s in held], [s[2] for s in held]
    if not ok or not any(due + copy):
        return
    step, save, copy_all = held[0][0], all(due), all(copy)
    if save or copy_all:
        what = " and ".join(w for w, on in (("autosave", save), ("copy in memory", copy_all)) if on)
        d.gather(d.apply(f"{what} of step {step}", engine_autosave.write_due, args=(step, save, copy_all),
                         fast=not copy_all))
    if (any(due) and not save) or (any(copy) and not copy_all):
        why = "the ranks did not all have it due at the cell's end"
        d.gather(d.apply("drop the autosave due", engine_autosave.drop_due, args=(why,), fast=True))


def stop(ctx: SessionContext) -> None:
    """Disarm every rank's autosave (its saves still being written finish), or forget a
    suspended one; either way the copies in memory are freed."""
    from . import rank_autosave as engine_autosave

    spec = ctx.autosave or ctx.suspended_autosave
    if spec is not None and (ctx.autosave is not None or spec.in_memory):
        d = ctx.dispatcher
        d.gather(d.apply("stop autosave", engine_autosave.disarm, args=(spec.in_memory,)))
    adopt(ctx, None)


def suspend(ctx: SessionContext) -> None:
    """Disarm every rank's autosave and keep its spec, suspended, for the next
    ``restart(restore=...)`` to arm again (the models were rebuilt at initial weights)."""
    from . import rank_autosave as engine_autosave

    spec = ctx.autosave or ctx.suspended_autosave
    d = ctx.plain_dispatcher
    d.gather(d.apply("suspend autosave", engine_autosave.disarm))
    adopt(ctx, None)
    ctx.suspended_autosave = spec


def describe(ctx: SessionContext) -> Autosaving | None:
    """The session's autosave with each rank's step count, last committed save and save in
    flight; a suspended one says so (None: off)."""
    from . import rank_autosave as engine_autosave

    spec = ctx.autosave or ctx.suspended_autosave
    if spec is None:
        return None
    ranks: tuple[AutosaveState | None, ...] = ()
    if ctx.autosave is not None:
        d = ctx.dispatcher
        dead = set(ctx.cluster.dead_ranks())  # a degraded session: what the live ranks say
        live = [r for r in range(ctx.world_size) if r not in dead]
        said = dict(zip(live, d.gather(d.apply("autosave status", engine_autosave.status, ranks=live))))
        ranks = tuple(said.get(r) for r in range(ctx.world_size))
    return Autosaving(spec.root, spec.every if spec.root else None, spec.model, spec.optimizers, spec.state,
                      spec.keep_last, ranks, spec.loaders, suspended=ctx.autosave is None, in_memory=spec.in_memory,
                      buddies=spec.buddies)


def latest(ctx: SessionContext) -> str:
    """The newest valid checkpoint under the autosave's root (``restart(restore="latest")``),
    the running one's, a suspended one's or the last one's; CheckpointError saying why
    there is none."""
    spec = ctx.autosave or ctx.suspended_autosave or ctx.last_autosave  # a stopped one's checkpoints are still there
    if spec is None:
        raise CheckpointError(
            "restore='latest' means the newest checkpoint sess.autosave(...) wrote, but this session has had no "
            "autosave; pass the path of a checkpoint instead"
        )
    if spec.root is None:
        raise CheckpointError("restore='latest': the autosave keeps copies in memory only (no root=), and no "
                              "generation of them survives for every rank")
    found = [i for i in list_checkpoints(spec.root, storage_options=spec.storage_options) if i.valid]
    if not found:
        raise CheckpointError(f"restore='latest': no complete checkpoint under {spec.root!r} yet")
    # the newest written, not the highest step: after a run went back to an earlier step,
    # the steps it abandoned are older than what it saved since
    return max(found, key=lambda i: i.created or 0.0).path
