"""Engine side of the session's definitions (``fsdp_nb.runtime.definitions``): replay them
on a rank that joined later, in the engine namespace ``%%px`` cells run in."""

from __future__ import annotations

from typing import Any

from .namespace import unship, user_ns

__all__ = ["replay"]


def replay(items: list[tuple[str, Any]]) -> list[str]:
    """Run each ``("source", code)`` and bind each ``("value", (name, shipped))`` in order;
    one line per definition that failed (the others still run): ``what: error``."""
    ns = user_ns()
    failed = []
    for kind, item in items:
        try:
            if kind == "source":
                exec(compile(item, "<fsdp_nb definitions>", "exec"), ns)  # noqa: S102 - the user's own cell, as %%px ran it
            else:
                name, shipped = item
                ns[name] = unship(shipped)
        except Exception as exc:  # noqa: BLE001 - reported to the notebook, line by line
            what = item.splitlines()[0] if kind == "source" else item[0]
            failed.append(f"{what}: {type(exc).__name__}: {exc}")
    return failed
