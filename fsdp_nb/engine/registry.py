"""Everything a rank keeps between calls, in one place: the rank's registry.

Each rank-side feature keeps its state in one object of its own, a :class:`Part`: the
autosave armed, the async saves still writing, the step view's window, the profile being
taken, the gradient scaler, what the memory feed last read, the call server. The
registry (:data:`RANK`) holds one part of each kind, made on first use. Nothing else on
the rank side is mutable at module level, and no module rebinds a global:
``tests/unit/test_structure.py`` keeps it so.

Every part has the same small lifecycle. The session drives it through one path
(``fsdp_nb.recovery.regroup``, its rank half ``fsdp_nb.recovery.rank_regroup``) for a
``restart``, a ``resize`` and a recovery's re-form alike, and a rank closes its parts as
it leaves the group (``fsdp_nb.engine.process_group.destroy``):

1. made (``__init__``, no arguments, no side effects): on first use, or when the group
   forms around a rank that lacks a kind another rank holds (:meth:`Registry.make`);
2. :meth:`Part.reformed`: the group formed again around this rank (a new group after a
   failure, a restart, a resize). Every rank is told, the ranks
   that stayed and those that joined, part by part in one order
   (:attr:`Part.order`, then the kind's name), so collectives a part runs there (on
   :func:`fsdp_nb.engine.checkpoint_group.checkpoint_group`) line up on every rank. A
   part drops what belonged to the old group, and where the ranks must agree (the
   scaler's scale, the autosave's count) it agrees, so a rank that joined holds what a
   rank that stayed holds. A part whose own work there can fail on one rank does it
   before its collective and takes the outcome into it, so no rank is left waiting;
3. :meth:`Part.closed`: the rank is leaving (a ``resize`` that retires it, the shutdown
   of engines the session does not own): threads stopped, sockets closed, hooks removed. The part stays in the registry,
   empty: an engine that serves a later session starts it again on first use.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

__all__ = ["RANK", "Part", "Registry", "World", "part"]

log = logging.getLogger("fsdp_nb")


@dataclass(frozen=True)
class World:
    """The group a rank is in, as the registry's parts are told it."""

    rank: int
    """This rank."""
    size: int
    """How many ranks the group has."""
    joined: tuple[int, ...] = ()
    """The ranks that joined with this formation (new engines of a restart or resize)."""


class Part:
    """One feature's state on a rank, held by the :class:`Registry` (one per kind).

    A subclass takes no constructor arguments, and overrides what its feature needs of the
    lifecycle (both do nothing here).
    """

    order: ClassVar[int] = 50
    """Where the part is told in the lifecycle among the others (lower first): parts whose
    ``reformed`` runs collectives, or that others read there, say so by their order. A
    part that is also a step listener (``fsdp_nb.engine.step``) has one order for both."""

    def reformed(self, world: World) -> None:
        """The group formed again around this rank (see the module docstring)."""

    def closed(self) -> None:
        """This rank is leaving: stop threads, close sockets, remove hooks, and be ready to
        start again on first use (a later session on the same engine)."""


P = TypeVar("P", bound=Part)


def kind_of(cls: type) -> str:
    """A part's kind, as the ranks exchange it: ``module:qualname``."""
    return f"{cls.__module__}:{cls.__qualname__}"


class Registry:
    """The rank's parts, one of each kind, in the order they were made."""

    def __init__(self) -> None:
        self._parts: dict[type, Part] = {}
        self._lock = threading.RLock()  # a part may be asked for from a sampler thread
        self.world: World | None = None
        """The group this rank is in, as last told (None: none formed yet)."""

    def get(self, cls: type[P]) -> P:
        """The part of kind ``cls``, made now if this rank has none."""
        found = self._parts.get(cls)
        if found is None:
            with self._lock:
                found = self._parts.get(cls)
                if found is None:
                    found = self._parts[cls] = cls()
        return found  # type: ignore[return-value]

    def find(self, cls: type[P]) -> P | None:
        """The part of kind ``cls`` if this rank made one (None: it made none)."""
        return self._parts.get(cls)  # type: ignore[return-value]

    def kinds(self) -> list[str]:
        """The kinds of the parts this rank holds (``module:qualname``)."""
        return [kind_of(cls) for cls in list(self._parts)]

    def make(self, kinds: list[str] | tuple[str, ...]) -> None:
        """Make every part of ``kinds`` (``module:qualname``) this rank lacks: what a rank
        that joined needs before the group's parts are told, so it is told what the others
        are. Raises what importing or making one raised."""
        for kind in kinds:
            module, _, name = kind.partition(":")
            found: Any = importlib.import_module(module)
            for attr in name.split("."):
                found = getattr(found, attr)
            self.get(found)

    def reformed(self, world: World) -> list[str]:
        """The group formed around this rank: tell every part, in order; the kinds told,
        in that order (the same on every rank that made the same kinds). A part that raises
        is logged and the later parts are still told, so no rank stops short of a later
        part's collective; then a RuntimeError names every part that failed."""
        self.world = world
        told, failed = [], []
        for cls, p in sorted(list(self._parts.items()), key=lambda kv: (kv[1].order, kind_of(kv[0]))):
            try:
                p.reformed(world)
            except Exception as exc:  # noqa: BLE001 - named once every part was told
                log.exception("fsdp_nb: %s failed as the group formed again", kind_of(cls))
                failed.append(f"{kind_of(cls)}: {type(exc).__name__}: {exc}")
            told.append(kind_of(cls))
        if failed:
            raise RuntimeError("rank parts failed as the group formed again: " + "; ".join(failed))
        return told

    def close(self) -> None:
        """This rank is leaving: close every part, newest first. A part that fails to close
        is logged and the others still close."""
        for cls, p in reversed(list(self._parts.items())):
            try:
                p.closed()
            except Exception:  # noqa: BLE001 - one part's failure must not keep the others open
                log.exception("fsdp_nb: closing %s on this rank failed", kind_of(cls))
        self.world = None


RANK = Registry()
"""This process's registry: the one piece of module-level mutable state on the rank side."""


def part(cls: type[P]) -> P:
    """``RANK.get(cls)``: this rank's part of kind ``cls``, made now if it has none."""
    return RANK.get(cls)

