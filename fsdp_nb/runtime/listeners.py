"""Starting the engines' signed listeners and holding the notebook's end of each link.

An engine's listener (``fsdp_nb.engine.signing.start_listener``: the hang watch, the NCCL
abort channel) binds where the notebook reaches it (``EngineCluster.listen_address``:
loopback for a local engine) and answers only messages signed for its purpose with
the cluster's key and its own nonce. ``start_listeners`` starts it on some ranks through
the task queue (once per engine: a second start returns the same endpoint and nonce)
and returns the notebook's side of each link.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..engine.signing import Link

if TYPE_CHECKING:
    from .cluster import EngineCluster
    from .dispatch import Dispatcher

__all__ = ["start_listeners"]


def start_listeners(cluster: EngineCluster, dispatcher: Dispatcher, what: str,
                    start: Callable[[str], tuple[str, bytes]], purpose: str,
                    ranks: list[int] | None = None, window: int = 0) -> dict[int, tuple[str, Link]]:
    """Run ``start(address)`` on ``ranks``' engines (all by default); rank -> (endpoint,
    the client side of its link for ``purpose``).

    Args:
        cluster: the engines (where each listens, the cluster's key).
        dispatcher: sends the start to the ranks (``what`` names the call).
        what: the call's name in progress and errors.
        start: the engine function that starts the listener and returns its endpoint and nonce.
        purpose: the link's purpose, as the engine side names it (``"hang-watch"``).
        ranks: which ranks (None: every rank).
        window: the client links' ``window`` (``Link``): as the engine side's.
    """
    who = list(range(cluster.world_size)) if ranks is None else list(ranks)
    d = dispatcher
    started = d.gather(d.apply(what, start, [(cluster.listen_address(r),) for r in who], ranks=who), 30)
    return {r: (endpoint, Link(cluster.key, purpose, nonce, "client", window)) for r, (endpoint, nonce) in zip(who, started)}
