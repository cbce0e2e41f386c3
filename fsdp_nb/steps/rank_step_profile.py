"""This rank's deep look at the next training iterations (``sess.profile(steps=N)``).

Call order, on every rank:

1. ``arm(spec)`` (the notebook's ``sess.profile``): ``torch.profiler`` starts on the
   thread that runs cells, and the rank's :class:`Profiling` part listens to its step
   owner (``fsdp_nb.engine.step``, order 50: after the step view; no hook of its own).
2. The training cell runs. Each iteration counts once, its optimizer steps together (a
   second optimizer's step joins the first's): a step's window runs from the step
   before's end to the end of its iteration's last optimizer step. At the boundary after
   the N-th (the next training forward, an eval forward, or the cell's end) the profiler
   stops, so every optimizer step of that iteration is in the trace and nothing after
   it is; the Chrome trace is exported to a private temporary file, read into memory and
   the file removed. On a GPU each step's end first waits for the device, so its kernels
   are in the trace.
3. ``take(token)`` (the notebook reads the result): the trace leaves the rank, with each
   step's window. Nothing of it stays on the rank. ``discard()`` drops an unfinished one.

A capture also ends, the profiler off and what it recorded dropped, when a cell fails
before its N steps ran (an eval cell after it would be profiled, and the trace would
grow) or when the group forms again (restart, resize, a recovery: a window across it
would count the recovery as the step's). ``take`` then says which, and after how many
steps.

The trace's ``ts`` count microseconds from its ``baseTimeNanoseconds``; ``take`` moves them
to the Unix epoch, the clock every rank of a host shares (across hosts, as well as their
clocks agree), so the notebook can lay the ranks side by side.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Any, ClassVar

from ..engine.checkpoint_group import rank_and_world
from ..engine.registry import Part, World, part
from ..engine.step import StepListener, owner
from .wire_profile import ProfileSpec, RankTrace

__all__ = ["Profiling", "arm", "discard", "take"]

log = logging.getLogger("fsdp_nb")

KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL"
"""torch's profiler library reads it when first used: fsdp_nb sets it to 6 (nothing) on a
rank where it is not set; 4 shows the library's errors, 0 everything."""


class _Capture(StepListener):
    """One profile being taken on this rank: told by the step owner."""

    order: ClassVar[int] = 50

    def __init__(self, spec: ProfileSpec, profiler: Any) -> None:
        self.spec, self.profiler = spec, profiler
        self.ends_ns: list[int] = []
        """Each profiled step's end (Unix ns): its iteration's last optimizer step."""
        self.thread = 0
        self.trace: dict[str, Any] | None = None
        self.ended = ""
        """Why the capture ended before its steps ran ("": it did not)."""

    @property
    def running(self) -> bool:
        return self.trace is None and not self.ended

    def step_ended(self, step: int, optimizer: Any) -> None:
        if self.running and len(self.ends_ns) < self.spec.steps:
            self.ends_ns.append(_now_ns())
            self.thread = threading.get_native_id()

    def step_joined(self, step: int, optimizer: Any) -> None:
        """A second optimizer's step in the iteration: the step now ends after it."""
        if self.running and self.ends_ns and len(self.ends_ns) <= self.spec.steps:
            self.ends_ns[-1] = _now_ns()

    def boundary(self, step: int, at: str) -> None:
        if self.running and len(self.ends_ns) >= self.spec.steps:
            self.finish()

    def cell_ended(self, failed: bool) -> None:
        if not (failed and self.running):
            return
        if len(self.ends_ns) >= self.spec.steps:  # the steps ran; what failed came after them
            self.finish()
        else:
            self.end(f"a cell failed after {len(self.ends_ns)} of its {self.spec.steps} steps")

    def finish(self) -> None:
        """The steps ran: stop the profiler and keep its trace."""
        owner().unlisten(self)
        self.trace = _export(self.profiler)

    def end(self, why: str) -> None:
        """End the capture before its steps ran: the profiler stops, what it recorded is
        dropped, and ``take`` says ``why``."""
        owner().unlisten(self)
        self.ended = why
        try:
            self.profiler.stop()
        except RuntimeError as exc:  # already stopped by torch: nothing is left to drop
            log.debug("profiler stop: %s", exc)
        self.profiler = None
        log.info("fsdp_nb: the profile %s ended: %s", self.spec.token, why)


def _now_ns() -> int:
    """Now (Unix ns), once this rank's device has run what was launched (on a GPU)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the step's kernels end in the trace, not after it
    return time.time_ns()


class Profiling(Part):
    """This rank's profile being taken or waiting to be read (the registry's part)."""

    def __init__(self) -> None:
        self.capture: _Capture | None = None

    def reformed(self, world: World) -> None:
        """A capture under way ends: a step across the re-forming is no step's (a trace
        already taken stays, to be read)."""
        c = self.capture
        if c is not None and c.running:
            c.end(f"the group formed again (a restart, resize or recovery) after {len(c.ends_ns)} of its "
                  f"{c.spec.steps} steps")

    def closed(self) -> None:
        discard()


def arm(spec: ProfileSpec) -> None:
    """Start profiling this rank until ``spec.steps`` iterations have run (replacing any
    earlier profile).

    Args:
        spec: the profile, as every rank receives it.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    discard()
    # kineto prints "USDT: profiler_start" (and its stages) to each rank's stderr at every
    # start and stop; a user who sets the variable on the engines sees them
    os.environ.setdefault(KINETO_LOG_LEVEL, "6")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_initialized() else [])
    capture = _Capture(spec, profile(activities=activities))
    capture.profiler.start()
    part(Profiling).capture = capture
    owner().listen(capture)


def _export(profiler: Any) -> dict[str, Any]:
    """Stop ``profiler``; its Chrome trace, read from a private file that is then removed."""
    profiler.stop()
    folder = tempfile.mkdtemp(prefix="fsdp_nb-rank-trace-")  # 0700
    try:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def take(token: str) -> RankTrace:
    """This rank's trace for profile ``token`` once its steps have run (it then leaves the
    rank); else how many have run so far, and why the capture ended if it did.

    Args:
        token: the profile's (``ProfileSpec.token``).
    """
    held = part(Profiling)
    rank = rank_and_world()[0]
    capture = held.capture
    if capture is None or capture.spec.token != token:
        return RankTrace(rank=rank, token="", steps_run=0, done=False)
    if capture.trace is None:
        return RankTrace(rank=rank, token=token, steps_run=len(capture.ends_ns), done=False, ended=capture.ended)
    held.capture = None
    trace = capture.trace
    base = float(trace.get("baseTimeNanoseconds", 0)) / 1000.0
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    for e in events:
        if isinstance(e.get("ts"), int | float):
            e["ts"] = e["ts"] + base
    ends = [ns / 1000.0 for ns in capture.ends_ns]
    first = min((e["ts"] for e in events if e.get("tid") == capture.thread and e.get("ph") == "X"
                 and isinstance(e.get("ts"), float)), default=ends[0])
    starts = [min(first, ends[0]), *ends[:-1]]
    return RankTrace(rank=rank, token=token, steps_run=len(ends), done=True, events=events,
                     windows=list(zip(starts, ends)), thread=capture.thread, host=socket.gethostname())


def discard() -> None:
    """Stop and drop this rank's profile, taken or not (a new ``arm``, or the rank leaves)."""
    held = part(Profiling)
    capture, held.capture = held.capture, None
    if capture is not None and capture.running:
        capture.end("discarded")
