"""IPython magics: ``%%px`` / ``%px`` on the active session's ranks, and ``%fsdp``.

Our ``%%px`` runs through the session (``Session.execute``), not ipyparallel's magic,
so a cell gets the same rank order, rank-tagged streaming output, failure handling
and Ctrl-C behaviour as every other session call.

The magics sit below the ``Session`` façade: they never import it. A session hands
them itself when it activates (``activate_px``), and ``%load_ext fsdp_nb`` hands them
the class (``register``), which ``%fsdp start`` and ``%fsdp attach`` then use.
"""

from __future__ import annotations

import shlex
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from ..debugging.breakpoints import parse_ranks
from ..errors import hide_frame
from ..runtime.checks import check_hang_after


class Session(Protocol):
    """What the magics use of a ``fsdp_nb.Session``."""

    @property
    def state(self) -> str: ...

    def __init__(self, n: int | None = None, *, backend: str | None = None) -> None: ...

    @classmethod
    def attach(cls, cluster_id: str | None = None) -> Session: ...

    def _execute(self, code: str, timeout: float | None, *, ranks: Sequence[int] | None = None,
                 output: str | None = "all", hang_after: float | None = None,
                 debug: int | Sequence[int] | None = None, check_collectives: bool | float | None = None,
                 debug_commands: str | Sequence[str] | None = None) -> list[Any]: ...

    def debug(self, rank: int | None = None) -> str | None: ...

    def shutdown(self) -> None: ...


__all__ = [
    "TARGET", "PxArgs", "PxTarget", "activate_px", "active_session", "deactivate_px", "fsdp_command", "parse_px", "register",
]

class PxTarget:
    """What the magics point at, held in one object (no module-level name is rebound): the
    session ``%%px`` runs on and the class ``%fsdp start`` / ``attach`` make."""

    def __init__(self) -> None:
        self.active: weakref.ReferenceType[Session] | None = None
        """The session ``%%px`` targets, weakly: the magics keep no session alive."""
        self.kind: type[Session] | None = None
        """The session class (``fsdp_nb.Session``) that ``register`` was handed."""


TARGET = PxTarget()
"""The process's one ``PxTarget``: an IPython kernel has one ``%%px``."""


def active_session() -> Session | None:
    """The session ``%%px`` targets, if it is still open."""
    sess = TARGET.active() if TARGET.active is not None else None
    return sess if sess is not None and sess.state != "closed" else None


def _ipython():
    try:
        from IPython import get_ipython

        return get_ipython()
    except ImportError:  # pragma: no cover
        return None


def activate_px(sess: Session) -> None:
    """Make ``%%px`` and ``%px`` target ``sess`` (inside IPython; a no-op elsewhere)."""
    TARGET.active = weakref.ref(sess)
    ip = _ipython()
    if ip is not None:
        register(ip, type(sess))


def deactivate_px(sess: Session) -> None:
    """Forget ``sess`` as the ``%%px`` target if it was."""
    if TARGET.active is not None and TARGET.active() is sess:
        TARGET.active = None


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
        """Run the cell on every rank at once (the ranks run in parallel; their output and
        results come back in rank order).

        ``%%px --ranks 0,2`` runs it on some ranks only, ``--output rank0`` shows one
        rank's output, ``--output each`` every rank's own lines (by default a line the
        ranks print alike shows once, ``[ranks 0-7] ...``), ``--output none`` none,
        ``--timeout S`` bounds it, ``--hang-after S`` explains a collective that has
        waited S seconds, ``--debug 1,3`` stops ranks 1 and 3 at ``breakpoint()`` with a
        ``(Pdb rank N)`` prompt (``--debug-commands "p x.shape;; c"`` sends those pdb
        lines at each stop before it asks), ``--check-collectives`` compares each
        collective across its group before it runs.
        """
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        args = parse_px(line)
        _show_results(
            self._session()._execute(cell, args.timeout, ranks=args.ranks, output=args.output,
                                     hang_after=args.hang_after, debug=args.debug,
                                     check_collectives=args.check_collectives, debug_commands=args.debug_commands),
            sorted(args.ranks) if args.ranks is not None else None,
        )

    @line_magic("px")  # type: ignore[arg-type]  # IPython 9.x stubs reject a method here; it runs
    def px_line(self, line: str) -> None:
        """Run one line on every rank."""
        __tracebackhide__ = hide_frame  # left out of a rank error's traceback
        _show_results(self._session()._execute(line, None))

    @line_magic
    def fsdp(self, line: str) -> Any:
        """``%fsdp start [N] [--backend B]`` | ``status`` | ``stop`` | ``list`` |
        ``attach [CLUSTER_ID]`` | ``debug [RANK]`` | ``resize N``."""
        return fsdp_command(line, self.shell)


@dataclass(frozen=True)
class PxArgs:
    """The options of a ``%%px`` line."""

    ranks: list[int] | None = None
    """``--ranks 0,2``: the ranks to run on (None: every rank)."""
    output: str = "all"
    """``--output rank0``: whose output to show (``all``: every rank's, a line printed alike
    once; ``each``: every rank's own lines; ``none``: no rank's)."""
    timeout: float | None = None
    """``--timeout S``: seconds before the cell is stopped on every rank."""
    hang_after: float | None = None
    """``--hang-after S``: seconds a collective waits before the cell shows who waits where
    and who is missing (default: the session's ``hang_after``)."""
    debug: list[int] | None = None
    """``--debug 1,3``: the ranks ``breakpoint()`` stops in this cell (None: none)."""
    check_collectives: bool | None = None
    """``--check-collectives``: compare each collective across its group before it runs
    (``--no-check-collectives``: not in this cell, whatever ``sess.check_collectives``)."""
    debug_commands: str | None = None
    """``--debug-commands "p x;; c"``: pdb lines sent at each stop before the prompt."""


