"""The engine's user namespace, and calling notebook functions inside it."""

from __future__ import annotations

import os
import types
from typing import Any

import cloudpickle

from ..wire.calls import ByValue
from .registry import Part, part


def user_ns() -> dict[str, Any]:
    """The namespace ``%%px`` cells run in (the engine kernel's ``user_ns``)."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except ImportError:  # pragma: no cover - engines always have IPython
        ip = None
    if ip is not None:
        return ip.user_ns
    import __main__

    return __main__.__dict__


class Placement(Part):
    """Where this engine computes as a rank, as ``process_group.init`` set it (the
    registry's part for it). The cells see the device as the engine global ``device``,
    which they may rebind; fsdp_nb reads it here."""

    def __init__(self) -> None:
        self.device = "cpu"
        """``"cpu"``, or the rank's ``"cuda:N"``."""


def rank_device() -> str:
    """This rank's device (``"cpu"``, ``"cuda:0"``), as the group's formation set it;
    ``"cpu"`` before one is formed."""
    return part(Placement).device


def ranks_on_host() -> int:
    """How many ranks share this rank's host (``LOCAL_WORLD_SIZE``, set by the rendezvous; 1
    before one)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def unship(obj: Any) -> Any:
    """Undo :func:`fsdp_nb.runtime.shipping.by_value`; other objects pass through."""
    if isinstance(obj, ByValue):
        rebind = obj.rebind
        obj = cloudpickle.loads(obj.payload)
        if rebind and isinstance(obj, types.FunctionType):
            obj = _rebind(obj)
    return obj


def _rebind(fn: types.FunctionType) -> types.FunctionType:
    """Let a notebook function also see engine globals (``model``, ``optimizer``...).

    cloudpickle gives the function only the notebook globals it used; names the
    notebook did not have are looked up in the engine namespace, as in ``%%px``.
    """
    g = dict(user_ns())
    g.update(fn.__globals__)
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    return new


def call(fn: Any, args: Any, kwargs: Any) -> Any:
    """Run a shipped function with shipped arguments on this rank."""
    fn = unship(fn)
    args = unship(args)
    kwargs = unship(kwargs)
    return fn(*args, **kwargs)


def call_setup(fn: Any) -> list[str]:
    """Run a shipped function of no arguments that binds engine globals
    (``restart(setup=)``: ``global opt; opt = AdamW(model.parameters())``): a notebook
    function runs on a copy of the namespace (:func:`_rebind`), so every global it bound
    or rebound (by ``global`` in it or in a function it calls from its module, or through
    ``globals()[name] = ...``) is copied back. Returns their names."""
    fn = unship(fn)
    g = fn.__globals__
    before = dict(g)  # holds the old objects, so an id is never reused in between
    fn()
    missing = object()
    stored = sorted(k for k, v in g.items() if before.get(k, missing) is not v)
    ns = user_ns()
    if g is not ns:
        for name in stored:
            ns[name] = g[name]
    return stored


def assign(mapping: Any) -> None:
    """Bind names in the engine namespace (``sess.push``)."""
    user_ns().update(unship(mapping))


def get(name: str) -> Any:
    """Return an engine global (``sess.pull``), with a clear error when it is missing."""
    ns = user_ns()
    if name not in ns:
        raise NameError(f"name {name!r} is not defined on this rank")
    return ns[name]
