"""What a feature hears from its rank's step: the interface the step owner
(``engine.step``) tells, in the order its module docstring gives."""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = ["StepListener"]


class StepListener:
    """What a feature hears from its rank's step (every method does nothing here)."""

    order: ClassVar[int] = 50
    """Where it is told among the listeners (lower first; the owner's docstring lists them)."""

    def cell_started(self) -> None:
        """A cell (or a ``sess.run`` call) starts on this rank."""

    def step_began(self, step: int) -> None:
        """Iteration ``step``'s first training forward is about to run."""

    def forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        """A training forward of a watched ``module`` (or the step's first forward of an
        unwatched one) is about to run, with these arguments."""

    def eval_forward(self, module: Any) -> None:
        """A forward with grad disabled is about to run: no training step."""

    def optimizer_stepping(self, optimizer: Any) -> None:
        """``optimizer.step`` is about to change its parameters."""

    def step_ended(self, step: int, optimizer: Any) -> None:
        """Iteration ``step``'s first optimizer step ran (``optimizer``)."""

    def step_joined(self, step: int, optimizer: Any) -> None:
        """Another optimizer stepped in iteration ``step``, after the first."""

    def boundary(self, step: int, at: str) -> None:
        """Iteration ``step`` is over, the loop's own updates done: ``at`` the next
        training forward (``"forward"``), an eval forward (``"eval"``), the end of a cell
        that did not fail (``"cell end"``), or the next optimizer step of a loop whose
        forwards the owner does not see (``"step"``)."""

    def cell_ended(self, failed: bool) -> None:
        """The cell (or call) ended; ``failed``: it raised (an error, Ctrl-C)."""

    def cut_short(self) -> None:
        """A failed cell cut a step short (here, or on another rank after this one ended the
        cell): that step is no step. Told before ``cell_ended`` where the cell failed here,
        and again when the notebook settles the cell on every rank: act once."""

    def loaded(self, extra: dict[str, Any] | None) -> None:
        """A load replaced the run's state; ``extra``: its checkpoint's (``step`` among them)."""

    def watched(self, module: Any) -> None:
        """``module`` is watched from now on: a model ``sess.wrap`` just built, or one a save
        holds (what a rank holds changed)."""
