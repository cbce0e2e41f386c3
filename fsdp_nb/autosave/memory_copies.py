"""The notebook's half of the in-memory autosave: who keeps whose copy, which generation a
restart can take from memory, and the restore itself.

Each rank's state after every step is copied into its own host memory and its buddy's
(``autosave.rank_memory_copies``). The buddy map (:func:`buddy_map`) shifts every rank by
one stride so that each rank's buddy is on another host where there is one: a whole host
can then die and every one of its ranks' states survives on the next host. The map is a
permutation, so every rank keeps exactly one other rank's copies.

A restart asks the live ranks what they hold (:func:`find`) and takes the newest step at
which every rank's state is whole somewhere: the rank's own copy if it lived, else its
buddy's (:func:`cover`). Where none is, it says why, naming the ranks whose copies died
with them, and the restart falls back to the newest disk autosave.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..display.tables import fmt_bytes
from .wire_autosave import AutosaveState, HeldCopies

if TYPE_CHECKING:
    from ..context import SessionContext
    from .wire_autosave import AutosaveSpec

__all__ = ["MemoryRestore", "buddy_map", "cover", "find", "in_memory_line", "restore"]

log = logging.getLogger("fsdp_nb")


def buddy_map(hosts: Sequence[str | None]) -> tuple[int, ...]:
    """``buddies[r]``, the rank that keeps rank r's copies, for ranks on ``hosts`` (by rank):
    ``(r + s) % n`` with the smallest stride ``s`` that puts every rank's buddy on another
    host, else the stride that puts the most there (one host: the next rank). A
    permutation, so each rank keeps one other rank's copies; one rank keeps none."""
    n = len(hosts)
    if n < 2:
        return tuple(range(n))
    best, best_across = 1, -1
    for stride in range(1, n):
        across = sum(hosts[r] != hosts[(r + stride) % n] for r in range(n))
        if across == n:
            return tuple((r + stride) % n for r in range(n))
        if across > best_across:
            best, best_across = stride, across
    return tuple((r + best) % n for r in range(n))


@dataclass(frozen=True)
class MemoryRestore:
    """Where a restart finds the state in memory (``step`` None: it does not, ``why``)."""

    step: int | None
    """The generation every rank can roll back to (None: none is whole for every rank)."""
    sources: dict[int, int] = field(default_factory=dict)
    """Rank -> the rank that sends it its copy: each rank that holds no copy of its own
    (a new engine)."""
    why: str = ""
    """Why memory cannot serve, when it cannot."""

    def what(self) -> str:
        """Where each rank's state comes from, in words."""
        if self.step is None:
            return self.why
        sent = "; ".join(f"rank {r} from rank {h}'s memory" for r, h in sorted(self.sources.items()))
        return f"step {self.step} from memory ({sent + '; ' if sent else ''}every other rank from its own copy)"


def cover(world: int, said: dict[int, HeldCopies | None], buddies: Sequence[int]) -> MemoryRestore:
    """The newest step at which every one of ``world`` ranks' state is whole in memory,
    from what each live rank said it holds (``said``; a rank missing or None holds
    nothing: dead, or a new engine). A pure function."""
    own = {r: set(h.own) for r, h in said.items() if h is not None}
    kept: dict[int, dict[int, int]] = {}  # ward -> step -> holder
    for holder, h in said.items():
        for ward, steps in (h.held.items() if h is not None else ()):
            for step in steps:
                kept.setdefault(ward, {}).setdefault(step, holder)
    candidates = sorted({s for steps in own.values() for s in steps} | {s for k in kept.values() for s in k},
                        reverse=True)
    for step in candidates:
        sources = {}
        for r in range(world):
            if step in own.get(r, ()):
                continue
            found = kept.get(r, {}).get(step)
            if found is None:
                break
            sources[r] = found
        else:
            return MemoryRestore(step, sources)
    lacking = [r for r in range(world) if not own.get(r) and not kept.get(r)]
    if not candidates:
        why = "no rank holds a copy in memory yet (none was taken since the autosave was armed)"
    elif lacking:
        pairs = ", ".join(f"rank {r} (its buddy: rank {buddies[r]})" if r < len(buddies) else f"rank {r}"
                          for r in lacking)
        why = (f"no copy in memory of {pairs} survives: the rank and the rank that kept its copy both died "
               "(or that copy was never complete)")
    else:
        why = "no one step is whole for every rank in memory (a copy was cut short, and the older one is gone)"
    return MemoryRestore(None, why=why)


def find(ctx: SessionContext, spec: AutosaveSpec) -> MemoryRestore:
    """What the live ranks hold, and the generation :func:`cover` takes from it."""
    from . import rank_memory_copies as engine_copies

    d = ctx.plain_dispatcher
    dead = set(ctx.cluster.dead_ranks())
    live = [r for r in range(ctx.world_size) if r not in dead]
    said = dict(zip(live, d.gather(d.apply("copies in memory", engine_copies.held, ranks=live), 60)))
    return cover(ctx.world_size, said, spec.buddies)


def restore(ctx: SessionContext, spec: AutosaveSpec, found: MemoryRestore) -> list[str]:
    """Roll every rank back to ``found.step`` from memory, into the engine globals the
    autosave names; where each rank's state came from, by rank."""
    from . import rank_memory_copies as engine_copies

    d = ctx.plain_dispatcher
    names = (*spec.loaders, *spec.state)
    return d.gather(d.apply(f"restore step {found.step} from memory", engine_copies.restore,
                            args=(found.step, found.sources, spec.model, spec.optimizers, names)))


def in_memory_line(ranks: Sequence[AutosaveState | None]) -> str:
    """What the ranks hold in memory, for the autosave's repr ("" when nothing is)."""
    held = [r.copies for r in ranks if r is not None and r.copies is not None]
    if not held:
        return ""
    newest = max((max(h.own) for h in held if h.own), default=None)
    line = f"; in memory: step {newest}, {fmt_bytes(sum(h.bytes for h in held))} over {len(held)} ranks"
    if failed := [h.failed for h in held if h.failed]:
        line += f"; a copy FAILED: {failed[0]}"
    return line
