"""IPython magics: ``%%px`` / ``%px`` on the active session's ranks, and ``%fsdp``.

Our ``%%px`` runs through the session (``Session.execute``), not ipyparallel's magic,
so a cell gets the same rank order, rank-tagged streaming output, failure handling
and Ctrl-C behaviour as every other session call.
"""

from __future__ import annotations

import shlex
import weakref
from typing import TYPE_CHECKING, Any

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

if TYPE_CHECKING:
    from .session import Session

__all__ = ["activate_px", "active_session", "deactivate_px", "load_ipython_extension"]

_active: weakref.ReferenceType[Session] | None = None


def active_session() -> Session | None:
    """The session ``%%px`` targets, if it is still open."""
    sess = _active() if _active is not None else None
    return sess if sess is not None and sess.state != "closed" else None


def _ipython():
    try:
        from IPython import get_ipython

        return get_ipython()
    except ImportError:  # pragma: no cover
        return None


def activate_px(sess: Session) -> None:
    """Make ``%%px`` and ``%px`` target ``sess`` (inside IPython; a no-op elsewhere)."""
    global _active
    _active = weakref.ref(sess)
    ip = _ipython()
    if ip is not None and "PxMagics" not in {type(m).__name__ for m in ip.magics_manager.registry.values()}:
        ip.register_magics(PxMagics)


def deactivate_px(sess: Session) -> None:
    """Forget ``sess`` as the ``%%px`` target if it was."""
    global _active
    if _active is not None and _active() is sess:
        _active = None


def _show_results(replies: list[Any]) -> None:
    """Display each rank's ``Out`` value of a cell, tagged by rank."""
    from IPython.display import display

    for rank, reply in enumerate(replies):
        data = getattr(reply, "execute_result", None) or {}
        data = data.get("data") if isinstance(data, dict) else None
        if data:
            text = data.get("text/plain", "")
            print(f"Out[rank {rank}]: {text}")
            rich = {k: v for k, v in data.items() if k != "text/plain"}
            if rich:
                display(rich, raw=True)


@magics_class
class PxMagics(Magics):
    """``%%px`` (a cell) and ``%px`` (a line) on every rank of the active session."""

    def _session(self) -> Session:
        sess = active_session()
        if sess is None:
            raise RuntimeError(
                "no open fsdp_nb session: create one with `sess = fsdp_nb.Session()` "
                "or `%fsdp start`"
            )
        return sess

    @cell_magic
    def px(self, line: str, cell: str) -> None:
        """Run the cell on every rank in rank order. ``%%px --timeout S`` bounds it."""
        timeout = _timeout(line)
        _show_results(self._session()._execute(cell, timeout))

    @line_magic("px")
    def px_line(self, line: str) -> None:
        """Run one line on every rank."""
        _show_results(self._session()._execute(line, None))

    @line_magic
    def fsdp(self, line: str) -> Any:
        """``%fsdp start [N] [--backend B]`` | ``%fsdp status`` | ``%fsdp stop``."""
        return fsdp_command(line, self.shell)


def _timeout(line: str) -> float | None:
    args = shlex.split(line)
    if not args:
        return None
    if len(args) == 2 and args[0] == "--timeout":
        return float(args[1])
    raise ValueError(f"%%px takes only `--timeout SECONDS`, got {line!r}")


def fsdp_command(line: str, shell: Any = None) -> Any:
    """The ``%fsdp`` line magic: start, status or stop the session bound as ``sess``."""
    from .session import Session

    args = shlex.split(line)
    verb = args[0] if args else "status"
    ns = shell.user_ns if shell is not None else {}
    if verb == "start":
        n = None
        backend = None
        rest = args[1:]
        if rest and rest[0].isdigit():
            n = int(rest.pop(0))
        if len(rest) == 2 and rest[0] == "--backend":
            backend = rest[1]
        elif rest:
            raise ValueError(f"usage: %fsdp start [N] [--backend gloo|nccl]; got {line!r}")
        sess = active_session()
        if sess is not None:
            print("a session is already running; `%fsdp stop` it first")
            return sess
        sess = Session(n, backend=backend)
        ns["sess"] = sess
        return sess
    if verb == "status":
        sess = active_session()
        if sess is None:
            print("no fsdp_nb session")
            return None
        return sess
    if verb == "stop":
        sess = active_session()
        if sess is None:
            print("no fsdp_nb session")
            return None
        sess.shutdown()
        print("session stopped")
        return None
    raise ValueError(f"unknown %fsdp command {verb!r}; allowed: start, status, stop")


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext fsdp_nb``: adds ``%fsdp``, ``%px`` and ``%%px``."""
    ip.register_magics(PxMagics)