_PX_USAGE = ("%%px [--ranks 0,2] [--output all|each|rankN|none] [--timeout SECONDS] [--hang-after SECONDS] "
             "[--debug 1,3] [--debug-commands 'p x;; c'] [--check-collectives | --no-check-collectives]")


def parse_px(line: str) -> PxArgs:
    """Read ``%%px``'s options; a ValueError naming the usage for anything else."""
    args = shlex.split(line)
    opts: dict[str, Any] = {}
    if "--check-collectives" in args and "--no-check-collectives" in args:
        raise ValueError(f"--check-collectives and --no-check-collectives together; usage: {_PX_USAGE}")
    for flag, on in (("--check-collectives", True), ("--no-check-collectives", False)):
        if flag in args:
            args.remove(flag)
            opts["check_collectives"] = on
    if len(args) % 2:
        raise ValueError(f"usage: {_PX_USAGE}; got {line!r}")
    for flag, value in zip(args[::2], args[1::2]):
        try:
            if flag == "--ranks":
                opts["ranks"] = [int(r) for r in value.split(",")]
            elif flag == "--output":
                opts["output"] = value
            elif flag == "--timeout":
                opts["timeout"] = float(value)
            elif flag == "--hang-after":
                opts["hang_after"] = check_hang_after(float(value))
            elif flag == "--debug":
                opts["debug"] = parse_ranks(value, 1 << 16)  # 0-3 or 1,3; checked against the session later
            elif flag == "--debug-commands":
                opts["debug_commands"] = value
            else:
                raise ValueError(flag)
        except ValueError:
            raise ValueError(f"usage: {_PX_USAGE}; cannot read {flag} {value!r}") from None
    return PxArgs(**opts)


def fsdp_command(line: str, shell: Any = None) -> Any:
    """The ``%fsdp`` line magic: start, status or stop the session bound as ``sess``;
    list kept-alive sessions, attach to one, debug the rank that failed."""
    args = shlex.split(line)
    verb = args[0] if args else "status"
    command = _COMMANDS.get(verb)
    if command is None:
        raise ValueError(f"unknown %fsdp command {verb!r}; allowed: {', '.join(_COMMANDS)}")
    return command(line, args[1:], shell.user_ns if shell is not None else {})


def _start(line: str, rest: list[str], ns: dict[str, Any]) -> Any:
    n = int(rest.pop(0)) if rest and rest[0].isdigit() else None
    backend = None
    if len(rest) == 2 and rest[0] == "--backend":
        backend = rest[1]
    elif rest:
        raise ValueError(f"usage: %fsdp start [N] [--backend gloo|nccl]; got {line!r}")
    sess = active_session()
    if sess is not None:
        print("a session is already running; `%fsdp stop` it first")
        return sess
    ns["sess"] = sess = _session_class()(n, backend=backend)
    return sess


def _status(line: str, rest: list[str], ns: dict[str, Any]) -> Any:
    sess = active_session()
    if sess is None:
        print("no fsdp_nb session")
    return sess


def _list(line: str, rest: list[str], ns: dict[str, Any]) -> None:
    from ..lifetime.keepalive import sessions

    print("\n".join(map(str, sessions())) or "no running fsdp_nb sessions")


def _attach(line: str, rest: list[str], ns: dict[str, Any]) -> Any:
    if len(rest) > 1:
        raise ValueError(f"usage: %fsdp attach [CLUSTER_ID]; got {line!r}")
    ns["sess"] = sess = _session_class().attach(rest[0] if rest else None)
    return sess


def _debug(line: str, rest: list[str], ns: dict[str, Any]) -> None:
    if len(rest) > 1 or (rest and not rest[0].isdigit()):
        raise ValueError(f"usage: %fsdp debug [RANK]; got {line!r}")
    sess = _status(line, rest, ns)
    if sess is not None:
        sess.debug(int(rest[0]) if rest else None)


def _resize(line: str, rest: list[str], ns: dict[str, Any]) -> Any:
    if len(rest) != 1 or not rest[0].isdigit():
        raise ValueError(f"usage: %fsdp resize N (the new number of ranks); got {line!r}")
    sess = _status(line, rest, ns)
    return sess.resize(int(rest[0])) if sess is not None else None


def _stop(line: str, rest: list[str], ns: dict[str, Any]) -> None:
    sess = _status(line, rest, ns)
    if sess is not None:
        sess.shutdown()
        print("session stopped")


_COMMANDS: dict[str, Callable[[str, list[str], dict[str, Any]], Any]] = {
    "start": _start, "status": _status, "stop": _stop, "list": _list, "attach": _attach, "debug": _debug,
    "resize": _resize,
}


def _session_class() -> type[Session]:
    if TARGET.kind is None:  # pragma: no cover - the magics are registered by one of the two
        raise RuntimeError("load the magics with `%load_ext fsdp_nb`")
    return TARGET.kind


def register(ip: Any, session_class: type[Session]) -> None:
    """Add ``%fsdp``, ``%px`` and ``%%px`` to IPython ``ip``; ``%fsdp start`` and
    ``attach`` make sessions of ``session_class`` (``%load_ext fsdp_nb`` passes
    ``fsdp_nb.Session``; a session passes its own class when it activates)."""
    TARGET.kind = session_class
    if "PxMagics" not in {type(m).__name__ for m in ip.magics_manager.registry.values()}:
        ip.register_magics(PxMagics)
