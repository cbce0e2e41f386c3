"""A profiled step as a picture: each rank's compute and communication lanes over one step
(an SVG), and the per-rank table of where the steps' time went."""

from __future__ import annotations

import html
from collections.abc import Sequence

from ..display.tables import html_table, text_table
from .step_trace import StepParts

__all__ = ["PARTS_HEADER", "lanes_svg", "parts_html", "parts_rows", "parts_text"]

PARTS_HEADER = ("rank", "step ms", "compute ms", "exposed comm ms", "overlap ms", "idle ms", "from")
"""The breakdown table's columns (milliseconds per step, the mean over the profiled steps)."""
_COLOURS = {"compute": "#4c78a8", "communication": "#f58518"}


def parts_rows(parts: Sequence[StepParts]) -> list[list[str]]:
    """The breakdown table's rows, one per rank."""
    return [[str(p.rank), *(f"{v * 1e3:.2f}" for v in (p.step, p.compute, p.exposed, p.overlap, p.idle)),
             f"{p.device} trace"] for p in parts]


def lanes_svg(rows: Sequence[tuple[int, Sequence[tuple[float, float]], Sequence[tuple[float, float]]]],
              window: tuple[float, float], width: int = 640) -> str:
    """Each rank's compute and communication intervals within ``window`` (microseconds,
    one clock), two thin lanes per rank, as an SVG.

    Args:
        rows: each rank's (rank, compute intervals, communication intervals).
        window: the time shown: one step, from its earliest start to its latest end.
        width: the drawing's width in pixels.
    """
    lo, hi = window
    span = max(hi - lo, 1e-9)
    label, lane = 64, 7
    height = len(rows) * (2 * lane + 4) + 18
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width + label}' height='{height}' "
           "font-family='monospace' font-size='10'>"]
    for i, (rank, compute, comm) in enumerate(rows):
        y = i * (2 * lane + 4)
        out.append(f"<text x='0' y='{y + 2 * lane - 2}'>rank {rank}</text>")
        for k, (kind, intervals) in enumerate((("compute", compute), ("communication", comm))):
            for a, b in intervals:
                x0 = label + (max(a, lo) - lo) / span * width
                w = max((min(b, hi) - max(a, lo)) / span * width, 0.5)
                out.append(f"<rect x='{x0:.1f}' y='{y + k * lane}' width='{w:.1f}' height='{lane - 1}' "
                           f"fill='{_COLOURS[kind]}'><title>{kind}: {(b - a) / 1e3:.3f} ms</title></rect>")
    y = len(rows) * (2 * lane + 4) + 12
    out.append(f"<text x='{label}' y='{y}'>0</text><text x='{label + width - 60}' y='{y}'>"
               f"{span / 1e3:.2f} ms</text>")
    out.append(f"<text x='{label + width // 3}' y='{y}'><tspan fill='{_COLOURS['compute']}'>&#9632;</tspan> compute "
               f"<tspan fill='{_COLOURS['communication']}'>&#9632;</tspan> communication</text></svg>")
    return "".join(out)


def parts_text(parts: Sequence[StepParts]) -> str:
    """The breakdown as a text table."""
    return text_table(PARTS_HEADER, parts_rows(parts))


def parts_html(parts: Sequence[StepParts], picture: str, trace: str) -> str:
    """The breakdown table under the picture, with where the merged trace is."""
    return (f"<div class='fsdp-nb-profile'><b>Profiled steps</b> <small>trace: <code>{html.escape(trace)}</code> "
            "(open it in Perfetto UI or TensorBoard)</small><br>" + picture + "<br>"
            + html_table(PARTS_HEADER, parts_rows(parts), cls="fsdp-nb-table fsdp-nb-profile-table") + "</div>")
