"""``sess.steps()``: where each rank's recent optimizer steps' time went, and which rank
holds the others back.

Every rank measures its own steps (``steps.rank_step_timing``); the view reads the last
``window`` of them from every rank and splits each rank's mean step into:

- **compute**: in a wrapped model's forward and backward, and the optimizer step;
- **communication**: in collectives, as long as the rank that waited least was in them
  (the transfer itself, which no rank escapes);
- **waiting**: the rest of its time in collectives: for the other ranks to arrive;
- **other**: data loading, Python between the steps, the host.

The parts add up to the step. A **straggler** is a rank whose own work per step
(the step less its waiting) is more than ``SLOWER`` above the median rank's; the view
names it, the part that grew most against the median of that part, and the step from
which it stayed slow. On a GPU rank the host's clocks do not say where the device's time
went: there the view reads the device's own times from CUDA events (the step, the
device idle before its first forward, and the model part, unsplit; ``sess.profile``
splits a GPU step).

It also gives the throughput, the model FLOPs utilisation on a known GPU and the curves
of what the ranks log (``steps.step_rates``). Above ``display.rank_strip.COMPACT``
ranks it draws a strip, a cell per rank, in place of the table.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import statistics
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..display.rank_strip import COMPACT, StripCell, html_strip, levels, shade, text_strip
from ..display.sparkline import sparkline_svg
from ..display.tables import html_table, text_table
from . import rank_step_timing as _est
from .step_metrics import StepMetrics, flush_of, writer_for
from .step_rates import StepRates, curves, step_rates
from .wire_step_times import RankSteps

if TYPE_CHECKING:
    from ..context import SessionContext

log = logging.getLogger("fsdp_nb")

__all__ = ["SLOWER", "RankParts", "StepsView", "Straggler", "check_window", "start_measuring", "stop_measuring"]

SLOWER = 0.10
"""A rank whose own work per step is this much above the median rank's is a straggler."""
_PARTS = ("compute", "communication", "waiting", "other")
_SAYS = {"compute": "compute", "communication": "communication", "waiting": "waiting",
         "other": "other (data loading, Python, the host)"}


@dataclass(frozen=True)
class RankParts:
    """One rank's mean step over the window, in seconds: the parts add up to ``step``."""

    step: float
    """The step: from the end of the optimizer step before to the end of its own."""
    compute: float
    """Forward, backward and the optimizer step."""
    communication: float
    """In collectives, as long as the rank that waited least (the transfer)."""
    waiting: float
    """In collectives beyond that: waiting for the other ranks to arrive."""
    other: float
    """Data loading, Python, the host."""
    steps: int
    """Steps in the window."""


