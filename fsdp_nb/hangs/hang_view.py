"""A call's live hang diagnosis, shown while the cell keeps running.

The dispatcher's hang watch (``fsdp_nb.hangs.hang_watch``) hands each new diagnosis
to a :class:`HangView`: in a notebook it is one output of the running cell, updated in
place at every refresh and turned into a one-line note saying how it ended (the
collective completed, or the call was cut off by its ``timeout=``, interrupted, or
failed: then the collective did not complete); in a script it goes to stderr, each
time it says something new (the waiting times alone changing do not count).
"""

from __future__ import annotations

import re
import sys
from typing import Any, Protocol

from ..display.progress import in_notebook
from .hang_report import HangReport

__all__ = ["COMPLETED", "HangShow", "HangView", "diagnosis_text"]

_SECONDS = re.compile(r"\d+ s\b")

COMPLETED = "the collective completed"
"""How a diagnosed wait ended when nothing cut the call off."""


class HangShow(Protocol):
    """Where a call's diagnosis is shown (the dispatcher's ``hang_view``)."""

    def __call__(self, what: str, report: HangReport | None, ended: str = COMPLETED) -> None:
        """Show ``report`` for call ``what``; None: take it down, ``ended`` saying how the
        wait ended."""


def diagnosis_text(what: str, report: HangReport) -> str:
    """The diagnosis as shown: a head line, then one indented line per rank."""
    head = f"fsdp_nb: {what} has waited {report.waited:.0f} s in a collective"
    return head + "".join(f"\n  {line}" for line in report.lines)


class HangView:
    """Where one session's diagnoses are shown (one call at a time: the notebook's thread)."""

    def __init__(self) -> None:
        self.handle: Any = None
        """The notebook output being updated (None: none yet for this call)."""
        self.said: str | None = None
        """What was last written to stderr, waiting times left out."""
        self.waited = 0.0
        self.text = ""
        """The diagnosis last shown."""

    def __call__(self, what: str, report: HangReport | None, ended: str = COMPLETED) -> None:
        """Show ``report`` for call ``what``; None: the wait is over, ``ended`` saying how
        (``COMPLETED``, or the call cut off by its timeout, interrupted, failed)."""
        if report is None:
            self._resolved(what, ended)
            return
        text = diagnosis_text(what, report)
        self.waited, self.text = report.waited, text
        if in_notebook():
            from IPython.display import display

            shown = {"text/plain": text}
            if self.handle is None:
                self.handle = display(shown, raw=True, display_id=True)
            else:
                self.handle.update(shown, raw=True)
            return
        key = _SECONDS.sub("", text)
        if key != self.said:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            self.said = key

    def _resolved(self, what: str, ended: str) -> None:
        note = f"fsdp_nb: {what}: {ended} (it had waited {self.waited:.0f} s)"
        if self.handle is not None:  # what was seen stays, with how it ended
            self.handle.update({"text/plain": f"{self.text}\n{note}"}, raw=True)
        elif self.said is not None:
            sys.stderr.write(note + "\n")
            sys.stderr.flush()
        self.handle, self.said = None, None
