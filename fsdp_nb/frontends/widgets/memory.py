"""Live per-rank memory: one bar per rank against its device's limit, plus history.

``sess.memory()`` returns a :class:`MemoryWidget`. Samples arrive through the side
channel (:class:`fsdp_nb.frontends.widgets._feed.MemoryFeed`), so the bars keep moving while a
long ``%%px`` cell trains; the widget redraws once per interval, inside
``hold_sync`` so each redraw is one message to the front end. The drawing is a pure
function of a :class:`MemorySnapshot`.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ipywidgets as W

from ._feed import MemoryFeed, MemorySample
from ._render import StaticForm, fmt_bytes, sparkline_svg, text_table

if TYPE_CHECKING:
    from ...context import SessionContext

__all__ = ["MemorySample", "MemorySnapshot", "MemoryWidget", "memory_widget"]


@dataclass(frozen=True)
class MemorySnapshot:
    """What the memory widget shows: each rank's latest sample and recent history."""

    latest: tuple[MemorySample | None, ...]
    """Newest sample per rank (index = rank), None before the first."""
    history: tuple[tuple[MemorySample, ...], ...]
    """Recent samples per rank, oldest first."""

    @classmethod
    def of(cls, feed: MemoryFeed) -> MemorySnapshot:
        return cls(tuple(feed.latest()),
                   tuple(tuple(feed.samples(r)) for r in range(feed.world_size)))

    @property
    def world_size(self) -> int:
        return len(self.latest)

    def rows(self) -> list[tuple[str, ...]]:
        """Text rows: rank, device, used, limit, percent, peak, reserved."""
        out = []
        for r, s in enumerate(self.latest):
            if s is None:
                out.append((str(r), "?", "-", "-", "-", "-", "-"))
                continue
            gpu = s.cuda_allocated is not None
            pct = 100.0 * s.used / s.limit if s.limit else 0.0
            out.append((
                str(r), s.device,
                fmt_bytes(s.used), fmt_bytes(s.limit), f"{pct:.1f}%",
                fmt_bytes(s.cuda_peak if gpu else s.rss_peak),
                fmt_bytes(s.cuda_reserved) if gpu else "-",
            ))
        return out

    HEADER = ("rank", "device", "used", "limit", "%", "peak", "reserved")

    def to_text(self) -> str:
        kind = "CUDA allocated" if any(s and s.cuda_allocated is not None
                                       for s in self.latest) else "process RSS"
        return f"fsdp_nb memory ({kind})\n" + text_table(self.HEADER, self.rows())

    def to_html(self) -> str:
        rows = []
        for r, s in enumerate(self.latest):
            if s is None:
                rows.append(f"<tr><td>rank {r}</td><td colspan='3'><i>waiting for samples"
                            f"</i></td></tr>")
                continue
            gpu = s.cuda_allocated is not None
            pct = min(100.0, 100.0 * s.used / s.limit) if s.limit else 0.0
            peak = s.cuda_peak if gpu else s.rss_peak
            peak_pct = min(100.0, 100.0 * (peak or 0) / s.limit) if s.limit else 0.0
            res_pct = (min(100.0, 100.0 * (s.cuda_reserved or 0) / s.limit)
                       if gpu and s.limit else 0.0)
            color = "#d62728" if pct > 90 else "#ff7f0e" if pct > 75 else "#2ca02c"
            bar = (
                "<div class='fsdp-nb-bar' style='position:relative;width:260px;height:14px;"
                "background:#eee;border:1px solid #ccc'>"
                f"<div style='position:absolute;left:0;top:0;height:100%;width:{res_pct:.2f}%;"
                "background:#c7dcef'></div>"
                f"<div style='position:absolute;left:0;top:0;height:100%;width:{pct:.2f}%;"
                f"background:{color}'></div>"
                f"<div title='peak' style='position:absolute;top:0;height:100%;left:{peak_pct:.2f}%;"
                "border-left:2px solid #333'></div></div>"
            )
            detail = (f"{fmt_bytes(s.used)} / {fmt_bytes(s.limit)} ({pct:.1f}%) &middot; "
                      f"peak {fmt_bytes(peak)}")
            if gpu:
                detail += f" &middot; reserved {fmt_bytes(s.cuda_reserved)} &middot; RSS {fmt_bytes(s.rss)}"
            spark = sparkline_svg([x.used for x in self.history[r]] if self.history else [])
            rows.append(
                f"<tr><td style='padding:2px 6px'>rank {r}<br><small>{html.escape(s.device)}"
                f"</small></td><td style='padding:2px 6px'>{bar}<small>{detail}</small></td>"
                f"<td style='padding:2px 6px'>{spark}</td></tr>"
            )
        kind = "CUDA allocated (reserved light blue)" if any(
            s and s.cuda_allocated is not None for s in self.latest) else "process RSS vs host RAM"
        return (f"<div class='fsdp-nb-memory'><b>Memory per rank</b> <small>{kind}; "
                f"line: history</small><table style='font-size:12px'>{''.join(rows)}</table></div>")


class MemoryWidget(StaticForm, W.VBox):
    """Live memory bars and history for every rank; ``close()`` stops the sampling."""

    def __init__(self, feed: MemoryFeed, **kwargs: Any):
        self.feed = feed
        self.snapshot = MemorySnapshot.of(feed)
        self.view = W.HTML(self.snapshot.to_html())
        self.view.add_class("fsdp-nb-memory-view")
        self.renders = 0
        super().__init__([self.view], **kwargs)
        self.add_class("fsdp-nb-memory-widget")
        feed.add_listener(self._on_samples)

    def _on_samples(self, feed: MemoryFeed) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Redraw from the feed's current data (one front-end message)."""
        snap = MemorySnapshot.of(self.feed)
        with self.hold_sync(), self.view.hold_sync():
            self.snapshot = snap
            self.view.value = snap.to_html()
            self.renders += 1

    def to_text(self) -> str:
        return self.snapshot.to_text()

    def to_html(self) -> str:
        return self.snapshot.to_html()

    def close(self) -> None:
        """Stop the samplers and the receiver, then close the widget."""
        self.feed.remove_listener(self._on_samples)
        self.feed.close()
        super().close()


def memory_widget(ctx: SessionContext, *, interval: float = 1.0, history: int = 120) -> MemoryWidget:
    """A live memory widget for ``sess``; samples every ``interval`` seconds per rank.

    Display it before starting a long cell: the samplers are started once through the
    engines' task queue, then stream on their own sockets.
    """
    feed = MemoryFeed(ctx, interval=interval, history=history)
    feed.start()
    return MemoryWidget(feed)
