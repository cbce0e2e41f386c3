"""Where each step's time goes on this rank, measured while it trains (``sess.steps()``).

Call order, on every rank:

1. ``start(keep, view)`` (each ``sess.steps()``): the rank's :class:`StepTiming` part
   listens to its step owner (``fsdp_nb.engine.step``, order 40: no hook of its own) and
   starts a sampling thread. Each view is named by its token; the rank keeps the most
   steps any view asks for.
2. The owner tells it a cell's start (IPython's, or a ``sess.run`` call's), each step's
   first forward, each forward of a watched model and each step's end. A step runs from
   the step before's end (or the cell's start: the pause between cells is no step's) to
   the end of its iteration's optimizer steps (a second optimizer's joins it); ``other``
   is the time before its first forward, and the rest, from that forward to its end, is
   split by the sampler's counts into compute and collective.
3. ``window()`` (the notebook reads the view), or the side channel's sampler thread
   (``StepsReading``, once a second while a cell trains): the last steps, with what
   ``fsdp_nb.log`` kept (``steps.rank_logged``).
4. ``stop(view)``: that view is done; the last one's end stops the measurement.

When the group forms again (restart, resize, a recovery: ``reformed``) the ranks agree
on the views measuring and on a new **epoch**, and every rank's window starts afresh, so
no rank's mean mixes steps from both sides of it, and a rank that joined measures as the
others do.

The first model a step calls counts that step's batch (a watched, wrapped model takes
over from a model the loop built itself): the leading dimension of its first tensor
argument is its samples, and an integer tensor of two or more dimensions (token ids)
counts its first two as tokens.

The sampler looks at the training thread's innermost Python frame every ``INTERVAL``
seconds (``sys._current_frames``): in ``torch/distributed`` on a line that issues a
collective or waits for one, it counts a collective; in a data loader (``torch/utils/data``,
``torchdata``) it counts other; anywhere else (FSDP's copies in and out of its
communication buffers included), compute. On a CPU rank a collective blocks the thread,
so this is where its time goes. On a GPU the host runs ahead of the device, so these host
clocks do not say where the device's time went: there the parts come from CUDA events
(``steps.rank_step_events``).
"""

from __future__ import annotations

import collections
import linecache
import logging
import re
import sys
import threading
import time
import weakref
from typing import Any, ClassVar

from ..engine.checkpoint_group import gathered, rank_and_world
from ..engine.registry import Part, World, part
from ..engine.side_channel import Reading
from ..engine.step import StepListener, owner
from . import rank_logged as logged
from .rank_step_events import DeviceSteps
from .wire_step_times import RankSteps

__all__ = ["COLLECTIVE", "COMPUTE", "INTERVAL", "OTHER", "StepTiming", "StepsReading", "count", "frame_kind",
           "line_kind", "live", "start", "stop", "window"]

log = logging.getLogger("fsdp_nb")

INTERVAL = 0.01
"""Seconds between two looks at the training thread while a step's model part runs on a
CPU rank (the thread sleeps on an event between steps and cells, so an idle rank pays
nothing, and on a GPU rank, whose parts come from CUDA events). Each look takes the GIL
from the training thread: at 5 ms a small, Python-bound CPU loop ran about 3% slower."""
COMPUTE, COLLECTIVE, OTHER = 0, 1, 2
"""What a look at the training thread counts."""
_DISTRIBUTED = "/torch/distributed/"
_DATA = ("/torch/utils/data/", "/torchdata/")
_CALLED = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_COLLECTIVE_CALL = re.compile(
    r"_*(wait|all_?gather|allgather|reduce_?scatter|all_?reduce|allreduce|broadcast|barrier|monitored_barrier"
    r"|all_?to_?all|alltoall|i?send|i?recv|batch_isend_irecv|gather|scatter|reduce)", re.I)


def line_kind(source: str) -> int:
    """What a frame in ``torch/distributed`` counts, by its current line: ``COLLECTIVE``
    when the line calls a collective or a wait (``work.wait()``, ``group.allreduce(...)``,
    ``dist.all_gather_into_tensor(...)``), else ``COMPUTE`` (FSDP's copy-in and copy-out,
    its buffers, a DTensor's dispatch).

    Args:
        source: the line's source text.
    """
    for name in _CALLED.findall(source):
        last = name.rsplit(".", 1)[-1]
        if "copy" not in last.lower() and _COLLECTIVE_CALL.match(last):
            return COLLECTIVE
    return COMPUTE


