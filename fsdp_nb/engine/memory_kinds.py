"""What this rank holds by kind (parameters, gradients, optimizer state), read on the
main thread only and kept for the memory sampler's thread.

The sampler used to read the tensors from its own thread while the main thread trained,
and that crashed engines: about one quickstart in twenty on 2 busy cores lost a rank to
a SIGSEGV in ``untyped_storage()`` (``THPVariable_storage``) on the sampler's thread; a
thread reading them every 2 ms through an FSDP2 training loop crashed a rank at once.
A tensor that the training step changes is not safe to read from another thread. So the
sampler never touches one. :func:`note` reads them on the main thread: after each
optimizer step (a hook on every optimizer, at most once per ``EVERY`` seconds), at the
end of each cell, after a wrap and when a feed starts; :func:`kept` hands the sampler the
last reading.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..torch_compat import local_tensor
from .namespace import user_ns
from .wrap import MODELS, ON_WRAPPED

__all__ = ["EVERY", "by_kind", "install", "kept", "note"]

log = logging.getLogger("fsdp_nb")

EVERY = 1.0
"""Seconds between two readings after optimizer steps (one reading walks every
parameter, gradient and state tensor: a fraction of a millisecond for a small model)."""

_KEPT: dict[str, Any] = {"value": None, "at": float("-inf"), "installed": False}


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct storages under ``tensors`` (DTensors: their local shards)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        t = local_tensor(t)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, AttributeError):
            continue
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def by_kind() -> tuple[int, int, int] | None:
    """(parameters and buffers, gradients, optimizer state) bytes this rank holds for the
    wrapped models and the engine globals' optimizers; None when no model is wrapped.
    Main thread only (see the module's docstring)."""
    if not MODELS:
        return None
    import torch

    models = list(MODELS.values())
    params = [t for w in models for t in (*w.module.parameters(), *w.module.buffers())]
    grads = [p.grad for w in models for p in w.module.parameters() if p.grad is not None]
    state = [v for o in list(user_ns().values()) if isinstance(o, torch.optim.Optimizer)
             for s in list(o.state.values()) for v in list(s.values()) if isinstance(v, torch.Tensor)]
    return _bytes(params), _bytes(grads), _bytes(state)


def note(force: bool = False) -> None:
    """Read ``by_kind`` now and keep it, if this is the main thread and (unless
    ``force``) ``EVERY`` seconds have passed since the last reading."""
    if threading.current_thread() is not threading.main_thread():
        return
    now = time.monotonic()
    if not force and now - _KEPT["at"] < EVERY:
        return
    try:
        _KEPT["value"] = by_kind()
    except RuntimeError as exc:  # a model mid-change (a failed wrap): the last reading stays
        log.debug("fsdp_nb: reading what this rank holds failed: %s", exc)
    _KEPT["at"] = now


def kept() -> tuple[int, int, int] | None:
    """The last reading (:func:`note`): safe from any thread, as it touches no tensor."""
    return _KEPT["value"]


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    note()


def _after_cell(*_: Any) -> None:
    note(force=True)


def install() -> None:
    """Keep the reading current from now on (idempotent; call on the main thread): a
    post-step hook on every optimizer (``register_optimizer_step_post_hook``),
    IPython's ``post_execute`` event and ``wrap.ON_WRAPPED``; then read once."""
    if not _KEPT["installed"]:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_after_step)
        try:
            from IPython import get_ipython

            ip = get_ipython()
        except ImportError:  # pragma: no cover - engines always have IPython
            ip = None
        if ip is not None:
            ip.events.register("post_execute", _after_cell)
        ON_WRAPPED.append(_after_cell)
        _KEPT["installed"] = True
    note(force=True)
