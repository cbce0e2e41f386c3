"""Where each optimizer step's time goes on this rank, measured while it trains (``sess.steps()``).

Call order, on every rank:

1. ``start(window)`` (the first ``sess.steps()``): a global optimizer post-step hook, a
   forward pre-hook on every wrapped model (and each one wrapped later), a one-shot
   global forward pre-hook that finds a step's first forward of any module (a model the
   loop built itself, not through ``sess.wrap``; it removes itself at once and is armed
   again when the step ends), and a sampling thread.
2. Each optimizer step (the post-step hook) closes a step: its time from the step
   before's end (or the cell's start: an IPython ``pre_execute`` hook); ``other`` from there to the first forward of a wrapped model; and the
   rest, from that forward to the step's end, split by the sampler's counts into compute
   and collective.
3. ``window()`` (the notebook reads the view), or ``live(rank, seq)`` (the side
   channel's sampler thread, once a second while a cell trains): the last ``window``
   steps, with what ``fsdp_nb.log`` kept (``steps.rank_logged``).
4. ``stop()``: hooks and thread gone.

The first wrapped model a step calls counts that step's batch: the leading dimension of
its first tensor argument is its samples, and an integer tensor of two or more
dimensions (token ids) counts its first two as tokens.

The sampler looks at the training thread's innermost Python frame every ``INTERVAL``
seconds (``sys._current_frames``): in ``torch/distributed`` (FSDP's all-gathers and
reduce-scatters and their waits, any ``dist`` call) it counts a collective; in a data
loader (``torch/utils/data``, ``torchdata``) it counts other; anywhere else inside the
model part, compute. On a CPU rank a collective blocks the thread, so this is where its
time goes. On a GPU the host runs ahead of the device, so these host clocks do not say
where the device's time went; the view says so (``device``).
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..engine.checkpoint_group import rank_and_world
from ..engine.side_channel import Reading
from ..engine.step import training_step
from ..models.rank_wrap import on_wrapped, wrapped
from . import rank_logged as logged
from .rank_step_events import DeviceSteps
from .wire_step_times import RankSteps

__all__ = ["INTERVAL", "StepsReading", "count", "live", "start", "stop", "window"]

log = logging.getLogger("fsdp_nb")

INTERVAL = 0.01
"""Seconds between two looks at the training thread while a step's model part runs on a
CPU rank (the thread sleeps on an event between steps and cells, so an idle rank pays
nothing, and on a GPU rank, whose parts come from CUDA events). Each look takes the GIL
from the training thread: at 5 ms a small, Python-bound CPU loop ran about 3% slower."""
_COLLECTIVE = ("/torch/distributed/",)
_DATA = ("/torch/utils/data/", "/torchdata/")


@dataclass
class _Timing:
    keep: int
    steps: collections.deque = field(default_factory=collections.deque)
    last_end: float = field(default_factory=time.perf_counter)
    first_forward: float | None = None
    batch_model: Any = None
    """A weak reference to the model whose batches this step counts (None: none yet)."""
    samples: int = 0
    tokens: int = 0
    forwarded: bool = False
    """A forward ran since the last optimizer step (a second optimizer's step joins the step)."""
    last_forwarded: bool = False
    parameters: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    thread: int | None = None
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])  # compute, collective, other
    count: int = 0
    hooks: list[Any] = field(default_factory=list)
    hooked: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    sampler: threading.Thread | None = None
    active: threading.Event = field(default_factory=threading.Event)
    once: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    device_name: str = "cpu"
    device: DeviceSteps = field(default_factory=lambda: DeviceSteps(0))
    """CUDA events at each step's first forward and end (nothing on a CPU rank)."""
    running: bool = True


_TIMING: _Timing | None = None


