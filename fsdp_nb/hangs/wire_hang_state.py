"""Where one rank is, as its hang-watch thread tells the notebook: :class:`RankState`.

Each engine's watch thread (``fsdp_nb.hangs.rank_hang_watch``) answers a signed question with
one of these as JSON (or a :class:`WatchError`; a request to free a rank gets a
:class:`Freed`); the notebook decodes it strictly (``fsdp_nb.wire.decode``) and explains
the ranks together (``fsdp_nb.hangs.hang_report``). A process group is named
two ways, never under one key: ``name``, torch's name of the group (the same on every
member, what counts are compared by), and ``desc``, what a person reads (``default_pg``,
a mesh dimension).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Collective", "Freed", "GroupCount", "RankState", "UserFrame", "WatchError"]


@dataclass(frozen=True, kw_only=True)
class Collective:
    """The collective a rank waits in."""

    op: str
    """Its op (``all_reduce``), or ``"collective"`` when only the counts tell of it."""
    desc: str
    """Its group's description (``default_pg``, a mesh dimension)."""
    group_ranks: tuple[int, ...] | None
    """The group's members (None: not known)."""
    seq: int
    """Its sequence number within the group (-1: not known)."""
    since: float
    """Unix time the wait began (or was first seen)."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """Its tensors' shapes."""
    dtypes: tuple[str, ...] = ()
    """Their dtypes, as torch names them (``float32``)."""
    from_counts: bool = False
    """Told by the groups' counts of issued collectives alone (op, shapes and dtypes unknown)."""


@dataclass(frozen=True, kw_only=True)
class GroupCount:
    """How many collectives one process group has issued on a rank, for one backend."""

    name: str
    """torch's name of the group, the same on every member."""
    desc: str
    """What a person reads (``default_pg``, a mesh dimension)."""
    ranks: tuple[int, ...]
    """The group's members."""
    backend: str
    """``gloo``, ``nccl``."""
    seq: int
    """Collectives issued so far."""
    since: float
    """Unix time this count was first seen on this rank."""
    checkpoint: bool = False
    """The checkpoint group's (``fsdp_nb.engine.checkpoint_group``): saves and loads, whose
    async writes and commits run in a background thread; never a collective the
    training waits in."""


@dataclass(frozen=True, kw_only=True)
class UserFrame:
    """The innermost frame of the user's code on a rank's main thread."""

    function: str
    """Its function's name."""
    where: str
    """``cell line 3``, or ``file.py:12``."""
    code: str
    """The line's source."""


@dataclass(frozen=True, kw_only=True)
class RankState:
    """One rank, now: what its watch thread answers."""

    rank: int | None
    """The rank (None before a group is formed)."""
    pid: int
    """The engine's process id."""
    now: float
    """The engine's Unix time when it answered (waits are measured against it)."""
    collective: Collective | None
    """The collective it waits in (None: none)."""
    issued: tuple[GroupCount, ...]
    """Each of its groups' counts of issued collectives."""
    frame: UserFrame | None
    """Where its main thread is in user code (None: not in user code)."""
    stopped: str | None = None
    """Where it is stopped at a breakpoint (``cell [12] line 4``; None: not stopped)."""


@dataclass(frozen=True, kw_only=True)
class WatchError:
    """A rank's watch thread could not tell where the rank is (its answer in place of a
    :class:`RankState`)."""

    error: str
    """The exception it met, as ``"RuntimeError: ..."``."""


@dataclass(frozen=True, kw_only=True)
class Freed:
    """A rank's answer to the recovery's request to shut its connections to its peers."""

    closed: int
    """How many connections it shut."""
