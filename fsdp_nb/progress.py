"""Progress bars for long checkpoint work: bytes done and the rate, in notebooks only.

``Progress(total, what)`` shows a ``tqdm.auto`` bar (a widget in a notebook) when the
work is larger than ``MIN_BYTES`` and the code runs in a Jupyter kernel; in scripts
and tests it shows nothing and costs nothing. ``enabled=True`` / ``False`` overrides.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["MIN_BYTES", "Progress", "in_notebook"]

MIN_BYTES = 256 << 20
"""Below this many bytes no bar is shown: the work ends before a bar would help."""


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
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()
