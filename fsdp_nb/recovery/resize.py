"""``sess.resize(n)``: grow or shrink a live session, its models re-sharded in place.

Everything that can refuse is checked first (``resize_checks.check``), with nothing
changed yet. Then:

1. growing: the new engines are started at once (the standby engine first), so they
   import torch while the old ranks stage;
2. the old ranks stage every wrapped model and its optimizers in a private folder of
   the staging tmpfs (``/dev/shm``), one DCP folder per model, and free them
   (``fsdp_nb.recovery.rank_resize.stage``): host memory, never the user's disk;
3. shrinking: the highest ranks leave and their engines are shut down; growing: the new
   engines become the next ranks;
4. the group forms again on ``n`` ranks, the ranks that stay keeping their rank and
   every variable; new ranks get the health hooks and the session's definitions
   (``fsdp_nb.runtime.definitions``);
5. each model is rebuilt on its new mesh and filled from its staged folder, one model
   at a time; optimizers keep their objects where they were and are built from their
   recipe where they were not (``fsdp_nb.recovery.rank_resize.restore``).

A failure after step 1 leaves the staged folders (``sess.load`` reads each) and a
degraded session for ``sess.restart()``; ``ResizeError`` says so.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..autosave.autosave import Autosaving, arm, describe
from ..autosave.autosave import stop as stop_autosave
from ..checkpoints.async_saves import wait_pending
from ..errors import FsdpNbError, ResizeError
from ..models import rank_wrap as _ew
from ..runtime import membership, rendezvous
from ..runtime.phases import PhaseClock
from . import rank_resize as _er
from . import regroup
from .resize_checks import ResizePlan, check

if TYPE_CHECKING:
    from ..autosave.wire_autosave import AutosaveSpec
    from ..context import SessionContext

log = logging.getLogger("fsdp_nb")

__all__ = ["ResizeReport", "resize"]


@dataclass
class ResizeReport:
    """What ``sess.resize`` did."""

    old: int
    """World size before."""
    new: int
    """World size after."""
    models: tuple[str, ...] = ()
    """Wrapped models re-sharded onto the new mesh."""
    optimizers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Model -> the optimizers re-sharded with it (built on ranks that had none)."""
    variables: tuple[str, ...] = ()
    """Engine globals (not models, optimizers or definitions) that only the ranks that
    stayed hold: new ranks do not have them, retired ranks took theirs with them."""
    replay_failures: tuple[str, ...] = ()
    """Definitions that failed to run on a new rank (``[rank r] what: error``)."""
    staged_bytes: int = 0
    """Bytes of model and optimizer state that went through the staging tmpfs."""
    peak_rss: tuple[int, ...] = ()
    """Each rank's highest resident memory (bytes) during the resize, in new rank order."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds each phase took."""

    autosave: str = ""
    """What became of an in-memory autosave: armed again on the new world, its copies
    taken under the new buddy map before the resize returned."""

    @property
    def seconds(self) -> float:
        """The whole resize, in seconds."""
        return sum(self.phases.values())

    def __str__(self) -> str:
        if self.old == self.new:
            return f"resize: already {self.new} rank(s); nothing changed"
        lines = [f"resized {self.old} -> {self.new} ranks in {self.seconds:.1f} s"]
        for m in self.models:
            opts = self.optimizers.get(m, ())
            lines.append(f"  model {m!r} re-sharded" + (f" with {', '.join(opts)}" if opts else ""))
        if self.staged_bytes:
            lines.append(f"  {self.staged_bytes / 2**20:.1f} MiB staged in memory; peak resident per rank: "
                         + ", ".join(f"{b / 2**20:.0f}" for b in self.peak_rss) + " MiB")
        if self.variables:
            where = "new ranks do not have" if self.new > self.old else "the retired ranks took theirs of"
            lines.append(f"  {where}: {', '.join(self.variables)}")
        lines += [f"  definition not replayed: {f}" for f in self.replay_failures]
        if self.autosave:
            lines.append(f"  {self.autosave}")
        return "\n".join(lines)

    __repr__ = __str__