def frame_kind(frame: Any, lines: dict[tuple[str, int], int]) -> int:
    """What a look at the training thread counts when its innermost frame is ``frame``:
    ``COLLECTIVE`` in ``torch/distributed`` on a line that issues or waits for a
    collective (``line_kind``), ``OTHER`` in a data loader, else ``COMPUTE``.

    Args:
        frame: the frame (``f_code.co_filename``, ``f_lineno``).
        lines: (file, line) -> its kind, filled as lines are first seen (each read once).
    """
    name = frame.f_code.co_filename.replace("\\", "/")
    if _DISTRIBUTED in name:
        key = (name, frame.f_lineno)
        kind = lines.get(key)
        if kind is None:
            kind = lines[key] = line_kind(linecache.getline(name, frame.f_lineno))
        return kind
    return OTHER if any(p in name for p in _DATA) else COMPUTE


class _Window(StepListener):
    """The steps a rank measures: told by its step owner, read from any thread."""

    order: ClassVar[int] = 40

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.steps: collections.deque[tuple] = collections.deque()
        """(number, seconds, compute, collective, other, samples, tokens), oldest first."""
        self.count = 0
        """Steps measured in this window (the next step's number)."""
        self.last_end = time.perf_counter()
        self.first_forward: float | None = None
        self.batch_model: Any = None
        """A weak reference to the model whose batches this step counts (None: none yet)."""
        self.taken = False
        """A forward of this step has named its batch's model."""
        self.samples = self.tokens = 0
        self.parameters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.thread: int | None = None
        self.counts = [0, 0, 0]
        """Looks at the training thread this step: compute, collective, other."""
        self.lines: dict[tuple[str, int], int] = {}
        """(file, line) in ``torch/distributed`` -> what a look there counts (read once)."""
        self.active = threading.Event()
        self.running = True
        self.device_name = "cpu"
        self.device = DeviceSteps(keep)
        """CUDA events at each step's first forward and end (nothing on a CPU rank)."""
        self.sampler = threading.Thread(target=self._sample, name="fsdp_nb-step-sampler", daemon=True)

    def afresh(self) -> None:
        """Start the window again: the steps kept so far belonged to the group before."""
        self.active.clear()
        self.steps.clear()
        self.count, self.last_end, self.first_forward = 0, time.perf_counter(), None
        self.batch_model, self.taken, self.samples, self.tokens = None, False, 0, 0
        self.device = DeviceSteps(self.keep)

    # -- what the step owner tells ------------------------------------------------------

    def cell_started(self) -> None:
        self.last_end, self.first_forward = time.perf_counter(), None
        self.device.cell_started()
        self.active.clear()

    def step_began(self, step: int) -> None:
        self.first_forward = time.perf_counter()
        self.thread = threading.get_ident()
        self.counts = [0, 0, 0]
        self.taken = False
        if self.device_name == "cpu":  # a GPU rank's parts come from CUDA events: no sampling
            self.active.set()
        self.device.forward()

    def forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        batch = self.batch_model() if self.batch_model is not None and self.taken else None
        steps = owner()
        if batch is None or (module in steps.watched and batch not in steps.watched):  # a wrapped model takes over
            self.batch_model, self.samples, self.tokens, batch = weakref.ref(module), 0, 0, module
            self.taken = True
            if module not in self.parameters:
                self.parameters[module] = sum(p.numel() for p in module.parameters())  # global numel (DTensor)
        if module is batch:  # each forward of the step's model (micro-batches too)
            x = next((a for a in (*args, *kwargs.values()) if hasattr(a, "shape") and hasattr(a, "is_floating_point")),
                     None)
            if x is not None and x.dim() >= 1:
                self.samples += int(x.shape[0])
                if x.dim() >= 2 and not x.is_floating_point() and not x.is_complex():
                    self.tokens += int(x.shape[0]) * int(x.shape[1])

    def step_ended(self, step: int, optimizer: Any) -> None:
        now = time.perf_counter()
        start_model = self.first_forward if self.first_forward is not None else now
        other, model = start_model - self.last_end, now - start_model
        comp, coll, oth = self.counts
        seen = comp + coll + oth
        coll_s = model * coll / seen if seen else 0.0
        oth_s = model * oth / seen if seen else 0.0
        self.steps.append((self.count, now - self.last_end, model - coll_s - oth_s, coll_s, other + oth_s,
                           self.samples, self.tokens))
        while len(self.steps) > self.keep:
            self.steps.popleft()
        self.device.stepped(self.count)
        self.count += 1
        if self.device_name == "cpu":
            self.device_name = _device_name()
        self.last_end, self.first_forward, self.samples, self.tokens = now, None, 0, 0
        self.active.clear()

    def step_joined(self, step: int, optimizer: Any) -> None:
        """A second optimizer's step in the same iteration: the step now ends after it,
        its time counted as compute."""
        now = time.perf_counter()
        if self.steps:
            i, seconds, comp, coll, oth, samples, tokens = self.steps[-1]
            self.steps[-1] = (i, seconds + now - self.last_end, comp + now - self.last_end, coll, oth, samples, tokens)
        self.last_end = now
        self.device.joined()

    def cell_ended(self, failed: bool) -> None:
        """A forward with no optimizer step after it (an eval cell, a failed step) ends with
        its cell: the sampler goes back to sleep."""
        self.first_forward = None
        self.active.clear()

    # -- the sampler ----------------------------------------------------------------------

    def _sample(self) -> None:
        """The sampling thread: where the training thread is, while a step's model part runs."""
        while self.running:
            if not self.active.wait(0.5):  # between steps: asleep until a forward starts one
                continue
            time.sleep(INTERVAL)
            if self.first_forward is None or self.thread is None:
                continue
            frame = sys._current_frames().get(self.thread)
            if frame is not None:
                self.counts[frame_kind(frame, self.lines)] += 1


