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

import logging
from typing import TYPE_CHECKING

from ..engine import health as _health
from ..runtime import rendezvous
from ..runtime.phases import PhaseClock

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["reform", "restart"]

log = logging.getLogger("fsdp_nb")


def reform(ctx: SessionContext) -> None:
    """Every rank joins a new process group on a fresh port, keeping the rank order,
    then DeviceMeshes and FSDP2 modules on the ranks are re-pointed at the new groups."""
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


def restart(ctx: SessionContext, restore: str | None = None, drop: tuple[str, ...] = ()) -> None:
    """Bring back the same ranks and rebuild the session.

    Dead engines are replaced (new engine, same rank), every rank joins a new process
    group, the replaced ranks get the session's imports, classes and functions
    (``fsdp_nb.runtime.definitions``), and models wrapped with ``sess.wrap`` are wrapped again on every rank
    (``fsdp_nb.models.wrap.replay_wraps``). On a healthy session this only re-forms the
    group, keeping every rank's state. ``restore``: a checkpoint loaded into the
    last wrapped model afterwards (``sess.load``). A model wrapped from a notebook
    instance can only come back through ``restore`` (no copy of its weights is kept);
    ``drop`` names wraps to forget instead of replaying them. A replay that cannot be
    done is refused before anything changes (``fsdp_nb.models.wrap.check_replayable``).
    The time of each phase is kept in ``sess.restart_phases``. Afterwards, failed or
    not, the session record learns the new engines' pids and a standby engine is
    launched for the next death if this one was used.
    """
    ctx.check_open()
    try:
        _restart(ctx, restore, drop)
    finally:
        if ctx.state != "closed":
            if ctx.keeper is not None:
                ctx.keeper.refresh(ctx)  # new engines: the watchdog must know their pids
            ctx.cluster.keep_standby()


def _restart(ctx: SessionContext, restore: str | None, drop: tuple[str, ...]) -> None:
    from ..checkpoint.load import load
    from ..models.wrap import check_replayable, replay_wraps

    clock = PhaseClock()
    drop = tuple(drop)
    dead = ctx.cluster.dead_ranks()
    check_replayable(ctx, restore, drop, replaying=bool(dead))
    ctx.restart_phases = clock.times  # filled as the phases end, a failed restart's too
    everyone = tuple(range(ctx.world_size))
    ctx.dispatcher.notify("restart", "recovering", everyone,
                           note=f"replacing rank(s) {dead}" if dead else "re-forming the group")
    if dead:
        ctx.cluster.replace(dead)
        clock.mark("engines replaced")
        ctx.health.install(ctx.plain_dispatcher, dead, nccl=ctx.backend == "nccl")
        clock.mark("health hooks")
    reform(ctx)
    clock.mark("group re-formed")
    if dead and len(ctx.definitions):
        for failure in ctx.definitions.replay(ctx.plain_dispatcher, dead):
            log.warning("restart: a definition did not run on the new engine: %s", failure)
        clock.mark("definitions replayed")
    if dead and ctx.wraps:
        replay_wraps(ctx, drop, ctx.plain_dispatcher)
        clock.mark("wraps replayed")
    ctx.lifecycle.to("ready")
    if restore is not None:
        names = list(ctx.wraps)
        if not names:
            raise ValueError(
                f"restart(restore={restore!r}) needs a model to load into, but this session "
                "has no wrapped model; call sess.wrap(...) then sess.load(path, model)."
            )
        load(ctx, restore, names[-1])
        clock.mark("checkpoint loaded")
    what = f"rank(s) {', '.join(map(str, dead))} replaced" if dead else "group re-formed"
    ctx.dispatcher.notify("restart", "recovered", everyone,
                           note=what + (f", {restore} loaded" if restore else ""))
