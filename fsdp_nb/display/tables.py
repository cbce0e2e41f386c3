"""Plain tables and byte sizes: the text and HTML forms every status object prints.

Shared by ``status``, the widgets and the checkpoint views, so a layer below the
widgets never imports them.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

__all__ = ["fmt_bytes", "html_table", "text_table"]


def fmt_bytes(n: float | int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def text_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain, aligned text table."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def html_table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, cls: str = "",
               raw_cols: Sequence[int] = ()) -> str:
    """An HTML table; cells are escaped except the columns in ``raw_cols``."""
    th = "".join(f"<th style='text-align:left;padding:1px 6px'>{html.escape(str(h))}</th>"
                 for h in header)
    body = []
    for r in rows:
        tds = "".join(
            f"<td style='padding:1px 6px'>{c if i in raw_cols else html.escape(str(c))}</td>"
            for i, c in enumerate(r)
        )
        body.append(f"<tr>{tds}</tr>")
    return (f"<table class='fsdp-nb-table {cls}' style='border-collapse:collapse;"
            f"font-family:monospace;font-size:12px'><thead><tr>{th}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")
