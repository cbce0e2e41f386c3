"""The session context: the one small object every feature takes instead of ``Session``.

A ``Session`` is a façade over one :class:`SessionContext`. Features (wrap, save and
load, recovery, status, widgets, attach) take the context, read what they need of it
and keep their own per-session state in its registries, never in module globals keyed
by session. The context knows the runtime (engines, calls, health); the features
above it are only named here for their types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import SessionClosedError
from .runtime.call_channel import CallChannel
from .runtime.cluster import EngineCluster
from .runtime.definitions import Definitions
from .runtime.dispatch import Dispatcher
from .runtime.health import RankHealth
from .runtime.lifecycle import Lifecycle
from .runtime.rendezvous import RankInfo

if TYPE_CHECKING:
    from .autosave.wire_autosave import AutosaveSpec
    from .checkpoints.async_saves import AsyncCheckpoint
    from .lifetime.keepalive import Keeper
    from .memory.memory_report import MemoryPlan
    from .memory.wire_memory_sample import MemorySample
    from .models.sharded_model import ShardedModel
    from .models.wrap import WrapRecord

__all__ = ["SessionContext", "SessionFacts"]


@dataclass(eq=False, kw_only=True)
class SessionContext:
    """One session's engines, how calls reach them, and what features registered on it."""

    cluster: EngineCluster
    """The engines: rank <-> engine map, liveness, process control."""
    recovering: Dispatcher
    """Sends work to the ranks and gathers it; a failure goes to the recovering policy."""
    plain_dispatcher: Dispatcher
    """The same engines, failures only reported (no recovery, no echo): what recovery's
    own calls use, so they never recurse into recovery."""
    channel: CallChannel
    """Signed sockets to the engines: the fast path of ``run``, ``push`` and ``pull``."""
    health: RankHealth
    """The engines' health hooks: stack dumps, NCCL abort listeners."""
    backend: str | None
    """Process-group backend (``gloo``, ``nccl``); None until the group is formed."""
    launcher: str
    """The ipyparallel launcher that started the engines, or ``"connected"``."""
    pg_timeout: float
    """Seconds a collective may wait before torch.distributed gives up."""
    omp_threads: int | None
    """``OMP_NUM_THREADS`` given to CPU ranks (None: not set by fsdp_nb)."""
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    """The session's state machine."""
    wraps: dict[str, WrapRecord] = field(default_factory=dict)
    """Engine global name -> how it was wrapped, replayed by ``restart()``."""
    models: dict[str, ShardedModel] = field(default_factory=dict)
    """Engine global name -> the ``ShardedModel`` of each model wrapped on the ranks."""
    definitions: Definitions = field(default_factory=Definitions)
    """Imports, classes and functions made on every rank: what a rank that joins later
    is given (``sess.resize``, ``sess.restart``)."""
    saves: list[AsyncCheckpoint] = field(default_factory=list)
    """Async saves still being written; the next save, load or shutdown waits for them."""
    autosave: AutosaveSpec | None = None
    """The ranks' autosave (``sess.autosave``), re-armed by ``restart``; None when off."""
    last_autosave: AutosaveSpec | None = None
    """The last autosave armed, kept after it stops: where ``restore="latest"`` looks."""
    suspended_autosave: AutosaveSpec | None = None
    """An autosave a restart suspended (it rebuilt the models at their initial weights, and
    restored nothing): the next ``restart(restore=...)`` arms it again; None when none is."""
    after_call: list[Callable[[SessionContext, bool], None]] = field(default_factory=list)
    """Run after every user call (``sess.run``, ``sess.execute``, ``%%px``) while the session
    is ready, told whether it succeeded on every rank (``runtime.calls``): what a feature
    must do on every rank once a cell ended on all of them (the autosave writes a save
    that fell due at the cell's last step). A feature adds itself and removes itself."""
    keeper: Keeper | None = None
    """The session record and watchdog (None for a connected session not kept alive)."""
    last_memory: dict[int, MemorySample] = field(default_factory=dict)
    """Rank -> its last memory sample (``sess.memory()``'s feed): what a rank the OOM
    killer ended last held."""
    last_plan: MemoryPlan | None = None
    """The last ``sess.plan``: an out-of-memory error names its cheapest change that fits."""
    restart_phases: dict[str, float] = field(default_factory=dict)
    """Seconds each phase of the last ``restart()`` took (empty before one)."""
    start_phases: dict[str, float] = field(default_factory=dict)
    """Seconds each phase of this session's start took."""
    check_collectives: float | None = None
    """Every cell's collectives are checked, waiting this many seconds for the others
    (``Session.check_collectives``; None: off)."""
    debugged_cells: int = 0
    """Cells armed for debugging so far: each one's number keys its checks on the ranks."""
    merge_output: bool = True
    """Lines the ranks print alike show once, naming the ranks (``[ranks 0-7] ...``); False
    shows each rank's own lines (``Session.merge_output``)."""
    layout_view: Callable[[ShardedModel], Any] | None = None
    """Makes a wrapped model's shard layout widget (``ShardedModel.layout()``): put here by
    the ``Session`` façade, since the front ends sit above the models that offer it."""
    fill_weights: Callable[[SessionContext, str, str], None] | None = None
    """Fills the just-built model (its engine global name) from a checkpoint or weights
    folder (``sess.wrap(..., weights=)``, and its replay by ``restart``): put here by the
    ``Session`` façade (``fsdp_nb.checkpoints.load.fill_weights``), since the checkpoints
    sit above the models they fill."""
    measure_memory: Callable[..., MemoryPlan] | None = None
    """Runs real training steps on the ranks under the memory tracker
    (``ShardedModel.measure_memory``): put here by the ``Session`` façade
    (``fsdp_nb.memory.memory_plan.measure``), since the memory feature sits above the
    models it measures."""

    @property
    def state(self) -> str:
        """``starting``, ``ready``, ``degraded``, ``unfinished`` (a restart stopped part way:
        calls are refused until a restart runs to its end), ``failed`` or ``closed``."""
        return self.lifecycle.state

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.cluster.ranks)

    @property
    def ranks(self) -> list[RankInfo]:
        """Per-rank info in rank order."""
        return list(self.cluster.ranks)

    @property
    def dispatcher(self) -> Dispatcher:
        """The recovering dispatcher; ``SessionClosedError`` once the session is shut down."""
        self.check_open()
        return self.recovering

    def check_open(self) -> None:
        """Raise ``SessionClosedError`` when the session was shut down."""
        if self.state == "closed":
            raise SessionClosedError("this session was shut down; start a new fsdp_nb.Session()")


