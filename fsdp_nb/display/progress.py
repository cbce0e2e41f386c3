"""Progress bars for long checkpoint work: bytes done and the rate, in notebooks only.

``Progress(total, what)`` shows a ``tqdm.auto`` bar (a widget in a notebook) when the
work is larger than ``MIN_BYTES`` and the code runs in a Jupyter kernel; in scripts
and tests it shows nothing and costs nothing. ``enabled=True`` / ``False`` overrides.
``follow(pending, what)`` draws one bar for a call on the ranks from the counts each
rank publishes (``fsdp_nb.checkpoints.rank_progress``) while the notebook waits for it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..wire.calls import PROGRESS_KEY

if TYPE_CHECKING:
    from ..runtime.results import Pending

__all__ = ["KEY", "MIN_BYTES", "Progress", "check_progress", "follow", "in_notebook", "may_show"]

KEY = PROGRESS_KEY
"""The key under which a rank publishes ``{"done": bytes, "total": bytes}``."""

MIN_BYTES = 256 << 20
"""Below this many bytes no bar is shown: the work ends before a bar would help."""


def check_progress(progress: Any) -> bool | None:
    """``progress`` as given (None: decide by size and place; True / False); TypeError otherwise."""
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None (a bar in notebooks for big work), got {progress!r}")
    return progress


def may_show(enabled: bool | None) -> bool:
    """Whether a bar could be drawn at all (asked for, or by default in a notebook): when
    not, callers skip the work of counting."""
    return bool(enabled) or (enabled is None and in_notebook())


def in_notebook() -> bool:
    """True inside a Jupyter kernel (an IPython kernel app is running)."""
    app = sys.modules.get("ipykernel.kernelapp")
    return bool(app is not None and app.IPKernelApp.initialized())


class Progress:
    """A byte counter that draws a bar when worth it (see the module docstring)."""

    def __init__(self, total: int, what: str, *, enabled: bool | None = None):
        self.total = int(total)
        self.what = what
        self.done = 0
        show = (self.total >= MIN_BYTES and in_notebook()) if enabled is None else enabled
        self.bar: Any = None
        if show:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc=what, unit="B", unit_scale=True,
                            unit_divisor=1024, leave=True)

    def update(self, n: int) -> None:
        """``n`` more bytes done (counted up to ``total``: files add framing to the tensors)."""
        n = max(0, min(n, self.total - self.done))
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()


@contextmanager
def follow(pending: Pending, what: str, *, enabled: bool | None = None) -> Iterator[None]:
    """While inside, one bar sums what the ranks of ``pending`` (a dispatcher call)
    publish; drawn once their total is known and worth it (see ``Progress``)."""
    if not may_show(enabled):
        yield
        return
    state: dict[str, Any] = {"bar": None}

    def poll() -> None:
        done = total = 0
        for ar in pending.results.values():
            d = (ar.data or {}).get(KEY)
            if d:
                done, total = done + d["done"], total + d["total"]
        if state["bar"] is None:
            if not total or (enabled is None and total < MIN_BYTES):
                return
            state["bar"] = Progress(total, what, enabled=True)
        state["bar"].update(done - state["bar"].done)

    pending.on_poll = poll
    try:
        yield
    finally:
        pending.on_poll = None
        poll()
        if state["bar"] is not None:
            state["bar"].__exit__(None, None, None)
