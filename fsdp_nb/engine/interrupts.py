"""SIGINT on an engine: a KeyboardInterrupt in the code a request runs, never in the
kernel's bookkeeping around it.

While the kernel handles a request, ipykernel installs Python's default SIGINT handler
(``pre_handler_hook``) and puts ipyparallel's back (which ignores SIGINT) afterwards.
A SIGINT that lands outside the ``try`` that turns the request's failure into its reply
(in the dispatch code; or after the call, while the kernel flushes the output, which
waits on its I/O thread, and sends the reply) raises KeyboardInterrupt in the kernel's
own code: the reply is never sent, so the rank looks as if it never returned and
recovery replaces it, its state lost (seen in CI: Ctrl-C while a call was sent). The
recovery sends SIGINT just as a call is sent and again to a rank that has not answered
after two seconds, so those windows are hit under load.

:func:`guarded` looks at the interrupted stack from the innermost frame out; the first
frame it knows decides. A call frame (:func:`calls`: ipyparallel's ``do_apply``,
IPython's ``run_code``, the call server's ``_invoke``) means the request's code, or the
``try`` around it, was running: KeyboardInterrupt, which becomes the call's error. A
bookkeeping frame (:func:`own`: the kernel's ``dispatch_shell`` and handler hooks, the
call server's) means the kernel's own code: the signal is dropped, and the recovery's
next SIGINT reaches the call. A stack with neither raises, as Python's default handler
would.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

from .registry import Part, part

__all__ = ["calls", "guarded", "install", "own"]

log = logging.getLogger("fsdp_nb")

class Marks(Part):
    """The frames this engine's SIGINT handler knows (the registry's part for it; marked
    as the modules that own them are imported, kept for the engine's life)."""

    def __init__(self) -> None:
        self.own: set[Any] = set()
        """Code objects of bookkeeping frames: a SIGINT under them (and under no call) is dropped."""
        self.calls: set[Any] = set()
        """Code objects of the frames that run a request's code inside the ``try`` that turns a
        KeyboardInterrupt into the request's error reply."""


def own(*fns: Callable[..., Any]) -> None:
    """Mark ``fns``' frames as bookkeeping: a SIGINT landing under them is dropped,
    unless a call frame is nearer the interrupted one."""
    part(Marks).own.update(fn.__code__ for fn in fns)


def calls(*fns: Callable[..., Any]) -> None:
    """Mark ``fns``' frames as running a request's code: a SIGINT landing under them
    raises KeyboardInterrupt, which they answer as the request's error."""
    part(Marks).calls.update(fn.__code__ for fn in fns)


def guarded(signum: int, frame: Any) -> None:
    """The SIGINT handler while a request runs: KeyboardInterrupt, except in bookkeeping.

    Args:
        signum: the signal (SIGINT).
        frame: the frame the signal interrupted; its callers decide (module docstring).
    """
    marks = part(Marks)
    while frame is not None:
        code = frame.f_code
        if code in marks.calls:
            break
        if code in marks.own:
            log.warning("SIGINT in the kernel's own handling of a request (%s): dropped "
                        "(the next one reaches the call)", code.co_name)
            return
        frame = frame.f_back
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
    calls(*(fn for fn in (getattr(cls, "do_apply", None), getattr(type(kernel.shell), "run_code", None)) if fn))
    kernel.pre_handler_hook = pre_handler_hook
    return True
