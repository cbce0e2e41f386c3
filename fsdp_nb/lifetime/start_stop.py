"""How a session's context comes to be and how it ends.

``start`` launches engines, ``connect`` takes a running cluster, ``attach`` takes back
one a previous kernel kept alive; each forms (or checks) the process group, installs
the health hooks and returns the :class:`~fsdp_nb.context.SessionContext` the
``Session`` façade holds. ``stop`` ends it: pending async saves first, then the
record, the group on engines we do not own, the sockets, the engines we started.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from ..context import SessionContext
from ..engine import process_group as _pg
from ..hangs.hang_view import HangView
from ..hangs.hang_watch import HangWatch
from ..recovery.failure_policy import RecoveringPolicy
from ..runtime import rendezvous
from ..runtime.call_channel import CallChannel
from ..runtime.cluster import EngineCluster
from ..runtime.dispatch import Dispatcher
from ..runtime.health import RankHealth
from ..runtime.phases import PhaseClock
from . import attach as _attach
from .keepalive import Keeper
from .record import SessionRecord

__all__ = ["HANG_AFTER", "attach", "connect", "form", "start", "stop"]

HANG_AFTER = 30.0
"""Seconds a rank may wait in one collective before the running cell explains the hang
(the default of ``Session(hang_after=)``). The watch asks the ranks where they are from
the call's start, every 0.2 s; this is how long a wait must last to be shown."""

log = logging.getLogger("fsdp_nb")


def form(
    cluster: EngineCluster,
    *,
    backend: str | None,
    launcher: str,
    threads: int | None,
    pg_timeout: float,
    grace: float,
    formed: bool = False,
    clock: PhaseClock | None = None,
) -> SessionContext:
    """The context of a session on ``cluster``'s engines: its dispatchers, then the
    process group (``formed``: it already is, ``attach``), then the health hooks. On
    failure the engines a start launched are stopped and the error raised."""
    channel = CallChannel(cluster)
    plain = Dispatcher(cluster, channel=channel)  # failures only reported
    plain.echo = False
    ctx = SessionContext(
        cluster=cluster, recovering=Dispatcher(cluster, channel=channel), plain_dispatcher=plain,
        channel=channel, health=RankHealth(cluster, HangWatch(cluster)), backend=backend, launcher=launcher,
        pg_timeout=pg_timeout, omp_threads=threads,
    )
    ctx.recovering.policy = RecoveringPolicy(ctx, grace=grace)  # it needs the context it recovers
    ctx.recovering.watch, ctx.recovering.hang_view = ctx.health.watch, HangView()
    ctx.health.watch.prompt_limit_s = max(60.0, pg_timeout - 60.0)  # before the others' collectives time out
    ctx.recovering.hang_after = HANG_AFTER
    ctx.recovering.lifecycle = ctx.lifecycle  # an unfinished restart refuses calls until mended
    clock = clock or PhaseClock()
    try:
        if not formed:
            ctx.backend = rendezvous.form_group(
                cluster, ctx.recovering, backend, pg_timeout=pg_timeout, threads=threads, clock=clock,
            )
        ctx.health.install(plain, nccl=ctx.backend == "nccl")
        clock.mark("health hooks")
    except BaseException:  # a failed start, Ctrl-C included, stops what it started, then re-raises
        ctx.lifecycle.to("failed")
        if not formed:
            cluster.stop()
        raise
    ctx.lifecycle.to("ready")
    return ctx


