"""SIGINT on an engine: a KeyboardInterrupt in the code a request runs, never in the
kernel's bookkeeping around it.

While the kernel handles a request, ipykernel installs Python's default SIGINT handler
(``pre_handler_hook``) and puts ipyparallel's back (which ignores SIGINT) afterwards.
A SIGINT that lands between those steps and the handler's own ``try`` raises
KeyboardInterrupt in the kernel's dispatch code, out of the event loop, and the engine
exits. The recovery sends SIGINT just as a call is sent (Ctrl-C while sending) and
again to a rank that has not answered after two seconds, so that window was hit under
load. :func:`guarded` raises only when the interrupted frame is not one of those
bookkeeping frames; there the signal is dropped, and the notebook's next SIGINT
reaches the call.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

__all__ = ["guarded", "install", "own"]

log = logging.getLogger("fsdp_nb")

_OWN: set[Any] = set()
"""Code objects of bookkeeping frames a SIGINT must not interrupt."""


def own(*fns: Callable[..., Any]) -> None:
    """Mark ``fns``' frames as bookkeeping: a SIGINT landing in them is dropped."""
    _OWN.update(fn.__code__ for fn in fns)


def guarded(signum: int, frame: Any) -> None:
    """The SIGINT handler while a request runs: KeyboardInterrupt, except in bookkeeping."""
    if frame is not None and frame.f_code in _OWN:
        log.warning("SIGINT between a request's bookkeeping steps: dropped (the next one reaches the call)")
        return
    raise KeyboardInterrupt


def install() -> bool:
    """Make this engine's kernel install :func:`guarded` instead of Python's default
    handler while it handles a request; False outside a kernel."""
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
    except ImportError:  # pragma: no cover - engines always have IPython
        kernel = None
    if kernel is None:
        return False
    cls = type(kernel)

    def pre_handler_hook() -> None:
        kernel.saved_sigint_handler = signal.signal(signal.SIGINT, guarded)

    own(cls.dispatch_shell, cls.post_handler_hook, pre_handler_hook)
    kernel.pre_handler_hook = pre_handler_hook
    return True