def start(keep: int) -> None:
    """Measure this rank's steps from now on, keeping the last ``keep`` (idempotent: a
    second call keeps the larger of the two).

    Args:
        keep: how many of the newest steps to keep (each view reads its own last window).
    """
    from torch.optim.optimizer import register_optimizer_step_post_hook

    global _TIMING
    if _TIMING is not None:
        _TIMING.keep = _TIMING.device.keep = max(_TIMING.keep, keep)  # each view takes its own window
        return
    t = _Timing(keep=keep, device=DeviceSteps(keep))
    t.hooks.append(register_optimizer_step_post_hook(lambda *_: _stepped(t)))
    _TIMING = t
    _hook_models()
    _arm(t)
    on_wrapped().append(_hook_models)
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except ImportError:  # pragma: no cover - engines always have IPython
        ip = None
    if ip is not None:  # a cell's first step starts with the cell, not at the last step of the cell before
        for event, fn in (("pre_execute", lambda: _cell_started(t)), ("post_execute", lambda: _cell_ended(t))):
            ip.events.register(event, fn)
            t.hooks.append(_Unregister(lambda event=event, fn=fn: ip.events.unregister(event, fn)))
    t.sampler = threading.Thread(target=_sample, args=(t,), name="fsdp_nb-step-sampler", daemon=True)
    t.sampler.start()


class _Unregister:
    """A callable undo, held with the torch hook handles (``remove()``)."""

    def __init__(self, undo: Any) -> None:
        self.remove = undo


def _cell_started(t: _Timing) -> None:
    t.last_end, t.first_forward, t.forwarded = time.perf_counter(), None, False
    t.device.cell_started()
    t.active.clear()
    _arm(t)


def _cell_ended(t: _Timing) -> None:
    """A forward with no optimizer step after it (an eval cell) ends with its cell: the
    sampler goes back to sleep."""
    t.first_forward = None
    t.active.clear()


def _arm(t: _Timing) -> None:
    """Arm the one-shot global forward pre-hook that finds the step's first forward of a
    model the loop built itself; only while no model is wrapped (a wrapped model's own
    hook finds it, and no other module can take its place)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    with t.lock:
        if t.once is None and t.running and not len(t.hooked):
            t.once = register_module_forward_pre_hook(lambda m, args: _first(t, m, args))


def _first(t: _Timing, module: Any, args: tuple) -> None:
    import torch

    if not torch.is_grad_enabled():  # an eval forward does not start a training step: stay armed
        return
    with t.lock:
        once, t.once = t.once, None
    if once is not None:
        once.remove()  # one call a step: every other module's forward runs without it
    if t.first_forward is None and module not in t.hooked:  # a wrapped model's own hook counts it
        _forward(t, module, args, {})


def _hook_models() -> None:
    t = _TIMING
    if t is None:
        return
    for w in wrapped().values():
        if w.module not in t.hooked:
            t.hooked.add(w.module)
            t.hooks.append(w.module.register_forward_pre_hook(
                lambda m, args, kwargs: _forward(t, m, args, kwargs), prepend=True, with_kwargs=True))


def _forward(t: _Timing, module: Any, args: tuple, kwargs: dict) -> None:
    import torch

    if not torch.is_grad_enabled():  # an eval forward is not part of a training step
        return
    batch = t.batch_model() if t.batch_model is not None else None
    if t.first_forward is None:
        t.first_forward = time.perf_counter()
        t.thread = threading.get_ident()
        t.counts = [0, 0, 0]
        if t.device_name == "cpu":  # a GPU rank's parts come from CUDA events: no sampling
            t.active.set()
        t.device.forward()
        batch = None
    if batch is None or (module in t.hooked and batch not in t.hooked):  # a wrapped model takes over
        t.batch_model, t.samples, t.tokens, batch = weakref.ref(module), 0, 0, module
        if module not in t.parameters:
            t.parameters[module] = sum(p.numel() for p in module.parameters())  # global numel (DTensor)
    t.forwarded = True
    if module is batch:  # each forward of the step's model (micro-batches too)
        x = next((a for a in (*args, *kwargs.values()) if hasattr(a, "shape") and hasattr(a, "is_floating_point")), None)
        if x is not None and x.dim() >= 1:
            t.samples += int(x.shape[0])
            if x.dim() >= 2 and not x.is_floating_point() and not x.is_complex():
                t.tokens += int(x.shape[0]) * int(x.shape[1])


def _stepped(t: _Timing) -> None:
    if not training_step():  # a save's or load's own step (an optimizer without state)
        return
    now = time.perf_counter()
    if not t.forwarded and t.last_forwarded and t.steps:  # a second optimizer's step: the same iteration
        i, seconds, comp, coll, oth, samples, tokens = t.steps[-1]
        t.steps[-1] = (i, seconds + now - t.last_end, comp + now - t.last_end, coll, oth, samples, tokens)
        t.last_end = now
        t.device.joined()
        return
    seconds = now - t.last_end
    start_model = t.first_forward if t.first_forward is not None else now
    other = start_model - t.last_end
    model = now - start_model
    comp, coll, oth = t.counts
    seen = comp + coll + oth
    coll_s = model * coll / seen if seen else 0.0
    oth_s = model * oth / seen if seen else 0.0
    t.steps.append((t.count, seconds, model - coll_s - oth_s, coll_s, other + oth_s, t.samples, t.tokens))
    while len(t.steps) > t.keep:
        t.steps.popleft()
    t.device.stepped(t.count)
    t.count += 1
    if t.device_name == "cpu":
        t.device_name = _device_name()
    t.last_end, t.first_forward, t.samples, t.tokens = now, None, 0, 0
    t.last_forwarded, t.forwarded = t.forwarded, False
    t.active.clear()
    _arm(t)


def _device_name() -> str:
    """This rank's GPU's name, read on the training thread (its current device), or ``cpu``."""
    import torch

    if torch.cuda.is_initialized() and torch.cuda.is_available():  # the flag first: a CPU rank asks every step
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return "cpu"


def _sample(t: _Timing) -> None:
    """The sampling thread: where the training thread is, while a step's model part runs."""
    while t.running:
        if not t.active.wait(0.5):  # between steps: asleep until a forward starts one
            continue
        time.sleep(INTERVAL)
        if t.first_forward is None or t.thread is None:
            continue
        frame = sys._current_frames().get(t.thread)
        if frame is None:
            continue
        name = frame.f_code.co_filename.replace("\\", "/")
        kind = 1 if any(p in name for p in _COLLECTIVE) else 2 if any(p in name for p in _DATA) else 0
        t.counts[kind] += 1


