"""Safetensors files written tensor by tensor.

The header goes first, built from names, dtypes and shapes alone; then each tensor's
bytes, straight from its memory, into any binary file object: a local file written
past the page cache (``direct_io``), or a remote stream, where
``safetensors.torch.save`` would first build the whole file as one ``bytes`` (and
``save_file`` takes only a local path, which it writes through the page cache). The
layout is the one safetensors writes: an 8-byte header length, the JSON header padded
with spaces to a multiple of 8, the data back to back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from .dtypes import tensor_bytes, to_safetensors

__all__ = ["header", "raw_bytes", "write_safetensors"]


def header(specs: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """The header of a file holding tensors ``(name, dtype name, shape)`` in that order,
    with ``metadata`` (strings) as its ``__metadata__``."""
    head: dict[str, Any] = {"__metadata__": metadata}
    off = 0
    for name, dtype, shape in specs:
        code = to_safetensors(dtype)
        if code is None:
            raise TypeError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store")
        end = off + tensor_bytes(shape, dtype)
        head[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, end]}
        off = end
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw


def raw_bytes(t: Any) -> memoryview:
    """The bytes of CPU tensor ``t`` in memory order (a view, no copy when contiguous)."""
    import torch

    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def write_safetensors(f: Any, tensors: dict[str, Any], metadata: dict[str, str]) -> None:
    """Write ``tensors`` (CPU, none sharing memory) and ``metadata`` to binary file ``f``."""
    f.write(header(((k, str(t.dtype), tuple(t.shape)) for k, t in tensors.items()), metadata))
    for t in tensors.values():
        f.write(raw_bytes(t))
