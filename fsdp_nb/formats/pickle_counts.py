"""Refusing a pickle that asks for memory by a count, before torch's weights-only
unpickler takes it.

torch's weights-only unpickler (what every pickle in a checkpoint goes through unless the
user trusts it: ``pickles``) runs no code, but its allowed globals include callables that
allocate what a number says: ``bytearray(1610612736)`` fills 1.5 GiB from a pickle of 30
bytes, and ``torch.ByteTensor(n)``, ``torch.UntypedStorage(n)`` or ``torch.Tensor(n)``
hand back that many uninitialised bytes that the next read touches. torch's own files
never call them so: a tensor's bytes are a record of the archive, reached through a
persistent id, and ``torch.load`` checks that record's size against the pickle's count.

So the pickle is first read by ``count_problem``: an unpickler whose every global is a
stand-in that remembers its name and records the calls made of it, and builds nothing
else (a container is as large as the pickle that lists its items). A call of a counted
callable with a number (or a ``torch.Size``) among its arguments is the problem, named.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

__all__ = ["count_problem", "is_counted"]

_LEGACY_PICKLES = 5
"""torch's legacy (not zip) format: magic number, protocol, system info, the object, the
storage keys; raw storage bytes follow, which are no pickle."""


def is_counted(module: str, name: str) -> bool:
    """Whether global ``module.name``, called with a number, allocates that many bytes or
    elements: ``bytes``, ``bytearray``, and torch's storage and tensor classes."""
    if module == "builtins":
        return name in ("bytes", "bytearray")
    return module.split(".")[0] == "torch" and (name.endswith("Storage") or name.endswith("Tensor"))


class _Counted(Exception):
    """A counted callable was called with a count (the message names it)."""


class _Stand:
    """What a global of the scanned pickle stands for: anything it is called, built or
    filled with is accepted and dropped."""

    origin = ""
    counted = False

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stand:
        if cls.counted:
            for a in (*args, *kwargs.values()):
                if (isinstance(a, int) and not isinstance(a, bool)) or getattr(a, "origin", "") == "torch.Size":
                    raise _Counted(f"{cls.origin}({a if isinstance(a, int) else 'torch.Size(...)'})")
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Stand:
        return type(self)(*args, **kwargs)

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        """Dropped (APPEND onto a stand-in)."""

    def extend(self, items: Any) -> None:
        """Dropped (APPENDS onto a stand-in)."""


class _Scan(pickle.Unpickler):
    """Resolves every global to a stand-in class of its own name (counted ones check
    their arguments), and every persistent id to a stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module  # protocol 2 names Python 2's
        return type(name, (_Stand,), {"origin": f"{module}.{name}", "counted": is_counted(module, name)})

    def persistent_load(self, pid: Any) -> Any:
        return _Stand()


def count_problem(data: Any) -> str | None:
    """The call by a count that the pickle in ``data`` would make (``"builtins.bytearray(
    1610612736)"``), or None. ``data``: bytes (a ``torch.save`` archive, torch's legacy
    format or a bare pickle) or a binary file open at its start (an archive or the legacy
    format). A pickle that cannot be read is left to ``torch.load``, which says so."""
    f = io.BytesIO(bytes(data)) if isinstance(data, bytes | bytearray | memoryview) else data
    start = f.tell()
    try:
        if zipfile.is_zipfile(f):
            f.seek(start)
            with zipfile.ZipFile(f) as zf:
                name = next((n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")), None)
                if name is None:
                    return None
                with zf.open(name) as pkl:
                    return _scan(pkl, 1)
        f.seek(start)
        return _scan(f, _LEGACY_PICKLES)
    finally:
        f.seek(start)


def _scan(f: Any, pickles: int) -> str | None:
    """Read up to ``pickles`` pickles from ``f`` with the scanning unpickler."""
    for _ in range(pickles):
        try:
            _Scan(f, encoding="utf-8").load()
        except _Counted as exc:
            return str(exc)
        except Exception:  # noqa: BLE001 - not (or no more) a pickle: torch.load reports what is wrong
            return None
    return None
