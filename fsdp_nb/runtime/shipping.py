"""Ship notebook objects to the engines by value.

ipyparallel's default canning re-creates ``__main__`` classes with ``type()`` on the
engine, which breaks zero-argument ``super()``: the class it builds is not the one the
methods' ``__class__`` cell names. cloudpickle pickles
notebook-defined functions, classes and instances by value, with the notebook
globals they use, so we wrap everything we send in :class:`ByValue` and let the
engine unpickle it (``fsdp_nb.engine.namespace.unship``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import site
import sys
import sysconfig
import types
from typing import Any

import cloudpickle

from ..wire.calls import ByValue

__all__ = ["ByValue", "by_value", "register_local_modules"]


def by_value(obj: Any) -> ByValue:
    """Pickle ``obj`` by value, naming it in a clear error when it cannot be shipped."""
    register_local_modules(obj)
    try:
        payload = cloudpickle.dumps(obj)
    except Exception as exc:  # any pickling failure becomes one TypeError naming the object
        raise TypeError(
            f"cannot ship {_describe(obj)} to the engines: {type(exc).__name__}: {exc}. "
            "Objects sent to the ranks must be picklable with cloudpickle (open files, "
            "sockets, locks and live CUDA handles are not); build them on the engines "
            "with %%px or sess.execute instead."
        ) from exc
    module = getattr(obj, "__module__", None)
    rebind = isinstance(obj, types.FunctionType) and (module == "__main__" or module in _LOCAL)
    return ByValue(payload, _describe(obj), rebind)


def register_local_modules(obj: Any, depth: int = 4) -> None:
    """Ship the user's own modules (a script beside the notebook) by value too.

    cloudpickle pickles ``__main__`` by value but other modules by reference, and an
    engine may not be able to import a module that lives only in the notebook's
    folder. Modules outside site-packages and the standard library are registered
    for by-value pickling: those of ``obj``, its type, and (a few levels down) what
    it contains: container items, dataclass fields, an nn.Module's submodule classes.
    """
    for target in (obj, type(obj)):
        _register_module_of(target)
    if depth <= 0:
        return
    children: Any = ()
    if isinstance(obj, (tuple, list, set, frozenset)):
        children = obj
    elif isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "modules") and hasattr(obj, "named_parameters") and not isinstance(obj, type):
        children = {type(m) for m in obj.modules()}
    for child in children:
        register_local_modules(child, depth - 1)


def _register_module_of(target: Any) -> None:
    mod = sys.modules.get(getattr(target, "__module__", None) or "")
    if mod is None or mod.__name__ in _LOCAL or mod.__name__ == "__main__":
        return
    path = getattr(mod, "__file__", None) or ""
    if not path or mod.__name__.split(".")[0] in ("fsdp_nb", "torch", "builtins"):
        return
    real = os.path.realpath(path)
    if real.startswith(_library_paths()):
        return
    cloudpickle.register_pickle_by_value(mod)
    _LOCAL.add(mod.__name__)


_LOCAL: set[str] = set()


@functools.cache
def _library_paths() -> tuple[str, ...]:
    """Where installed and standard-library modules live (computed once)."""
    paths = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    return tuple(os.path.realpath(p) for p in paths if p)


def _describe(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{type(obj).__name__} {name!r}" if name != type(obj).__qualname__ else repr(name)
