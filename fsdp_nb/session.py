"""The ``Session`` façade: one object a notebook holds to drive every rank.

Each method checks its arguments, then delegates in one line to the feature that does
the work, handing it the session's :class:`~fsdp_nb.context.SessionContext`:
``lifetime`` starts, attaches and stops sessions, ``runtime`` runs code on the ranks,
``models`` wraps, ``checkpoints`` saves and loads, ``autosave`` saves on its own,
``memory`` plans, ``steps`` measures, ``recovery`` restarts and explains, ``frontends``
draws.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .autosave.session_autosave import SessionAutosave
from .checkpoints.session_checkpoints import SessionCheckpoints
from .context import SessionContext, SessionFacts
from .debugging.cell_debug import (
    armed_cell,
    check_collectives_option,
    check_debug,
    check_debug_commands,
)
from .errors import hide_frame
from .frontends import magics
from .frontends.session_view import session_html, session_text
from .frontends.session_widgets import SessionWidgets, layout_view
from .lifetime import start_stop
from .lifetime.keepalive import check_keep_alive
from .memory.session_planning import SessionPlanning
from .recovery.session_recovery import SessionRecovery
from .runtime import calls, checks
from .runtime.phases import phase_table
from .steps.step_profile import SessionProfiling

if TYPE_CHECKING:
    import ipyparallel as ipp

    from .models.sharded_model import ShardedModel

log = logging.getLogger("fsdp_nb")

__all__ = ["Session"]

_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()
"""Every open session of this kernel: shut down at exit, found again by ``attach``."""


class Session(SessionFacts, SessionCheckpoints, SessionAutosave, SessionRecovery, SessionPlanning, SessionProfiling,
              SessionWidgets):
    """An ipyparallel cluster whose engines are the ranks of one process group.

    ``Session(n)`` starts the engines and forms the group; ``Session.connect`` takes a
    cluster started elsewhere (mpiexec, Slurm); ``Session.attach`` takes back one a
    previous kernel kept alive. A context manager: ``shutdown()`` on exit stops only
    what this session started.

    Args:
        n: number of ranks (default: one per visible GPU, or 2 CPU engines on gloo).
        backend: ``"nccl"`` or ``"gloo"`` (default: nccl when there are GPUs).
        launcher: ipyparallel's engine launcher: ``"local"``, ``"mpi"``, ``"slurm"``, ...
        timeout: seconds to wait for the engines to start and register.
        pg_timeout: seconds a collective may wait before torch.distributed gives up.
        activate: make ``%%px`` / ``%px`` run on this session's ranks.
        grace: seconds other ranks may keep running after one rank failed before the
            session stops them, raises the failure and recovers.
        hang_after: seconds a collective may wait before the running cell shows who
            waits in which collective and who is missing, and where (None: never).
        keep_alive: ``True`` (or seconds of idleness allowed): the engines outlive this
            kernel, and ``Session.attach()`` in the next one takes them back.
        verbose: print how long each phase of the start took (``start_phases``).
        standby: keep one engine started and imported but unregistered, to take a dead
            rank's place at once (local launcher; ``fsdp_nb.runtime.standby``).
        **cluster_kwargs: passed on to ``ipyparallel.Cluster`` (``controller_ip``,
            ``queue``, ``engine_timeout``, ...) or its launchers; Slurm's ``options``
            go on ``sbatch``'s command line.
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
        hang_after: float | None = start_stop.HANG_AFTER,
        keep_alive: bool | float = False,
        verbose: bool = False,
        standby: bool = True,
        **cluster_kwargs: Any,
    ):
        n, backend = checks.validate(n, backend, launcher)
        checks.check_grace(grace)
        checks.check_hang_after(hang_after)
        checks.check_standby(standby)
        keep_alive = check_keep_alive(keep_alive)
        self._open(start_stop.start(
            n, backend, launcher, timeout=timeout, pg_timeout=pg_timeout, grace=grace,
            keep_alive=keep_alive, standby=standby, cluster_kwargs=cluster_kwargs,
        ), activate)
        self.hang_after = hang_after
        if verbose:
            print(phase_table(self.start_phases), flush=True)  # asked for: the user reads it

    def _open(self, ctx: SessionContext, activate: bool) -> None:
        self._ctx = ctx
        ctx.layout_view = layout_view
        from .checkpoints.load import fill_weights  # the features the models' handles reach up to
        from .memory.memory_plan import measure

        ctx.fill_weights, ctx.measure_memory = fill_weights, measure
        _LIVE.add(self)
        if activate:
            magics.activate_px(self)

    @classmethod
    def _from(cls, ctx: SessionContext, activate: bool) -> Session:
        (self := object.__new__(cls))._open(ctx, activate)
        return self

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
        keep_alive: bool | float = False,
    ) -> Session:
        """Attach to a running ipyparallel cluster and form the process group on its engines.

        ``shutdown()`` leaves those engines running.

        Args:
            url_file: the cluster's client connection file (``ipcontroller-client.json``).
            profile: the IPython profile it runs under (instead of ``url_file``).
            cluster_id: its cluster id (with ``profile``).
            n: wait for this many engines and use the first ``n``.
            backend: ``"nccl"`` / ``"gloo"``; None picks nccl when every engine has a GPU
                of its own, else gloo (from the engines' probes, before the group forms).
            timeout: seconds to wait for the engines.
            pg_timeout: seconds a collective may wait before torch.distributed gives up.
            activate: make ``%%px`` run on these ranks.
            grace: as ``Session``'s.
            keep_alive: ``True`` (or seconds of idleness allowed): a later kernel can
                ``Session.attach()`` to the group and models.
        """
        checks.check_n_backend(n, backend)
        checks.check_grace(grace)
        alive = check_keep_alive(keep_alive)
        return cls._from(start_stop.connect(
            url_file, profile=profile, cluster_id=cluster_id, n=n, backend=backend, timeout=timeout,
            pg_timeout=pg_timeout, grace=grace, keep_alive=alive,
        ), activate)

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

        The ranks come back in the same order, in the same process group (re-formed only
        if it broke), with every engine variable; ``sess.models`` maps each wrapped name
        to its ``ShardedModel``. In the kernel that holds it, the session itself.

        Args:
            cluster_id: which one (``fsdp_nb.sessions()`` lists them); default the most
                recent that no running kernel holds.
            timeout: seconds to wait for the engines to answer.
            activate: make ``%%px`` run on these ranks.
            grace: as ``Session``'s.
        """
        from .lifetime.attach import find

        checks.check_grace(grace)
        record = find(cluster_id)
        held = [s for s in _LIVE if record.owner_pid == os.getpid() and s._ctx.keeper is not None
                and s._ctx.keeper.record.cluster_id == record.cluster_id]
        if held:
            return held[0]
        return cls._from(start_stop.attach(record, timeout=timeout, grace=grace), activate)

    # -- what it is ---------------------------------------------------------------

    @property
    def context(self) -> SessionContext:
        """The session context every feature takes: engines, dispatchers, registries."""
        return self._ctx

    @property
    def grace(self) -> float:
        """Seconds other ranks may keep running after one rank failed before the session
        stops them, raises the failure and recovers (``fsdp_nb.recovery``)."""
        return self._ctx.recovering.policy.grace

    @grace.setter
    def grace(self, seconds: float) -> None:
        checks.check_grace(seconds)
        self._ctx.recovering.policy.grace = float(seconds)

    @property
    def hang_after(self) -> float | None:
        """Seconds a collective may wait before the running cell explains it (None: never)."""
        return self._ctx.recovering.hang_after

    @hang_after.setter
    def hang_after(self, seconds: float | None) -> None:
        self._ctx.recovering.hang_after = checks.check_hang_after(seconds)

    @property
    def check_collectives(self) -> bool | float:
        """Whether every cell's collectives are checked across their group before they are
        issued (False: off, the default; True or seconds to wait for the other ranks;
        ``docs/how-to/debugging.md`` says what it costs per collective)."""
        return self._ctx.check_collectives or False

    @check_collectives.setter
    def check_collectives(self, value: bool | float) -> None:
        self._ctx.check_collectives = check_collectives_option(value)

    @property
    def client(self) -> ipp.Client:
        """The underlying ``ipyparallel.Client`` (escape hatch)."""
        return self._ctx.cluster.client

    def view(self) -> ipp.DirectView:
        """An ``ipyparallel.DirectView`` on all ranks' engines, in rank order."""
        return self._ctx.cluster.view()

    # -- running code -------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            hang_after: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; results in rank order.

        Args:
            fn: a function; one defined in the notebook is shipped by value with the
                notebook globals it uses, other names resolve in the engine namespace.
            *args: its positional arguments (shipped by value).
            timeout: seconds before the call is stopped on every rank (None: no limit).
            hang_after: seconds a collective may wait before the call is explained
                while it runs (None: the session's ``hang_after``).
            **kwargs: its keyword arguments (shipped by value).
        """
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        if not callable(fn):
            raise TypeError(f"run() needs a callable, got {type(fn).__name__}")
        return calls.run(self.dispatcher, fn, args, kwargs, timeout, checks.check_hang_after(hang_after),
                         self._ctx.merge_output, ctx=self._ctx)

    def execute(self, code: str, *, ranks: Sequence[int] | None = None, output: str | None = "all",
                timeout: float | None = None, hang_after: float | None = None,
                debug: int | Sequence[int] | None = None, check_collectives: bool | float | None = None,
                debug_commands: str | Sequence[str] | None = None) -> None:
        """Run ``code`` on every rank (as ``%%px`` does); raise the failing ranks' errors.

        Use ``pull`` or ``run`` to get values back.

        Args:
            code: Python source.
            ranks: run on these ranks only (the others stay idle; code that calls a
                collective then waits for ranks that never join it).
            output: whose printed output to show: ``"all"`` (a line the ranks printed
                alike once, ``[ranks 0-7] ...``, unless ``merge_output`` is False; the
                others tagged by rank), ``"each"`` (every rank's own lines), ``"rankN"``,
                or ``"none"`` (None too: nothing shown; a failing rank's error still raises).
            timeout: seconds before the code is stopped on every rank (None: no limit).
            hang_after: seconds a collective may wait before the call is explained
                while it runs (None: the session's ``hang_after``).
            debug: the rank(s) whose ``breakpoint()`` (or ``pdb.set_trace()``) stops them
                in this code, with a ``(Pdb rank N)`` prompt under the cell (None: none).
            check_collectives: compare each collective across its group before it is
                issued, raising ``CollectiveMismatchError`` on every rank at a difference
                (True, or seconds to wait for the other ranks; False: not this cell; None:
                the session's ``check_collectives``).
            debug_commands: pdb lines sent at each stop before the prompt asks, shown as if
                typed (a list, or one string with ``;;`` between them): ``"p loss.item();; c"``
                prints and goes on, a breakpoint that asks nothing (None: none).
        """
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        self._execute(code, timeout, ranks=ranks, output=output, silent=True, hang_after=hang_after, debug=debug,
                      check_collectives=check_collectives, debug_commands=debug_commands)

    def _execute(self, code: str, timeout: float | None, *, ranks: Sequence[int] | None = None,
                 output: str | None = "all", silent: bool = False, hang_after: float | None = None,
                 debug: int | Sequence[int] | None = None, check_collectives: bool | float | None = None,
                 debug_commands: str | Sequence[str] | None = None) -> list[Any]:
        """``execute`` returning each rank's ExecuteReply (its ``Out`` value, unless
        ``silent``), for ``%%px``."""
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        if not isinstance(code, str):
            raise TypeError(f"execute() needs source code as str, got {type(code).__name__}")
        targets = checks.check_ranks(ranks, self.world_size)
        echoed, hang_after = checks.check_output(output, targets), checks.check_hang_after(hang_after)
        limit = self._ctx.check_collectives if check_collectives is None else check_collectives_option(check_collectives)
        with armed_cell(self._ctx, targets, check_debug(debug, self.world_size, targets), limit, check_debug_commands(debug_commands)):
            replies = calls.execute(self.dispatcher, code, timeout, ranks=None if ranks is None else targets,
                                    echoed=echoed, silent=silent, merged=self._ctx.merge_output and output != "each",
                                    hang_after=hang_after, ctx=self._ctx)
        if ranks is None:  # on every rank: a rank that joins later is given its definitions
            self._ctx.definitions.note_code(code)
        return replies

    def push(self, mapping: Mapping[str, Any]) -> None:
        """Bind ``mapping``'s names on every rank (values shipped by value).

        Args:
            mapping: engine global name -> value.
        """
        if not isinstance(mapping, Mapping) or not all(isinstance(k, str) for k in mapping):
            raise TypeError("push() needs a mapping of str names to values")
        calls.push(self.dispatcher, mapping)
        self._ctx.definitions.note_push(mapping)

    def pull(self, name: str) -> list[Any]:
        """The value of engine global ``name`` on every rank, in rank order.

        Args:
            name: the engine global to read.
        """
        if not isinstance(name, str):
            raise TypeError(f"pull() needs a name (str), got {type(name).__name__}")
        return calls.pull(self.dispatcher, name)

    def all_reduce_check(self) -> float:
        """Run one collective (sum of ranks) on every rank; return its result."""
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        return calls.all_reduce_check(self.dispatcher)

    # -- models -------------------------------------------------------------------

    def wrap(self, model: Any, *args: Any, name: str = "model", weights: str | None = None,
             **options: Any) -> ShardedModel:
        """Build (or take) ``model`` on every rank and shard it with FSDP2.

        Args:
            model: an nn.Module instance (its weights are sharded), a Module class or
                factory (built on the meta device, then materialized shard by shard), or
                the name of a module ``%%px`` code built.
            *args: arguments of the class or factory.
            name: the engine global the FSDP2 module is bound to.
            weights: fill a class-built model from this Hugging Face folder, safetensors
                file, fsdp_nb or DCP checkpoint instead of initialising it (each rank
                reads only its slices; every parameter must be there).
            **options: how to shard (``sharding``, ``auto_wrap``, ``mixed_precision``,
                ``cpu_offload``, ``activation_checkpointing``, ``parallelize``,
                ``data_parallel_size``, ``tensor_parallel_size``, ``init_fn``, ``compile``, ...; see
                ``fsdp_nb.WrapOptions``) and keyword arguments of the class or factory.
        """
        from .models.wrap import wrap

        self._ctx.check_open()
        return wrap(self._ctx, model, args, name=name, weights=weights, **options)

    def reload(self, module: str) -> list[int]:
        """Reload ``module`` on every rank that imported it, and in the notebook, so the
        next cell, ``run`` or ``wrap`` uses the edited code (models already built keep
        theirs; names bound with ``from module import X`` are re-bound). Returns the
        ranks it was reloaded on.

        Args:
            module: the module's import name, e.g. ``"mymodel"``.
        """
        from .models.reload import reload

        self._ctx.check_open()
        return reload(self._ctx, module)

    # -- lifecycle ----------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the engines and controller this session started (nothing else).

        Async saves still writing are finished and committed first, so none is lost.
        """
        _LIVE.discard(self)
        try:
            start_stop.stop(self._ctx)
        finally:
            magics.deactivate_px(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return session_text(self._ctx)

    def _repr_html_(self) -> str:
        return session_html(self._ctx)


@atexit.register
def _shutdown_all() -> None:
    """At interpreter exit, stop every open session except those kept alive."""
    for sess in list(_LIVE):
        if sess.keep_alive:
            continue
        try:
            sess.shutdown()
        except Exception as exc:  # noqa: BLE001 - exiting: log each session's failure, stop the rest
            log.warning("shutting down a session at exit failed: %s", exc)
