"""Ranks' printed lines, merged: a line every rank printed alike shows once, naming the ranks.

At 8 ranks a training cell's ``print(f"step {i} loss {loss}")`` would show 8 copies of
each line. The lines are lined up by position (each rank's first pending line with the
others' first, then the second...): where ranks' lines are alike they print once as
``[ranks 0-7] step 10 loss 2.31``; where they differ each group keeps its tag
(``[rank 3] ...``), in rank order. Each rank's own order is always kept.

A line waits for the other ranks' lines at the same position only while they may still
come: not for a rank whose call has finished (with all its output in), and not longer
than ``HOLD`` seconds. So a rank far behind does not hold back the others' output, and a
line only rank 0 prints (``if rank == 0: print(...)``) shows at most ``HOLD`` late.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice

__all__ = ["HOLD", "LOOKAHEAD", "LineMerger", "rank_label"]

HOLD = 1.0
"""Seconds a line waits at most for the other ranks' lines at the same position."""
LOOKAHEAD = 32
"""How many of a rank's next lines are searched for a line other ranks print now."""


def rank_label(ranks: Iterable[int]) -> str:
    """``rank 3``, or ``ranks 0-3,6``: the ranks in order, runs of consecutive ones joined."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    runs: list[str] = []
    start = prev = rs[0]
    for r in [*rs[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(runs)


class LineMerger:
    """One stream's (stdout's or stderr's) pending lines of every rank, written merged.

    Args:
        write: called with each merged piece of text (tagged lines, each ending in a newline).
        clock: seconds, for ``HOLD`` (``time.monotonic``).
    """

    def __init__(self, write: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._write, self._clock = write, clock
        self._pending: dict[int, deque[tuple[str, float]]] = {}

    def add(self, rank: int, lines: Iterable[str]) -> None:
        """Queue ``rank``'s new whole lines (without their newlines)."""
        now = self._clock()
        q = self._pending.setdefault(rank, deque())
        q.extend((line, now) for line in lines)

    def emit(self, running: Iterable[int], final: bool = False) -> None:
        """Write every position whose lines are all in, or have waited ``HOLD``.

        Args:
            running: the shown ranks whose call has not finished, or whose output is not
                all in (their lines may still come).
            final: write everything still pending (the call has ended).
        """
        awaited = set(running)
        out: list[str] = []
        while heads := {r: q[0] for r, q in self._pending.items() if q}:
            late = awaited - set(heads)
            oldest = min(t for _, t in heads.values())
            if late and not final and self._clock() - oldest < HOLD:
                break
            groups: dict[str, list[int]] = {}
            for r in sorted(heads):
                groups.setdefault(heads[r][0], []).append(r)
            for text, rs in self._in_step(groups).items():
                out.append(f"[{rank_label(rs)}] {text}\n")
                for r in rs:
                    self._pending[r].popleft()
        if out:
            self._write("".join(out))

    def _in_step(self, groups: dict[str, list[int]]) -> dict[str, list[int]]:
        """The groups to write at this position. Where a group's line is among the next
        few of another group's ranks (those printed a line more before it, a warning),
        it waits for them, so the ranks fall back into step and their lines merge again."""
        if len(groups) == 1:
            return groups
        ahead = {text: {line for r in rs for line, _ in islice(self._pending[r], 1, 1 + LOOKAHEAD)}
                 for text, rs in groups.items()}
        now = {text: rs for text, rs in groups.items()
               if not any(text in later for other, later in ahead.items() if other != text)}
        return now or groups
