"""The checkpoint code's helper thread pools, each started on first use."""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

__all__ = ["LazyPool", "lower_priority", "priority"]

log = logging.getLogger("fsdp_nb")


def priority() -> int:
    """The calling thread's nice value (Linux keeps one per thread; 0 where unknown)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):  # no getpriority (Windows)
        return 0


def lower_priority(by: int) -> None:
    """Raise the calling thread's nice value by ``by`` (at most 19), so that it runs only
    on CPU time the process's other threads and processes leave over. Threads it starts
    inherit that. Where the platform has no per-thread priority, nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, priority() + by))
    except (AttributeError, OSError) as exc:
        log.debug("cannot lower this thread's CPU priority: %s", exc)


class LazyPool:
    """A ``ThreadPoolExecutor`` of ``workers`` threads named ``name``, made by the first
    call (a process that never saves starts no threads), one per CPU priority of the
    threads that call: a worker starts with its starter's priority and could not raise
    it again, so a background save's helpers never serve a foreground save. A forked
    child starts its own: it inherits the pools but not their threads, and a job sent
    there would never run."""

    def __init__(self, name: str, workers: int = 4):
        self.name = name
        self.workers = workers
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # POSIX
            os.register_at_fork(after_in_child=functools.partial(_forget_in_child, weakref.ref(self)))

    def _forget(self) -> None:
        self._pools = {}
        self._lock = threading.Lock()

    def __call__(self) -> ThreadPoolExecutor:
        nice = priority()
        with self._lock:
            pool = self._pools.get(nice)
            if pool is None:
                suffix = f"-nice{nice}" if nice else ""
                pool = self._pools[nice] = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name + suffix)
            return pool


def _forget_in_child(ref: weakref.ref) -> None:
    pool = ref()
    if pool is not None:
        pool._forget()
