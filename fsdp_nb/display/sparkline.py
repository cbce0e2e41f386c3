"""A small inline SVG line: a rank's memory over time, a logged scalar's curve."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

from .tables import fmt_bytes

__all__ = ["sparkline_svg"]


def sparkline_svg(values: Sequence[float], *, width: int = 160, height: int = 28,
                  color: str = "#1f77b4", fmt: Callable[[float], str] = fmt_bytes) -> str:
    """An inline SVG line of ``values`` between their min and max (flat: mid-height).

    The tooltip gives the range (each end written by ``fmt``: bytes by default), so a
    small change still reads as one. Values that are not finite are left out.
    """
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return f"<svg width='{width}' height='{height}'></svg>"
    lo, hi = min(values), max(values)
    span = hi - lo
    n = len(values)

    def y(v: float) -> float:
        frac = 0.5 if span <= 0 else (v - lo) / span
        return height - 2 - frac * (height - 4)

    pts = " ".join(
        f"{(i / max(n - 1, 1)) * (width - 2) + 1:.1f},{y(v):.1f}" for i, v in enumerate(values)
    )
    return (f"<svg width='{width}' height='{height}' style='background:#f6f6f6'>"
            f"<title>{html.escape(fmt(lo))} .. {html.escape(fmt(hi))} over {n} samples</title>"
            f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='{pts}'/></svg>")
