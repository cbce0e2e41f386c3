"""One step on each rank: the only hooks fsdp_nb puts on optimizers and models, and what
the features hear from them, in which order.

A training loop repeats an iteration::

    batch = next(loader)              # the loop draws the next batch
    loss = model(batch).mean()        # step began: its first training forward
    loss.backward()
    optimizer.step()                  # step ended: the iteration's first optimizer step
    other_optimizer.step()            # step joined: another optimizer, same iteration
    scheduler.step(); scaler.update() # the loop's own updates
                                      # boundary: the next training forward, an eval
                                      # forward, or the cell's end

The :class:`StepOwner` (one per rank, a registry part) holds the hooks: a pre- and a
post-step hook for every optimizer (torch's global ones), a forward pre-hook on each model
a feature asks it to watch (the wrapped models; put ahead of FSDP2's own, so the
parameters are still sharded there), a one-shot global forward pre-hook that finds a
step's first forward when no watched model is alive (a model the loop built itself), and
IPython's ``pre_execute`` / ``post_execute`` events, which with the call server's own
(``call_channel``) mark a cell's (or a ``sess.run`` call's) start and end. No feature
registers hooks of its own.

What a listener hears (:class:`StepListener`), in the order a rank meets it:

1. ``cell_started()``;
2. ``boundary(step, at)`` when an iteration ended and the next begins (``at``: ``"forward"``,
   ``"eval"``), then ``step_began(step)`` at the first training forward (grad enabled and
   the module in training mode; a forward under ``no_grad`` or after ``model.eval()`` is an
   evaluation),
   ``forward(module, args, kwargs)`` at each training forward of a watched model
   (micro-batches too), ``eval_forward(module)`` at a forward with grad disabled;
3. ``optimizer_stepping(optimizer)`` before every optimizer's step, ``step_ended(step,
   optimizer)`` after the iteration's first, ``step_joined(step, optimizer)`` after each
   further one in the same iteration (no training forward between them, and the
   iteration had one). Where the owner saw no forward at all (no model it watches, and a
   one-shot hook that found none), each optimizer step is a step of its own:
   ``boundary(step, "step")`` (before it changes anything), ``step_began``, ``step_ended``;
4. ``boundary(step, "cell end")`` when a cell that did not fail ends after a step, then
   ``cell_ended(failed)``. A cell that failed tells no boundary: the iteration did not end
   cleanly, and a step it cut short is no step: if the cell made a training forward and
   no optimizer step followed, the gradients a watched FSDP2 model holds unsynced of that
   step (``set_requires_gradient_sync(False)``, earlier cells' micro-batches included) are
   dropped and the listeners hear ``cut_short()`` first. A watched model puts the owner's
   hooks in, so the drop holds with no listener.
   Once every rank answered a cell that failed on some, the notebook asks each
   (:meth:`StepOwner.cell_failed`) and, where it cut a step short on any, tells every
   rank to drop it (:meth:`StepOwner.drop_cut_short`; listeners hear ``cut_short()``).

``loaded(extra)`` says a load replaced the run's state (``extra``: its checkpoint's), and
``watched(module)`` that a model is watched from now on (a wrap built it). A step a
gradient scaler skipped (inf or NaN: the optimizer's own step never ran) ends its
iteration too, when the scaler says so (:meth:`StepOwner.skipped`). Steps
that a save or load takes (torch's ``get_state_dict`` steps an optimizer with no state to
make it) are no steps: inside :meth:`StepOwner.taking_state` nothing is told.

Within each event the listeners are told in their :attr:`StepListener.order`:

- 5, the end of a debugged cell (``debugging.rank_cell_debug``): its breakpoints and
  collective check end before anything else hears of the cell's end;
- 10, the async-save gate (``checkpoints.rank_async_saves``): a step or forward waits for
  the copy of a save still being taken, before anything changes a tensor it copies;
- 20, the gradient scaler (``models.rank_grad_scaler``): it counts a skipped step by
  :meth:`StepOwner.optimizer_steps`, and drops a scaled step that a failed cell cut short;
- 30, autosave (``autosave.rank_autosave``): the loaders' positions and the random state
  at the step's end, the save at the boundary (so the step view counts what it blocks);
- 35, the in-memory autosave's gate (``autosave.rank_memory_copies``): an optimizer step
  waits until the copy autosave took at the boundary has staged the shards;
- 40, the step view (``steps.rank_step_timing``);
- 50, the profile (``steps.rank_step_profile``): after the step view has the step's end,
  since it exports its trace there;
- 60, ``fsdp_nb.log`` (``steps.rank_logged``);
- 70, the memory readings (``memory.rank_memory_kinds``), and 80 a memory measurement
  (``memory.rank_memory_plan``): what the step left, and where in it the peak fell.

Step numbers count the iterations this rank's owner saw since it was made (from 0); a
feature keeps its own count from there.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace  # an undo held with torch's hook handles (``remove()``)
from typing import Any

from ..torch_compat import drop_unsynced_gradients
from .registry import Part, World, part
from .step_listener import StepListener

__all__ = ["StepListener", "StepOwner", "cell_failed", "drop_cut_short", "owner", "taking_state"]

log = logging.getLogger("fsdp_nb")


class StepOwner(Part):
    """The hooks of one rank's step, and the listeners it tells (see the module docstring)."""

    order = 0  # its iteration is reset before any feature hears of a new group

    def __init__(self) -> None:
        self.listeners: list[StepListener] = []
        """Who is told, in their order."""
        self.steps = 0
        """Iterations that ended on this rank since the owner was made."""
        self.in_step = False
        """A training forward ran and no optimizer step followed yet."""
        self.pending = False
        """An iteration ended and its boundary was not told yet."""
        self.forwarded = False
        """The iteration that ended last had a training forward (a later optimizer step with
        no forward between joins it; without one, it is a step of its own)."""
        self.taking = 0
        """How many saves or loads are taking or giving state now (nested)."""
        self.trained_in_cell = False
        """The cell (or call) running made a training forward: failing, it cut a step short."""
        self.optimizer_calls = 0
        """Optimizer steps this rank took since the owner was made, every optimizer's."""
        self.cell_from = 0
        """:attr:`optimizer_calls` as the last cell started (or a rank joined, or a load ended)."""
        self.ended_in_step = False
        """The last cell ended here (failing or not) inside a step it trained in (``cell_failed``)."""
        self.failed_cell = False
        """The last cell failed on this rank (an error, Ctrl-C)."""
        self.changes = 0
        """Counts each change of the step's state (a step ended or joined, a boundary, a
        cell's end, a load, a new group), bumped before the change: a reader on another
        thread that sees it unchanged around its reads read one state (``rank_step_timing``)."""
        self.stepped: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        """Optimizer -> its steps this owner saw (not those taken inside ``taking_state``)."""
        self.watched: weakref.WeakSet[Any] = weakref.WeakSet()
        self.hooks: list[Any] = []
        self.once: Any = None
        self.installed = False

    def __reduce__(self) -> tuple[Any, tuple]:
        """Pickled, the owner is "this rank's owner" (:func:`owner`), by reference: its hooks sit
        in torch's global hook dicts, which the step wrapper torch puts on an optimizer's class
        reads, so cloudpickling a notebook's optimizer class (a resize's recipe) reaches it,
        and its weak references cannot be pickled."""
        return owner, ()

    # -- who listens -----------------------------------------------------------------

    def listen(self, listener: StepListener) -> None:
        """Tell ``listener`` from now on (idempotent); the hooks go in at the first one."""
        if listener not in self.listeners:  # a new list: a step being told reads the old one whole
            self.listeners = sorted([*self.listeners, listener], key=lambda x: x.order)
        if not self.installed:
            self._install()

    def unlisten(self, listener: StepListener) -> None:
        """Tell ``listener`` no more (the hooks stay: microseconds a step, which
        ``benchmarks/session_cost.py`` measures)."""
        if listener in self.listeners:
            self.listeners = [x for x in self.listeners if x is not listener]

    def watch(self, module: Any) -> None:
        """Put the owner's forward pre-hook on ``module`` (once for its life), ahead of its
        other hooks (FSDP2's all-gather among them)."""
        if module in self.watched:
            return
        import torch

        self.watched.add(module)
        self.hooks.append(module.register_forward_pre_hook(
            torch.compiler.disable(self._watched_forward), prepend=True, with_kwargs=True))
        if not self.installed:  # a wrapped model's steps are known, so a failed cell's cut-short one is dropped
            self._install()
        if self.once is not None:  # the watched model's own hook finds its steps from now on
            self.once.remove()
            self.once = None
        for x in list(self.listeners):
            x.watched(module)

    # -- what the features ask --------------------------------------------------------

    @contextmanager
    def taking_state(self) -> Iterator[None]:
        """Inside, an optimizer step or a forward is no training step's: a save or load
        taking or giving state (torch's ``get_state_dict`` steps an optimizer that has no
        state yet with a learning rate of 0, to make it)."""
        self.taking += 1
        try:
            yield
        finally:
            self.taking -= 1

    def optimizer_steps(self, optimizer: Any) -> int:
        """How many training steps ``optimizer`` took since the owner was made."""
        return self.stepped.get(optimizer, 0)

    def loaded(self, extra: dict[str, Any] | None) -> None:
        """A load replaced the run's state: an iteration under way or ending is gone."""
        self.changes += 1
        self.in_step, self.pending, self.ended_in_step = False, False, False
        self.cell_from = self.optimizer_calls
        for x in list(self.listeners):
            x.loaded(extra)

    def reformed(self, world: World) -> None:
        """A new group: a step it cut short is no step, and no boundary is owed. The last
        cell's count of optimizer steps goes on (a recovery's note compares the ranks'),
        unless a rank joined, whose count starts at 0."""
        self.changes += 1
        self.in_step, self.pending, self.ended_in_step = False, False, False
        if world.joined:
            self.cell_from = self.optimizer_calls
        self._arm_once()

    def closed(self) -> None:
        """The rank leaves: every hook removed and the owner as new, so an engine that serves
        a later session watches its models again."""
        if self.once is not None:
            self.once.remove()
        for h in self.hooks:
            h.remove()
        self.__init__()  # type: ignore[misc]

    # -- the hooks ------------------------------------------------------------------

    def _install(self) -> None:
        import torch
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.installed = True
        self.hooks.append(register_optimizer_step_pre_hook(torch.compiler.disable(self._stepping)))
        self.hooks.append(register_optimizer_step_post_hook(torch.compiler.disable(self._stepped)))
        from IPython import get_ipython  # ipyparallel's engines are IPython kernels

        ip = get_ipython()
        if ip is not None:
            for event, fn in (("pre_execute", self.cell_started), ("post_execute", self._post_execute)):
                ip.events.register(event, fn)
                self.hooks.append(SimpleNamespace(remove=lambda event=event, fn=fn: ip.events.unregister(event, fn)))
        self._arm_once()

    def _arm_once(self) -> None:
        """Arm the one-shot global forward pre-hook that finds the next step's first forward
        of a model the loop built itself; only while no watched model is alive."""
        if self.once is not None or not self.installed or len(self.watched):
            return
        import torch
        from torch.nn.modules.module import register_module_forward_pre_hook

        self.once = register_module_forward_pre_hook(torch.compiler.disable(self._first_forward))

    def _first_forward(self, module: Any, args: tuple) -> None:
        import torch

        if self.taking or not torch.is_grad_enabled() or not module.training:  # an eval forward: stay armed
            if not self.taking and self.pending:
                self._boundary("eval")
            return
        once, self.once = self.once, None
        if once is not None:
            once.remove()  # one call a step: every other module's forward runs without it
        self._forward(module, args, {})

    def _watched_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.taking:
            return
        import torch

        if not torch.is_grad_enabled() or not module.training:  # evaluation: under no_grad, or model.eval()
            if self.pending:
                self._boundary("eval")
            for x in list(self.listeners):
                x.eval_forward(module)
            return
        self._forward(module, args, kwargs)

    def _forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.trained_in_cell = True
        if self.pending:
            self._boundary("forward")
        if not self.in_step:
            self.in_step = True
            for x in list(self.listeners):
                x.step_began(self.steps)
        for x in list(self.listeners):
            x.forward(module, args, kwargs)

    def _boundary(self, at: str) -> None:
        self.changes += 1
        self.pending = False
        for x in list(self.listeners):
            x.boundary(self.steps - 1, at)

    def _stepping(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.taking:
            return
        if self.pending and not self.in_step and not self.forwarded:
            self._boundary("step")  # the owner sees no forward of this loop: told before the step changes anything
        for x in list(self.listeners):
            x.optimizer_stepping(optimizer)

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.taking:
            return
        self.stepped[optimizer] = self.stepped.get(optimizer, 0) + 1
        self.optimizer_calls += 1
        self._ended(optimizer)

    def skipped(self, optimizer: Any) -> None:
        """``optimizer``'s step was skipped (a gradient scaler found inf or NaN and did not
        call it): the iteration ended all the same, so it is told as an ended step (not
        counted in :meth:`optimizer_steps`), and the next forward begins the next one."""
        if not self.taking:
            self._ended(optimizer)

    def _ended(self, optimizer: Any) -> None:
        self.changes += 1
        if self.pending and not self.in_step:
            if self.forwarded:  # no training forward since the last step, which had one: same iteration
                for x in list(self.listeners):
                    x.step_joined(self.steps - 1, optimizer)
                return
            self._boundary("step")  # a skipped step, whose pre-hook never ran: the owner sees no forward
        self.forwarded = self.in_step
        if not self.in_step:  # a step with no forward the owner saw: still a step
            for x in list(self.listeners):
                x.step_began(self.steps)
        step, self.in_step, self.pending = self.steps, False, True
        self.steps += 1
        for x in list(self.listeners):
            x.step_ended(step, optimizer)
        self._arm_once()

    # -- cells ----------------------------------------------------------------------

    def cell_started(self) -> None:
        """A cell or a ``sess.run`` call starts (IPython's event, or the call server)."""
        self.trained_in_cell, self.ended_in_step, self.failed_cell = False, False, False
        self.cell_from = self.optimizer_calls
        for x in list(self.listeners):
            x.cell_started()

    def _post_execute(self) -> None:
        from IPython import get_ipython

        ip = get_ipython()
        self.cell_ended(ip is not None and not ip.last_execution_succeeded)

    def cell_ended(self, failed: bool) -> None:
        """The cell or call ended (``failed``: it raised, Ctrl-C included)."""
        self.changes += 1
        self.ended_in_step = cut_short = self.in_step and self.trained_in_cell
        self.failed_cell = failed
        if failed and cut_short:  # a step this cell cut short: what FSDP2 holds unsynced of it goes
            self._cut()
        elif not failed and self.pending:
            self._boundary("cell end")
        self.in_step = self.pending = False  # a failed cell owes no boundary
        for x in list(self.listeners):
            x.cell_ended(failed)
        self._arm_once()

    def cell_failed(self) -> tuple[int, bool, bool]:
        """What the notebook asks once every rank answered a cell that failed on some: the
        optimizer steps this rank took in it, whether it ended here (failing or not) inside
        a step it trained in, and whether it failed here (where no rank says so, the call
        never ran as a cell and these are an older cell's). Changes nothing."""
        return self.optimizer_calls - self.cell_from, self.ended_in_step, self.failed_cell

    def drop_cut_short(self) -> None:
        """The failed cell cut a step short on some rank: it is no step on this one either
        (where the cell ended, or failed before its training forward). What FSDP2 holds
        unsynced goes, and the listeners hear ``cut_short`` (again, where it failed here)."""
        self.ended_in_step = False
        self._cut()

    def _cut(self) -> None:
        """A step cut short is no step: what the watched FSDP2 models hold unsynced of it goes
        (``torch_compat.drop_unsynced_gradients``; a torch whose fields moved is said, not
        raised), and the listeners hear ``cut_short`` (before ``cell_ended`` on a failed cell)."""
        try:
            if dropped := sum(drop_unsynced_gradients(m) for m in list(self.watched)):
                log.info("dropped %d unsynced gradient tensors of a step a failed cell cut short", dropped)
        except Exception as exc:  # noqa: BLE001 - the cell's end must still reach every listener
            log.warning("could not drop the unsynced gradients of a step a failed cell cut short: %s", exc)
        for x in list(self.listeners):
            x.cut_short()


def owner() -> StepOwner:
    """This rank's step owner."""
    return part(StepOwner)


def cell_failed() -> tuple[int, bool, bool]:
    """``owner().cell_failed()``: the notebook's question after a cell failed on some rank."""
    return owner().cell_failed()


def drop_cut_short() -> None:
    """``owner().drop_cut_short()``: the notebook's call when that cell cut a step short."""
    owner().drop_cut_short()


def taking_state() -> Any:
    """``owner().taking_state()``: optimizer steps inside are no training steps."""
    return owner().taking_state()
