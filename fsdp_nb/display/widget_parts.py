"""Small rendering helpers shared by the widgets: sizes, tables, SVG, PNG."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

from .sparkline import sparkline_svg
from .tables import fmt_bytes, html_table, text_table

__all__ = [
    "StaticForm", "fmt_bytes", "html_table", "png_of", "sparkline_svg", "text_table",
]


def png_of(fig: Any) -> bytes:
    """PNG bytes of a ``matplotlib.figure.Figure`` (Agg; no pyplot, no backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return buf.getvalue()


def img_tag(png: bytes, alt: str = "") -> str:
    return (f"<img alt='{html.escape(alt)}' "
            f"src='data:image/png;base64,{base64.b64encode(png).decode()}'/>")


class StaticForm:
    """Mixin for widget boxes: readable without a widget front end.

    Subclasses implement ``to_text()`` and ``to_html()``. The MIME bundle carries the
    widget view (used by JupyterLab) plus ``text/plain`` and ``text/html`` (used by a
    terminal and by nbconvert when the widget state is missing).
    """

    def to_text(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def to_html(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        data: dict[str, Any] = {"text/plain": self.to_text(), "text/html": self.to_html()}
        if getattr(self, "_view_name", None) is not None:
            data["application/vnd.jupyter.widget-view+json"] = {
                "version_major": 2, "version_minor": 0, "model_id": self._model_id,  # type: ignore[attr-defined]
            }
        return data

    def _repr_html_(self) -> str:
        return self.to_html()

    def __repr__(self) -> str:
        return self.to_text()
