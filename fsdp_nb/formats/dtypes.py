"""Tensor dtypes by name, without importing torch: item sizes and safetensors codes.

Checkpoint inspection, the offline full-file reader and the shard table describe
tensors by dtype name (``"float32"``); this one table answers how many bytes an
element takes and which name a safetensors header code (``"F32"``) stands for.
"""

from __future__ import annotations

import math

__all__ = ["FLOATING", "from_safetensors", "itemsize", "tensor_bytes", "to_safetensors"]

# name: (bytes per element, safetensors header code)
_DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "F64"), "float32": (4, "F32"), "float16": (2, "F16"),
    "bfloat16": (2, "BF16"), "float8_e4m3fn": (1, "F8_E4M3"), "float8_e5m2": (1, "F8_E5M2"),
    "int64": (8, "I64"), "int32": (4, "I32"), "int16": (2, "I16"), "int8": (1, "I8"),
    "uint8": (1, "U8"), "bool": (1, "BOOL"), "complex64": (8, "C64"), "complex128": (16, "C128"),
}
_FROM_ST = {code: name for name, (_, code) in _DTYPES.items()}
FLOATING = tuple(name for name in _DTYPES if name.startswith(("float", "bfloat")))
"""Names of the floating dtypes (what an export may cast to)."""


def itemsize(dtype: str) -> int:
    """Bytes per element of the dtype named ``dtype`` (``"float32"`` -> 4); 0 if unknown."""
    return _DTYPES.get(dtype.removeprefix("torch."), (0, ""))[0]


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a dense tensor of ``shape`` and the dtype named ``dtype``."""
    return math.prod(shape) * itemsize(dtype)


def from_safetensors(code: str) -> str:
    """The dtype name for a safetensors header code (``"BF16"`` -> ``"bfloat16"``)."""
    return _FROM_ST.get(code, code.lower())


def to_safetensors(dtype: str) -> str | None:
    """The safetensors header code for a dtype name (``"bfloat16"`` -> ``"BF16"``); None if none."""
    return _DTYPES.get(dtype.removeprefix("torch."), (0, None))[1]
