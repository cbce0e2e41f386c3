"""What this rank holds by kind (parameters, gradients, optimizer state), read on the main
thread only and kept for the memory sampler's thread.

The sampler used to read the tensors from its own thread while the main thread trained,
and that crashed engines: about one quickstart in twenty on 2 busy cores lost a rank to
a SIGSEGV in ``untyped_storage()`` (``THPVariable_storage``) on the sampler's thread; a
thread reading them every 2 ms through an FSDP2 training loop crashed a rank at once.
A tensor that the training step changes is not safe to read from another thread. So the
sampler never touches one. :meth:`KindReadings.note` reads them on the main thread: at
each step's end (the rank's step owner tells it, order 70: at most once per ``EVERY``
seconds), at the end of each cell (or ``sess.run`` call), when a feed starts and when the
group forms again; :meth:`KindReadings.kept` hands the sampler the last reading. The
engine's readings are its :class:`MemoryKinds` part's (:func:`readings`); a test makes
its own, handing it the models, the namespace and the clock it reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from ..engine.namespace import user_ns
from ..engine.registry import Part, World, part
from ..engine.side_channel import Reading
from ..engine.step import StepListener, owner
from ..models.rank_wrap import wrapped
from ..torch_compat import local_tensor

__all__ = ["EVERY", "KindReadings", "MemoryKinds", "MemoryReading", "by_kind", "copy_bytes", "note_copies", "readings"]

log = logging.getLogger("fsdp_nb")

EVERY = 1.0
"""Seconds between two readings after optimizer steps (one reading walks every
parameter, gradient and state tensor: a fraction of a millisecond for a small model)."""


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct storages under ``tensors`` (DTensors: their local shards)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        t = local_tensor(t)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, AttributeError):
            continue
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def by_kind(models: Mapping[str, Any] | None = None, namespace: Mapping[str, Any] | None = None,
            ) -> tuple[int, int, int] | None:
    """(parameters and buffers, gradients, optimizer state) bytes this rank holds for the
    wrapped models and the optimizers among the engine globals; None when no model is
    wrapped. Main thread only (see the module's docstring).

    Args:
        models: name -> wrapped model (default: this engine's, ``rank_wrap.wrapped()``).
        namespace: where optimizers are looked for (default: the engine's globals).
    """
    models = wrapped() if models is None else models
    if not models:
        return None
    import torch

    modules = [w.module for w in list(models.values())]
    params = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    names = user_ns() if namespace is None else namespace
    state = [v for o in list(names.values()) if isinstance(o, torch.optim.Optimizer)
             for s in list(o.state.values()) for v in list(s.values()) if isinstance(v, torch.Tensor)]
    return _bytes(params), _bytes(grads), _bytes(state)


_SLOTS = MappingProxyType({"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "RMSprop": 1,
                           "SGD": 1})
"""Tensors like a parameter an optimizer keeps per parameter (before its first step, when
its state is still empty); an optimizer not listed is counted at 2."""


def copy_bytes(model: Any, optims: list[Any]) -> int:
    """Bytes of this rank's shards of ``model`` (parameters and buffers) and of ``optims``'
    state: what one copy of the in-memory autosave holds (an optimizer that has not stepped
    yet is counted by its kind). Fake tensors (a plan) are counted as real ones."""
    import torch

    def size(t: Any) -> int:
        t = local_tensor(t)
        return int(t.numel() * t.element_size())

    total = sum(size(p) for p in model.parameters()) + sum(size(b) for b in model.buffers())
    for o in optims:
        held = [v for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        if held:
            total += sum(size(v) for v in held)
        else:
            total += _SLOTS.get(type(o).__name__, 2) * sum(size(p) for g in o.param_groups for p in g["params"])
    return total


class KindReadings(StepListener):
    """The last reading of what this rank holds by kind, made on the main thread; kept
    current, once installed, by the step owner's events.

    Args:
        read: makes a reading (default: :func:`by_kind` of this engine's models).
        every: seconds between two readings after optimizer steps.
        clock: seconds, monotonic.
        on_main_thread: whether the caller is the main thread (only it reads tensors).
    """

    order: ClassVar[int] = 70

    def __init__(self, read: Callable[[], tuple[int, int, int] | None] = by_kind, every: float = EVERY,
                 clock: Callable[[], float] = time.monotonic,
                 on_main_thread: Callable[[], bool] = lambda: threading.current_thread() is threading.main_thread()):
        self.read, self.every, self.clock, self.on_main_thread = read, every, clock, on_main_thread
        self.value: tuple[int, int, int] | None = None
        """The last reading (None: none yet, or no model wrapped)."""
        self.at = float("-inf")
        """When it was made (``clock``)."""
        self.installed = False
        """Whether the step owner tells it (``install``)."""

    def note(self, force: bool = False) -> None:
        """Make a reading now and keep it, if this is the main thread and (unless
        ``force``) ``every`` seconds have passed since the last one."""
        if not self.on_main_thread():
            return
        now = self.clock()
        if not force and now - self.at < self.every:
            return
        try:
            self.value = self.read()
        except RuntimeError as exc:  # a model mid-change (a failed wrap): the last reading stays
            log.debug("fsdp_nb: reading what this rank holds failed: %s", exc)
        self.at = now

    def kept(self) -> tuple[int, int, int] | None:
        """The last reading (:meth:`note`): safe from any thread, as it touches no tensor."""
        return self.value

    def step_ended(self, step: int, optimizer: Any) -> None:
        self.note()

    def step_joined(self, step: int, optimizer: Any) -> None:
        self.note()

    def cell_ended(self, failed: bool) -> None:
        self.note(force=True)

    def loaded(self, extra: dict[str, Any] | None) -> None:
        self.note(force=True)

    def watched(self, module: Any) -> None:
        self.note(force=True)  # a wrap just built a model: what the rank holds changed

    def install(self) -> None:
        """Keep the reading current from now on (idempotent; call on the main thread): the
        rank's step owner tells it each step's end, each cell's, each load and each model a
        wrap builds; then read once."""
        owner().listen(self)
        self.installed = True
        self.note(force=True)

    def uninstall(self) -> None:
        """Undo :meth:`install`: no more readings after steps or cells."""
        owner().unlisten(self)
        self.installed = False


class MemoryKinds(Part):
    """This rank's readings by kind (the registry's part): what its memory samples carry."""

    def __init__(self) -> None:
        self.readings = KindReadings()
        self.copies = 0
        """Host bytes the in-memory autosave's copies hold on this rank (its own and its
        ward's generations), as the autosave last said (:func:`note_copies`)."""

    def reformed(self, world: World) -> None:
        """The models may have been rebuilt or re-sharded: read again, if a feed reads them."""
        if self.readings.installed:
            self.readings.note(force=True)

    def closed(self) -> None:
        self.readings.uninstall()
        self.readings.value = None


def note_copies(nbytes: int) -> None:
    """The in-memory autosave's copies now hold ``nbytes`` of host memory on this rank
    (what its memory samples say from now on)."""
    part(MemoryKinds).copies = int(nbytes)


def readings() -> KindReadings:
    """This engine's readings (its :class:`MemoryKinds` part's)."""
    return part(MemoryKinds).readings


class MemoryReading(Reading):
    """What the memory feed's sampler publishes: this rank's ``MemorySample``, from the
    main thread's last reading by kind (the sampler's thread touches no tensor)."""

    name = "memory"

    @classmethod
    def prepare(cls) -> None:
        """Keep this engine's readings current from now on (main thread)."""
        readings().install()

    def read(self, rank: int, seq: int, process: Any) -> Any:
        from .rank_memory_sample import read

        return read(rank, readings().kept(), seq=seq, process=process, copies=part(MemoryKinds).copies or None)
