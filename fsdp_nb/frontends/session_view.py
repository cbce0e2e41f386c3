"""How a session prints: its state and one row per rank, as text and as HTML."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from ..display.tables import html_table, text_table

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["session_html", "session_text"]

_COLUMNS = ("rank", "engine", "host", "pid", "device", "local rank")


def _rows(ctx: SessionContext) -> list[tuple[str, ...]]:
    return [(str(r.rank), str(r.engine_id), r.host, str(r.pid), r.device, f"{r.local_rank}/{r.local_world_size}")
            for r in ctx.ranks]


def session_text(ctx: SessionContext) -> str:
    """``repr(sess)``: the state line, then the ranks."""
    head = (f"<fsdp_nb.Session {ctx.state}: {ctx.world_size} ranks, "
            f"backend={ctx.backend}, launcher={ctx.launcher}>")
    table = text_table(_COLUMNS, _rows(ctx))
    return head + "\n" + "\n".join("  " + line for line in table.splitlines())


def session_html(ctx: SessionContext) -> str:
    """The notebook's rich view of a session."""
    return (
        f"<div><b>fsdp_nb.Session</b> &mdash; state <code>{html.escape(ctx.state)}</code>, "
        f"{ctx.world_size} ranks, backend <code>{html.escape(str(ctx.backend))}</code>, "
        f"launcher <code>{html.escape(ctx.launcher)}</code>{html_table(_COLUMNS, _rows(ctx))}</div>"
    )
