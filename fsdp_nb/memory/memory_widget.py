"""Live per-rank memory: one bar per rank against what it may hold, plus history.

``sess.memory()`` returns a :class:`MemoryWidget`. Samples arrive through the side
channel (:class:`fsdp_nb.memory.memory_feed.MemoryFeed`), so the bars keep moving while a
long ``%%px`` cell trains; the widget redraws once per interval, inside
``hold_sync`` so each redraw is one message to the front end. The drawing is a pure
function of a :class:`MemorySnapshot`.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ipywidgets as W

from ..display.rank_strip import COMPACT, StripCell, html_strip, shade, text_strip
from ..display.widget_parts import StaticForm, fmt_bytes, sparkline_svg, text_table
from .memory_feed import MemoryFeed
from .memory_report import CATEGORY_COLOURS
from .wire_memory_sample import MemorySample

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["MemorySnapshot", "MemoryWidget", "memory_widget"]


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

    @property
    def split(self) -> bool:
        """Whether a model is wrapped: each rank's memory is then split by kind."""
        return any(s is not None and s.kinds is not None for s in self.latest)

    def header(self) -> tuple[str, ...]:
        """The text table's columns (by kind too once a model is wrapped)."""
        return self.HEADER + (KINDS if self.split else ())

    def rows(self) -> list[tuple[str, ...]]:
        """Text rows: rank, device, used, budget, percent, peak, reserved (and by kind)."""
        out: list[tuple[str, ...]] = []
        for r, s in enumerate(self.latest):
            if s is None:
                out.append((str(r), "waiting for the first sample"))
                continue
            pct = 100.0 * s.used / s.budget if s.budget else 0.0
            kinds = s.kinds
            out.append((
                str(r), s.device,
                fmt_bytes(s.used), fmt_bytes(s.budget) if s.budget else "-", f"{pct:.1f}%",
                fmt_bytes(s.peak),
                fmt_bytes(s.device_reserved) if s.device_reserved is not None else "-",
                *((fmt_bytes(kinds.get(k)) if kinds else "-" for k in KINDS) if self.split else ()),
            ))
        return out

    HEADER = ("rank", "device", "used", "budget", "%", "peak", "reserved")

    def _cells(self) -> list[StripCell]:
        """A strip cell per rank: what it uses of its budget (darker: fuller)."""
        out = []
        for r, s in enumerate(self.latest):
            frac = s.used / s.budget if s is not None and s.budget else None
            title = (f"rank {r}: waiting for the first sample" if s is None else
                     f"rank {r} ({s.device}): {fmt_bytes(s.used)}" + (f" of {fmt_bytes(s.budget)} ({frac:.0%})" if frac is not None else "")
                     + f", peak {fmt_bytes(s.peak)}")
            out.append(StripCell(rank=r, level=frac, colour=shade(frac), title=title))
        return out

    def _summary(self) -> str:
        """One line for a strip: the fullest ranks."""
        full = sorted(((s.used / s.budget, r) for r, s in enumerate(self.latest) if s is not None and s.budget),
                      reverse=True)
        most = ", ".join(f"rank {r} {f:.0%}" for f, r in full[:3])
        return f"{self.world_size} ranks; fullest: {most or 'no sample yet'} (darker: fuller)"

    def to_text(self) -> str:
        kind = "CUDA allocated" if any(s and s.on_device for s in self.latest) else "process RSS"
        if self.world_size > COMPACT:
            return f"fsdp_nb memory ({kind} of each rank's budget)\n{self._summary()}\n{text_strip(self._cells())}"
        head = self.header()
        rows = [r if len(r) == len(head) else (*r, *([""] * (len(head) - len(r)))) for r in self.rows()]
        return f"fsdp_nb memory ({kind})\n" + text_table(head, rows)

    def to_html(self) -> str:
        if self.world_size > COMPACT:
            return (f"<div class='fsdp-nb-memory'><b>Memory per rank</b><br><small>{html.escape(self._summary())}"
                    f"</small>{html_strip(self._cells(), cls='fsdp-nb-memory-strip')}</div>")
        rows = []
        for r, s in enumerate(self.latest):
            if s is None:
                rows.append(f"<tr><td>rank {r}</td><td colspan='3'><i>waiting for the first sample"
                            f"</i></td></tr>")
                continue
            budget = s.budget
            pct = min(100.0, 100.0 * s.used / budget) if budget else 0.0
            peak = s.peak
            peak_pct = min(100.0, 100.0 * peak / budget) if budget else 0.0
            res_pct = min(100.0, 100.0 * (s.device_reserved or 0) / budget) if budget else 0.0
            color = "#d62728" if pct > 90 else "#ff7f0e" if pct > 75 else "#2ca02c"
            bar = (
                "<div class='fsdp-nb-bar' style='position:relative;width:260px;height:14px;"
                "background:#eee;border:1px solid #ccc'>"
                f"<div style='position:absolute;left:0;top:0;height:100%;width:{res_pct:.2f}%;"
                "background:#c7dcef'></div>"
                + _used_bar(s, pct, color)
                + f"<div title='peak' style='position:absolute;top:0;height:100%;left:{peak_pct:.2f}%;"
                "border-left:2px solid #333'></div></div>"
            )
            of = f" / {fmt_bytes(budget)} ({pct:.1f}%)" if budget else ""
            detail = f"{fmt_bytes(s.used)}{of} &middot; peak {fmt_bytes(peak)}"
            if s.on_device:
                detail += (f" &middot; reserved {fmt_bytes(s.device_reserved or 0)} &middot; "
                           f"RSS {fmt_bytes(s.resident)}")
                if s.copies:
                    detail += f" &middot; copies in host memory {fmt_bytes(s.copies)}"
            if s.kinds:
                detail += "<br>" + " &middot; ".join(
                    f"<span style='color:{_KIND_COLOURS[k]}'>&#9632;</span> {k} {fmt_bytes(v)}"
                    for k, v in s.kinds.items())
            spark = sparkline_svg([x.used for x in self.history[r]] if self.history else [])
            rows.append(
                f"<tr><td style='padding:2px 6px'>rank {r}<br><small>{html.escape(s.device)}"
                f"</small></td><td style='padding:2px 6px'>{bar}<small>{detail}</small></td>"
                f"<td style='padding:2px 6px'>{spark}</td></tr>"
            )
        kind = "CUDA allocated (reserved light blue)" if any(
            s and s.on_device for s in self.latest) else "process RSS vs the rank's share of host RAM"
        return (f"<div class='fsdp-nb-memory'><b>Memory per rank</b> <small>{kind}; "
                f"line: history</small><table style='font-size:12px'>{''.join(rows)}</table></div>")


