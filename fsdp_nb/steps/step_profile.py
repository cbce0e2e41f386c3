"""``sess.profile(steps=N)``: torch.profiler on every rank for the next N training steps,
the ranks' traces merged into one Chrome trace file, split into parts per rank.

Call it before a training cell; read the result once the steps have run::

    prof = sess.profile(steps=3)
    # %%px: the training cell
    prof            # the picture and the table
    prof.trace      # the merged file: open it in Perfetto UI (ui.perfetto.dev) or TensorBoard

The ranks profile themselves (``steps.rank_step_profile``); reading the result takes each
rank's trace off it, so nothing of it stays on the ranks, and writes the merged file,
private to the user (0600).
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from typing import TYPE_CHECKING

from . import rank_step_profile as _esp
from .step_lanes import lanes_svg, parts_html, parts_text
from .step_trace import StepParts, lanes, step_parts
from .wire_profile import ProfileSpec, RankTrace

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["SessionProfiling", "StepProfile"]


class StepProfile:
    """The profile of N training steps on every rank: read it once they have run.

    Reading ``trace``, ``parts`` or showing it before every rank has run its N steps
    raises RuntimeError naming how far each rank is; read it again after the training cell.
    A profile whose capture ended early (a cell that failed before its steps ran, or the
    group formed again: restart, resize, recovery) raises RuntimeError saying so, on each
    rank. ``sess.profile`` makes it.

    Args:
        ctx: the session context whose ranks profile.
        spec: what every rank was asked to profile.
        path: where to write the merged trace (None: a new private temporary folder).
    """

    def __init__(self, ctx: SessionContext, spec: ProfileSpec, path: str | None) -> None:
        self._ctx, self._spec, self._path = ctx, spec, path
        self._got: dict[int, RankTrace] = {}
        self._parts: list[StepParts] | None = None

    def _collect(self) -> list[RankTrace]:
        if self._parts is None:
            d = self._ctx.dispatcher
            answers = d.gather(d.apply("profile: take the traces", _esp.take, args=(self._spec.token,)))
            for t in answers:
                if t.done:
                    self._got[t.rank] = t
            waiting = [t for t in answers if t.rank not in self._got]
            ended = [t for t in waiting if t.ended or not t.token]
            if ended:
                why = "; ".join(f"rank {t.rank}: {t.ended}" if t.ended else
                                f"rank {t.rank} holds no trace of it (a later sess.profile or a restart replaced it)"
                                for t in ended)
                raise RuntimeError(f"the profile of {self._spec.steps} steps ended before they all ran ({why}); "
                                   "its profilers are off: profile again")
            if waiting:
                far = ", ".join(f"rank {t.rank}: {t.steps_run}" for t in waiting)
                raise RuntimeError(f"the profile's {self._spec.steps} steps have not all run ({far} run so far); "
                                   "run the training cell, then read the profile again")
            self._write()
        return [self._got[r] for r in sorted(self._got)]

    def _write(self) -> None:
        from .step_trace import merge_traces

        traces = [self._got[r] for r in sorted(self._got)]
        merged = merge_traces([(t.rank, t.host, t.events, t.windows) for t in traces])
        if self._path is None:
            self._path = os.path.join(tempfile.mkdtemp(prefix="fsdp_nb-profile-"),
                                      f"profile-{time.strftime('%Y%m%d-%H%M%S')}.json")
        with open(self._path, "w", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            os.fchmod(f.fileno(), 0o600)
            json.dump(merged, f)
        self._parts = [step_parts(t.rank, t.events, t.windows, t.thread) for t in traces]

    @property
    def trace(self) -> str:
        """The merged trace's path: one process per rank, on one clock (Perfetto UI, TensorBoard)."""
        self._collect()
        assert self._path is not None
        return self._path

    @property
    def parts(self) -> list[StepParts]:
        """Each rank's steps split into compute, exposed communication, overlap and idle
        (seconds per step, the mean over the profiled steps; ``steps.step_trace``)."""
        self._collect()
        assert self._parts is not None
        return self._parts

    def picture(self) -> str:
        """An SVG of each rank's compute and communication lanes over the last profiled step."""
        traces = self._collect()
        window = (min(t.windows[-1][0] for t in traces), max(t.windows[-1][1] for t in traces))
        return lanes_svg([(t.rank, *lanes(t.events, window, t.thread)) for t in traces], window)

    def to_text(self) -> str:
        """The breakdown table as text."""
        return parts_text(self.parts)

    def _repr_html_(self) -> str:
        return parts_html(self.parts, self.picture(), self.trace)

    def __repr__(self) -> str:
        try:
            return f"{self.to_text()}\ntrace: {self.trace}"
        except RuntimeError as exc:
            return f"<StepProfile of {self._spec.steps} steps: {exc}>"


class SessionProfiling:
    """The ``Session`` façade's profiling calls."""

    _ctx: SessionContext

    def profile(self, steps: int = 3, *, path: str | None = None) -> StepProfile:
        """Profile the next ``steps`` training steps on every rank with torch.profiler.

        Call it before a training cell; it returns at once. Once the steps have run, the
        result gives the merged trace (``.trace``), each rank's split into parts
        (``.parts``, the table it shows) and a picture of one step. A later call replaces
        an unfinished profile. A cell that fails before the steps ran, or a restart,
        resize or recovery, ends the profile (the profilers stop); reading it says so.

        Args:
            steps: training steps (iterations) to profile, 1 to 100: an iteration's
                optimizer steps count once, however many optimizers step in it.
            path: where to write the merged trace (default: a new private temporary
                folder). The file is 0600.
        """
        spec = ProfileSpec(steps=steps, token=secrets.token_hex(8))
        if path is not None and not isinstance(path, str | os.PathLike):
            raise TypeError(f"path must be a file path (str), got {type(path).__name__}")
        d = self._ctx.dispatcher
        d.gather(d.apply("profile: arm", _esp.arm, args=(spec,)))
        return StepProfile(self._ctx, spec, None if path is None else os.fspath(path))


