"""One small cell per rank: how the memory, step and status views stay readable at many ranks.

Above ``COMPACT`` ranks a view stops giving a row per rank. It draws a strip instead:
``PER_ROW`` cells to a row, each coloured by its rank's value and carrying the rank's
figures in its tooltip. Under the strip it gives the few ranks that stand out. The text
form is a strip of block characters, 32 ranks to a line, so 64 ranks take 2 lines.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["COMPACT", "PER_ROW", "StripCell", "html_strip", "levels", "shade", "text_strip"]

COMPACT = 16
"""A view of more ranks than this shows a strip, not a row per rank."""
PER_ROW = 32
"""Cells to a row of the strip."""
_BLOCKS = " ▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class StripCell:
    """One rank's cell."""

    rank: int
    """The rank."""
    level: float | None
    """Where it sits between the strip's lowest and highest (0 to 1); None: no figure yet."""
    colour: str
    """Its fill (a CSS colour)."""
    title: str
    """Its tooltip: the rank's figures."""
    mark: str = ""
    """A character for the text strip instead of the level's block (``x``: dead)."""


def shade(level: float | None, low: str = "#e8f1e4", high: str = "#c0392b") -> str:
    """A colour between ``low`` (level 0) and ``high`` (level 1); grey for None."""
    if level is None:
        return "#dddddd"
    f = min(1.0, max(0.0, level))
    a = [int(low[i:i + 2], 16) for i in (1, 3, 5)]
    b = [int(high[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b, strict=True))


def html_strip(cells: Sequence[StripCell], *, cls: str) -> str:
    """The strip as HTML: a grid of ``PER_ROW`` columns, each cell 14 px square, its
    rank number under the first cell of every row."""
    boxes = "".join(
        f"<div class='fsdp-nb-strip-cell' data-rank='{c.rank}' title='{html.escape(c.title, quote=True)}' "
        f"style='width:14px;height:14px;background:{c.colour};border:1px solid #fff'></div>" for c in cells)
    rows = [f"<small style='display:block;width:34px'>{cells[i].rank}-{cells[min(i + PER_ROW, len(cells)) - 1].rank}</small>"
            for i in range(0, len(cells), PER_ROW)]
    labels = "".join(f"<div style='height:16px'>{r}</div>" for r in rows)
    return (f"<div><div class='fsdp-nb-strip {html.escape(cls)}' style='display:inline-flex;gap:4px;align-items:flex-start'>"
            f"<div style='font-size:10px;line-height:16px'>{labels}</div>"
            f"<div style='display:grid;grid-template-columns:repeat({PER_ROW},16px)'>{boxes}</div></div></div>")


def text_strip(cells: Sequence[StripCell]) -> str:
    """The strip as text: a block character per rank (its level), ``PER_ROW`` to a line."""
    out = []
    for i in range(0, len(cells), PER_ROW):
        row = cells[i:i + PER_ROW]
        chars = "".join(c.mark or ("·" if c.level is None else _BLOCKS[1 + round(min(1.0, max(0.0, c.level)) * 7)])
                        for c in row)
        out.append(f"ranks {row[0].rank:>3}-{row[-1].rank:<3} {chars}")
    return "\n".join(out)


def levels(values: Sequence[float | None]) -> list[float | None]:
    """Each value's place between the lowest and the highest (all equal: 0)."""
    known = [v for v in values if v is not None]
    if not known:
        return [None] * len(values)
    lo, hi = min(known), max(known)
    return [None if v is None else (0.0 if hi <= lo else (v - lo) / (hi - lo)) for v in values]
