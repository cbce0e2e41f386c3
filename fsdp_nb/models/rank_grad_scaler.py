"""The gradient scaler a ``"16-mixed"`` wrap gives each rank, as the engine global ``scaler``.

fp16 has five exponent bits: small gradients underflow to zero in an fp16 backward.
Lightning's FSDP precision pairs ``"16-mixed"`` with a sharded gradient scaler, which
multiplies the loss before the backward, divides the gradients before the step, and
skips a step whose gradients hold inf or NaN (lowering the scale). Every rank gets one
here, made when the first such model is wrapped and kept after (its scale is the run's),
so a training cell reads as the docs' does::

    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

``sess.save(state=["scaler"])`` keeps its state with the rest of the run; ``skipped``
counts the steps it skipped for inf / NaN gradients, and is saved with it.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ..engine.namespace import user_ns

__all__ = ["SCALER", "CountingScaler", "forget", "install"]

log = logging.getLogger("fsdp_nb")

SCALER = "scaler"
"""The engine global a ``"16-mixed"`` wrap binds its scaler to."""


class CountingScaler(ShardedGradScaler):
    """torch's ``ShardedGradScaler`` that counts the optimizer steps it skipped.

    A step is skipped when the optimizer's ``step`` did not run (inf or NaN in some rank's
    gradients): seen through the optimizer's public step hook, so no extra device sync.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skipped = 0
        """Optimizer steps skipped for inf / NaN gradients since the scaler was made (or
        as loaded with its state)."""

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``ShardedGradScaler.step``, counting a step it skips in ``skipped``."""
        ran = False

        def seen(*_: Any) -> None:
            nonlocal ran
            ran = True

        handle = optimizer.register_step_post_hook(seen)
        try:
            out = super().step(optimizer, *args, **kwargs)
        finally:
            handle.remove()
        if self.is_enabled() and not ran:
            self.skipped += 1
        return out

    def unscale_(self, optimizer: Any) -> None:
        """``ShardedGradScaler.unscale_`` (which ``step`` calls too), without the warning
        torch gives when it divides FSDP2's DTensor gradients by its one-element inverse
        scale ("Found a non-scalar tensor with numel=1"): torch's own scaler does that,
        not the user's loop, and it is harmless (the inverse scale is replicated)."""
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning)
            super().unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """torch's state (scale, growth tracker, factors) and ``skipped``."""
        return {**super().state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave (``skipped`` included)."""
        state = dict(state_dict)
        self.skipped = int(state.pop("skipped", 0))
        super().load_state_dict(state)


def install(device_type: str) -> None:
    """Bind a :class:`CountingScaler` for ``device_type`` to the engine global ``scaler``,
    unless one is there already (a second fp16 model shares the run's scale)."""
    ns = user_ns()
    if isinstance(ns.get(SCALER), ShardedGradScaler):
        return
    if SCALER in ns:
        log.warning("the engine global %r is a %s: a 16-mixed wrap leaves it and makes no gradient scaler",
                    SCALER, type(ns[SCALER]).__name__)
        return
    ns[SCALER] = CountingScaler(device=device_type)


def forget() -> None:
    """Drop this rank's ``scaler`` (one :func:`install` made) before ``restart`` rebuilds
    the models: every rank then makes a new one with the rebuilt ``"16-mixed"`` model, so
    all ranks scale alike (a survivor's scale next to a new rank's would reduce gradients
    scaled differently); a restore with ``state=["scaler"]`` then gives back the run's."""
    ns = user_ns()
    if isinstance(ns.get(SCALER), CountingScaler):
        del ns[SCALER]
