"""A hang, explained: which rank waits in which collective, who is missing and where.

Pure functions over what each rank's watch thread told (a :class:`~fsdp_nb.hangs.wire_hang_state.RankState`):
``hang_report`` turns them into one line per rank, mismatches and missing ranks first,
for the live diagnosis, the status widget and the errors of a timeout, a Ctrl-C or a
recovery. The checkpoint group's counts are the checkpoint's own business: an async
save commits there from a background thread, one rank well ahead of another while its
files are still being written. They never make a rank wait in, or miss, a collective of
the training's, nor a group out of step; :func:`saving` names them as what they are,
under a diagnosis of the training's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..engine.checkpoint_group import DESC
from .wire_hang_state import Collective, GroupCount, RankState, UserFrame, WatchError

__all__ = ["HangReport", "ahead", "hang_report", "out_of_step", "saving"]

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


@dataclass(frozen=True)
class HangReport:
    """The ranks of a call that waits, explained."""

    lines: tuple[str, ...] = ()
    """One line per rank (mismatches, then ranks missing from the collective, then the
    ranks waiting in it, then any save running on the checkpoint group meanwhile); empty
    when no rank waits in a collective of the training's."""
    waited: float = 0.0
    """The longest any rank has waited in its collective, in seconds."""
    waiting: tuple[int, ...] = ()
    """Ranks that wait in a collective."""
    missing: tuple[int, ...] = ()
    """Ranks of a waiting collective's group that are not in it."""
    stalled: tuple[int, ...] = ()
    """Ranks that did not answer at all (stopped, or stuck in C holding the GIL)."""
    mismatch: bool = False
    """Ranks sit in different collectives under one sequence number, or in one op with
    different shapes."""
    stopped: tuple[int, ...] = field(default=())
    """Of ``stalled``, the ranks whose process is stopped (SIGSTOP, a debugger)."""

    def triggered(self, hang_after: float) -> bool:
        """Whether some rank has waited in a collective for ``hang_after`` seconds."""
        return bool(self.waiting) and self.waited >= hang_after

    @property
    def text(self) -> str:
        """The lines, one per line."""
        return "\n".join(self.lines)


def _group(desc: str) -> str:
    if desc == DESC:
        return "the checkpoint group"
    return "the default group" if desc in ("default_pg", "", "0") else f"group {desc}"


def _tensors(c: Collective) -> str:
    parts = [f"{dt}[{', '.join(map(str, shape))}]" for shape, dt in zip(c.shapes, c.dtypes)]
    return ", ".join(parts[:3]) + (f", … ({len(parts)} tensors)" if len(parts) > 3 else "")


def _coll(c: Collective) -> str:
    return f"{c.op} #{c.seq}"


def _place(frame: UserFrame | None) -> str:
    if frame is None:
        return ""
    code = f": {frame.code}" if frame.code else ""
    return f"in {frame.function} ({frame.where}){code}"


def _silent(r: int, stopped: set[int]) -> str:
    if r in stopped:
        return f"rank {r} is not responding (process stopped)"
    return f"rank {r} is not responding (no answer: stuck in C holding the GIL, or gone)"


Answers = Mapping[int, "RankState | WatchError | None"]
"""Rank -> what its watch thread answered: its state, the error it met telling it, or None
when it did not answer."""


def hang_report(states: Answers, stopped: set[int] | None = None, running: set[int] | None = None) -> HangReport:
    """Explain the ranks of a call from their states.

    Args:
        states: rank -> what its watch thread answered (``hangs.rank_hang_watch.RankWatch.state``),
            the error it met telling it, or None when it did not answer.
        stopped: ranks whose process is stopped (checked by the notebook).
        running: the ranks still running the call (default: all in ``states``); the
            others are idle.
    """
    running = set(states) if running is None else set(running)
    stopped = set(stopped or ())
    told = {r: st for r, st in states.items() if isinstance(st, RankState)}
    erred = {r: st.error for r, st in states.items() if isinstance(st, WatchError)}
    silent = sorted(r for r, st in states.items() if st is None)
    coll = {r: st.collective for r, st in told.items() if st.collective is not None}
    for r, c in ahead(states).items():
        coll.setdefault(r, c)
    if not coll:
        return HangReport(stalled=tuple(silent), stopped=tuple(r for r in silent if r in stopped))
    waited = {r: max(0.0, told[r].now - (c.since or told[r].now)) for r, c in coll.items()}
    mismatch_lines = _mismatches(coll)
    members: set[int] = set()
    for c in coll.values():
        members |= set(c.group_ranks or states)
    missing = sorted(r for r in members if r not in coll and r in states or r in silent)
    lines = list(mismatch_lines)
    for r in missing:
        st = told.get(r)
        if r in erred:
            lines.append(f"rank {r} is not in it, as far as it can tell: its watch failed ({erred[r]})")
        elif st is None:
            lines.append(_silent(r, stopped))
        elif r not in running:
            lines.append(f"rank {r} is not in it: idle (it finished the call, or was not asked to run it)")
        else:
            where = _place(st.frame)
            lines.append(f"rank {r} is not in it: {where}" if where else f"rank {r} is not in it (not in user code)")
    for r in sorted(coll):
        c = coll[r]
        shapes = _tensors(c)
        line = f"rank {r} waits in {_coll(c)} on {_group(c.desc)}"
        line += f" ({shapes})" if shapes else ""
        line += f" for {waited[r]:.0f} s"
        frame = told[r].frame
        if frame is not None:
            line += f", from {frame.function} ({frame.where})"
        lines.append(line)
    lines += saving(states)  # what the checkpoint group does meanwhile, named as such
    return HangReport(lines=tuple(lines), waited=max(waited.values()), waiting=tuple(sorted(coll)),
                      missing=tuple(missing), stalled=tuple(silent), mismatch=bool(mismatch_lines),
                      stopped=tuple(r for r in silent if r in stopped))


