"""The ``Session`` façade: one object a notebook holds to drive every rank.

It validates input, then delegates: ``cluster`` starts or attaches to engines,
``rendezvous`` forms the process group, ``dispatch`` sends work and gathers it in
rank order; later layers (wrap, checkpoints, widgets, recovery) hang off it.
"""

from __future__ import annotations

import atexit
import html
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import rendezvous
from .call_channel import CallChannel
from .cluster import EngineCluster
from .dispatch import Dispatcher, FailurePolicy
from .engine import namespace as _ns
from .engine import process_group as _pg
from .errors import SessionClosedError
from .keepalive import Keeper, check_keep_alive
from .lifecycle import Lifecycle
from .phases import PhaseClock
from .rendezvous import RankInfo
from .session_checks import (
    check_grace,
    check_n_backend,
    check_output,
    check_ranks,
    check_standby,
    validate,
)
from .shipping import by_value

log = logging.getLogger("fsdp_nb")

if TYPE_CHECKING:
    from .sharded_model import ShardedModel

__all__ = ["Session"]

_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()


class Session:
    """An ipyparallel cluster whose engines are the ranks of one process group.

    ``Session(n)`` starts ``n`` engines (default: one per visible GPU, or 2 CPU
    engines on gloo) and forms the group; use ``Session.connect`` for a cluster
    started elsewhere (mpiexec, Slurm). A context manager; ``shutdown()`` stops
    only what this session started. ``standby``: keep one engine started and
    imported but unregistered, to take a dead rank's place at once (local launcher;
    ``fsdp_nb.standby``).
    """

    def __init__(
        self,
        n: int | None = None,
        *,
        backend: str | None = None,
        launcher: str = "local",
        timeout: float = 120.0,
        pg_timeout: float = 1800.0,
        activate: bool = True,
        grace: float = 3.0,
        keep_alive: bool | float = False,
        verbose: bool = False,
        standby: bool = True,
        **cluster_kwargs: Any,
    ):
        clock = PhaseClock()
        n, backend = validate(n, backend, launcher)
        check_grace(grace)
        check_standby(standby)
        keep_alive = check_keep_alive(keep_alive)
        threads = max(1, (os.cpu_count() or 1) // n) if backend == "gloo" else None
        env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        if keep_alive:
            cluster_kwargs.setdefault("shutdown_atexit", False)
        cluster = EngineCluster.start(
            n, launcher, timeout=timeout, environment=env, clock=clock, **cluster_kwargs
        )
        self._adopt(cluster, backend, launcher, threads, pg_timeout, activate, grace, clock=clock)
        cluster.wants_standby = standby
        self._keep(keep_alive, {"cluster_file": cluster.cluster.cluster_file})
        clock.mark("session record")
        cluster.keep_standby()  # after the start: its imports would slow the ranks'
        clock.mark("standby engine launched")
        self.start_phases = clock.times
        """Seconds each phase of this session's start took (``verbose=True`` prints them)."""
        if verbose:
            print(clock.table(), flush=True)

    @classmethod
    def connect(
        cls,
        url_file: str | None = None,
        *,
        profile: str | None = None,
        cluster_id: str | None = None,
        n: int | None = None,
        backend: str | None = None,
        timeout: float = 60.0,
        pg_timeout: float = 1800.0,
        activate: bool = True,
        grace: float = 3.0,
        keep_alive: bool = False,
    ) -> Session:
        """Attach to a running ipyparallel cluster and form the process group on its engines.

        Arguments are as ``ipyparallel.Client`` takes them (the client connection
        file, or profile and cluster id); ``n`` waits for that many engines.
        ``backend=None`` picks nccl when every engine has a GPU of its own, else gloo
        (decided from the engines' probes before the group forms).
        ``shutdown()`` leaves those engines running. ``keep_alive=True``: a later kernel
        can ``Session.attach()`` to the group and models formed here.
        """
        check_n_backend(n, backend)
        check_grace(grace)
        keep_alive = check_keep_alive(keep_alive)
        cluster = EngineCluster.connect(
            url_file, profile=profile, cluster_id=cluster_id, n=n, timeout=timeout
        )
        if n is not None:
            cluster.engine_ids = cluster.engine_ids[:n]
        self = cls.__new__(cls)
        # backend None: decided from the engines' probes (nccl if every rank has a GPU)
        self._adopt(cluster, backend, "connected", None, pg_timeout, activate, grace)
        if keep_alive:
            self._keep(True, {"url_file": url_file, "profile": profile, "cluster_id": cluster_id})
        return self

    @classmethod
    def attach(
        cls,
        cluster_id: str | None = None,
        *,
        timeout: float = 60.0,
        activate: bool = True,
        grace: float = 3.0,
    ) -> Session:
        """Take back a session whose engines outlived their kernel (``keep_alive=True``).

        ``cluster_id``: which one (``fsdp_nb.sessions()`` lists them); default the most
        recent that no running kernel holds. The ranks come back in the same order,
        in the same process group (re-formed only if it broke), with every engine
        variable; ``sess.models`` maps each wrapped name to its ``ShardedModel``.
        """
        from . import attach as _attach

        check_grace(grace)
        record = _attach.find(cluster_id)
        if record.owner_pid == os.getpid():
            for live in _LIVE:
                keeper = live.keeper
                if keeper is not None and keeper.record.cluster_id == record.cluster_id:
                    return live
        cluster = _attach.reconnect(record, timeout)
        self = cls.__new__(cls)
        self._adopt(
            cluster, record.backend, record.launcher, record.omp_threads, record.pg_timeout,
            activate, grace, formed=True,
        )
        note = _attach.adopt_group(self, timeout)
        _attach.rebuild_models(self)
        self.keeper = Keeper(record)
        self.keeper.take(self)
        cluster.keep_standby(adopt=True)  # the one an earlier kernel launched, if it waits
        log.info("attached to session %s: %s", record.cluster_id, note)
        return self

    def _keep(self, keep_alive: bool | float, connection: dict[str, Any]) -> None:
        """Write the session record; start the watchdog (engines stop with the kernel
        unless ``keep_alive``)."""
        try:
            self.keeper = Keeper.begin(self, keep_alive, connection)
        except Exception:
            self.shutdown()
            raise

    def _adopt(
        self,
        cluster: EngineCluster,
        backend: str | None,
        launcher: str,
        threads: int | None,
        pg_timeout: float,
        activate: bool,
        grace: float,
        formed: bool = False,
        clock: PhaseClock | None = None,
    ) -> None:
        """Declare every attribute (``__init__``, ``connect`` and ``attach`` come here),
        then form the process group on ``cluster``'s engines (``formed``: it already
        is: ``attach``) and install the health hooks."""
        from .failure_policy import RecoveringPolicy
        from .health import RankHealth

        self.backend: str | None = backend
        """Process-group backend (``gloo``, ``nccl``); decided from probes when None."""
        self.launcher = launcher
        """The ipyparallel launcher that started the engines, or ``"connected"``."""
        self.pg_timeout = pg_timeout
        """Seconds a collective may wait before torch.distributed gives up."""
        self.omp_threads = threads
        """``OMP_NUM_THREADS`` given to CPU ranks (None: not set by fsdp_nb)."""
        self.lifecycle = Lifecycle()
        """The session's state machine (``state`` reads it)."""
        self.wraps: dict[str, Any] = {}
        """Engine global name -> ``sharding.WrapRecord``, replayed by ``restart()``."""
        self.models: dict[str, ShardedModel] = {}
        """Engine global name -> the ``ShardedModel`` of each model wrapped on the ranks."""
        self.keeper: Keeper | None = None
        """The session record and watchdog (None for a connected session not kept alive)."""
        self.health = RankHealth(cluster)
        """The engines' health hooks: stack dumps, NCCL abort listeners."""
        self.restart_phases: dict[str, float] = {}
        """Seconds each phase of the last ``restart()`` took (empty before one)."""
        self._cluster = cluster
        self._policy = RecoveringPolicy(self, grace=grace)
        self.channel = CallChannel(cluster)
        """Direct sockets to the engines: the fast path of ``run``, ``push`` and ``pull``."""
        self._dispatch = Dispatcher(cluster, self._policy, self.channel)
        self._plain = Dispatcher(cluster, FailurePolicy(), self.channel)
        self._plain.echo = False
        try:
            clock = clock or PhaseClock()
            if not formed:
                self.backend = rendezvous.form_group(
                    cluster, self._dispatch, backend, pg_timeout=pg_timeout, threads=threads,
                    clock=clock,
                )
            self.health.install(self._plain, nccl=self.backend == "nccl")
            clock.mark("health hooks")
        except BaseException:
            self.lifecycle.to("failed")
            if not formed:
                cluster.stop()
            raise
        self.lifecycle.to("ready")
        _LIVE.add(self)
        if activate:
            from .magics import activate_px

            activate_px(self)

    # -- what it is ---------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self._cluster.ranks)

    @property
    def ranks(self) -> list[RankInfo]:
        """Per-rank info in rank order: rank, engine id, host, pid, device, local rank."""
        return list(self._cluster.ranks)

    @property
    def state(self) -> str:
        """``ready``, ``degraded`` (a rank died: ``restart()``), ``closed``, ``failed`` (or ``starting``)."""
        return self.lifecycle.state

    @property
    def keep_alive(self) -> bool | float:
        """Whether the engines outlive this kernel (seconds: until idle that long)."""
        return self.keeper.keep_alive if self.keeper is not None else False

    @property
    def cluster(self) -> EngineCluster:
        """The engines: rank <-> engine map, liveness, process control."""
        return self._cluster

    @property
    def dispatcher(self) -> Dispatcher:
        """Sends work to the ranks and gathers it; failures go to the recovering policy.
        SessionClosedError after ``shutdown()``."""
        self._check_open()
        return self._dispatch

    def _check_open(self) -> None:
        if self.state == "closed":
            raise SessionClosedError("this session was shut down; start a new fsdp_nb.Session()")

    @property
    def plain_dispatcher(self) -> Dispatcher:
        """A dispatcher on the same engines that only reports failures (no recovery, no
        echo): what recovery's own calls use, so they never recurse into recovery."""
        return self._plain

    @property
    def grace(self) -> float:
        """Seconds other ranks may keep running after one rank failed before the session
        stops them, raises the failure and recovers (``fsdp_nb.recovery``)."""
        return self._policy.grace

    @grace.setter
    def grace(self, seconds: float) -> None:
        check_grace(seconds)
        self._policy.grace = float(seconds)

    @property
    def client(self):
        """The underlying ``ipyparallel.Client`` (escape hatch)."""
        return self._cluster.client

    def view(self):
        """An ``ipyparallel.DirectView`` on all ranks' engines, in rank order."""
        return self._cluster.view()

    # -- running code -------------------------------------------------------------

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; results in rank order.

        ``fn`` may be defined in the notebook: it is shipped by value with the
        notebook globals it uses; other names resolve in the engine namespace.
        """
        if not callable(fn):
            raise TypeError(f"run() needs a callable, got {type(fn).__name__}")
        d = self.dispatcher
        what = f"run({getattr(fn, '__qualname__', type(fn).__name__)})"
        payload = (by_value(fn), by_value(args), by_value(kwargs))
        return d.gather(d.apply(what, _ns.call, args=payload, fast=True), timeout)

    def execute(
        self,
        code: str,
        *,
        ranks: Sequence[int] | None = None,
        output: str | None = "all",
        timeout: float | None = None,
    ) -> None:
        """Run ``code`` on every rank (as ``%%px`` does); raise the failing ranks' errors.

        ``ranks``: run on these ranks only (the others stay idle; code that calls a
        collective then waits for ranks that never join it). Output streams tagged by
        rank; ``output="rank0"`` shows one rank's. Use ``pull`` or ``run`` to get values.
        """
        self._execute(code, timeout, ranks=ranks, output=output, silent=True)

    def _execute(
        self,
        code: str,
        timeout: float | None,
        *,
        ranks: Sequence[int] | None = None,
        output: str | None = "all",
        silent: bool = False,
    ) -> list[Any]:
        """``execute`` returning each rank's ExecuteReply (its ``Out`` value, unless
        ``silent``), for ``%%px``."""
        if not isinstance(code, str):
            raise TypeError(f"execute() needs source code as str, got {type(code).__name__}")
        targets = check_ranks(ranks, self.world_size)
        echoed = check_output(output, targets)
        d = self.dispatcher
        return d.gather(
            d.execute(code, ranks=None if ranks is None else targets, echoed=echoed, silent=silent),
            timeout,
        )

    def push(self, mapping: Mapping[str, Any]) -> None:
        """Bind ``mapping``'s names on every rank (values shipped by value)."""
        if not isinstance(mapping, Mapping) or not all(isinstance(k, str) for k in mapping):
            raise TypeError("push() needs a mapping of str names to values")
        d = self.dispatcher
        d.gather(d.apply("push", _ns.assign, args=(by_value(dict(mapping)),), fast=True))

    def pull(self, name: str) -> list[Any]:
        """The value of engine global ``name`` on every rank, in rank order."""
        if not isinstance(name, str):
            raise TypeError(f"pull() needs a name (str), got {type(name).__name__}")
        d = self.dispatcher
        return d.gather(d.apply(f"pull({name!r})", _ns.get, args=(name,), fast=True))

    def all_reduce_check(self) -> float:
        """Run one collective (sum of ranks) on every rank; return its result."""
        d = self.dispatcher
        return d.gather(d.apply("all_reduce", _pg.all_reduce_rank, fast=True))[0]

    # -- models (fsdp_nb.sharding) -----------------------------------------------

    def wrap(self, model: Any, *args: Any, name: str = "model", **options: Any) -> ShardedModel:
        """Build (or take) ``model`` on every rank and shard it with FSDP2.

        ``model``: an nn.Module instance (its weights are sharded), a Module class or
        factory (built on the meta device, then materialized shard by shard), or the
        name of a module ``%%px`` code built. Binds the FSDP2 module as engine global
        ``name``. Options: see ``fsdp_nb.wrap_options.WrapOptions``.
        """
        from .sharding import wrap

        self._check_open()
        return wrap(self, model, args, name=name, **options)

    # -- checkpoints (fsdp_nb.checkpoint) -------------------------------------------

    def save(
        self,
        path: str,
        model: ShardedModel | str,
        *,
        optimizer: str | None = None,
        extra: dict[str, Any] | None = None,
        sharded: bool = True,
        overwrite: bool = False,
        async_save: bool = False,
        keep_last: int | None = None,
        progress: bool | None = None,
    ) -> Any:
        """Write a checkpoint of ``model`` (and engine global ``optimizer``) atomically.

        ``progress``: a bar of the bytes written (default: in a notebook, for more than a
        few hundred MB).
        """
        from .checkpoint import save

        self._check_open()
        return save(
            self, path, model, optimizer=optimizer, extra=extra, sharded=sharded,
            overwrite=overwrite, async_save=async_save, keep_last=keep_last, progress=progress,
        )

    def load(
        self,
        path: str,
        model: ShardedModel | str,
        *,
        optimizer: str | None = None,
        strict: bool = True,
        verify: bool = True,
        progress: bool | None = None,
        weights_only: bool = True,
    ) -> dict[str, Any]:
        """Load a checkpoint onto this world size; returns its ``extra``.

        ``path``: an fsdp_nb checkpoint (sharded folder, full file), a folder of plain
        ``dcp.save``, or safetensors weights (a file, or a Hugging Face folder).
        ``verify=False`` loads one whose files cannot be verified. ``progress``: a bar of
        the bytes read (default: in a notebook, for more than a few hundred MB).
        ``weights_only=False`` trusts the checkpoint's pickles (optimizer ``param_groups``,
        ``.pt`` files): they are unpickled as plain ``torch.load`` does, which can run
        arbitrary code; by default one that could is refused
        (``fsdp_nb.UnsafeCheckpointError``) before anything is loaded.
        """
        from .checkpoint import load

        self._check_open()
        return load(self, path, model, optimizer=optimizer, strict=strict, verify=verify,
                    progress=progress, weights_only=weights_only)

    # -- failures (fsdp_nb.recovery) ----------------------------------------------

    def status(self) -> Any:
        """Which rank is busy, idle or dead, and where a busy rank is (its stack)."""
        from .status import read_status

        return read_status(self)

    def restart(self, restore: str | None = None, *, drop: Sequence[str] = ()) -> Session:
        """Bring back the same ranks (dead engines replaced), rebuild the group and wraps.

        ``restore``: a checkpoint loaded into the last wrapped model afterwards (needed
        to bring back a model wrapped from a notebook instance, whose weights are not
        kept); ``drop``: names of wrapped models not to rebuild.
        """
        from .recovery import restart

        if isinstance(drop, str) or not all(isinstance(n, str) for n in drop):
            raise TypeError(f"drop must be a list of wrapped model names, got {drop!r}")
        self._check_open()
        try:
            return restart(self, restore=restore, drop=tuple(drop))
        finally:
            if self.state != "closed":
                if self.keeper is not None:
                    self.keeper.refresh(self)  # new engines: the watchdog must know their pids
                self.cluster.keep_standby()  # one for the next death, if this one was used

    def debug(self, rank: int | None = None, commands: Sequence[str] | None = None) -> str | None:
        """Post-mortem pdb on the frame where ``rank`` failed (default: the first rank
        that failed in the last ``RankError``).

        Interactive (commands read with ``input()``) unless ``commands`` is given, e.g.
        ``["p y", "up", "p x"]``: then they run on that rank and their output is
        returned. Each rank keeps its last failure until the next one.
        """
        from .postmortem import debug

        self._check_open()
        return debug(self, rank, commands)

    def reload(self, module: str) -> list[int]:
        """Reload ``module`` on every rank that imported it, and in the notebook, so the
        next cell, ``run`` or ``wrap`` uses the edited code (models already built keep
        theirs; names bound with ``from module import X`` are re-bound). Returns the
        ranks it was reloaded on."""
        from .reloading import reload

        self._check_open()
        return reload(self, module)

    # -- widgets (fsdp_nb.widgets) -------------------------------------------------

    def memory(self, **kwargs: Any) -> Any:
        """Live per-rank memory widget (updates while a cell trains)."""
        from .widgets.memory import memory_widget

        return memory_widget(self, **kwargs)

    def status_widget(self) -> Any:
        """Per-rank status that follows the session live: busy, failed, dead, recovering,
        recovered, with a log of failures and recoveries (``sess.status()`` is a snapshot)."""
        from .widgets.status import status_widget

        return status_widget(self)

    def checkpoints(self, root: str, **kwargs: Any) -> Any:
        """Checkpoint browser widget for a local folder or fsspec URL."""
        from .widgets.checkpoints import checkpoint_browser

        return checkpoint_browser(self, root, **kwargs)

    def dashboard(self, **kwargs: Any) -> Any:
        """Status, memory, layouts and checkpoints in one widget."""
        from .widgets.dashboard import dashboard

        return dashboard(self, **kwargs)

    # -- lifecycle ----------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the engines and controller this session started (nothing else).

        Async saves still writing are finished and committed first, so none is lost.
        """
        if self.state == "closed":
            return
        saving = sys.modules.get(f"{__package__}.checkpoint.pending")  # loaded only if used
        if saving is not None and self.state == "ready":
            try:
                saving.wait_pending(self)
            except Exception as exc:  # noqa: BLE001 - shutting down regardless
                warnings.warn(f"an async checkpoint did not finish: {exc}", stacklevel=2)
        self.lifecycle.to("closed")
        _LIVE.discard(self)
        if self.keeper is not None:
            self.keeper.end()
        try:
            if not self._cluster.owns_engines:
                try:
                    self._dispatch.gather(
                        self._dispatch.apply("destroy_process_group", _pg.destroy), timeout=30
                    )
                except Exception as exc:
                    log.warning("could not leave the process group on the connected engines: %s", exc)
        finally:
            self.channel.close()
            self._cluster.stop()
            self.health.close()
            from .magics import deactivate_px

            deactivate_px(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _rows(self) -> list[tuple[str, ...]]:
        return [
            (str(r.rank), str(r.engine_id), r.host, str(r.pid), r.device, f"{r.local_rank}/{r.local_world_size}")
            for r in self.ranks
        ]

    def __repr__(self) -> str:
        head = (
            f"<fsdp_nb.Session {self.state}: {self.world_size} ranks, "
            f"backend={self.backend}, launcher={self.launcher}>"
        )
        cols = ("rank", "engine", "host", "pid", "device", "local")
        rows = [cols, *self._rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
        return head + "\n" + "\n".join("  " + line for line in lines)

    def _repr_html_(self) -> str:
        cols = ("rank", "engine", "host", "pid", "device", "local rank")
        th = "".join(f"<th>{c}</th>" for c in cols)
        trs = "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>"
            for row in self._rows()
        )
        return (
            f"<div><b>fsdp_nb.Session</b> &mdash; state <code>{self.state}</code>, "
            f"{self.world_size} ranks, backend <code>{self.backend}</code>, "
            f"launcher <code>{html.escape(self.launcher)}</code>"
            f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table></div>"
        )


@atexit.register
def _shutdown_all() -> None:
    """At interpreter exit, stop every open session except those kept alive."""
    for sess in list(_LIVE):
        if sess.keeper is not None and sess.keeper.keep_alive:
            continue
        try:
            sess.shutdown()
        except Exception as exc:
            log.warning("shutting down a session at exit failed: %s", exc)
