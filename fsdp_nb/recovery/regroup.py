"""The one path by which every rank's features hear that the group formed again.

``restart``, ``resize`` and a recovery's re-form end here, once the new group stands,
its meshes are re-pointed and the wrapped models are built: :func:`reformed` tells every
rank's registry (``fsdp_nb.engine.registry``), so each feature's rank part drops what
belonged to the old group and, where the ranks must agree, agrees. A rank that joined
first makes the parts the others hold, so it ends up holding what a rank that stayed
holds (the gradient scaler among them). A rank that leaves the session (a resize that
retires it, the shutdown of engines the session does not own; engines it owns exit)
closes its parts as it leaves the group (``fsdp_nb.engine.process_group.destroy``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import rank_regroup as _registry

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["reformed"]

log = logging.getLogger("fsdp_nb")


def reformed(ctx: SessionContext, joined: Sequence[int] = ()) -> list[str]:
    """Tell every rank's parts the group formed again; ``joined``: the ranks that are new
    engines. Returns the kinds told, in the order every rank told them."""
    d = ctx.plain_dispatcher
    held = d.gather(d.apply("list rank parts", _registry.kinds), 60)
    every: list[str] = sorted({k for ks in held for k in ks})
    n = ctx.world_size
    args = [(r, n, tuple(joined), every) for r in range(n)]
    told = d.gather(d.apply("regroup rank parts", _registry.reformed, args), 120)
    return list(told[0]) if told else []
