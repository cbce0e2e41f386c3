"""``Session.attach``: a new kernel takes back a kept-alive session's engines.

The engines, their process group, wrapped models, optimizers and every engine
variable outlived the kernel that started them (``keep_alive=True``). ``find`` picks
the session record (``fsdp_nb.lifetime.record``), ``reconnect`` reaches its cluster
again (ipyparallel's cluster file: the new kernel can also stop it), ``adopt_group``
checks that every rank is still in the same group under the same rank (re-forming
it only when it is not), and ``rebuild_models`` gives the session its
``sess.models`` from what the engines hold.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import cloudpickle

from ..engine import process_group as _pg
from ..models import rank_wrap as _ew
from ..runtime.cluster import EngineCluster
from ..runtime.launch_settings import ipp_log_level
from ..runtime.rendezvous import RankInfo
from .keepalive import live_records
from .record import SessionRecord, folder

if TYPE_CHECKING:
    from ..context import SessionContext

log = logging.getLogger("fsdp_nb")

__all__ = ["adopt_autosave", "adopt_group", "find", "rebuild_models", "reconnect"]


def find(cluster_id: str | None) -> SessionRecord:
    """The record to attach to: ``cluster_id``'s, else the newest kept-alive session no
    running kernel holds. LookupError / RuntimeError say what there is instead."""
    if cluster_id is not None and not isinstance(cluster_id, str):
        raise TypeError(f"cluster_id must be a str (see fsdp_nb.sessions()), got {cluster_id!r}")
    records = live_records()
    me = os.getpid()
    if cluster_id is not None:
        match = [r for r in records if r.cluster_id == cluster_id]
        if not match:
            running = ", ".join(r.cluster_id for r in records) or "none"
            raise LookupError(
                f"no running fsdp_nb session has cluster_id {cluster_id!r} (running: {running})"
            )
        rec = match[0]
    else:
        free = [
            r for r in records
            if (r.keep_alive is not False and not r.owner_alive) or r.owner_pid == me
        ]
        if not free:
            held = [f"{r.cluster_id} (kernel pid {r.owner_pid})" for r in records if r.owner_alive]
            raise LookupError(
                "no kept-alive fsdp_nb session to attach to in "
                f"{folder()}; start one with fsdp_nb.Session(n, keep_alive=True)"
                + (f". Held by running kernels: {', '.join(held)}" if held else "")
            )
        rec = free[0]
    if rec.owner_alive and rec.owner_pid != me:
        raise RuntimeError(
            f"session {rec.cluster_id} is held by the kernel with pid {rec.owner_pid}, which "
            "still runs; shut it down there (sess.shutdown()), or attach once that kernel ends"
        )
    if rec.keep_alive is False and rec.owner_pid != me:
        raise RuntimeError(
            f"session {rec.cluster_id} was not started with keep_alive=True, so it stops with "
            "its kernel; nothing to attach to"
        )
    return rec


def reconnect(rec: SessionRecord, timeout: float) -> EngineCluster:
    """The cluster of ``rec``, with its rank order and per-rank info as recorded."""
    if rec.owns_engines:
        import ipyparallel as ipp

        cluster = ipp.Cluster.from_file(
            rec.connection["cluster_file"], shutdown_atexit=False, log_level=ipp_log_level()
        )
        engines = EngineCluster(cluster.connect_client_sync(), cluster)
        engines.wants_standby = rec.standby
    else:
        engines = EngineCluster.connect(**rec.connection, timeout=timeout)
    ranks = [RankInfo(**r) for r in rec.ranks]
    started = dict((pid, stamp) for pid, stamp in rec.engine_pids)
    engines.set_rank_order([r.engine_id for r in ranks], [r.pid for r in ranks], [r.host for r in ranks],
                           [started.get(r.pid) for r in ranks])
    engines.ranks = ranks
    engines.controller_pids = [(pid, stamp) for pid, stamp in rec.controller_pids]  # JSON lists as tuples
    return engines


def adopt_group(ctx: SessionContext, timeout: float) -> str:
    """Check that every rank is still in the group under its rank; re-form it if not.
    Returns what was found, for the log. Ranks that died meanwhile leave the session
    ``degraded`` (``sess.restart()`` brings them back)."""
    from ..recovery.restart import reform

    n = ctx.world_size
    dead = ctx.cluster.dead_ranks()
    if dead:
        ctx.lifecycle.to("degraded")
        return f"rank(s) {dead} died while no kernel was attached; sess.restart() brings them back"
    d = ctx.plain_dispatcher
    seen = d.gather(d.apply("check the process group", _pg.membership), timeout)
    expected = [(r, n, info.pid) for r, info in enumerate(ctx.ranks)]
    if [tuple(m) for m in seen] == expected:
        return "process group intact"
    reform(ctx)
    return "process group re-formed"


def rebuild_models(ctx: SessionContext) -> None:
    """Fill ``sess.wraps`` and ``sess.models`` from the models wrapped on the engines."""
    from ..models.sharded_model import ShardedModel
    from ..models.wire_wrap_options import WrapOptions
    from ..models.wrap import WrapRecord

    dead = set(ctx.cluster.dead_ranks())
    live = [r for r in range(ctx.world_size) if r not in dead]
    if not live:
        return
    d = ctx.plain_dispatcher
    held = d.gather(d.apply("list wrapped models", _ew.wrapped_models, ranks=live[:1]))[0]
    for name, (shipped, summary) in held.items():
        if shipped is None or summary is None:
            continue
        try:
            options = cloudpickle.loads(shipped.payload.payload)[3]
        except Exception as exc:  # noqa: BLE001 - the model still works; only replay is lost
            log.warning("cannot read how %r was wrapped in this kernel (%s); sess.restart() "
                        "will not rebuild it", name, exc)
            ctx.models[name] = ShardedModel(ctx, name, WrapOptions(), summary)
            continue
        ctx.wraps[name] = WrapRecord(name, shipped.kind, shipped.payload, options, shipped.plan, shipped.seed)
        ctx.models[name] = ShardedModel(ctx, name, options, summary)


def adopt_autosave(ctx: SessionContext) -> None:
    """Take back the autosave the engines still run (``sess.autosave``), so that this
    kernel's ``sess.autosave()`` shows it and ``restart(restore="latest")`` finds its
    checkpoints (``autosave.adopt``: a cell's end writes a save due then, as before)."""
    from ..autosave import rank_autosave as engine_autosave
    from ..autosave.autosave import adopt

    dead = set(ctx.cluster.dead_ranks())
    live = [r for r in range(ctx.world_size) if r not in dead]
    if live:
        d = ctx.plain_dispatcher
        adopt(ctx, d.gather(d.apply("autosave", engine_autosave.armed_spec, ranks=live[:1]))[0])