KINDS = ("parameters", "gradients", "optimizer", "copies", "rest")
"""What a rank's memory is split into once a model is wrapped (``copies``: the in-memory
autosave's, on a CPU rank)."""
_KIND_COLOURS = {**{k: CATEGORY_COLOURS[k] for k in KINDS[:3]}, "copies": "#b07aa1", "rest": "#9d9d9d"}


def _used_bar(s: MemorySample, pct: float, color: str) -> str:
    """The used part of a rank's bar: one colour, or a segment per kind once a model is wrapped."""
    kinds = s.kinds
    if not kinds or not s.used:
        return (f"<div style='position:absolute;left:0;top:0;height:100%;width:{pct:.2f}%;"
                f"background:{color}'></div>")
    segs = "".join(f"<div title='{k}' style='height:100%;width:{100.0 * v / s.used:.2f}%;"
                   f"background:{_KIND_COLOURS[k]}'></div>" for k, v in kinds.items())
    return (f"<div style='position:absolute;left:0;top:0;height:100%;width:{pct:.2f}%;display:flex'>"
            f"{segs}</div>")


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
        return MemorySnapshot.of(self.feed).to_text()  # the feed's latest, not the last redraw's

    def to_html(self) -> str:
        return MemorySnapshot.of(self.feed).to_html()

    def close(self) -> None:
        """Stop the samplers and the receiver, then close the widget."""
        self.feed.close()  # its thread joined first: no redraw after, and none missed before
        self.feed.remove_listener(self._on_samples)
        super().close()


def memory_widget(ctx: SessionContext, *, interval: float = 1.0, history: int = 120) -> MemoryWidget:
    """A live memory widget for ``sess``; samples every ``interval`` seconds per rank.

    Display it before starting a long cell: the samplers are started once through the
    engines' task queue, then stream on their own sockets. It returns once every rank
    sent its first sample (at most ``interval`` + 2 s), so it opens with numbers; a rank
    still silent shows "waiting for the first sample".
    """
    import time

    feed = MemoryFeed(ctx, interval=interval, history=history)
    feed.start()
    deadline = time.monotonic() + interval + 2.0  # every rank's first sample, so it opens with numbers
    while None in feed.latest() and time.monotonic() < deadline:
        time.sleep(0.02)
    return MemoryWidget(feed)
