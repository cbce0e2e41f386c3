"""Widgets: live per-rank memory and status, shard layout, checkpoint browser, one dashboard.

Each widget is an ipywidgets box rendered from a plain dataclass (testable without a
browser), and each also has a static form (text table, HTML, PNG) for a terminal or a
notebook converted without its widget state.
"""

from __future__ import annotations

__all__ = ["checkpoints", "dashboard", "layout", "memory", "status"]