def _follow(ctx: SessionContext, spec: AutosaveSpec, was: Autosaving | None) -> str:
    """Arm the in-memory autosave ``spec`` again on the resized world, counting on from the
    step it had reached (``was``), and copy every rank's state now under the new buddy map:
    the old world's copies hold shards of another layout, so each rank's state is in its
    new buddy's memory before the resize returns. Where a rank refuses it by name (a new
    rank lacks a loader or scheduler a cell made), it stays stopped, and the words say why.
    What it did, in words."""
    from ..autosave import rank_autosave as engine_autosave

    step = next((r.step for r in (was.ranks if was else ()) if r is not None), spec.start_step)
    try:
        arm(ctx, dataclasses.replace(spec, start_step=step))
    except (NameError, TypeError, ValueError, MemoryError, FsdpNbError) as exc:  # refused on some rank: nothing armed
        # (the resize itself succeeded: its report is not lost to the autosave's refusal)
        why = str(exc).splitlines()[0]
        log.warning("sess.resize: the autosave was not armed again: %s", why)
        return (f"autosave stopped, not armed again on the new world: {why}. Make what it names on every rank "
                "(a new rank has only the model and its optimizers), then call sess.autosave(...) again")
    d = ctx.dispatcher
    d.gather(d.apply("copy into memory", engine_autosave.copy_now))
    assert ctx.autosave is not None
    pairs = ", ".join(f"{r}->{b}" for r, b in enumerate(ctx.autosave.buddies))
    return (f"autosave armed again from step {step}; every rank's state copied into its buddy's memory "
            f"under the new map ({pairs})" + (f"; disk saves go on under {spec.root}" if spec.root else ""))


def resize(ctx: SessionContext, n: int, staging: str | None = None, timeout: float = 120.0) -> ResizeReport:
    """Grow or shrink ``ctx``'s world to ``n`` ranks (see the module docstring).

    Args:
        ctx: the session.
        n: the new number of ranks.
        staging: a folder in memory (tmpfs) every rank can read and write; default
            ``/dev/shm``.
        timeout: seconds new engines may take to register.
    """
    clock = PhaseClock()
    plan = check(ctx, n, staging)
    report = ResizeReport(ctx.world_size, n)
    if n == ctx.world_size:
        return report
    wait_pending(ctx)
    follow = None
    if ctx.autosave is not None and ctx.autosave.in_memory:  # armed again on the new world, below
        follow = (ctx.autosave, describe(ctx))
        stop_autosave(ctx)
    elif ctx.autosave is not None:  # its checkpoints keep each rank's own state for this world size
        root = ctx.autosave.root
        stop_autosave(ctx)
        log.warning("sess.resize(%d) stopped the autosave to %s (its checkpoints keep %d ranks' own state): "
                    "call sess.autosave(...) again", n, root, report.old)
    clock.mark("checked")
    report.phases = clock.times
    folder = tempfile.mkdtemp(prefix="fsdp_nb-resize-", dir=plan.staging)  # 0700, this user's
    ctx.dispatcher.notify("resize", "recovering", tuple(range(ctx.world_size)), note=f"{ctx.world_size} -> {n} ranks")
    try:
        _change(ctx, plan, folder, report, clock, timeout)
    except BaseException as exc:
        if ctx.state != "closed":
            ctx.lifecycle.to("degraded")
        said = _failed(ctx, report, folder, exc)
        if follow is not None:  # stopped above, its copies freed: a failed resize does not arm it again
            said += ("\nThe autosave in memory was stopped for the resize and its copies freed; it is not armed "
                     "again: call sess.autosave(...) once the session is usable.")
        raise ResizeError(said, folder) from exc
    finally:
        if ctx.state != "closed":
            if ctx.keeper is not None:
                ctx.keeper.refresh(ctx)
            ctx.cluster.keep_standby()
    shutil.rmtree(folder, ignore_errors=True)
    if follow is not None:
        report.autosave = _follow(ctx, *follow)
    ctx.dispatcher.notify("resize", "recovered", tuple(range(n)), note=f"{report.old} -> {n} ranks")
    log.info("%s", report)
    return report


