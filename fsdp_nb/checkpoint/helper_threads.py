"""The checkpoint code's helper thread pools, each started on first use."""

from __future__ import annotations

import functools
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

__all__ = ["LazyPool"]


class LazyPool:
    """A ``ThreadPoolExecutor`` of ``workers`` threads named ``name``, made by the first
    call (a process that never saves starts no threads). A forked child starts its own:
    it inherits the pool but not its threads, and a job sent there would never run."""

    def __init__(self, name: str, workers: int = 4):
        self.name = name
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # POSIX
            os.register_at_fork(after_in_child=functools.partial(_forget_in_child, weakref.ref(self)))

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()

    def __call__(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            return self._pool


def _forget_in_child(ref: weakref.ref) -> None:
    pool = ref()
    if pool is not None:
        pool._forget()