class SessionFacts:
    """What a session is, read from its context: the ``Session`` façade's read-only
    properties (sizes, state, engines, registries)."""

    _ctx: SessionContext

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._ctx.world_size

    @property
    def ranks(self) -> list[RankInfo]:
        """Per-rank info in rank order: rank, engine id, host, pid, device, local rank."""
        return self._ctx.ranks

    @property
    def state(self) -> str:
        """``ready``, ``degraded`` (a rank died: ``restart()``), ``unfinished`` (a restart
        stopped part way: every call is refused, saying where, until ``restart()`` runs to its
        end), ``closed``, ``failed`` (or ``starting``)."""
        return self._ctx.state

    @property
    def merge_output(self) -> bool:
        """Whether a cell's lines that every shown rank printed alike show once, as
        ``[ranks 0-7] step 10 loss 2.31`` (the default), or each rank's own, tagged
        (False; one call: ``output="each"``, ``%%px --output each``)."""
        return self._ctx.merge_output

    @merge_output.setter
    def merge_output(self, merge: bool) -> None:
        if not isinstance(merge, bool):
            raise TypeError(f"merge_output must be True or False, got {merge!r}")
        self._ctx.merge_output = merge

    @property
    def backend(self) -> str | None:
        """Process-group backend (``gloo``, ``nccl``)."""
        return self._ctx.backend

    @property
    def launcher(self) -> str:
        """The ipyparallel launcher that started the engines, or ``"connected"``."""
        return self._ctx.launcher

    @property
    def keep_alive(self) -> bool | float:
        """Whether the engines outlive this kernel (seconds: until idle that long)."""
        return self._ctx.keeper.keep_alive if self._ctx.keeper is not None else False

    @property
    def models(self) -> dict[str, ShardedModel]:
        """Engine global name -> the ``ShardedModel`` of each model wrapped on the ranks."""
        return self._ctx.models

    @property
    def start_phases(self) -> dict[str, float]:
        """Seconds each phase of this session's start took (``verbose=True`` prints them)."""
        return self._ctx.start_phases

    @property
    def restart_phases(self) -> dict[str, float]:
        """Seconds each phase of the last ``restart()`` took (empty before one)."""
        return self._ctx.restart_phases

    @property
    def cluster(self) -> EngineCluster:
        """The engines: rank <-> engine map, liveness, process control."""
        return self._ctx.cluster

    @property
    def dispatcher(self) -> Dispatcher:
        """Sends work to the ranks and gathers it; failures go to the recovering policy.
        SessionClosedError after ``shutdown()``."""
        return self._ctx.dispatcher
