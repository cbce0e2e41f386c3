"""A feature's gate: training waits there for the feature's own work (a copy being staged,
a save being taken) before it changes a tensor that work reads."""

from __future__ import annotations

from typing import Any

__all__ = ["waited"]


def waited(f: Any) -> float:
    """Block until the future ``f`` (None: none) is done; the seconds that took (0 when it
    was): a gate's wait, which the feature that holds the gate counts as training's."""
    if f is None or f.done():
        return 0.0
    from concurrent.futures import wait as wait_futures
    from time import perf_counter

    t0 = perf_counter()
    wait_futures([f])
    return perf_counter() - t0
