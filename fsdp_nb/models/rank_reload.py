"""Reloading edited modules on this rank (engine side of ``sess.reload``).

``importlib.reload`` re-runs a module's code in its existing module object, so
``import mymodule`` bindings see the new code at once; names bound with
``from mymodule import Net`` still point at the old objects, so they are re-bound in
the namespace given (the engine's ``%%px`` namespace, or the notebook's). Objects
built from the old code (a wrapped model, an optimizer) keep working: they keep
their old classes.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from ..engine.namespace import user_ns
from .wire_reload import Reloaded

__all__ = ["imported", "reload_here", "reload_on_rank"]


def imported(name: str) -> bool:
    """True if module ``name`` is imported in this process."""
    return name in sys.modules


def _family(name: str) -> list[str]:
    """``name`` and its loaded submodules, deepest first, the package last."""
    subs = [m for m in sys.modules if m.startswith(name + ".")]
    return sorted(subs, key=lambda m: -m.count(".")) + [name]


def reload_here(name: str, ns: dict[str, Any]) -> Reloaded:
    """Reload ``name`` (and its loaded submodules) in this process; re-bind in ``ns``
    the names that held classes or functions of the old code."""
    importlib.invalidate_caches()
    names = [m for m in _family(name) if isinstance(sys.modules.get(m), types.ModuleType)]
    old = {m: dict(vars(sys.modules[m])) for m in names}
    for m in names:
        importlib.reload(sys.modules[m])
    rebound = []
    for key, value in list(ns.items()):
        home = getattr(value, "__module__", None)
        if home not in old or not isinstance(value, (type, types.FunctionType)):
            continue
        attr = getattr(value, "__name__", None)
        if attr is None or old[home].get(attr) is not value:
            continue
        new = getattr(sys.modules[home], attr, None)
        if new is not None and new is not value:
            ns[key] = new
            rebound.append(key)
    return Reloaded(tuple(names), tuple(sorted(rebound)))


def reload_on_rank(name: str) -> Reloaded:
    """``reload_here`` in the ``%%px`` namespace of this engine."""
    return reload_here(name, user_ns())
