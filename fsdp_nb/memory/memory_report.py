"""What ``sess.plan`` returns: each rank's peak by category, whether it fits, and the
what-ifs ranked; as text, as an HTML table with a bar per rank.

Plain data (``MemoryPlan``, ``WhatIf``) over the wire's ``RankMemory``; nothing here
talks to engines.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from ..display.tables import fmt_bytes, html_table, text_table
from .wire_memory_plan import CATEGORIES, RankMemory

__all__ = ["CATEGORY_COLOURS", "MemoryPlan", "WhatIf", "cheapest_change"]

CATEGORY_COLOURS = {"parameters": "#4c78a8", "gradients": "#f58518", "optimizer": "#54a24b",
                    "activations": "#e45756", "communication": "#72b7b2", "other": "#b279a2"}
"""Each category's colour in a plan's bars (the live memory view uses the same)."""


@dataclass(frozen=True)
class WhatIf:
    """One alternative the plan weighed."""

    change: dict[str, Any]
    """What it changes (see ``fsdp_nb.memory.what_if``)."""
    label: str
    """A short name of the change."""
    peak: int | None
    """The highest rank's peak under it, in bytes (None: it could not be planned)."""
    fits: bool | None
    """Whether that peak fits the budget (None: no budget known, or not planned)."""
    cost_rank: int
    """What it costs in speed, 0 (free) and up."""
    cost: str
    """That cost, in words."""
    error: str | None = None
    """Why it could not be planned."""