@dataclass(frozen=True)
class Straggler:
    """A rank that holds the others back."""

    rank: int
    """The rank."""
    slower: float
    """Its own work per step over the median rank's, less one (0.21: 21% more)."""
    part: str
    """The part that grew most: ``compute``, ``communication`` or ``other``."""
    since: int
    """The first step (its number on that rank) from which it stayed slow."""

    def __str__(self) -> str:
        return (f"rank {self.rank}: {self.slower:.0%} more work per step than the median rank, "
                f"in {_SAYS[self.part]}, since step {self.since}")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class StepsView:
    """The ranks' recent steps, read from the ranks at each ``refresh()`` (and when shown).
    ``sess.steps`` makes it.

    Args:
        ctx: the session context whose ranks measure.
        window: the last this many steps make each rank's means.
        token: names the view on the ranks (default: a new one), so that stopping it
            leaves the other views measuring.
    """

    def __init__(self, ctx: SessionContext, window: int, token: str | None = None) -> None:
        self._ctx, self.window = ctx, window
        self.token = token or uuid.uuid4().hex
        """Names this view's measurement on the ranks (``rank_step_timing.start``)."""
        self.ranks: dict[int, RankParts] = {}
        """Rank -> its mean step over the window, split into parts."""
        self.stragglers: list[Straggler] = []
        """The ranks that hold the others back, slowest first."""
        self.device = "cpu"
        """``cpu``, or ``cuda`` (there the times come from CUDA events and the model part is
        not split: ``sess.profile`` splits it)."""
        self.rates = StepRates(samples_per_s=None, tokens_per_s=None, mfu=None, peak=None)
        """Throughput over the window, all ranks together, and MFU on a known GPU."""
        self.curves: dict[str, list[float]] = {}
        """What the ranks log with ``fsdp_nb.log``: each name's mean over the ranks, oldest first."""
        self.updated = 0
        """How many times the ranks' steps were applied (each refresh, each live update)."""
        self._lock = threading.Lock()  # the live feed's thread applies, the notebook's refreshes and adds targets
        self._seen: dict[int, RankSteps] = {}  # each rank's newest message: what the view shows, where a target begins
        self._metrics: list[tuple[Any, StepMetrics]] = []
        """(target, what was written to it) for each ``log_to`` target."""

    def log_to(self, target: Any) -> StepsView:
        """Write the ranks' steps and logged values to ``target`` as they arrive: at every
        live update while a cell trains, and at each ``refresh()``. Per rank, each step's
        ``step_ms/rank{r}``, ``compute_ms/...``, ``communication_ms/...`` and ``other_ms/...``; for the
        whole run, ``throughput/samples_per_s`` (``tokens_per_s``, ``mfu`` where known) and
        each name logged with ``fsdp_nb.log`` (its mean over the ranks). Steps are numbered
        on from a restart or resize; a target given after steps were shown begins after
        them. Neither library is imported here: the target is used as it is. Returns the
        view.

        Args:
            target: a TensorBoard ``torch.utils.tensorboard.SummaryWriter`` (``add_scalar``,
                flushed after each write) or a Weights & Biases run (``wandb.init()``'s;
                ``log``, with ``fsdp_nb/step`` and ``fsdp_nb/logged`` as the x-axes). The
                same target twice is written once.
        """
        write = writer_for(target)  # a TypeError naming what is taken, before anything is written
        with self._lock:
            if all(t is not target for t, _ in self._metrics):
                metrics = StepMetrics(write, flush=flush_of(target))
                metrics.start_after([_on_device(g) for g in self._seen.values()])
                self._metrics.append((target, metrics))
        return self

    def reformed(self) -> None:
        """The group formed again (the live feed starts afresh): the ranks' messages from
        before are forgotten, so a rank that counts again from a lower epoch is shown."""
        with self._lock:
            self._seen.clear()

    def flush(self) -> None:
        """Flush each ``log_to`` target that can (a ``SummaryWriter``'s event file)."""
        for target, metrics in list(self._metrics):
            try:
                metrics.flush()
            except Exception as err:  # noqa: BLE001 - closing the view goes on: a failing target stops only itself
                self._drop(target, err)

    def _drop(self, target: Any, err: Exception) -> None:
        with self._lock:
            if all(t is not target for t, _ in self._metrics):
                return  # the other thread dropped it and said so
            self._metrics = [m for m in self._metrics if m[0] is not target]
        log.warning("log_to: writing to %s failed (%s: %s); it is written to no more",
                    type(target).__name__, type(err).__name__, err)

    def refresh(self) -> StepsView:
        """Read every rank's last ``window`` steps and split them; returns the view."""
        d = self._ctx.dispatcher
        self.apply(d.gather(d.apply("steps: read", _est.window)))
        return self

    def apply(self, got: list[RankSteps]) -> None:
        """Split the ranks' measured steps into the view.

        Args:
            got: each rank's last steps (``RankSteps``), as the ranks measured them.
                Only those of the newest epoch are taken: after a restart, resize or
                recovery a rank that has not sent since is left out until it does.
        """
        with self._lock:
            for g in got:
                old = self._seen.get(g.rank)
                if old is None or _newness(g) >= _newness(old):
                    self._seen[g.rank] = g
            # each rank's newest message: a live update after a refresh may carry an older one
            got = [self._seen[g.rank] for g in got]
        newest = max((g.epoch for g in got), default=0)
        got = [g for g in got if g.epoch == newest]
        every = got
        got = [_on_device(g) for g in got]  # a GPU rank: its steps as the device ran them (CUDA events)
        world = self._ctx.world_size if self._ctx is not None else None
        for target, metrics in list(self._metrics):
            try:
                metrics.take(got, world)
            except Exception as err:  # noqa: BLE001 - the view goes on: a failing target stops only itself
                self._drop(target, err)
        got = [_last(g, self.window) for g in got if g.seconds]  # ranks with steps; each view its own window
        coll = {g.rank: _mean(g.collective) for g in got}
        comm = min(coll.values(), default=0.0)
        ranks = {g.rank: RankParts(step=_mean(g.seconds), compute=_mean(g.compute), communication=comm,
                                   waiting=coll[g.rank] - comm, other=_mean(g.other), steps=len(g.seconds))
                 for g in got}
        stragglers = _stragglers({g.rank: g for g in got}, ranks)
        # built first, then set together: the live feed's thread and refresh() may both apply
        self.device = "cuda" if any(g.device == "cuda" for g in got) else "cpu"
        self.ranks, self.stragglers, self.rates, self.curves = ranks, stragglers, step_rates(got), curves(every)
        self.updated += 1

    def _table(self) -> tuple[tuple[str, ...], list[tuple]]:
        """The per-rank table's header and rows (milliseconds); on GPU ranks the model part
        is not split (``steps.rank_step_events``)."""
        parts = ("compute", "other") if self.device == "cuda" else _PARTS
        header = ("rank", "steps", "step ms", *(f"{'model' if p == 'compute' and self.device == 'cuda' else p} ms"
                                                   for p in parts))
        rows = [(r, p.steps, f"{p.step * 1e3:.1f}", *(f"{getattr(p, k) * 1e3:.1f}" for k in parts))
                for r, p in sorted(self.ranks.items())]
        return header, rows

    def _notes(self) -> list[str]:
        """The lines under the table: throughput, the stragglers, what a GPU rank's figures are."""
        lines = [f"throughput: {self.rates}"]
        lines += [f"straggler: {s}" for s in self.stragglers] or ["no straggler"]
        if self.device == "cuda":
            lines.append("GPU ranks: times from CUDA events; model = forward, backward, optimizer step and the "
                         "collectives FSDP2 overlaps with them (sess.profile splits it); a straggler is named "
                         "only when its whole step is longer")
        return lines

    def _cells(self) -> list[StripCell]:
        """A strip cell per rank: its own work per step (step less waiting), lowest to highest."""
        ranks = sorted(self.ranks)
        lv = levels([self.ranks[r].step - self.ranks[r].waiting for r in ranks])
        return [StripCell(rank=r, level=lv[i], colour=shade(lv[i]),
                          title=f"rank {r}: step {p.step * 1e3:.1f} ms = " + ", ".join(
                              f"{k} {getattr(p, k) * 1e3:.1f}" for k in _PARTS))
                for i, (r, p) in enumerate((r, self.ranks[r]) for r in ranks)]

    def _summary(self) -> str:
        """One line for a strip: the median rank's step and the slowest rank's."""
        steps = {r: p.step for r, p in self.ranks.items()}
        slow = max(steps, key=lambda r: steps[r])
        return (f"{len(steps)} ranks: median step {statistics.median(steps.values()) * 1e3:.1f} ms, "
                f"slowest rank {slow} at {steps[slow] * 1e3:.1f} ms (darker: more own work per step)")

    def _curve_lines(self) -> list[str]:
        return [f"{name}: {vals[-1]:.4g} (last of {len(vals)})" for name, vals in self.curves.items() if vals]

    def to_text(self) -> str:
        """The view as a text table (a strip above ``COMPACT`` ranks), with throughput,
        stragglers and the last value of each logged curve under it."""
        if not self.ranks:
            return "no optimizer step measured yet: run a training cell, then refresh()"
        body = (text_table(*self._table()) if len(self.ranks) <= COMPACT
                else f"{self._summary()}\n{text_strip(self._cells())}")
        return "\n".join([body, *self._notes(), *self._curve_lines()])

    def to_html(self) -> str:
        """The view as HTML, from what was last applied (no read of the ranks)."""
        if not self.ranks:
            return f"<div class='fsdp-nb-steps'>{html.escape(self.to_text())}</div>"
        notes = "<br>".join(html.escape(line) for line in self._notes())
        body = (html_table(*self._table(), cls="fsdp-nb-table") if len(self.ranks) <= COMPACT
                else f"<br><small>{html.escape(self._summary())}</small>" + html_strip(self._cells(), cls="fsdp-nb-steps-strip"))
        plots = "".join(f"<div class='fsdp-nb-curve'><small>{html.escape(line)}</small><br>"
                        f"{sparkline_svg(vals, fmt=lambda v: f'{v:.4g}')}</div>"
                        for line, vals in zip(self._curve_lines(), (v for v in self.curves.values() if v), strict=True))
        return (f"<div class='fsdp-nb-steps'><b>Steps</b> <small>mean over the last {self.window} per rank</small>"
                + body + f"<small>{notes}</small>{plots}</div>")

    def _repr_html_(self) -> str:
        self.refresh()
        return self.to_html()

    def __repr__(self) -> str:
        return self.to_text()


