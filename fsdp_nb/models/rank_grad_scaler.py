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

The rank's part for it (:class:`GradScaling`, in the rank's registry) keeps the ranks'
scalers alike through the session's life:

- a step the scaler skipped is one the step owner did not see run: the scaler asks the
  owner how many steps the optimizer took (``owner().optimizer_steps``), before and after,
  and puts no hook of its own on the optimizer;
- a failed cell (an error, Ctrl-C) that cut a step short (``StepListener.cut_short``: on
  any rank, it made a training forward and no optimizer step followed) and a group formed
  again drop a step the scaler had begun and not updated
  (:meth:`CountingScaler.forget_step`): a step cut short is no step, and torch's scaler
  would refuse the next ``unscale_`` or ``step``; a failed cell that cut no step short
  leaves it, so the step goes on without unscaling its gradients twice, and one that
  failed between ``step`` and ``update`` runs the update;
- when the group forms again (``restart``, ``resize``, a recovery), every rank ends with
  the same scaler state (:meth:`GradScaling.reformed`): the ranks that stayed keep the
  run's (the lowest such rank's, agreed over the checkpoint group), a rank that joined
  gets exactly that, and every scaler reduces over the session's group as it is now.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ..engine.checkpoint_group import gathered
from ..engine.namespace import user_ns
from ..engine.registry import RANK, Part, World, part
from ..engine.step import StepListener, StepOwner, owner

__all__ = ["SCALER", "CountingScaler", "GradScaling", "Offer", "choose", "current", "install"]

log = logging.getLogger("fsdp_nb")

SCALER = "scaler"
"""The engine global a ``"16-mixed"`` wrap binds its scaler to."""