def _device_name() -> str:
    """This rank's GPU's name, read on the training thread (its current device), or ``cpu``."""
    import torch

    if torch.cuda.is_initialized() and torch.cuda.is_available():  # the flag first: a CPU rank asks every step
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return "cpu"


class StepTiming(Part):
    """This rank's step view: the views measuring, their window, its epoch (the registry's part)."""

    def __init__(self) -> None:
        self.views: dict[str, int] = {}
        """View token -> the steps it keeps. Measuring while any view is here."""
        self.epoch = 0
        """Which formation of the group the window belongs to, agreed by every rank."""
        self.window: _Window | None = None

    def start(self, keep: int, view: str = "") -> None:
        """Measure for ``view``, keeping at least its last ``keep`` steps (idempotent)."""
        self.views[view] = max(keep, self.views.get(view, 0))
        keep = max(self.views.values())
        w = self.window
        if w is None:
            w = self.window = _Window(keep)
            w.sampler.start()
        w.keep = w.device.keep = keep
        owner().listen(w)

    def stop(self, view: str | None = None) -> None:
        """``view`` is done (None: every view); the last one stops the measurement."""
        if view is None:
            self.views.clear()
        else:
            self.views.pop(view, None)
        if self.views:
            return
        w, self.window = self.window, None
        if w is None:
            return
        owner().unlisten(w)
        w.running = False
        w.active.set()  # the sampler sees it stopped now

    def reformed(self, world: World) -> None:
        """Every rank agrees on the views measuring and a new epoch; every window starts
        afresh, and so do the logged values' counts (``rank_logged``, told after this part:
        cleared here first). The epoch moves last: a message that carries the new epoch
        (``live`` reads it first) carries only the new epoch's steps and counts."""
        views, epoch = self._agree()
        try:
            for view, keep in views.items():
                self.start(keep, view)
            if self.window is not None:
                self.window.afresh()
            logged.clear()
        finally:  # every rank moves on to the agreed epoch, whatever failed here
            self.epoch = epoch + 1

    def _agree(self) -> tuple[dict[str, int], int]:
        """The views and the highest epoch of every rank (one gather on the checkpoint group)."""
        every = gathered((dict(self.views), self.epoch))
        views: dict[str, int] = {}
        for vs, _ in every:
            for view, keep in vs.items():
                views[view] = max(keep, views.get(view, 0))
        return views, max(e for _, e in every)

    def closed(self) -> None:
        self.stop()
        self.epoch = 0


