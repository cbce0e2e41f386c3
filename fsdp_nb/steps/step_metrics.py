"""The step view's numbers, written out as they arrive: TensorBoard or Weights & Biases.

``view.log_to(target)`` (``StepsView.log_to``) adds a :class:`StepMetrics`; the view calls
its ``take`` with each batch of the ranks' ``RankSteps`` it applies (the live feed's once a
second while steps end, or a refresh's), and it writes what it has not written:

- per step (the ranks' step numbers, carried past a restart or resize, which starts them
  again at 0): ``step_ms/rank{r}``, ``compute_ms/rank{r}``, ``communication_ms/rank{r}``
  and ``other_ms/rank{r}`` for each rank (one chart a series, a line a rank), and
  ``throughput/samples_per_s`` (``throughput/tokens_per_s`` where the batches show
  tokens, ``throughput/mfu`` on GPUs of a known device), summed over the ranks; a step is
  written once every rank of the world has passed it, so a rank whose message is late
  loses nothing;
- each name the loop logs with ``fsdp_nb.log``: its mean over the ranks, at the value's
  own number (the k-th value logged under that name is written at k), once every rank
  that logs it has logged it.

A TensorBoard ``SummaryWriter`` gets ``add_scalar(tag, value, step)``. A W&B run, whose
own step must only grow, gets ``log({...})`` with the step as a value of its own
(``fsdp_nb/step``, ``fsdp_nb/logged``), declared with ``define_metric`` as the x-axis of
the others.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .step_rates import mfu, shared_peak
from .wire_step_times import RankSteps

__all__ = ["STEP_SERIES", "StepMetrics", "flush_of", "writer_for"]

STEP_SERIES = ("step_ms", "compute_ms", "communication_ms", "other_ms")
"""The per-rank series, each tagged ``{series}/rank{r}``."""

log = logging.getLogger("fsdp_nb")

Write = Callable[[str, int, dict[str, float]], None]
"""Writes ``values`` at ``step`` of the x-axis named by the first argument (``"step"``
for the step times, ``"logged"`` for the logged values)."""


def writer_for(target: Any) -> Write:
    """A TensorBoard ``SummaryWriter`` (``add_scalar``) or a W&B run (``log`` and
    ``define_metric``) as one write function; a TypeError naming both for anything else.

    Args:
        target: where the numbers go.
    """
    if isinstance(target, logging.Logger):
        raise TypeError("log_to takes a TensorBoard SummaryWriter or a W&B run, not a logging.Logger: "
                        "the step view's numbers are series for a writer or a run to plot")
    add_scalar = getattr(target, "add_scalar", None)
    if callable(add_scalar):
        def to_tensorboard(axis: str, step: int, values: dict[str, float]) -> None:
            for tag, value in values.items():
                add_scalar(tag, value, step)

        return to_tensorboard
    run_log, define = getattr(target, "log", None), getattr(target, "define_metric", None)
    if callable(run_log) and callable(define):
        define("fsdp_nb/step")  # each series against its own step, not W&B's count of log calls
        define("fsdp_nb/logged")
        for series in (*STEP_SERIES, "throughput"):
            define(f"{series}/*", step_metric="fsdp_nb/step")
        axes: set[str] = set()

        def to_wandb(axis: str, step: int, values: dict[str, float]) -> None:
            if axis == "logged":  # each logged name against its value's number
                for name in sorted(values.keys() - axes):
                    define(name, step_metric="fsdp_nb/logged")
                    axes.add(name)
            run_log({**values, f"fsdp_nb/{axis}": step})

        return to_wandb
    raise TypeError("log_to takes a TensorBoard SummaryWriter (it has add_scalar) or a W&B run (it has log and "
                    f"define_metric), got {type(target).__name__}")


def flush_of(target: Any) -> Callable[[], None]:
    """The target's ``flush`` (a ``SummaryWriter``'s writes its event file), or nothing to do.

    Args:
        target: where the numbers go.
    """
    flush = getattr(target, "flush", None)
    return flush if callable(flush) else _nothing


def _nothing() -> None:
    pass


@dataclass
class StepMetrics:
    """What has been written of the ranks' steps and logged values (see the module)."""

    write: Write
    """Where they go (``writer_for``)."""
    epoch: int = -1
    """The formation of the group whose steps were written last."""
    base: int = 0
    """The written step number of this epoch's step 0."""
    next_step: int = 0
    """The first written step number not written yet."""
    logged_base: dict[str, int] = field(default_factory=dict)
    """Name -> the written number of this epoch's first logged value."""
    next_logged: dict[str, int] = field(default_factory=dict)
    """Name -> the first written value number not written yet."""
    flush: Callable[[], None] = _nothing
    """Called after each ``take`` that wrote (``flush_of``): the numbers show while the cell runs."""
    written: int = 0
    """Steps written so far."""
    missed: int = 0
    """Steps that ended and left the ranks' window between two updates, never written
    (logged once: ``sess.steps(window=...)`` larger keeps them)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """``take`` runs in the live feed's thread and in ``refresh()``: one at a time."""

    def start_after(self, seen: list[RankSteps]) -> None:
        """Begin after what ``seen`` holds (what the view showed before ``log_to``): a
        target given later gets the steps and values that come after, numbered as the
        ranks count them, from the oldest its first update holds; steps every rank has
        passed and values every rank logged are not written again.

        Args:
            seen: each rank's last steps as the view last applied them ([]: begin with
                the first update).
        """
        seen = [g for g in seen if g is not None]
        if not seen:
            return
        with self.lock:
            self.epoch = max(g.epoch for g in seen)
            seen = [g for g in seen if g.epoch == self.epoch]
            stepped = [g for g in seen if g.index]
            self.next_step = min(g.index[-1] for g in stepped) + 1 if stepped else 0
            names = {n for g in seen for n in g.logged_total}
            self.next_logged = {n: min(g.logged_total[n] for g in seen if n in g.logged_total) for n in names}

    def take(self, got: list[RankSteps], world: int | None = None) -> int:
        """Write what ``got`` holds that was not written yet; the number of writes.

        Args:
            got: each rank's last steps and logged values (GPU ranks' as their device ran
                them, as the view splits them); a rank of an older epoch is left out.
            world: the ranks there are: nothing is written until each has sent (None:
                those in ``got``).
        """
        got = [g for g in got if g is not None]
        if not got:
            return 0
        with self.lock:
            newest = max(g.epoch for g in got)
            got = [g for g in got if g.epoch == newest]
            if world is not None and len({g.rank for g in got}) < world:
                return 0  # a rank that has not sent in this epoch: its steps would be lost
            if newest != self.epoch:  # a restart or resize: the ranks count from 0 again
                self.epoch, self.base = newest, self.next_step
                self.logged_base = dict(self.next_logged)
            wrote = self._steps(got) + self._logged(got)
            if wrote:
                self.flush()
            return wrote

    def _steps(self, got: list[RankSteps]) -> int:
        stepped = [g for g in got if g.index]
        if len(stepped) < len(got):  # a rank with no step yet (a GPU's events not read): it has passed none
            return 0
        # every rank has passed it, and it is final there (a second optimizer's step may
        # still join a rank's newest: ``open_step``)
        upto = self.base + min(g.index[-1] if g.open_step < 0 else min(g.index[-1], g.open_step - 1)
                               for g in stepped)
        first = self.base + max(g.index[0] for g in stepped)  # the oldest step every rank still holds
        if first > self.next_step:
            if self.written:  # a target's first write begins where the ranks are; after it, a gap is said
                if not self.missed:
                    log.warning("log_to: steps %d to %d ended between two updates and were not written; "
                                "a larger sess.steps(window=...) keeps them", self.next_step, first - 1)
                self.missed += first - self.next_step
            self.next_step = first
        peak = shared_peak(stepped)
        rows: dict[int, dict[str, float]] = {}
        for g in stepped:
            for i, index in enumerate(g.index):
                step = self.base + index
                if not self.next_step <= step <= upto:
                    continue
                row = rows.setdefault(step, {})
                for series, seconds in zip(STEP_SERIES, (g.seconds, g.compute, g.collective, g.other), strict=True):
                    row[f"{series}/rank{g.rank}"] = seconds[i] * 1e3
                for key, counts in (("throughput/samples_per_s", g.samples), ("throughput/tokens_per_s", g.tokens)):
                    if i < len(counts) and counts[i] and g.seconds[i] > 0:
                        row[key] = row.get(key, 0.0) + counts[i] / g.seconds[i]
        for step in sorted(rows):
            utilisation = mfu(stepped, rows[step].get("throughput/tokens_per_s"), peak)  # for this one step
            if utilisation is not None:
                rows[step]["throughput/mfu"] = utilisation
            self.write("step", step, rows[step])
        if rows:
            self.next_step = max(rows) + 1
        self.written += len(rows)
        return len(rows)

    def _logged(self, got: list[RankSteps]) -> int:
        names = sorted({n for g in got for n in g.logged})
        rows: dict[int, dict[str, float]] = {}
        for name in names:
            having = [g for g in got if name in g.logged and g.logged_total.get(name)]
            if not having:
                continue
            base = self.logged_base.get(name, 0)
            upto = base + min(g.logged_total[name] for g in having) - 1  # every rank that logs it has
            start = self.next_logged.get(name, base)
            sums: dict[int, list[float]] = {}
            for g in having:
                values, total = g.logged[name], g.logged_total[name]
                first = base + total - len(values)  # the number of the oldest value kept
                for j, value in enumerate(values):
                    number = first + j
                    if start <= number <= upto:
                        sums.setdefault(number, []).append(value)
            for number, values in sums.items():  # as the view's curves: what is not finite is left out
                finite = [v for v in values if math.isfinite(v)]
                rows.setdefault(number, {})[name] = sum(finite) / len(finite) if finite else math.nan
            if sums:
                self.next_logged[name] = max(sums) + 1
        for number in sorted(rows):
            self.write("logged", number, rows[number])
        return len(rows)