class CountingScaler(ShardedGradScaler):
    """torch's ``ShardedGradScaler`` that counts the optimizer steps it skipped.

    A step is skipped when the optimizer's ``step`` did not run (inf or NaN in some rank's
    gradients): the rank's step owner counts the steps that ran, so the scaler needs no
    hook and no extra device sync. It reduces its inf / NaN check over the default group
    (``process_group=None``): the session's group as it is now, after any re-form.

    Args:
        device: the device type its scale lives on (``"cuda"``, ``"cpu"``).
        **kwargs: ``ShardedGradScaler``'s (``init_scale``, ``growth_interval``, ...).
    """

    def __init__(self, device: str = "cuda", **kwargs: Any) -> None:
        kwargs.setdefault("process_group", None)
        super().__init__(device=device, **kwargs)
        self.device_type = device
        """The device type it was made for (a rank that joins makes its own alike)."""
        self.skipped = 0
        """Optimizer steps skipped for inf / NaN gradients since the scaler was made (or
        as loaded with its state)."""
        self.begun = False
        """A step began (gradients unscaled, an optimizer stepped) and ``update`` has not
        ended it yet."""
        self.stepped = False
        """``step`` ran (the optimizer's step taken or skipped) and ``update`` has not yet."""

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``ShardedGradScaler.step``, counting a step it skips in ``skipped``."""
        steps = _owner()
        before = steps.optimizer_steps(optimizer)
        out = super().step(optimizer, *args, **kwargs)
        self.stepped = True
        if self.is_enabled() and steps.optimizer_steps(optimizer) == before:
            self.skipped += 1
            steps.skipped(optimizer)  # the iteration ended all the same: the owner tells the features
        return out

    def unscale_(self, optimizer: Any) -> None:
        """``ShardedGradScaler.unscale_`` (which ``step`` calls too), without the warning
        torch gives when it divides FSDP2's DTensor gradients by its one-element inverse
        scale ("Found a non-scalar tensor with numel=1"): torch's own scaler does that,
        not the user's loop, and it is harmless (the inverse scale is replicated)."""
        import warnings

        self.begun = True  # before torch marks the optimizer unscaled, which it does before its all-reduce
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning)
            super().unscale_(optimizer)

    def update(self, new_scale: Any = None) -> None:
        """``ShardedGradScaler.update``: the step ends (``new_scale``: torch's, a scale to set)."""
        super().update(new_scale)
        self.begun = self.stepped = False

    def forget_step(self) -> bool:
        """Drop what this scaler holds of a step begun and not updated (each optimizer's
        stage and inf check): ``update`` with the scale it has, which drops them and leaves
        the scale and its growth count as they are. The next ``unscale_`` and ``step`` then
        run as at an iteration's start. Returns whether a step had begun."""
        if not self.begun:
            return False
        self.update(self.get_scale())
        return True

    def state_dict(self) -> dict[str, Any]:
        """torch's state (scale, growth tracker, factors) and ``skipped``."""
        return {**super().state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave (``skipped`` included)."""
        state = dict(state_dict)
        self.skipped = int(state.pop("skipped", 0))
        super().load_state_dict(state)


class ScalerSteps(StepListener):
    """What the scaler hears from the rank's step owner: a failed cell, a step cut short."""

    order = 20

    def cell_ended(self, failed: bool) -> None:
        """A cell that failed after ``scaler.step`` and before ``scaler.update()`` (a typo
        between them): the update runs, as the loop's would have (its inf check was agreed
        across the ranks at ``unscale_``: no collective), so the next step starts afresh."""
        scaler = current()
        if failed and scaler is not None and scaler.stepped:
            scaler.update()
            log.info("fsdp_nb: the cell failed between scaler.step and scaler.update: the update ran")

    def cut_short(self) -> None:
        """A failed cell cut a step short, here or on another rank: the scaler's step begun in
        it is dropped (:meth:`CountingScaler.forget_step`). A failed cell that made no
        training forward (a typo after ``unscale_``) leaves it: ``step`` then goes on from
        the unscaled gradients, where a dropped step would unscale them again."""
        scaler = current()
        if scaler is not None and scaler.forget_step():
            log.info("fsdp_nb: the cell failed inside a step of the gradient scaler: that step is dropped, "
                     "the next one starts afresh")


@dataclass(frozen=True)
class Offer:
    """What one rank brings to the agreement of :meth:`GradScaling.reformed`."""

    stayed: bool
    """The rank was in the group before (it did not join with this formation)."""
    state: dict[str, Any]
    """Its scaler's state (:meth:`CountingScaler.state_dict`)."""
    device: str
    """Its scaler's device type."""


def choose(offers: Sequence[Offer | None]) -> int | None:
    """The rank whose scaler state every rank takes (``offers``: each rank's, None where
    it has no scaler): the lowest rank that stayed with one (the run's scale), else the
    lowest that has one (every rank is new), else None (no rank has a scaler)."""
    held = [r for r, o in enumerate(offers) if o is not None]
    stayed = [r for r, o in enumerate(offers) if o is not None and o.stayed]
    first = stayed or held
    return first[0] if first else None


class GradScaling(Part):
    """The rank's part for the gradient scaler: its step listener, and the agreement of
    the ranks' scalers when the group forms again."""

    order = 60
    """After the checkpoint group's part (50) has dropped the old group: the agreement
    runs on a checkpoint group of the new one."""

    def __init__(self) -> None:
        self.steps = ScalerSteps()
        """Listens to the rank's step owner while the rank has a scaler."""

    def reformed(self, world: World) -> None:
        """Every rank ends with the same scaler state (see the module docstring): one
        ``all_gather_object`` on the checkpoint group, made on every rank that holds this
        part (every rank, once any rank has one)."""
        mine, offer = current(), None
        if mine is not None:
            mine.process_group = None  # the group as it is now, whatever it was before
            try:  # nothing may keep this rank from the agreement's collective: the others wait in it
                mine.forget_step()  # a step the re-form cut short is no step
                offer = Offer(world.rank not in world.joined, mine.state_dict(), mine.device_type)
            except Exception:  # noqa: BLE001 - logged; this rank then takes the state the others agree on
                log.exception("fsdp_nb: this rank's gradient scaler could not offer its state; it takes the others'")
        offers: list[Offer | None] = gathered(offer)
        source = choose(offers)
        if source is None:  # no rank has a scaler
            return
        chosen = offers[source]
        if chosen is None:  # choose() names a rank with an offer
            return
        if mine is None:
            mine = _bind(chosen.device)
            if mine is None:
                return
        if chosen.state:
            mine.load_state_dict(chosen.state)
        owner().listen(self.steps)
        if world.rank == source and any(o is None or o.state != chosen.state for o in offers):
            log.info("fsdp_nb: every rank's gradient scaler now holds rank %d's state (scale %s)", source,
                     chosen.state.get("scale"))

    def closed(self) -> None:
        found = RANK.find(StepOwner)
        if found is not None:
            found.unlisten(self.steps)


def _owner() -> StepOwner:
    """The rank's step owner, told about the scaler (its hooks count the optimizer steps
    the scaler asks about: the first listener installs them)."""
    own = owner()
    steps = part(GradScaling).steps
    if steps not in own.listeners:
        own.listen(steps)
    return own


def current() -> CountingScaler | None:
    """This rank's scaler: the engine global ``scaler`` if it is a :class:`CountingScaler`
    (None: the rank has none, or the name holds something else)."""
    found = user_ns().get(SCALER)
    return found if isinstance(found, CountingScaler) else None


def _bind(device_type: str) -> CountingScaler | None:
    """A new :class:`CountingScaler` bound to ``scaler``, unless the name holds something
    else (None then, and a warning in the rank's log)."""
    ns = user_ns()
    if SCALER in ns:
        log.warning("the engine global %r is a %s: a 16-mixed wrap leaves it and makes no gradient scaler",
                    SCALER, type(ns[SCALER]).__name__)
        return None
    made = ns[SCALER] = CountingScaler(device=device_type)
    return made


def install(device_type: str) -> None:
    """Bind a :class:`CountingScaler` for ``device_type`` to the engine global ``scaler``,
    unless one is there already (a second fp16 model shares the run's scale; a
    ``ShardedGradScaler`` of the user's own is left alone), and let the scaler listen to
    the rank's steps."""
    found = user_ns().get(SCALER)
    if isinstance(found, ShardedGradScaler) and not isinstance(found, CountingScaler):
        return
    if not isinstance(found, CountingScaler) and _bind(device_type) is None:
        return
    owner().listen(part(GradScaling).steps)
