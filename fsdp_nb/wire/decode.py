"""Plain JSON back into the wire's dataclasses, strictly.

What a rank says over a side channel (a memory sample, where it waits) and what a planner
process prints arrive as JSON. :func:`decode` builds the dataclass the sender filled,
field by field and type by type, so a field renamed on one side, missing, or of the
wrong type fails loudly (:class:`~fsdp_nb.errors.WireError`, naming the type and the
field), never as a silent None further on. :func:`encode` is the other way:
``dataclasses.asdict`` made JSON.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, TypeVar

from ..errors import WireError

__all__ = ["decode", "encode", "loads"]

T = TypeVar("T")


def encode(obj: Any) -> bytes:
    """A wire dataclass as JSON bytes (tuples become lists; :func:`decode` turns them back)."""
    return json.dumps(dataclasses.asdict(obj)).encode()


def loads(cls: type[T], raw: bytes | str) -> T:
    """``decode(cls, json.loads(raw))``; a reply that is not JSON is a :class:`WireError` too."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise WireError(f"{cls.__name__}: not JSON ({exc})") from None
    return decode(cls, data)


def decode(cls: type[T], data: Any, where: str = "") -> T:
    """``data`` (parsed JSON) as a ``cls``, a dataclass of the wire.

    Every field without a default must be there, no other key may be, and each value must
    have its field's type (nested dataclasses, lists, tuples, dicts, ``X | None``, and
    ints where a float is asked are built and checked the same way).

    Args:
        cls: the dataclass to build.
        data: what ``json.loads`` gave.
        where: the path to ``data`` within a larger message, for the error (``""``: the top).

    Raises:
        WireError: naming ``cls``, the field and what was wrong.
    """
    here = where or cls.__name__
    if not isinstance(data, dict):
        raise WireError(f"{here}: expected an object of {cls.__name__}'s fields, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    missing = sorted(n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if unknown or missing:
        parts = ([f"unknown field(s) {', '.join(unknown)}"] if unknown else []) + (
            [f"missing field(s) {', '.join(missing)}"] if missing else [])
        raise WireError(f"{here}: {'; '.join(parts)} (fields of {cls.__name__}: {', '.join(fields)}); "
                        "the notebook and the engines run different versions of fsdp_nb?")
    hints = _hints(cls)
    return cls(**{k: _value(hints[k], v, f"{here}.{k}") for k, v in data.items()})


_HINTS: dict[type, dict[str, Any]] = {}
"""Each wire type's field types, resolved once (a memo: the types never change)."""


def _hints(cls: type) -> dict[str, Any]:
    found = _HINTS.get(cls)
    if found is None:
        found = _HINTS[cls] = typing.get_type_hints(cls)
    return found


def _value(tp: Any, v: Any, where: str) -> Any:  # noqa: C901 - one branch per kind of type
    """``v`` checked (and built) as type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return v
    if origin is typing.Literal:
        if v in args:
            return v
        raise WireError(f"{where}: {v!r} is not one of {', '.join(map(repr, args))}")
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for a in options:
            try:
                return _value(a, v, where)
            except WireError as exc:
                errors.append(str(exc))
        raise WireError(errors[0] if len(errors) == 1 else f"{where}: {v!r} is none of {tp}")
    if dataclasses.is_dataclass(tp):
        return decode(tp, v, where)  # type: ignore[arg-type]
    if origin in (list, tuple):
        if not isinstance(v, (list, tuple)):
            raise WireError(f"{where}: expected a list, got {type(v).__name__}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(v):
                raise WireError(f"{where}: expected {len(args)} items, got {len(v)}")
            return tuple(_value(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
        items = [_value(args[0] if args else Any, x, f"{where}[{i}]") for i, x in enumerate(v)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(v, dict):
            raise WireError(f"{where}: expected an object, got {type(v).__name__}")
        kt, vt = args or (Any, Any)
        return {_value(kt, k, where): _value(vt, x, f"{where}[{k!r}]") for k, x in v.items()}
    if tp is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        raise WireError(f"{where}: expected a number, got {v!r}")
    if tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        raise WireError(f"{where}: expected an int, got {v!r}")
    if tp in (str, bool):
        if isinstance(v, tp):
            return v
        raise WireError(f"{where}: expected a {tp.__name__}, got {v!r}")
    if tp is type(None):
        if v is None:
            return None
        raise WireError(f"{where}: expected null, got {v!r}")
    raise TypeError(f"{where}: a field of type {tp!r} cannot come from JSON; a wire type that crosses as JSON "
                    "holds numbers, strings, bools, None, lists, dicts and such dataclasses")
