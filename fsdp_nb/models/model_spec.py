"""What ``sess.wrap`` and ``sess.plan`` take as a model: its kind, its arguments checked
against the class or factory, and an instance's shapes without its weights.
"""

from __future__ import annotations

import copy
from typing import Any

from .wire_wrap_options import OPTION_NAMES

__all__ = ["check_call", "meta_clone", "model_kind"]


def model_kind(model: Any) -> str:
    import torch

    if isinstance(model, str):
        return "string"
    if isinstance(model, torch.nn.Module):
        return "instance"
    if isinstance(model, type):
        if issubclass(model, torch.nn.Module):
            return "class"
        raise TypeError(
            f"model class {model.__qualname__} is not a torch.nn.Module subclass; "
            "pass an nn.Module instance, subclass, factory callable, or an engine global name"
        )
    if callable(model):
        return "factory"
    raise TypeError(
        f"cannot wrap a {type(model).__name__}: model must be an nn.Module instance, an "
        "nn.Module subclass or factory callable (built on every rank), or the name (str) of "
        "a module %%px code built on the engines"
    )


def check_call(spec: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """Keyword arguments that are not wrap options go to the constructor: check they fit."""
    import inspect

    try:
        sig = inspect.signature(spec)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        what = getattr(spec, "__qualname__", repr(spec))
        unknown = [
            k for k in kwargs
            if k not in sig.parameters
            and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        ]
        if unknown:
            raise TypeError(
                f"unknown wrap option(s) {', '.join(map(repr, sorted(unknown)))}: neither a wrap "
                f"option (allowed: {', '.join(OPTION_NAMES)}) nor a parameter of {what}{sig}"
            ) from None
        raise TypeError(f"cannot build {what}{sig} from these arguments: {exc}") from None


def meta_clone(model: Any) -> Any:
    """A copy of ``model`` whose parameters are on the meta device (no weight copies).

    Buffers are copied (they are small and may be non-persistent, which a state-dict
    broadcast would not restore).
    """
    import torch

    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = torch.nn.Parameter(
                torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
            )
    return copy.deepcopy(model, memo)
