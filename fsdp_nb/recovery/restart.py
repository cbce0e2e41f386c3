"""Re-forming the process group and restarting ranks, keeping what can be kept.

``reform``: every rank joins a new group on a fresh port, keeping the rank order, and
every DeviceMesh / FSDP2 module on the ranks is re-pointed at the new groups
(``fsdp_nb.engine.health.rebind_groups``): variables, models and optimizers stay.
``restart``: dead engines are replaced under the same ranks (``EngineCluster.replace``),
the group is re-formed and recorded wraps are replayed. Both run their engine calls
through the session's plain dispatcher, never through the one that is recovering.
The failure policy that calls them on errors is ``fsdp_nb.recovery.failure_policy``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..engine import health as _health
from ..engine import namespace as _ns
from ..errors import add_note
from ..runtime import rendezvous
from ..runtime.phases import PhaseClock
from ..runtime.shipping import by_value
from . import regroup
from .restart_report import Progress, RestartReport, RestorePlan, restore_plan, stopped_at

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["RestartReport", "reform", "restart"]

log = logging.getLogger("fsdp_nb")


def reform(ctx: SessionContext, tell: bool = True) -> None:
    """Every rank joins a new process group on a fresh port, keeping the rank order,
    then DeviceMeshes and FSDP2 modules on the ranks are re-pointed at the new groups.
    ``tell``: then tell every rank's features (``regroup.reformed``); a restart tells them
    itself, once the models are built again."""
    if ctx.backend is None:  # set when the group was first formed
        raise RuntimeError("this session's process group was never formed: there is none to re-form")
    d = ctx.plain_dispatcher
    probes = rendezvous.probe_engines(ctx.cluster, d, timeout=60)
    rendezvous.join_group(
        ctx.cluster, d, probes, ctx.backend,
        pg_timeout=ctx.pg_timeout, threads=ctx.omp_threads, timeout=120,
    )
    parts = d.gather(d.apply("list mesh groups", _health.mesh_partitions), 60)
    union = sorted({rows for ps in parts for rows in ps})
    d.gather(d.apply("rebind meshes", _health.rebind_groups, args=(union,)), 120)
    if tell:
        regroup.reformed(ctx)


def restart(ctx: SessionContext, restore: str | None = None, drop: tuple[str, ...] = (),
            setup: Callable[[], Any] | None = None) -> RestartReport:
    """Bring back the same ranks and rebuild the session; what was rebuilt, restored and
    kept (:class:`RestartReport`).

    Dead engines are replaced (new engine, same rank), every rank joins a new process
    group, the replaced ranks get the session's imports, classes and functions
    (``fsdp_nb.runtime.definitions``), and models wrapped with ``sess.wrap`` are built
    again on every rank from their class and seed (``fsdp_nb.models.wrap.replay_wraps``):
    initial weights, not trained ones. The surviving ranks' optimizers are pointed at
    the rebuilt parameters (``fsdp_nb.recovery.rank_repoint``). On a healthy session this only
    re-forms the group, keeping every rank's state.

    ``setup``: a function run on every rank next, which makes the objects the training
    cell needs (an optimizer, a scheduler, a loader): a replaced rank has none of what
    cells made on it. ``restore``: a checkpoint path, or ``"latest"`` (the newest the
    session's autosave wrote, or its copies in memory when they are newer), loaded last into the model it was saved from with its
    optimizer, each engine global it keeps per rank and each rank's random state, so
    the training cell goes on from it bit for bit. What ``restore`` needs that a
    replaced rank will lack is refused before anything changes, as is a replay that
    cannot be done (``check_replayable``). A model wrapped from a notebook instance can
    only come back through ``restore``; ``drop`` names wraps to forget instead. An
    autosave is re-armed on the rebuilt objects, counting on from the restored step; a
    restart that rebuilt the models without ``restore`` suspends it (``_rearm``), and the
    next ``restart(restore=...)`` arms it again.
    The time of each phase is kept in ``sess.restart_phases``. Afterwards, failed or
    not, the session record learns the new engines' pids and a standby engine is
    launched for the next death if this one was used.

    A restart that fails once it began to change the session (its ``setup`` raised on a
    rank, say) leaves the session ``unfinished``: every call is refused, naming the step
    that failed and how to mend it, until a restart runs to its end (``restart`` itself,
    ``shutdown`` and ``status`` are allowed). One refused by its checks changes nothing.
    """
    ctx.check_open()
    if setup is not None and not inspect.isfunction(setup):
        raise TypeError(f"setup must be a function (def or lambda, run on every rank), got {setup!r}")
    mending, why = ctx.state == "unfinished", ctx.lifecycle.why
    # the restart it mends may have rebuilt the models already: then this one finds no dead
    # rank, yet the models are at their initial weights and the ranks' autosave was disarmed
    rebuilt_before = mending and "wraps replayed" in ctx.restart_phases
    if mending:  # this restart may mend it: its own calls (a restore's load) must go through
        ctx.lifecycle.to("degraded")
    progress = Progress()
    try:
        return _restart(ctx, restore, drop, setup, progress, rebuilt_before)
    except BaseException as exc:
        if ctx.state != "closed":
            if progress.changed:
                _unfinished(ctx, progress, exc, restore)
            elif mending:  # refused before it changed anything: still as the last one left it
                ctx.lifecycle.to("unfinished", why)
        raise
    finally:
        if ctx.state != "closed":
            if ctx.keeper is not None:
                ctx.keeper.refresh(ctx)  # new engines: the watchdog must know their pids
            ctx.cluster.keep_standby()


def _restart(ctx: SessionContext, restore: str | None, drop: tuple[str, ...],
             setup: Callable[[], Any] | None, progress: Progress, rebuilt_before: bool = False) -> RestartReport:
    from ..checkpoints.load import load
    from ..models.wrap import check_replayable, replay_wraps
    from . import rank_repoint as repoint

    clock = PhaseClock()
    drop = tuple(drop)
    dead = ctx.cluster.dead_ranks()
    plan = restore_plan(ctx, restore, dead, setup)
    check_replayable(ctx, restore, drop, replaying=bool(dead),
                     target=(plan.model, *(m for m, _ in plan.parts)) if plan else None)
    ctx.restart_phases = clock.times  # filled as the phases end, a failed restart's too
    everyone = tuple(range(ctx.world_size))
    ctx.dispatcher.notify("restart", "recovering", everyone,
                           note=f"replacing rank(s) {dead}" if dead else "re-forming the group")
    d = ctx.plain_dispatcher
    rebuilt: tuple[str, ...] = ()
    repointed: tuple[str, ...] = ()
    if dead:
        progress.at("replace the dead engines")
        ctx.cluster.replace(dead)
        clock.mark("engines replaced")
        progress.at("install the health hooks")
        ctx.health.install(d, dead, nccl=ctx.backend == "nccl")
        clock.mark("health hooks")
    progress.at("re-form the group")
    reform(ctx, tell=False)
    clock.mark("group re-formed")
    if dead and len(ctx.definitions):
        progress.at("replay the definitions")
        for failure in ctx.definitions.replay(d, dead):
            log.warning("restart: a definition did not run on the new engine: %s", failure)
        clock.mark("definitions replayed")
    if dead and ctx.wraps:
        progress.at("rebuild the wrapped models")
        d.gather(d.apply("remember parameters", repoint.remember))
        restored = set() if plan is None else {plan.model, *(m for m, _ in plan.parts)}
        rebuilt = tuple(n for n in replay_wraps(ctx, drop, d) if n not in restored)
        repointed = tuple(sorted({n for names in d.gather(d.apply("re-point optimizers", repoint.repoint,
                                                                  args=(rebuilt,))) for n in names}))
        clock.mark("wraps replayed")
    progress.at("re-form the features")  # after the wraps are built, before setup and restore
    regroup.reformed(ctx, joined=tuple(dead))
    clock.mark("features re-formed")
    if setup is not None:
        progress.at("setup")
        d.gather(d.apply(f"setup {getattr(setup, '__qualname__', 'function')}", _ns.call_setup,
                         args=(by_value(setup),)))
        clock.mark("setup ran")
    if plan is not None and plan.memory is not None:
        from ..autosave.memory_copies import restore as from_memory

        progress.at("restore")
        spec = ctx.autosave or ctx.suspended_autosave or ctx.last_autosave
        assert spec is not None  # a plan from memory is made from the session's autosave
        from_memory(ctx, spec, plan.memory)
        clock.mark("state moved from memory")
    elif plan is not None:
        progress.at("restore")
        if plan.parts:
            load(ctx, plan.path, [m for m, _ in plan.parts], optimizer=[o for _, o in plan.parts], state=plan.state,
                 rng=plan.rng or None)
        else:
            load(ctx, plan.path, plan.model, optimizer=plan.optimizer, state=plan.state, rng=plan.rng or None)
        clock.mark("checkpoint loaded")
    progress.at("re-arm the autosave")
    autosave = _rearm(ctx, plan, bool(dead) or rebuilt_before)
    if autosave:
        clock.mark("autosave armed again")
    ctx.lifecycle.to("ready")
    report = RestartReport(replaced=tuple(dead), rebuilt=rebuilt, restored=plan, repointed=repointed,
                           setup=setup is not None, autosave=autosave, survivors=tuple(
                               r for r in everyone if r not in dead))
    ctx.dispatcher.notify("restart", "recovered", everyone, note=report.line())
    log.info("restart: %s", report.line())
    return report


def _unfinished(ctx: SessionContext, progress: Progress, exc: BaseException, restore: str | None) -> None:
    """A restart failed after it began to change the session: leave it ``unfinished``
    (the recovering dispatcher refuses every call, naming the step, until a restart runs
    to its end) and say so in the error. The ranks' registries are consistent then: a
    step before the features were re-formed left them as the last group had them, which
    no call reaches before the next restart re-forms them."""
    why = stopped_at(progress.step, exc, restore)
    ctx.lifecycle.to("unfinished", why)
    add_note(exc, f"The session is left unfinished: {why}. Until then every call is refused.")
    ctx.dispatcher.notify("restart", "degraded", tuple(range(ctx.world_size)), note=why)


def _rearm(ctx: SessionContext, plan: RestorePlan | None, rebuilt: bool) -> str:
    """Arm the session's autosave (a suspended one too) again where its count must go back
    to the restored step; suspend it where the models were ``rebuilt`` at their initial
    weights and nothing was restored (saving them would put initial weights over the run's
    checkpoints); what became of it, in words."""
    from ..autosave.autosave import SUSPENDED, arm, suspend

    spec = ctx.autosave or ctx.suspended_autosave
    if spec is None:
        return ""
    if plan is not None:
        # a run token of its own: its saves never reuse a temporary folder the run before
        # the restart may have left half written under the same step number
        again = " (it was suspended)" if ctx.autosave is None else ""
        arm(ctx, dataclasses.replace(spec, start_step=plan.step or 0, run=uuid.uuid4().hex[:8]))
        return f"autosave goes on from step {plan.step or 0}{again}"
    if rebuilt or ctx.autosave is None:
        suspend(ctx)
        return f"autosave {SUSPENDED}"
    return "autosave goes on"