def _failed(ctx: SessionContext, report: ResizeReport, folder: str, exc: BaseException) -> str:
    """The message of a resize that failed after the state was staged. Models not yet
    rebuilt are gone from the engines: they leave the session's registries, and the
    message says where each one's state is. Before the staging finished, every model is
    still where it was."""
    if "state staged" not in report.phases:
        shutil.rmtree(folder, ignore_errors=True)
        return (f"resizing {report.old} -> {report.new} ranks failed before the models were staged: "
                f"{type(exc).__name__}: {exc}. Every model and optimizer is as it was; call sess.restart() "
                "if the session is not ready.")
    lost = [name for name in ctx.wraps if name not in report.models]
    for name in lost:
        ctx.wraps.pop(name)
        ctx.models.pop(name, None)
    where = "; ".join(f"{folder}/{name}" for name in lost)
    done = f" Re-sharded before it failed: {', '.join(report.models)}." if report.models else ""
    return (f"resizing {report.old} -> {report.new} ranks failed: {type(exc).__name__}: {exc}.{done} "
            f"The state of the model(s) not yet re-sharded is kept in memory, private to you: {where or 'none'} "
            "(sess.load reads each). Call sess.restart(), wrap each model again, make its optimizer and "
            "sess.load(folder, name, optimizer=...); remove the folder afterwards.")


def _change(ctx: SessionContext, plan: ResizePlan, folder: str, report: ResizeReport, clock: PhaseClock,
            timeout: float) -> None:
    d, cluster, old, n = ctx.plain_dispatcher, ctx.cluster, ctx.world_size, plan.n
    backend = ctx.backend
    if backend is None:  # set when the group was first formed
        raise RuntimeError("this session's process group was never formed: there is none to resize")
    known = membership.start_engines(cluster, n - old) if n > old else set()
    d.gather(d.apply("watch memory", _er.watch_memory), 30)
    report.staged_bytes = sum(d.gather(d.apply("stage models", _er.stage, args=(folder, plan.optimizers))))
    clock.mark("state staged")
    new: list[int] = []
    if n < old:
        d.gather(d.apply("leave the group", _er.leave, ranks=list(range(n, old))), 90)  # parts closed as they leave
        for r in range(n, old):
            ctx.health.forget(r)
        ctx.channel.drop(membership.retire_ranks(cluster, n))
        clock.mark("ranks retired")
    else:
        new = membership.adopt_engines(cluster, n - old, known, timeout)
        d.gather(d.apply("watch memory", _er.watch_memory, ranks=new), 30)
        clock.mark("engines added")
    probes = rendezvous.probe_engines(cluster, d, timeout=60)
    rendezvous.join_group(cluster, d, probes, backend, pg_timeout=ctx.pg_timeout,
                          threads=ctx.omp_threads, timeout=120)
    clock.mark("group formed")
    if new:
        ctx.health.install(d, new, nccl=ctx.backend == "nccl")
        report.replay_failures = tuple(ctx.definitions.replay(d, new))
        clock.mark("definitions replayed")
    for name, record in list(ctx.wraps.items()):
        rplan = plan.plans[name]
        summaries = d.gather(d.apply(f"wrap({name!r}) on {n} ranks", _ew.build, args=(
            name, record.kind, record.payload, rplan, record.seed, False)))
        d.gather(d.apply(f"re-shard {name!r}", _er.restore, args=(name, folder, plan.recipes[name])))
        shutil.rmtree(f"{folder}/{name}", ignore_errors=True)  # one model's state staged at a time from here
        ctx.wraps[name] = dataclasses.replace(record, plan=rplan)
        if name in ctx.models:
            ctx.models[name].summary = summaries[0]
        report.models += (name,)
    clock.mark("models re-sharded")
    regroup.reformed(ctx, joined=tuple(new))
    clock.mark("features re-formed")
    report.peak_rss = tuple(d.gather(d.apply("memory peak", _er.memory_peak), 30))
    report.optimizers = {m: o for m, o in plan.optimizers.items() if o}
    report.variables = plan.variables
