"""Shard layout: which rank holds which part of every parameter.

``model.layout()`` returns a :class:`LayoutWidget` for a :class:`~fsdp_nb.models.wire_shards.
ShardTable`: totals and bytes per rank, the device mesh (hybrid / tensor parallel
layouts show their 2-D grid), a rank x parameter heatmap (matplotlib PNG) and a
sortable table of placements and local shards (uneven shards shown as they are).
Everything is computed by :class:`LayoutData`, a plain function of the table.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import ipywidgets as W

from ..display.widget_parts import StaticForm, fmt_bytes, html_table, img_tag, png_of, text_table
from .wire_shards import ParamShard, ShardTable

__all__ = ["SORT_KEYS", "LayoutData", "LayoutWidget", "layout_widget"]

HEATMAP_MAX_PARAMS = 60
"""The heatmap shows at most this many parameters (the first in the current order)."""

SORT_KEYS = ("order", "name", "bytes", "imbalance")
"""Sort keys besides ``rank N`` (bytes held by rank N)."""


@dataclass(frozen=True)
class LayoutData:
    """A shard table, arranged for display."""

    table: ShardTable

    @property
    def world_size(self) -> int:
        return self.table.world_size

    def sort_keys(self) -> list[str]:
        return [*SORT_KEYS, *(f"rank {r}" for r in range(self.world_size))]

    def params(self, key: str = "order", descending: bool = False) -> list[ParamShard]:
        """Parameters sorted by ``key`` (see :meth:`sort_keys`)."""
        ps = list(self.table.params)
        if key == "order":
            return ps[::-1] if descending else ps
        if key == "name":
            f: Any = lambda p: p.name  # noqa: E731
        elif key == "bytes":
            f = lambda p: sum(p.local_bytes)  # noqa: E731
        elif key == "imbalance":
            f = lambda p: max(p.local_bytes) - min(p.local_bytes) if p.local_bytes else 0  # noqa: E731
        elif key.startswith("rank ") and key[5:].isdigit() and int(key[5:]) < self.world_size:
            r = int(key[5:])
            f = lambda p: p.local_bytes[r]  # noqa: E731
        else:
            raise ValueError(f"unknown sort key {key!r}; allowed: {', '.join(self.sort_keys())}")
        return sorted(ps, key=f, reverse=descending)

    def bytes_matrix(self, params: list[ParamShard] | None = None) -> list[list[int]]:
        """bytes[param][rank]."""
        return [list(p.local_bytes) for p in (params or list(self.table.params))]

    def mesh_grid(self) -> list[list[int]] | None:
        """Ranks laid out on a 2-D mesh (row = first dim), or None for 1-D / >2-D."""
        shape = self.table.mesh_shape
        if len(shape) != 2:
            return None
        return [[i * shape[1] + j for j in range(shape[1])] for i in range(shape[0])]

    def mesh_text(self) -> str:
        dims = " x ".join(f"{n}={s}" for n, s in zip(self.table.mesh_dims, self.table.mesh_shape))
        return f"mesh ({dims})" if dims else "mesh ()"

    def summary(self) -> str:
        t = self.table
        per = ", ".join(f"r{r} {fmt_bytes(b)}" for r, b in enumerate(t.bytes_per_rank()))
        return (f"{t.model}: {len(t.params)} parameters, {fmt_bytes(t.total_bytes)} total, "
                f"{t.world_size} ranks, {self.mesh_text()}; held: {per}")

    @staticmethod
    def shard_cell(p: ParamShard, r: int) -> str:
        shape = "x".join(map(str, p.local_shapes[r])) if r < len(p.local_shapes) else "?"
        off = ",".join(map(str, p.local_offsets[r])) if r < len(p.local_offsets) else "?"
        return f"[{shape or 'scalar'}]@({off}) {fmt_bytes(p.local_bytes[r])}"

    def header(self) -> list[str]:
        return ["#", "name", "shape", "dtype", "placements", "total",
                *(f"rank {r}" for r in range(self.world_size))]

    def rows(self, key: str = "order", descending: bool = False) -> list[list[str]]:
        index = {p.name: i for i, p in enumerate(self.table.params)}
        out = []
        for p in self.params(key, descending):
            out.append([
                str(index[p.name]), p.name, "x".join(map(str, p.global_shape)) or "scalar",
                p.dtype, ", ".join(p.placements) or "(not a DTensor)", fmt_bytes(sum(p.local_bytes)),
                *(self.shard_cell(p, r) for r in range(self.world_size)),
            ])
        return out

    def totals_row(self) -> list[str]:
        per = self.table.bytes_per_rank()
        return ["", "TOTAL", "", "", "", fmt_bytes(sum(per)), *(fmt_bytes(b) for b in per)]

    def to_text(self, key: str = "order", descending: bool = False) -> str:
        return (self.summary() + "\n"
                + text_table(self.header(), [*self.rows(key, descending), self.totals_row()]))

    def mesh_html(self) -> str:
        grid = self.mesh_grid()
        t = self.table
        if grid is None:
            cells = "".join(f"<td style='border:1px solid #999;padding:2px 8px'>rank {r}</td>"
                            for r in range(t.world_size))
            return (f"<div><b>{html.escape(self.mesh_text())}</b><table><tr>{cells}</tr>"
                    f"</table></div>")
        d0, d1 = (t.mesh_dims + ("dim0", "dim1"))[:2]
        head = "".join(f"<th>{html.escape(d1)}={j}</th>" for j in range(len(grid[0])))
        body = "".join(
            f"<tr><th>{html.escape(d0)}={i}</th>"
            + "".join(f"<td style='border:1px solid #999;padding:2px 8px'>rank {r}</td>"
                      for r in row) + "</tr>"
            for i, row in enumerate(grid)
        )
        return (f"<div class='fsdp-nb-mesh'><b>{html.escape(self.mesh_text())}</b>"
                f"<table><tr><th></th>{head}</tr>{body}</table></div>")

    def table_html(self, key: str = "order", descending: bool = False) -> str:
        return html_table(self.header(), [*self.rows(key, descending), self.totals_row()],
                          cls="fsdp-nb-layout-table")

    def heatmap_png(self, key: str = "order", descending: bool = False) -> bytes:
        """A rank x parameter heatmap of bytes held (first HEATMAP_MAX_PARAMS rows)."""
        from matplotlib.figure import Figure

        params = self.params(key, descending)
        cut = len(params) > HEATMAP_MAX_PARAMS
        params = params[:HEATMAP_MAX_PARAMS]
        m = self.bytes_matrix(params) or [[0] * self.world_size]
        h = max(1.6, 0.22 * len(m) + 1.0)
        fig = Figure(figsize=(1.6 + 0.7 * self.world_size + 2.2, h))
        ax = fig.add_subplot(1, 1, 1)
        im = ax.imshow(m, aspect="auto", cmap="Blues", interpolation="nearest",
                       vmin=0, vmax=max(1, max(max(r) for r in m)))
        ax.set_xticks(range(self.world_size), [f"r{r}" for r in range(self.world_size)])
        ax.set_yticks(range(len(params)), [p.name for p in params], fontsize=7)
        ax.set_xlabel("rank")
        title = f"{self.table.model}: bytes per rank and parameter"
        ax.set_title(title + (f" (first {HEATMAP_MAX_PARAMS})" if cut else ""), fontsize=9)
        if len(m) * self.world_size <= 200:
            hi = max(1, max(max(r) for r in m))
            for i, row in enumerate(m):
                for j, v in enumerate(row):
                    ax.text(j, i, fmt_bytes(v), ha="center", va="center", fontsize=6,
                            color="white" if v > hi * 0.6 else "black")
        fig.colorbar(im, ax=ax, label="bytes")
        return png_of(fig)

    def to_html(self, key: str = "order", descending: bool = False) -> str:
        return (f"<div class='fsdp-nb-layout'><p>{html.escape(self.summary())}</p>"
                f"{self.mesh_html()}{img_tag(self.heatmap_png(key, descending), 'heatmap')}"
                f"{self.table_html(key, descending)}</div>")


class LayoutWidget(StaticForm, W.VBox):
    """Summary, mesh, heatmap and a table sortable by a Dropdown key."""

    def __init__(self, table: ShardTable, **kwargs: Any):
        if not isinstance(table, ShardTable):
            raise TypeError(f"layout widget needs a fsdp_nb.ShardTable, got {type(table).__name__}")
        self.data = LayoutData(table)
        self.summary = W.HTML(f"<b>{html.escape(self.data.summary())}</b>")
        self.mesh = W.HTML(self.data.mesh_html())
        self.sort_key = W.Dropdown(options=self.data.sort_keys(), value="order",
                                   description="sort by")
        self.descending = W.Checkbox(value=False, description="descending", indent=False)
        self.heatmap = W.Image(format="png")
        self.heatmap.add_class("fsdp-nb-heatmap")
        self.table = W.HTML()
        self.table.add_class("fsdp-nb-layout-table")
        super().__init__([self.summary, self.mesh, self.heatmap,
                          W.HBox([self.sort_key, self.descending]), self.table], **kwargs)
        self.add_class("fsdp-nb-layout-widget")
        self.sort_key.observe(self._resort, names="value")
        self.descending.observe(self._resort, names="value")
        self._resort()

    def _resort(self, _change: Any = None) -> None:
        key, desc = self.sort_key.value, self.descending.value
        with self.hold_sync():
            self.table.value = self.data.table_html(key, desc)
            self.heatmap.value = self.data.heatmap_png(key, desc)

    def to_text(self) -> str:
        return self.data.to_text(self.sort_key.value, self.descending.value)

    def to_html(self) -> str:
        return self.data.to_html(self.sort_key.value, self.descending.value)


def layout_widget(model: Any) -> LayoutWidget:
    """The layout widget of a ``ShardedModel`` (its ``shards()``) or of a ``ShardTable``."""
    table = model if isinstance(model, ShardTable) else model.shards()
    return LayoutWidget(table)