def start(
    n: int,
    backend: str | None,
    launcher: str,
    *,
    timeout: float,
    pg_timeout: float,
    grace: float,
    keep_alive: bool | float,
    standby: bool,
    cluster_kwargs: dict[str, Any],
) -> SessionContext:
    """Launch ``n`` engines with ``launcher`` and form a ``backend`` group on them (the
    arguments are ``Session``'s, already checked; ``backend`` None, for engines started
    elsewhere: decided from their probes); the start's phases are timed in ``start_phases``."""
    clock = PhaseClock()
    chosen = dict(cluster_kwargs.pop("environment", None) or {})  # the user's environment= wins
    threads = max(1, (os.cpu_count() or 1) // n) if backend == "gloo" else None
    if threads and "OMP_NUM_THREADS" in chosen:  # a count fsdp_nb applies, else theirs as given
        given = str(chosen["OMP_NUM_THREADS"]).strip()
        threads = int(given) if given.isdigit() and int(given) > 0 else None
    env = {**({"OMP_NUM_THREADS": str(threads)} if threads else {}), **chosen}
    if keep_alive:
        cluster_kwargs.setdefault("shutdown_atexit", False)
    cluster = EngineCluster.start(n, launcher, timeout=timeout, environment=env, clock=clock, **cluster_kwargs)
    ctx = form(cluster, backend=backend, launcher=launcher, threads=threads, pg_timeout=pg_timeout,
               grace=grace, clock=clock)
    cluster.wants_standby = standby
    assert cluster.cluster is not None  # EngineCluster.start keeps the Cluster it started
    keep(ctx, keep_alive, {"cluster_file": cluster.cluster.cluster_file})
    clock.mark("session record")
    cluster.keep_standby()  # after the start: its imports would slow the ranks'
    clock.mark("standby engine launched")
    ctx.start_phases = clock.times
    return ctx


def connect(
    url_file: str | None,
    *,
    profile: str | None,
    cluster_id: str | None,
    n: int | None,
    backend: str | None,
    timeout: float,
    pg_timeout: float,
    grace: float,
    keep_alive: bool | float,
) -> SessionContext:
    """Take a running ipyparallel cluster's engines (the first ``n``) and form the group
    on them (``backend`` None: decided from their probes)."""
    cluster = EngineCluster.connect(url_file, profile=profile, cluster_id=cluster_id, n=n, timeout=timeout)
    if n is not None:
        cluster.engine_ids = cluster.engine_ids[:n]
    ctx = form(cluster, backend=backend, launcher="connected", threads=None, pg_timeout=pg_timeout, grace=grace)
    if keep_alive:
        keep(ctx, keep_alive, {"url_file": url_file, "profile": profile, "cluster_id": cluster_id})
    return ctx


def attach(record: SessionRecord, *, timeout: float, grace: float) -> SessionContext:
    """Take back the kept-alive session of ``record`` (``fsdp_nb.lifetime.attach.find``):
    the same ranks and group (re-formed only if it broke) and its wrapped models."""
    cluster = _attach.reconnect(record, timeout)
    ctx = form(cluster, backend=record.backend, launcher=record.launcher, threads=record.omp_threads,
               pg_timeout=record.pg_timeout, grace=grace, formed=True)
    note = _attach.adopt_group(ctx, timeout)
    _attach.rebuild_models(ctx)
    _attach.adopt_autosave(ctx)
    ctx.keeper = Keeper(record)
    ctx.keeper.take(ctx)
    cluster.keep_standby(adopt=True)  # the one an earlier kernel launched, if it waits
    log.info("attached to session %s: %s", record.cluster_id, note)
    return ctx


def keep(ctx: SessionContext, keep_alive: bool | float, connection: dict[str, Any]) -> None:
    """Write the session record and start the watchdog (engines stop with the kernel
    unless ``keep_alive``); if that fails, the session is stopped and the error raised."""
    try:
        ctx.keeper = Keeper.begin(ctx, keep_alive, connection)
    except Exception:  # no record: the session is stopped, then the error re-raised
        stop(ctx)
        raise


def stop(ctx: SessionContext) -> None:
    """End the session: finish its async saves (none is lost), close it, remove its
    record, leave the group on engines it does not own, stop the engines it started."""
    if ctx.state == "closed":
        return
    if ctx.saves and ctx.state == "ready":
        from ..checkpoints.async_saves import wait_pending

        try:
            wait_pending(ctx)
        except Exception as exc:  # noqa: BLE001 - shutting down regardless; the user is told
            warnings.warn(f"an async checkpoint did not finish: {exc}", stacklevel=3)
    ctx.lifecycle.to("closed")
    if ctx.keeper is not None:
        ctx.keeper.end()
    try:
        if not ctx.cluster.owns_engines:
            try:
                d = ctx.recovering
                d.gather(d.apply("destroy_process_group", _pg.destroy), timeout=30)
            except Exception as exc:  # noqa: BLE001 - engines we do not own may be gone already
                log.warning("could not leave the process group on the connected engines: %s", exc)
    finally:
        ctx.channel.close()
        ctx.cluster.stop()
        ctx.health.close()
