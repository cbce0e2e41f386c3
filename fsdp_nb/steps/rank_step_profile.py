"""This rank's deep look at the next optimizer steps (``sess.profile(steps=N)``).

Call order, on every rank:

1. ``arm(spec)`` (the notebook's ``sess.profile``): ``torch.profiler`` starts on the
   thread that runs cells, and a global optimizer post-step hook counts steps.
2. The training cell runs. After the N-th optimizer step (any optimizer's) the hook stops
   the profiler, exports its Chrome trace to a private temporary file, reads it into
   memory and removes the file; the hook then removes itself. On a GPU it first waits
   for the device, so the steps' kernels are in the trace.
3. ``take(token)`` (the notebook reads the result): the trace leaves the rank, with each
   step's window. Nothing of it stays on the rank. ``discard()`` drops an unfinished one.

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
from dataclasses import dataclass, field
from typing import Any

from ..engine.checkpoint_group import rank_and_world
from .wire_profile import ProfileSpec, RankTrace

__all__ = ["arm", "discard", "take"]

log = logging.getLogger("fsdp_nb")

KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL"
"""torch's profiler library reads it when first used: fsdp_nb sets it to 6 (nothing) on a
rank where it is not set; 4 shows the library's errors, 0 everything."""


@dataclass
class _Capture:
    spec: ProfileSpec
    profiler: Any
    hook: Any = None
    ends_ns: list[int] = field(default_factory=list)
    thread: int = 0
    trace: dict[str, Any] | None = None


_CAPTURE: _Capture | None = None


def arm(spec: ProfileSpec) -> None:
    """Start profiling this rank until ``spec.steps`` optimizer steps have run."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile

    global _CAPTURE
    discard()
    # kineto prints "USDT: profiler_start" (and its stages) to each rank's stderr at every
    # start and stop; a user who sets the variable on the engines sees them
    os.environ.setdefault(KINETO_LOG_LEVEL, "6")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_initialized() else [])
    capture = _Capture(spec, profile(activities=activities))
    capture.profiler.start()
    capture.hook = register_optimizer_step_post_hook(lambda *_: _stepped(capture))
    _CAPTURE = capture


def _stepped(capture: _Capture) -> None:
    """The optimizer post-step hook: count the step; after the last, end the capture."""
    if capture.trace is not None or capture is not _CAPTURE:
        return
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the step's kernels end in the trace, not after it
    capture.ends_ns.append(time.time_ns())
    capture.thread = threading.get_native_id()
    if len(capture.ends_ns) >= capture.spec.steps:
        capture.hook.remove()
        capture.trace = _export(capture.profiler)


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
    rank), or how many have run so far."""
    global _CAPTURE
    rank = rank_and_world()[0]
    capture = _CAPTURE
    if capture is None or capture.spec.token != token:
        return RankTrace(rank=rank, token="", steps_run=0, done=False)
    if capture.trace is None:
        return RankTrace(rank=rank, token=token, steps_run=len(capture.ends_ns), done=False)
    _CAPTURE = None
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
    """Stop and drop an unfinished capture (a new ``arm``, or the notebook gave up)."""
    global _CAPTURE
    capture, _CAPTURE = _CAPTURE, None
    if capture is None or capture.trace is not None:
        return
    capture.hook.remove()
    try:
        capture.profiler.stop()
    except RuntimeError as exc:  # already stopped by torch: nothing is left to drop
        log.debug("profiler stop: %s", exc)
