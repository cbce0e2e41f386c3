"""What this rank holds by kind (parameters, gradients, optimizer state), read on the
main thread only and kept for the memory sampler's thread.

The sampler used to read the tensors from its own thread while the main thread trained,
and that crashed engines: about one quickstart in twenty on 2 busy cores lost a rank to
a SIGSEGV in ``untyped_storage()`` (``THPVariable_storage``) on the sampler's thread; a
thread reading them every 2 ms through an FSDP2 training loop crashed a rank at once.
A tensor that the training step changes is not safe to read from another thread. So the
sampler never touches one. :meth:`KindReadings.note` reads them on the main thread: after each
optimizer step (a hook on every optimizer, at most once per ``EVERY`` seconds), at the
end of each cell, after a wrap and when a feed starts; :meth:`KindReadings.kept` hands the
sampler the last reading. The engine's readings are :data:`READINGS`; a test makes its own,
handing it the models, the namespace and the clock it reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..engine.namespace import user_ns
from ..engine.side_channel import Reading
from ..models.rank_wrap import on_wrapped, wrapped
from ..torch_compat import local_tensor

__all__ = ["EVERY", "READINGS", "KindReadings", "MemoryReading", "by_kind"]

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


class KindReadings:
    """The last reading of what this rank holds by kind, made on the main thread.

    Args:
        read: makes a reading (default: :func:`by_kind` of this engine's models).
        every: seconds between two readings after optimizer steps.
        clock: seconds, monotonic.
        on_main_thread: whether the caller is the main thread (only it reads tensors).
    """

    def __init__(self, read: Callable[[], tuple[int, int, int] | None] = by_kind, every: float = EVERY,
                 clock: Callable[[], float] = time.monotonic,
                 on_main_thread: Callable[[], bool] = lambda: threading.current_thread() is threading.main_thread()):
        self.read, self.every, self.clock, self.on_main_thread = read, every, clock, on_main_thread
        self.value: tuple[int, int, int] | None = None
        """The last reading (None: none yet, or no model wrapped)."""
        self.at = float("-inf")
        """When it was made (``clock``)."""
        self.hooks: list[Any] = []
        """What :meth:`install` registered, to undo (``uninstall``)."""

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

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.note()

    def _after_cell(self, *_: Any) -> None:
        self.note(force=True)

    def install(self) -> None:
        """Keep the reading current from now on (idempotent; call on the main thread): a
        post-step hook on every optimizer (``register_optimizer_step_post_hook``),
        IPython's ``post_execute`` event and ``rank_wrap.on_wrapped()``; then read once."""
        if not self.hooks:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self.hooks.append(register_optimizer_step_post_hook(self._after_step))
            try:
                from IPython import get_ipython

                ip = get_ipython()
            except ImportError:  # pragma: no cover - engines always have IPython
                ip = None
            if ip is not None:
                ip.events.register("post_execute", self._after_cell)
                self.hooks.append(lambda: ip.events.unregister("post_execute", self._after_cell))
            on_wrapped().append(self._after_cell)
            self.hooks.append(lambda: on_wrapped().remove(self._after_cell))
        self.note(force=True)

    def uninstall(self) -> None:
        """Undo :meth:`install`: no more readings after steps, cells or wraps."""
        for hook in reversed(self.hooks):
            if hasattr(hook, "remove"):  # torch's hook handle
                hook.remove()
            else:
                hook()
        self.hooks.clear()


READINGS = KindReadings()
"""This engine's readings: what its memory samples carry."""


class MemoryReading(Reading):
    """What the memory feed's sampler publishes: this rank's ``MemorySample``, from the
    main thread's last reading by kind (the sampler's thread touches no tensor)."""

    name = "memory"

    @classmethod
    def prepare(cls) -> None:
        """Keep :data:`READINGS` current from now on (main thread)."""
        READINGS.install()

    def read(self, rank: int, seq: int, process: Any) -> Any:
        from .rank_memory_sample import read

        return read(rank, READINGS.kept(), seq=seq, process=process)
