"""The JSON metadata written beside (or inside) every checkpoint.

World size, mesh, torch and fsdp_nb versions, model class, parameter count,
time, and the user's ``extra``. ``extra`` must be JSON values (dict / list / str /
number / bool / None with str keys): anything else is refused before any rank
writes a byte, so a checkpoint's metadata can always be read without unpickling.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

__all__ = ["FORMAT", "MARKER", "META_FILE", "base_metadata", "validate_extra"]

FORMAT = "fsdp_nb.checkpoints/1"
"""Format tag stored in every metadata record."""
META_FILE = "fsdp_nb.json"
"""Metadata file inside a sharded checkpoint folder."""
MARKER = ".fsdp_nb_complete"
"""Written last inside a sharded checkpoint: its files, their sizes and checksums
(``checksums``: one per stored item, taken as it was written).

A folder without it (a crash, a killed engine) never passes as a valid checkpoint."""


def validate_extra(extra: Any) -> dict[str, Any]:
    """Return ``extra`` as a dict if it is made only of JSON values; raise TypeError otherwise."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict of JSON values, got {type(extra).__name__}")
    _check(extra, "extra")
    return json.loads(json.dumps(extra))


def _check(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{where} is {value!r}: JSON has no NaN or infinity; store it as a string")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has key {k!r} of type {type(k).__name__}: JSON keys must be str")
            _check(v, f"{where}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which is not a JSON "
        "value. extra may hold only dict (str keys), list, str, int, float, bool and None; "
        "convert it (e.g. tensor.item(), str(path)) or save it elsewhere. Nothing was written."
    )


def base_metadata(extra: dict[str, Any], kind: str) -> dict[str, Any]:
    """Metadata known in the notebook before the save starts (engines add the rest)."""
    import torch

    now = time.time()
    return {
        "format": FORMAT,
        "kind": kind,
        "created": now,
        "created_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "versions": {"torch": str(torch.__version__), "fsdp_nb": _version()},
        "extra": extra,
    }


def dumps(meta: dict[str, Any]) -> bytes:
    """Metadata as UTF-8 JSON bytes."""
    return json.dumps(meta, indent=1, sort_keys=True).encode()


def _version() -> str:
    """fsdp_nb's installed version (the package's own metadata: no import of the package root)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fsdp_nb")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
