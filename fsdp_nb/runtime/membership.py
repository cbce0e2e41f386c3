"""Which engines are ranks: adding engines to a cluster's rank map and retiring ranks from it.

``sess.resize`` grows the world with ``start_engines`` (at once, so they import torch
while the old ranks stage their state) then ``adopt_engines``, and shrinks it with
``retire_ranks``. On a cluster this session started with a local launcher the standby
engine (``fsdp_nb.runtime.standby``) is taken first and new engines are launched for
the rest; a cluster it attached to lends the registered engines that are not ranks yet,
and only those. A retired engine this session started is shut down; one of an attached
cluster is only left out of the group (its launcher owns it).
"""

from __future__ import annotations

import logging

from ..engine.health import whoami
from .cluster import EngineCluster, wait_until

log = logging.getLogger("fsdp_nb")

__all__ = ["adopt_engines", "retire_ranks", "spare_engines", "start_engines"]


def spare_engines(cluster: EngineCluster) -> list[int]:
    """Registered engines of the cluster that are not ranks (attached clusters)."""
    return sorted(set(cluster.client.ids) - set(cluster.engine_ids))


def start_engines(cluster: EngineCluster, k: int) -> set[int]:
    """Have ``k`` more engines on their way without waiting for them: the standby engine
    first, new ones for the rest (a cluster this session started), or nothing to start
    (an attached cluster's spare engines, ``spare_engines``). Returns the engine ids
    registered before, which tell the new ones apart (``adopt_engines``)."""
    known = set(cluster.client.ids) | set(cluster.engine_ids)
    if cluster.cluster is None:
        return set(cluster.engine_ids)
    fresh = k
    if cluster.standby is not None and cluster.standby.alive():
        cluster.standby.release()
        fresh -= 1
        log.info("a new rank: the standby engine takes it")
    cluster.standby = None
    if fresh:
        cluster.cluster.start_engines_sync(n=fresh, **cluster._replacement_settings())
        log.info("%d new engine(s) starting", fresh)
    return known


def adopt_engines(cluster: EngineCluster, k: int, known: set[int], timeout: float = 120.0) -> list[int]:
    """Wait for ``k`` engines not in ``known`` and make them the next ranks (their pid,
    host and start time read from them); the new ranks."""
    if not wait_until(lambda: len(set(cluster.client.ids) - known) >= k, timeout, 0.1):
        raise TimeoutError(f"{k} new engine(s) did not register within {timeout:g} s")
    new = sorted(set(cluster.client.ids) - known)[:k]
    first = cluster.world_size
    for eid in new:
        pid, host, started = cluster.client[eid].apply_sync(whoami)  # a one-off view
        cluster.engine_ids.append(eid)
        cluster.pids.append(pid)
        cluster.hosts.append(host)
        cluster.started.append(started)
    return list(range(first, first + k))


def retire_ranks(cluster: EngineCluster, n: int, wait: float = 10.0) -> list[int]:
    """Remove ranks ``n`` and above from the rank map; engines this session started are
    shut down (``EngineCluster.ask_to_exit``) and, on this host, killed through their
    verified handle if still running after ``wait`` seconds. The engine ids retired."""
    gone = list(range(n, cluster.world_size))
    eids = [cluster.engine_ids[r] for r in gone]
    if cluster.owns_engines and gone:
        left = cluster.ask_to_exit(gone, wait)
        if left:
            cluster.kill(left, wait)
    del cluster.engine_ids[n:], cluster.pids[n:], cluster.hosts[n:], cluster.started[n:]
    cluster.ranks = cluster.ranks[:n]
    return eids