def _on_device(g: RankSteps) -> RankSteps:
    """A GPU rank's steps as its device ran them: step, the model part (as compute) and the
    device idle before it (as other), from CUDA events; its batches matched by step
    number. A CPU rank's as they are."""
    if g.device != "cuda":
        return g
    batch = {i: (s, k) for i, s, k in zip(g.index, g.samples, g.tokens, strict=False)}
    n = len(g.device_index)
    return dataclasses.replace(g, index=list(g.device_index), seconds=list(g.device_seconds),
                               compute=list(g.device_model), collective=[0.0] * n, other=list(g.device_other),
                               samples=[batch.get(i, (0, 0))[0] for i in g.device_index],
                               tokens=[batch.get(i, (0, 0))[1] for i in g.device_index])


def _newness(g: RankSteps) -> tuple[int, int, int, bool]:
    """Orders one rank's messages: epoch, then its last step, then its logged values, then
    whether that step is final (``open_step``)."""
    return g.epoch, g.index[-1] if g.index else -1, sum(g.logged_total.values()), g.open_step < 0


def _last(g: RankSteps, n: int) -> RankSteps:
    """``g`` with only its last ``n`` steps."""
    return dataclasses.replace(g, index=g.index[-n:], seconds=g.seconds[-n:], compute=g.compute[-n:],
                               collective=g.collective[-n:], other=g.other[-n:], samples=g.samples[-n:],
                               tokens=g.tokens[-n:])


