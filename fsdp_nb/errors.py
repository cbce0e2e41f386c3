"""Errors raised in the notebook: one class per thing a user can do about it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DeadRankError",
    "RankError",
    "RankFailure",
    "RankTimeoutError",
    "SessionClosedError",
]


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank."""

    rank: int
    """The rank (never the ipyparallel engine id)."""
    ename: str
    """Exception class name raised on the engine, e.g. ``"ValueError"``."""
    evalue: str
    """The exception message."""
    traceback: str
    """The engine-side traceback as text (ANSI colours stripped)."""

    def __str__(self) -> str:
        return f"[rank {self.rank}] {self.ename}: {self.evalue}"


class RankError(RuntimeError):
    """One or more ranks raised; ``failures`` lists them, the first failing rank first."""

    def __init__(self, what: str, failures: list[RankFailure], world_size: int | None = None):
        self.what = what
        self.failures = list(failures)
        self.world_size = world_size
        ranks = ", ".join(str(f.rank) for f in self.failures)
        of = f" of {world_size}" if world_size else ""
        lines = [f"{what} failed on rank(s) {ranks}{of}."]
        for f in self.failures:
            lines.append(f"\n--- rank {f.rank}: {f.ename}: {f.evalue}")
            if f.traceback:
                lines.append(f.traceback.rstrip())
        super().__init__("\n".join(lines))

    @property
    def ranks(self) -> list[int]:
        """The failing ranks, first failure first."""
        return [f.rank for f in self.failures]

    @property
    def first(self) -> RankFailure:
        """The first rank that failed: usually the cause, the rest its echo."""
        return self.failures[0]


class DeadRankError(RuntimeError):
    """An engine process died (killed, OOM); ``sess.restart()`` brings the rank back."""

    def __init__(self, ranks: list[int], detail: str = ""):
        self.dead_ranks = sorted(ranks)
        msg = (
            f"rank(s) {', '.join(map(str, self.dead_ranks))} died (engine process gone). "
            "Call sess.restart() to bring the same ranks back and rebuild the session."
        )
        if detail:
            msg += f"\n{detail}"
        super().__init__(msg)


class RankTimeoutError(TimeoutError):
    """A call did not finish on every rank within its ``timeout``."""

    def __init__(self, what: str, timeout: float, pending: list[int]):
        self.pending = sorted(pending)
        super().__init__(
            f"{what} did not finish within {timeout:g} s on rank(s) "
            f"{', '.join(map(str, self.pending))}; sess.status() shows where they are."
        )


class SessionClosedError(RuntimeError):
    """The session was shut down; start a new one with ``fsdp_nb.Session()``."""
