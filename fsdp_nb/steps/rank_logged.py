"""Scalars a rank logs while it trains (``fsdp_nb.log(loss=..., lr=...)``), for the step
view's live curves.

``log`` keeps each name's last ``KEEP`` values in this rank's :class:`Logged` part: a dict
lookup and a deque append, cheap enough for every step. A CPU tensor is read at once. A
GPU tensor is copied (one element, on its stream) and read as a number only when the step
view's sampler thread publishes the curves (``latest``), so logging a loss does not make a
GPU rank wait for its kernels. A DTensor gives this rank's local value.

It hears nothing of the step (no step event changes what was logged). When the group
forms again (restart, resize, recovery) every rank's curves start afresh, as the step
view's window does, so a rank that joined and the ranks that stayed line up.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from ..engine.registry import Part, World, part
from ..engine.step import StepListener, owner

__all__ = ["KEEP", "Logged", "clear", "count", "counted", "latest", "log"]

KEEP = 200
"""Values kept per name on each rank (the newest)."""


class Logged(Part, StepListener):
    """What ``fsdp_nb.log`` kept on this rank (the registry's part), and the step's listener
    that forgets it when the run's timeline changes under it: a load (the run went back or
    elsewhere) and a new group (a restart or resize: the ranks' curves start together)."""

    order = 60

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, collections.deque[Any]] = {}
        """Name -> its newest values, oldest first (a number, or a GPU tensor not read yet)."""
        self.count = 0
        """Calls of ``log`` that kept something."""
        self.totals: dict[str, int] = {}
        """Name -> values logged under it since the group last formed (the newest kept value
        is number ``total - 1``: a writer knows which it has not written; a load empties
        the values, not the counts)."""
        self.listening = False
        """It listens to the step owner from the first ``log`` on, on the training thread
        (a part makes no hook from whichever thread first asks for it)."""

    def loaded(self, extra: dict[str, Any] | None) -> None:
        """A load replaced the run's state: the values logged before belong to another
        timeline. Their counts go on (a writer numbers the values after them on)."""
        with self.lock:
            self.values.clear()

    def reformed(self, world: World) -> None:
        clear()

    def closed(self) -> None:
        clear()


def log(**scalars: Any) -> None:
    """Log scalars on this rank, for the live curves of ``sess.steps()``.

    Call it in the training loop, e.g. ``fsdp_nb.log(loss=loss, lr=sched.get_last_lr()[0])``.
    Each name gets a curve: the mean over the ranks that log it, newest values lined up.

    Args:
        **scalars: name = a number (``int``, ``float``) or a one-element tensor.

    Raises:
        TypeError: a value that is not a number or a one-element tensor (nothing is logged).
    """
    kept = {}
    for name, value in scalars.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            kept[name] = float(value)
            continue
        numel = getattr(value, "numel", None)
        if callable(numel) and callable(getattr(value, "detach", None)) and numel() == 1:
            local = value.to_local() if callable(getattr(value, "to_local", None)) else value  # a DTensor: this rank's
            # a CPU value is read now; a GPU one is copied (a value changed in place later stays as
            # logged, and no base tensor is kept alive) and read when the view's sampler sends it
            kept[name] = float(local.detach().float()) if local.device.type == "cpu" else local.detach().clone()
            continue
        raise TypeError(f"fsdp_nb.log: {name}= must be a number or a one-element tensor, "
                        f"got {type(value).__name__}" + (f" of {numel()} elements" if callable(numel) else ""))
    held = part(Logged)
    if not held.listening:
        held.listening = True
        owner().listen(held)
    with held.lock:
        held.count += 1
        for name, value in kept.items():
            q = held.values.get(name)
            if q is None:
                q = held.values[name] = collections.deque(maxlen=KEEP)
            q.append(value)
            held.totals[name] = held.totals.get(name, 0) + 1


def latest() -> dict[str, list[float]]:
    """Each logged name's kept values, oldest first, as numbers (a tensor is read once, the
    first time it is asked for, and kept as its number; one that is not finite stays
    ``nan`` or ``inf``, as the loop logged it)."""
    return counted()[0]


def counted() -> tuple[dict[str, list[float]], dict[str, int]]:
    """``latest()`` and each name's count of values logged (``totals``), read together: the
    last value of a name is number ``count - 1``."""
    held = part(Logged)
    with held.lock:
        kept = {name: list(q) for name, q in held.values.items()}
        totals = dict(held.totals)
    read = {id(v): float(v.float().item()) for vs in kept.values() for v in vs if not isinstance(v, float)}
    if read:
        with held.lock:  # keep the numbers: the tensors are not read again
            for q in held.values.values():
                for i, v in enumerate(q):
                    if id(v) in read and not isinstance(v, float):
                        q[i] = read[id(v)]
    return {name: [v if isinstance(v, float) else read[id(v)] for v in vs] for name, vs in kept.items()}, totals


def count() -> int:
    """How many calls of ``log`` kept something (the side channel sends news only)."""
    return part(Logged).count


def clear() -> None:
    """Forget every logged value on this rank."""
    held = part(Logged)
    with held.lock:
        held.values.clear()
        held.totals.clear()
