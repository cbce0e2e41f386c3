"""Profiled steps in the Chrome trace format: one rank's time split into parts, and the
ranks' traces merged into one file.

Each profiled step of a rank (its window: from the step before's end to its own) is split
by the union of intervals, as HolisticTraceAnalysis splits a GPU's time, so overlapping
events are never counted twice:

- **communication**: on a GPU, the device's collective kernels (NCCL's): the host's spans
  of a collective only launch it. On a CPU, every span whose name is a collective's
  (gloo's work on its threads; on the training thread ``c10d::`` ops, FSDP's all-gather
  and reduce-scatter steps and their waits), less the operators the training thread runs
  inside them (a copy into or out of a buffer is compute, not communication). A span
  named for a copy (FSDP's copy-in and copy-out) is never communication;
- **compute**: on a GPU, the device's other kernels and copies; on a CPU, the training
  thread's other operators, less the time that thread spent in communication (blocked in
  a wait, it computes nothing);
- **overlap**: communication while computing (hidden behind compute);
- **exposed communication**: communication while not computing;
- **idle**: neither (the host between operators, data loading, Python, waiting on
  something that is not a collective).

``compute + exposed + idle`` is the step; ``overlap`` is part of ``compute``.
HolisticTraceAnalysis itself is not used: it reads only GPU kernels (a CPU rank's trace
gives it nothing to split) and brings pandas and plotly with it.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["COMMUNICATION", "StepParts", "communication", "lanes", "merge_traces", "step_parts", "union"]

COMMUNICATION = re.compile(
    r"nccl|gloo:|c10d::|all_?gather|reduce_?scatter|all_?reduce|broadcast|all_?to_?all|rs_wait|ag_wait", re.I)
"""Names of the events that are communication (unless they name a copy: ``communication``)."""
_DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
Interval = tuple[float, float]


@dataclass(frozen=True)
class StepParts:
    """One rank's profiled steps, in seconds per step (the mean over them)."""

    rank: int
    """The rank."""
    step: float
    """The whole step."""
    compute: float
    """Computing (overlap included)."""
    exposed: float
    """Communicating while not computing."""
    overlap: float
    """Communicating while computing (hidden)."""
    idle: float
    """Neither."""
    device: str
    """``"gpu"`` (split from device kernels) or ``"cpu"`` (from the training thread)."""


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged: sorted, none overlapping."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: Sequence[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs: Sequence[Interval], ys: Sequence[Interval]) -> list[Interval]:
    """Where two merged lists overlap."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(xs: Sequence[Interval], ys: Sequence[Interval]) -> list[Interval]:
    """The parts of merged ``xs`` outside merged ``ys``."""
    out: list[Interval] = []
    for a, b in xs:
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def communication(event: dict[str, Any]) -> bool:
    """Whether ``event``'s name is a collective's (and not a copy's: FSDP's
    ``all_gather_copy_in`` and ``all_gather_copy_out`` move data between tensors on this
    rank).

    Args:
        event: a trace event.
    """
    name = str(event.get("name", ""))
    return bool(COMMUNICATION.search(name)) and "copy" not in name.lower()


def _within(merged: Sequence[Interval], starts: Sequence[float], span: Interval) -> bool:
    """Whether ``span`` lies inside one interval of the merged, sorted ``merged`` (whose
    starts are ``starts``)."""
    i = bisect.bisect_right(starts, span[0]) - 1
    return i >= 0 and merged[i][1] >= span[1]


def lanes(events: Iterable[dict[str, Any]], window: Interval, thread: int) -> tuple[list[Interval], list[Interval]]:
    """(compute, communication) of one rank within ``window``, merged and clipped.

    Args:
        events: the rank's trace events (``ts``, ``dur`` in microseconds).
        window: the step's (start, end), on the events' clock.
        thread: the training thread's id (the one that stepped the optimizer).
    """
    lo, hi = window
    spans = []
    for e in events:
        if e.get("ph") != "X" or not isinstance(e.get("dur"), int | float):
            continue
        whole = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if max(whole[0], lo) < min(whole[1], hi):
            spans.append((e, whole))

    def clip(w: Interval) -> Interval:
        return max(w[0], lo), min(w[1], hi)

    if any(e.get("cat") in _DEVICE_CATS for e, _ in spans):  # the device's own kernels say it
        on_device = [(e, w) for e, w in spans if e.get("cat") in _DEVICE_CATS]
        return (union(clip(w) for e, w in on_device if not communication(e)),
                union(clip(w) for e, w in on_device if communication(e)))
    collectives = [(e, w) for e, w in spans if communication(e)]
    waits = union(w for e, w in collectives if e.get("tid") == thread)  # unclipped, to find what is inside
    ops = [w for e, w in spans if e.get("cat") == "cpu_op" and e.get("tid") == thread and not communication(e)]
    starts = [a for a, _ in waits]
    inside = union(clip(w) for w in ops if _within(waits, starts, w))  # host work within a collective: compute
    thread_comm = _subtract(union(clip(w) for w in waits), inside)
    compute = union([*_subtract(union(clip(w) for w in ops), union(clip(w) for w in waits)), *inside])
    return compute, union([*thread_comm, *(clip(w) for e, w in collectives if e.get("tid") != thread)])


def step_parts(rank: int, events: list[dict[str, Any]], windows: Sequence[Interval], thread: int) -> StepParts:
    """Rank ``rank``'s profiled steps split into parts (seconds per step, mean).

    Args:
        rank: the rank the events are from.
        events: its trace events, ``ts`` and ``dur`` in microseconds.
        windows: each profiled step's (start, end) on the events' clock.
        thread: its training thread's id.
    """
    totals = [0.0] * 5
    device = any(e.get("cat") in _DEVICE_CATS for e in events)
    for window in windows:
        compute, comm = lanes(events, window, thread)
        overlap = _length(_intersect(compute, comm))
        exposed = _length(comm) - overlap
        step = window[1] - window[0]
        for k, v in enumerate((step, _length(compute), exposed, overlap, step - _length(compute) - exposed)):
            totals[k] += v
    n = max(len(windows), 1) * 1e6
    step_s, compute_s, exposed_s, overlap_s, idle_s = (t / n for t in totals)
    return StepParts(rank, step_s, compute_s, exposed_s, overlap_s, max(idle_s, 0.0), "gpu" if device else "cpu")


def merge_traces(ranks: Sequence[tuple[int, str, list[dict[str, Any]], Sequence[Interval]]]) -> dict[str, Any]:
    """One Chrome trace of every rank: each rank a process (``rank r (host)``), its steps
    marked on a lane of their own, all on one clock starting at the first step.

    Args:
        ranks: each rank's (rank, host, events with epoch ``ts``, step windows).
    """
    origin = min((w[0] for _, _, _, windows in ranks for w in windows), default=0.0)
    out: list[dict[str, Any]] = []
    for rank, host, events, windows in ranks:
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank} ({host})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": "steps", "args": {"name": "steps"}})
        for e in events:
            if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index", "process_labels"):
                continue
            moved = {**e, "pid": rank if not isinstance(e.get("pid"), str) else f"{e['pid']} (rank {rank})"}
            if isinstance(e.get("ts"), int | float):
                moved["ts"] = float(e["ts"]) - origin
            out.append(moved)
        for k, (a, b) in enumerate(windows, 1):
            out.append({"ph": "X", "name": f"step {k}", "cat": "fsdp_nb", "pid": rank, "tid": "steps",
                        "ts": a - origin, "dur": b - a})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"written_by": "fsdp_nb", "clock": "microseconds from the first profiled step"}}
