"""What a reload of edited code did in one process: :class:`Reloaded`, returned by
``fsdp_nb.models.rank_reload`` to ``sess.reload`` (``fsdp_nb.models.reload``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Reloaded"]


@dataclass(frozen=True)
class Reloaded:
    """What a reload did in one process."""

    modules: tuple[str, ...]
    """The modules reloaded (the package's submodules first)."""
    rebound: tuple[str, ...]
    """Names in the namespace re-bound to the new code (``from m import X`` ones)."""