def _counts(states: Answers, checkpoint: bool) -> list[dict[int, GroupCount]]:
    """Each group's counts by rank, of the checkpoint group (``checkpoint``) or of every
    other group, for the members that answered (a group some member did not answer for
    is left out: nothing to compare with)."""
    counts: dict[tuple[str, str], dict[int, GroupCount]] = {}
    for r, st in states.items():
        for g in st.issued if isinstance(st, RankState) else ():
            if g.checkpoint == checkpoint:
                counts.setdefault((g.name, g.backend), {})[r] = g
    out = []
    for by_rank in counts.values():
        members = set(next(iter(by_rank.values())).ranks or by_rank)
        by_rank = {r: g for r, g in by_rank.items() if r in members}
        if members <= set(by_rank):
            out.append(by_rank)
    return out


def saving(states: Answers) -> list[str]:
    """A line for each rank ahead of others on the checkpoint group: a save or load whose
    collectives run in the background (an async save's commit waits there for every rank's
    files). Not a collective of the training's: it never makes a hang, nor a group out of
    step, and it is named under a diagnosis of the training's for what it is."""
    lines = []
    for by_rank in _counts(states, checkpoint=True):
        low = min(g.seq for g in by_rank.values())
        behind = sorted(r for r, g in by_rank.items() if g.seq == low)
        for r, g in sorted(by_rank.items()):
            if g.seq > low:
                lines.append(f"rank {r} is {g.seq - low} collective(s) ahead on the checkpoint group, waiting for "
                             f"rank(s) {', '.join(map(str, behind))}: a save or load in the background (an async "
                             "save still writing), not the training's")
    return lines


def ahead(states: Answers) -> dict[int, Collective]:
    """The collective each rank waits in, told by the groups' counts of issued
    collectives (``hangs.rank_hang_watch.RankWatch.issued``): in a group whose members issued
    different counts, collective ``lowest + 1`` cannot complete, and every member that
    issued it waits in it (since its count last changed); the op is not known from a
    count. Where the flight recorder is off (NCCL), this is what names a hang. The
    checkpoint group's counts are left out (:func:`saving`)."""
    out: dict[int, Collective] = {}
    for by_rank in _counts(states, checkpoint=False):
        members = set(next(iter(by_rank.values())).ranks or by_rank)
        low = min(g.seq for g in by_rank.values())
        for r, g in by_rank.items():
            if g.seq > low and r not in out:
                out[r] = Collective(op="collective", desc=g.desc, group_ranks=tuple(sorted(members)), seq=low + 1,
                                    since=g.since, from_counts=True)
    return out


def out_of_step(states: Answers) -> list[str]:
    """For a call every rank has returned from: a line for each rank that issued a
    collective the other members of its group did not (``ahead``: rank 1 started an
    async one, then failed). The group's next collective would be paired with it, and
    fail (gloo aborts a mismatched size) or hang."""
    lines, issued = [], ahead(states)
    for r, c in sorted(issued.items()):
        others = [q for q in c.group_ranks or () if q not in issued or issued[q].seq != c.seq]
        who = f"rank(s) {', '.join(map(str, others))}" if others else "the other members"
        lines.append(f"rank {r} issued collective #{c.seq} on {_group(c.desc)}, which {who} never joined")
    return lines


def _mismatches(coll: dict[int, Collective]) -> list[str]:
    """A line for each group and sequence number whose ranks sit in different ops, or in
    one op with different shapes or dtypes (an op told by counts alone is not compared)."""
    by_seq: dict[tuple[str, int], dict[int, Collective]] = {}
    for r, c in coll.items():
        if c.from_counts:
            continue
        by_seq.setdefault((c.desc, c.seq), {})[r] = c
    out = []
    for (group, _seq), ranks in sorted(by_seq.items(), key=lambda kv: str(kv[0])):
        ops = {c.op for c in ranks.values()}
        sigs = {(c.op, c.shapes, c.dtypes) for c in ranks.values()}
        if len(sigs) < 2:
            continue
        what = "different collectives" if len(ops) > 1 else "the same op with different shapes"
        parts = ", ".join(f"rank {r} in {_coll(c)}" + (f" ({_tensors(c)})" if len(ops) == 1 else "")
                          for r, c in sorted(ranks.items()))
        out.append(f"mismatch on {_group(group)} ({what}): {parts}")
    return out