def count() -> int:
    """Steps measured on this rank since ``start`` (0 when not measuring)."""
    t = _TIMING
    return t.count if t is not None else 0


def window() -> RankSteps:
    """This rank's last steps (none when ``start`` was not called)."""
    return live(rank_and_world()[0])


def live(rank: int, seq: int = 0) -> RankSteps:
    """This rank's last steps and its logged scalars, as the side channel's sampler thread
    publishes them (``seq``: which of its messages). Reads only what the hooks wrote: a
    copy of the kept steps, and the logged values.

    Args:
        rank: this rank, written in the message.
        seq: the message's number within its sampler (0: read through the task queue).
    """
    t = _TIMING
    rows = list(t.steps) if t is not None else []
    cols = list(zip(*rows)) if rows else [()] * 7
    model = t.batch_model() if t is not None and t.batch_model is not None else None
    name = t.device_name if t is not None else "cpu"
    dev = list(zip(*t.device.read())) if t is not None else []
    dev = dev or [()] * 4
    return RankSteps(rank=rank, index=list(cols[0]), seconds=list(cols[1]), compute=list(cols[2]),
                     collective=list(cols[3]), other=list(cols[4]), samples=list(cols[5]), tokens=list(cols[6]),
                     parameters=t.parameters.get(model, 0) if t is not None and model is not None else 0,
                     device="cpu" if name == "cpu" else "cuda", device_name=name, logged=logged.latest(), seq=seq,
                     device_index=list(dev[0]), device_seconds=list(dev[1]), device_other=list(dev[2]),
                     device_model=list(dev[3]))


def stop() -> None:
    """Stop measuring on this rank."""
    global _TIMING
    t, _TIMING = _TIMING, None
    if t is None:
        return
    t.running = False
    t.active.set()  # the sampler sees it stopped now
    with t.lock:
        once, t.once = t.once, None
    for h in [*t.hooks, *([once] if once is not None else [])]:
        h.remove()
    if _hook_models in on_wrapped():
        on_wrapped().remove(_hook_models)


class StepsReading(Reading):
    """What the step view's sampler publishes: this rank's last steps and logged scalars
    (``live``), only when a step ended or a scalar was logged since the last it sent."""

    name = "steps"

    def __init__(self) -> None:
        self.sent: tuple[int, int] | None = None
        """(steps, logged calls) when it last sent."""

    def read(self, rank: int, seq: int, process: Any) -> Any:
        news = (count(), logged.count())
        if news == self.sent:
            return None
        self.sent = news
        return live(rank, seq=seq)
