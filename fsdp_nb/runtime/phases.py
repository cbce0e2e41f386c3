"""How long each phase of a session start (``Session(..., verbose=True)`` prints it) or
of a restart (``sess.restart_phases``) took.

Phases are marked in order as they end; each one's time runs from the previous mark,
so together they add up to the whole start.
"""

from __future__ import annotations

import time

__all__ = ["PhaseClock", "phase_table"]


class PhaseClock:
    """Seconds per phase, in the order they ended."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        """Phase name -> seconds it took."""
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """``phase`` just ended."""
        now = time.perf_counter()
        self.times[phase] = self.times.get(phase, 0.0) + now - self._last
        self._last = now


def phase_table(times: dict[str, float]) -> str:
    """``times`` (phase -> seconds) as one line per phase and the total, seconds and share."""
    total = sum(times.values())
    rows = [f"  {name:<32} {t:6.2f} s  {t / (total or 1e-9):5.1%}" for name, t in times.items()]
    return "\n".join(["session start:", *rows, f"  {'total':<32} {total:6.2f} s"])