def _own_work(g: RankSteps, i: int) -> float:
    return g.compute[i] + g.other[i] + g.collective[i]


def _stragglers(got: dict[int, RankSteps], parts: dict[int, RankParts]) -> list[Straggler]:
    """The ranks whose own work per step (step less waiting) is over ``SLOWER`` above the
    median rank's, slowest first."""
    if len(parts) < 2:
        return []
    work = {r: p.step - p.waiting for r, p in parts.items()}
    median = statistics.median(work.values())
    out = []
    for r, w in work.items():
        if median <= 0 or w / median - 1 <= SLOWER:
            continue
        excess = {k: getattr(parts[r], k) - statistics.median(getattr(p, k) for p in parts.values())
                  for k in ("compute", "communication", "other")}
        part = max(excess, key=lambda k: excess[k])
        out.append(Straggler(rank=r, slower=w / median - 1, part=part, since=_since(got, r)))
    return sorted(out, key=lambda s: -s.slower)


def _since(got: dict[int, RankSteps], r: int) -> int:
    """The step from which rank ``r`` stayed slow: the oldest of its newest steps, each with
    its own work over ``SLOWER`` above that step's median rank's (the window's first when
    none of the newest is)."""
    g = got[r]
    n = min(len(x.seconds) for x in got.values())
    offset = len(g.seconds) - n
    since = g.index[offset]
    for i in range(n - 1, -1, -1):
        median = statistics.median(_own_work(got[q], len(got[q].seconds) - n + i)
                                   - _waiting_at(got, q, len(got[q].seconds) - n + i, n) for q in got)
        if _own_work(g, offset + i) - _waiting_at(got, r, offset + i, n) <= median * (1 + SLOWER):
            break
        since = g.index[offset + i]
    return since


def _waiting_at(got: dict[int, RankSteps], r: int, i: int, n: int) -> float:
    """Rank ``r``'s waiting in its ``i``-th kept step: its collective time beyond the least
    of the ranks' in the same step (the ranks' last ``n`` steps lined up from the newest)."""
    back = len(got[r].seconds) - i
    return got[r].collective[i] - min(g.collective[len(g.seconds) - back] for g in got.values()
                                      if len(g.seconds) >= back and back <= n)


def check_window(window: object) -> int:
    """``window`` if it is an int from 1 to 1000, else a ``ValueError`` saying so.

    Args:
        window: what the caller passed as ``window=``.
    """
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= 1000:
        raise ValueError(f"window must be an int from 1 to 1000 (steps), got {window!r}")
    return window


def start_measuring(ctx: SessionContext, window: int, view: str = "") -> None:
    """Start (or keep) the measurement on every rank for ``view``, keeping at least its
    last ``window`` steps.

    Args:
        ctx: the session context whose ranks measure.
        window: the steps the view reads (each rank keeps the most any view asks for).
        view: the view's token (``StepsView.token``).
    """
    d = ctx.dispatcher
    d.gather(d.apply("steps: start", _est.start, args=(window, view)))


def stop_measuring(ctx: SessionContext, view: str | None = None) -> None:
    """``view`` stops measuring on every rank; the measurement ends there (listener and
    sampling thread gone) once no view is left.

    Args:
        ctx: the session context whose ranks measure.
        view: the view's token (None: every view).
    """
    d = ctx.dispatcher
    d.gather(d.apply("steps: stop", _est.stop, args=(view,)))