@dataclass(frozen=True, repr=False)
class MemoryPlan:
    """Each rank's peak memory over a training step, by category, in bytes; planned
    under a fake process group and fake tensors (or ``measured`` on the real ranks)."""

    ranks: list[RankMemory]
    """Per rank, in rank order: ``peak``, ``parameters``, ``gradients``, ``optimizer``,
    ``activations``, ``communication``, ``other``, and ``peak_unit`` / ``peak_phase``
    (the FSDP unit and the phase where the peak fell)."""
    world_size: int
    """Ranks planned for."""
    device: str
    """The device planned for (``"cuda"`` or ``"cpu"``)."""
    budget: int | None
    """Bytes one rank may hold (``budget=``, or by fsdp_nb's one rule: a GPU's memory, or the
    host's RAM shared by the ranks on it); None: unknown."""
    options: dict[str, str] = field(default_factory=dict)
    """The wrap options that differ from the defaults."""
    what_ifs: list[WhatIf] = field(default_factory=list)
    """The alternatives, cheapest that fits first, then by peak."""
    notes: list[str] = field(default_factory=list)
    """What the plan leaves out or assumed (CUDA's own overheads, a CPU stand-in)."""
    measured: bool = False
    """True for a step measured on the real ranks (``ShardedModel.measure_memory``)."""
    seconds: float = 0.0
    """How long planning (or measuring) took."""

    @property
    def peak(self) -> int:
        """The highest rank's peak, in bytes."""
        return max(r.peak for r in self.ranks)

    @property
    def fits(self) -> bool | None:
        """Whether every rank's peak fits the budget (None: no budget known)."""
        return None if self.budget is None else self.peak <= self.budget

    @property
    def cheapest_fit(self) -> WhatIf | None:
        """The what-if that fits at the lowest speed cost (then the lowest peak); None
        if none fits or none was weighed."""
        fitting = [w for w in self.what_ifs if w.fits]
        return min(fitting, key=lambda w: (w.cost_rank, w.peak or 0), default=None)

    def verdict(self) -> str:
        """One line: the peak, the budget, whether it fits, and the cheapest change if not."""
        what = "measured" if self.measured else "planned"
        head = (f"{what} peak {fmt_bytes(self.peak)} per rank on {self.world_size} rank(s) "
                f"({self.device})")
        if self.budget is None:
            return head + "; no budget known (pass budget=)"
        if self.fits:
            return head + f": fits {fmt_bytes(self.budget)}"
        return head + f": does NOT fit {fmt_bytes(self.budget)}; " + cheapest_change(self)

    def _rank_rows(self) -> list[list[str]]:
        return [[str(r.rank), fmt_bytes(r.peak), *(fmt_bytes(getattr(r, c)) for c in CATEGORIES),
                 f"{r.peak_unit or '(root)'} {r.peak_phase}"] for r in self.ranks]

    def _what_if_rows(self) -> list[list[str]]:
        return [[w.label, fmt_bytes(w.peak) if w.peak is not None else "-",
                 "-" if w.fits is None else "yes" if w.fits else "no", w.cost if w.error is None else w.error]
                for w in self.what_ifs]

    _HEAD = ("rank", "peak", *CATEGORIES, "peak in")
    _WHAT_IF_HEAD = ("what if", "peak", "fits", "cost")

    @property
    def copies(self) -> list[int]:
        """Per rank, the host bytes ``sess.autosave(..., in_memory=True)`` would keep: two
        generations of its own state and two of its ward's (the rank whose copies it keeps;
        the largest rank's state, at most). 0 for a rank whose state the plan did not weigh."""
        most = max((r.state for r in self.ranks), default=0)
        return [2 * r.state + 2 * most if r.state else 0 for r in self.ranks]

    def copies_line(self) -> str:
        """What the in-memory autosave would hold in host memory, in one line ("" when
        the plan did not weigh it)."""
        held = max(self.copies, default=0)
        if not held:
            return ""
        where = ("in host memory, beside the GPU's" if self.device == "cuda" else
                 "in the rank's share of host memory, on top of the peak")
        return (f"autosave(in_memory=True) would keep up to {fmt_bytes(held)} per rank {where}: two generations of "
                f"its own state ({fmt_bytes(max(r.state for r in self.ranks))}: its shards, and the optimizer's state "
                "when the plan was given optimizer=) and two of its ward's (the rank whose copies it keeps)")

    def to_text(self) -> str:
        """The plan as plain text: the verdict, the per-rank table, the what-ifs, what the
        in-memory autosave would hold, the notes."""
        parts = [self.verdict(), text_table(self._HEAD, self._rank_rows())]
        if self.what_ifs:
            parts.append(text_table(self._WHAT_IF_HEAD, self._what_if_rows()))
        if line := self.copies_line():
            parts.append(line)
        parts += [f"note: {n}" for n in self.notes]
        return "\n\n".join(parts)

    def __repr__(self) -> str:  # a notebook's text/plain form and print() show the table
        return self.to_text()

    def _bars(self) -> str:
        scale = max([self.peak, self.budget or 0, 1])
        rows = []
        for r in self.ranks:
            segs = "".join(
                f"<div title='{c}: {fmt_bytes(getattr(r, c))}' style='width:{100 * getattr(r, c) / scale:.2f}%;"
                f"background:{CATEGORY_COLOURS[c]}'></div>" for c in CATEGORIES)
            rows.append(f"<div style='display:flex;align-items:center;gap:6px'><code>rank {r.rank}</code>"
                        f"<div style='display:flex;width:320px;height:12px;background:#eee'>{segs}</div>"
                        f"<small>{fmt_bytes(r.peak)}</small></div>")
        legend = " ".join(f"<span style='color:{CATEGORY_COLOURS[c]}'>&#9632;</span> {c}" for c in CATEGORIES)
        budget = f" &mdash; budget {fmt_bytes(self.budget)} = full bar width" if self.budget and self.budget >= self.peak else ""
        return f"<div>{''.join(rows)}<small>{legend}{budget}</small></div>"

    def _repr_html_(self) -> str:
        parts = [f"<b>Memory plan</b> <small>{html.escape(self.verdict())}</small>", self._bars(),
                 html_table(self._HEAD, self._rank_rows(), cls="fsdp-nb-plan")]
        if self.what_ifs:
            parts.append(html_table(self._WHAT_IF_HEAD, self._what_if_rows(), cls="fsdp-nb-what-if"))
        if line := self.copies_line():
            parts.append(f"<small>{html.escape(line)}</small>")
        parts += [f"<small>note: {html.escape(n)}</small>" for n in self.notes]
        return "<div class='fsdp-nb-memory-plan'>" + "<br>".join(parts) + "</div>"


def cheapest_change(plan: MemoryPlan | None, source: str = "") -> str:
    """The one line that names the cheapest change that fits: in a plan's verdict, and
    (``source="the last plan"``) in an out-of-memory error or a killed rank's report.

    Args:
        plan: the plan (None: there is none, and the line says how to make one).
        source: where the plan came from, named after "fits" (``""``: nothing named).
    """
    if plan is None:
        return "no plan says what fits: sess.plan(Model, ..., batch=..., what_if='auto') does, before allocating"
    best = plan.cheapest_fit
    if best is None:
        return ("no change weighed fits" if plan.what_ifs else
                "no change was weighed: what_if='auto' weighs the usual ones") + (f" ({source})" if source else "")
    return (f"cheapest change that fits{', from ' + source if source else ''}: {best.label} "
            f"(peak {fmt_bytes(best.peak or 0)}; cost: {best.cost})")
