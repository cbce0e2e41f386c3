"""IPython magics: ``%%px`` / ``%px`` on the active session's ranks, and ``%fsdp``.

Our ``%%px`` runs through the session (``Session.execute``), not ipyparallel's magic,
so a cell gets the same rank order, rank-tagged streaming output, failure handling
and Ctrl-C behaviour as every other session call.
"""

from __future__ import annotations

import shlex
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

if TYPE_CHECKING:
    from .session import Session

__all__ = [
    "PxArgs", "activate_px", "active_session", "deactivate_px", "load_ipython_extension", "parse_px",
]

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


def _show_results(replies: list[Any], ranks: list[int] | None = None) -> None:
    """Display each rank's ``Out`` value of a cell, tagged by rank (``ranks``: the ranks
    that ran it, in order; None: every rank)."""
    from IPython.display import display

    for rank, reply in zip(ranks if ranks is not None else range(len(replies)), replies):
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
        """Run the cell on every rank in rank order.

        ``%%px --ranks 0,2`` runs it on some ranks only, ``--output rank0`` shows one
        rank's output, ``--timeout S`` bounds it.
        """
        args = parse_px(line)
        _show_results(
            self._session()._execute(cell, args.timeout, ranks=args.ranks, output=args.output),
            sorted(args.ranks) if args.ranks is not None else None,
        )

    @line_magic("px")
    def px_line(self, line: str) -> None:
        """Run one line on every rank."""
        _show_results(self._session()._execute(line, None))

    @line_magic
    def fsdp(self, line: str) -> Any:
        """``%fsdp start [N] [--backend B]`` | ``status`` | ``stop`` | ``list`` |
        ``attach [CLUSTER_ID]`` | ``debug [RANK]``."""
        return fsdp_command(line, self.shell)


@dataclass(frozen=True)
class PxArgs:
    """The options of a ``%%px`` line."""

    ranks: list[int] | None = None
    """``--ranks 0,2``: the ranks to run on (None: every rank)."""
    output: str = "all"
    """``--output rank0``: whose output to show (``all``: every rank's)."""
    timeout: float | None = None
    """``--timeout S``: seconds before the cell is stopped on every rank."""


_PX_USAGE = "%%px [--ranks 0,2] [--output all|rankN] [--timeout SECONDS]"


def parse_px(line: str) -> PxArgs:
    """Read ``%%px``'s options; a ValueError naming the usage for anything else."""
    args = shlex.split(line)
    if len(args) % 2:
        raise ValueError(f"usage: {_PX_USAGE}; got {line!r}")
    opts: dict[str, Any] = {}
    for flag, value in zip(args[::2], args[1::2]):
        try:
            if flag == "--ranks":
                opts["ranks"] = [int(r) for r in value.split(",")]
            elif flag == "--output":
                opts["output"] = value
            elif flag == "--timeout":
                opts["timeout"] = float(value)
            else:
                raise ValueError(flag)
        except ValueError:
            raise ValueError(f"usage: {_PX_USAGE}; cannot read {flag} {value!r}") from None
    return PxArgs(**opts)


def fsdp_command(line: str, shell: Any = None) -> Any:
    """The ``%fsdp`` line magic: start, status or stop the session bound as ``sess``;
    list kept-alive sessions, attach to one, debug the rank that failed."""
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
    if verb == "list":
        from .keepalive import sessions

        found = sessions()
        print("\n".join(map(str, found)) or "no running fsdp_nb sessions")
        return None
    if verb == "attach":
        if len(args) > 2:
            raise ValueError(f"usage: %fsdp attach [CLUSTER_ID]; got {line!r}")
        sess = Session.attach(args[1] if len(args) == 2 else None)
        ns["sess"] = sess
        return sess
    if verb == "debug":
        if len(args) > 2 or (len(args) == 2 and not args[1].isdigit()):
            raise ValueError(f"usage: %fsdp debug [RANK]; got {line!r}")
        sess = active_session()
        if sess is None:
            print("no fsdp_nb session")
            return None
        sess.debug(int(args[1]) if len(args) == 2 else None)
        return None
    if verb == "stop":
        sess = active_session()
        if sess is None:
            print("no fsdp_nb session")
            return None
        sess.shutdown()
        print("session stopped")
        return None
    raise ValueError(
        f"unknown %fsdp command {verb!r}; allowed: start, status, stop, list, attach, debug"
    )


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext fsdp_nb``: adds ``%fsdp``, ``%px`` and ``%%px``."""
    ip.register_magics(PxMagics)
