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
   steps, with what ``fsdp_nb.log`` kept (``engine.logged``).
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
from dataclasses import dataclass, field
from typing import Any

from ..wire.step_times import RankSteps
from . import logged
from .checkpoint_group import rank_and_world
from .run_state import training_step
from .wrap import MODELS, ON_WRAPPED

__all__ = ["INTERVAL", "count", "live", "start", "stop", "window"]

log = logging.getLogger("fsdp_nb")

INTERVAL = 0.005
"""Seconds between two looks at the training thread while a step's model part runs (the
thread sleeps on an event between steps and cells, so an idle rank pays nothing)."""
_COLLECTIVE = ("/torch/distributed/",)
_DATA = ("/torch/utils/data/", "/torchdata/")


@dataclass
class _Timing:
    keep: int
    steps: collections.deque = field(default_factory=collections.deque)
    last_end: float = field(default_factory=time.perf_counter)
    first_forward: float | None = None
    batch_model: int | None = None
    samples: int = 0
    tokens: int = 0
    parameters: dict[int, int] = field(default_factory=dict)
    thread: int | None = None
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])  # compute, collective, other
    count: int = 0
    hooks: list[Any] = field(default_factory=list)
    hooked: set[int] = field(default_factory=set)
    sampler: threading.Thread | None = None
    active: threading.Event = field(default_factory=threading.Event)
    once: Any = None
    running: bool = True


_TIMING: _Timing | None = None


def start(keep: int) -> None:
    """Measure this rank's steps from now on, keeping the last ``keep`` (idempotent: a
    second call only changes ``keep``)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    global _TIMING
    if _TIMING is not None:
        _TIMING.keep = keep
        return
    t = _Timing(keep=keep)
    t.hooks.append(register_optimizer_step_post_hook(lambda *_: _stepped(t)))
    _TIMING = t
    _arm(t)
    _hook_models()
    ON_WRAPPED.append(_hook_models)
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except ImportError:  # pragma: no cover - engines always have IPython
        ip = None
    if ip is not None:  # a cell's first step starts with the cell, not at the last step of the cell before
        ip.events.register("pre_execute", lambda: _cell_started(t))
        cb = ip.events.callbacks["pre_execute"][-1]
        t.hooks.append(_Unregister(lambda: ip.events.unregister("pre_execute", cb)))
    t.sampler = threading.Thread(target=_sample, args=(t,), name="fsdp_nb-step-sampler", daemon=True)
    t.sampler.start()


class _Unregister:
    """A callable undo, held with the torch hook handles (``remove()``)."""

    def __init__(self, undo: Any) -> None:
        self.remove = undo


def _cell_started(t: _Timing) -> None:
    t.last_end, t.first_forward = time.perf_counter(), None
    t.active.clear()
    _arm(t)


def _arm(t: _Timing) -> None:
    """Arm the one-shot global forward pre-hook: the step's first forward of any module."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    if t.once is None and t.running:
        t.once = register_module_forward_pre_hook(lambda m, args: _first(t, m, args))


def _first(t: _Timing, module: Any, args: tuple) -> None:
    once, t.once = t.once, None
    if once is not None:
        once.remove()  # one call a step: every other module's forward runs without it
    if t.first_forward is None and id(module) not in t.hooked:  # a wrapped model's own hook counts it
        _forward(t, module, args, {})


def _hook_models() -> None:
    t = _TIMING
    if t is None:
        return
    for w in MODELS.values():
        if id(w.module) not in t.hooked:
            t.hooked.add(id(w.module))
            t.parameters[id(w.module)] = sum(p.numel() for p in w.module.parameters())  # global numel
            t.hooks.append(w.module.register_forward_pre_hook(
                lambda m, args, kwargs: _forward(t, m, args, kwargs), prepend=True, with_kwargs=True))


def _forward(t: _Timing, module: Any, args: tuple, kwargs: dict) -> None:
    if t.first_forward is None:
        t.first_forward = time.perf_counter()
        t.thread = threading.get_ident()
        t.counts = [0, 0, 0]
        t.batch_model, t.samples, t.tokens = id(module), 0, 0
        t.active.set()
    if id(module) == t.batch_model:  # each forward of the step's first model (micro-batches too)
        x = next((a for a in (*args, *kwargs.values()) if hasattr(a, "shape") and hasattr(a, "is_floating_point")), None)
        if x is not None and x.dim() >= 1:
            t.samples += int(x.shape[0])
            if x.dim() >= 2 and not x.is_floating_point() and not x.is_complex():
                t.tokens += int(x.shape[0]) * int(x.shape[1])


def _stepped(t: _Timing) -> None:
    if not training_step():  # a save's or load's own step (an optimizer without state)
        return
    now = time.perf_counter()
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
    t.count += 1
    t.last_end, t.first_forward, t.samples, t.tokens = now, None, 0, 0
    t.active.clear()
    _arm(t)


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


def live(rank: int, seq: int = 0, process: Any = None) -> RankSteps:
    """This rank's last steps and its logged scalars, as the side channel's sampler thread
    publishes them (its signature: ``rank``, the sample's ``seq``; ``process`` unused).

    Reads only what the hooks wrote: a copy of the kept steps, and the logged values."""
    import torch

    t = _TIMING
    rows = list(t.steps) if t is not None else []
    cols = list(zip(*rows)) if rows else [()] * 7
    on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return RankSteps(rank=rank, index=list(cols[0]), seconds=list(cols[1]), compute=list(cols[2]),
                     collective=list(cols[3]), other=list(cols[4]), samples=list(cols[5]), tokens=list(cols[6]),
                     parameters=t.parameters.get(t.batch_model or 0, 0) if t is not None else 0,
                     device="cuda" if on_cuda else "cpu",
                     device_name=torch.cuda.get_device_name() if on_cuda else "cpu",
                     logged=logged.latest(), seq=seq)


def stop() -> None:
    """Stop measuring on this rank."""
    global _TIMING
    t, _TIMING = _TIMING, None
    if t is None:
        return
    t.running = False
    t.active.set()  # the sampler sees it stopped now
    for h in [*t.hooks, *([t.once] if t.once is not None else [])]:
        h.remove()
    if _hook_models in ON_WRAPPED:
        ON_WRAPPED.remove(_hook_models)