def start(keep: int, view: str = "") -> None:
    """Measure this rank's steps from now on for ``view``, keeping at least its last
    ``keep`` (idempotent: the rank keeps the most any view asks for).

    Args:
        keep: how many of the newest steps to keep (each view reads its own last window).
        view: the view's token (``""``: a view with none).
    """
    part(StepTiming).start(keep, view)


def stop(view: str | None = None) -> None:
    """``view`` stops measuring on this rank (None: every view); the measurement ends
    with the last one.

    Args:
        view: the view's token, as ``start`` had it.
    """
    part(StepTiming).stop(view)


def count() -> int:
    """Steps measured on this rank in the current window (0 when not measuring)."""
    w = part(StepTiming).window
    return w.count if w is not None else 0


def window() -> RankSteps:
    """This rank's last steps (none when not measuring)."""
    return live(rank_and_world()[0])


def live(rank: int, seq: int = 0) -> RankSteps:
    """This rank's last steps and its logged scalars, as the side channel's sampler thread
    publishes them (``seq``: which of its messages). Reads only what the owner's events
    wrote: a copy of the kept steps, and the logged values.

    Args:
        rank: this rank, written in the message.
        seq: the message's number within its sampler (0: read through the task queue).
    """
    timing = part(StepTiming)
    epoch = timing.epoch  # first: the steps and counts read after it are of this epoch or a later one
    t = timing.window
    rows, dev_rows, open_step = _steps_now(t)
    cols = list(zip(*rows)) if rows else [()] * 7
    model = t.batch_model() if t is not None and t.batch_model is not None else None
    name = t.device_name if t is not None else "cpu"
    dev = list(zip(*dev_rows)) or [()] * 4
    values, totals = logged.counted()
    return RankSteps(rank=rank, index=list(cols[0]), seconds=list(cols[1]), compute=list(cols[2]),
                     collective=list(cols[3]), other=list(cols[4]), samples=list(cols[5]), tokens=list(cols[6]),
                     parameters=t.parameters.get(model, 0) if t is not None and model is not None else 0,
                     device="cpu" if name == "cpu" else "cuda", device_name=name, logged=values,
                     logged_total=totals, seq=seq,
                     device_index=list(dev[0]), device_seconds=list(dev[1]), device_other=list(dev[2]),
                     device_model=list(dev[3]), epoch=epoch, open_step=open_step)


def _steps_now(t: _Window | None, tries: int = 3) -> tuple[list[tuple], list[tuple], int]:
    """The window's host and device rows and its open step (``RankSteps.open_step``), read
    as one state: the training thread changes them while this thread reads, so the step
    owner's count of changes must be the same before and after. Where it never is (a
    fast loop), the newest step is taken as open: a writer waits for a later message."""
    if t is None:
        return [], [], -1
    o = owner()
    for _ in range(tries):
        before = o.changes
        rows, dev = list(t.steps), list(t.device.read())
        # a step that ended with no forward seen cannot be joined: the next step is its own
        growing = o.pending and o.forwarded
        if o.changes == before:
            break
    else:
        growing = True  # never one state: the newest step is taken as open
    return rows, dev, rows[-1][0] if rows and growing else -1


class StepsReading(Reading):
    """What the step view's sampler publishes: this rank's last steps and logged scalars
    (``live``), only when a step ended, a scalar was logged or the window started afresh
    since the last it sent, or its newest step became final (``RankSteps.open_step``)."""

    name = "steps"

    def __init__(self) -> None:
        self.sent: tuple[Any, ...] | None = None
        """(epoch, steps, logged calls, whether the newest step may still grow, the newest
        step the device passed) when it last sent."""

    def read(self, rank: int, seq: int, process: Any) -> Any:
        t = part(StepTiming).window
        device = t.device.newest_passed() if t is not None else None  # a GPU's step the device passed since
        news = (part(StepTiming).epoch, count(), logged.count(), owner().pending, device)
        if news == self.sent:
            return None
        self.sent = news
        return live(rank, seq=seq)
