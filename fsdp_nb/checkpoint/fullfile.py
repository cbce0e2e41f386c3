"""One-file ("full") checkpoints: ``.pt`` (torch.save) or ``.safetensors``, by suffix.

Layout, both formats carry the same three parts:

- ``.pt``: ``{"model": {fqn: tensor}, "optim": {"state": ..., "param_groups": ...}, "fsdp_nb": meta}``,
  loaded with ``torch.load(weights_only=True)``.
- ``.safetensors``: tensors ``model.<fqn>`` and ``optim.state.<fqn>.<key>``; the
  metadata JSON and the optimizer's non-tensor parts (param groups, scalar states)
  in the header's ``__metadata__`` (``fsdp_nb`` and ``fsdp_nb.optim``).
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from ..dtypes import from_safetensors
from .info import CorruptCheckpointError
from .keys import MODEL, OPTIM_STATE, flat_optim_state, split_optim_key

__all__ = ["FULL_SUFFIXES", "full_suffix", "read_full", "read_full_meta", "write_full"]

FULL_SUFFIXES = (".pt", ".safetensors")
"""File suffixes of full checkpoints."""


def full_suffix(path: str) -> str | None:
    """``.pt`` / ``.safetensors`` when ``path`` names a full checkpoint file, else None."""
    for s in FULL_SUFFIXES:
        if path.rstrip("/").endswith(s):
            return s
    return None


def _to_safetensors(model_sd: dict, optim_sd: dict | None, meta: dict) -> tuple[dict, dict]:
    import torch

    tensors: dict[str, Any] = {}
    for k, v in model_sd.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"model state {k!r} is not a tensor; use a .pt file")
        tensors[MODEL + k] = v.detach().contiguous()
    other: dict[str, Any] = {}
    if optim_sd:
        scalars: dict[str, Any] = {}
        for flat, fqn, key, v in flat_optim_state(optim_sd.get("state", {})):
            if isinstance(v, torch.Tensor):
                tensors[flat] = v.detach().contiguous()
            else:
                scalars.setdefault(fqn, {})[key] = v
        other = {"param_groups": optim_sd.get("param_groups", []), "scalars": scalars}
    header = {"fsdp_nb": json.dumps(meta)}
    if optim_sd:
        header["fsdp_nb.optim"] = json.dumps(other)
    # safetensors refuses tensors sharing storage: clone those that do.
    seen: set[int] = set()
    for k, v in tensors.items():
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen and v.numel():
            tensors[k] = v.clone()
        seen.add(ptr)
    return tensors, header


def write_full(fs: Any, path: str, model_sd: dict, optim_sd: dict | None, meta: dict) -> None:
    """Write a full checkpoint file at ``path`` on ``fs`` (the caller handles atomicity)."""
    import torch

    from .storage import is_local

    if full_suffix(path) == ".safetensors":
        from safetensors.torch import save, save_file

        tensors, header = _to_safetensors(model_sd, optim_sd, meta)
        if is_local(fs):
            save_file(tensors, path, metadata=header)
        else:
            with fs.open(path, "wb") as f:
                f.write(save(tensors, metadata=header))
    else:
        obj = {"model": model_sd, "fsdp_nb": meta}
        if optim_sd:
            obj["optim"] = optim_sd
        with fs.open(path, "wb") as f:
            torch.save(obj, f)
    if is_local(fs):
        import os

        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_full(fs: Any, path: str, url: str) -> tuple[dict, dict | None, dict]:
    """(model state dict, optimizer state dict or None, metadata) of a full checkpoint.

    Any failure to parse raises CorruptCheckpointError naming ``url``.
    """
    import torch

    from .storage import is_local

    name = posixpath.basename(path)
    try:
        if full_suffix(path) == ".safetensors":
            from safetensors.torch import load, load_file

            if is_local(fs):
                flat = load_file(path)
            else:
                with fs.open(path, "rb") as f:
                    flat = load(f.read())
            header = read_safetensors_header(fs, path)
            meta = json.loads(header.get("fsdp_nb", "{}"))
            model_sd = {k[len(MODEL):]: v for k, v in flat.items() if k.startswith(MODEL)}
            optim_sd = None
            if "fsdp_nb.optim" in header:
                other = json.loads(header["fsdp_nb.optim"])
                state: dict[str, dict[str, Any]] = {
                    fqn: dict(vals) for fqn, vals in other.get("scalars", {}).items()
                }
                for k, v in flat.items():
                    if k.startswith(OPTIM_STATE):
                        fqn, key = split_optim_key(k)
                        state.setdefault(fqn, {})[key] = v
                optim_sd = {"state": state, "param_groups": other.get("param_groups", [])}
            return model_sd, optim_sd, meta
        if is_local(fs):
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        else:
            with fs.open(path, "rb") as f:
                obj = torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(
            f"checkpoint {url!r}: file {name!r} is corrupt or truncated "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(obj, dict) or "model" not in obj:
        raise CorruptCheckpointError(
            f"checkpoint {url!r}: file {name!r} is not an fsdp_nb full checkpoint "
            "(expected a dict with a 'model' state dict)"
        )
    return obj["model"], obj.get("optim"), obj.get("fsdp_nb", {})


def read_safetensors_header(fs: Any, path: str) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (reads only its header)."""
    return _safetensors_json(fs, path).get("__metadata__", {}) or {}


def _safetensors_json(fs: Any, path: str) -> dict[str, Any]:
    with fs.open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("file shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > 100 << 20:
            raise ValueError(f"safetensors header claims {n} bytes")
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError("safetensors header is truncated")
    return json.loads(raw)


def read_full_meta(fs: Any, path: str) -> tuple[dict, dict[str, tuple[tuple[int, ...], str, int, int]]]:
    """(metadata, key -> (shape, dtype, byte offset, length)) without loading tensor data."""
    if full_suffix(path) == ".safetensors":
        js = _safetensors_json(fs, path)
        header = js.pop("__metadata__", {}) or {}
        meta = json.loads(header.get("fsdp_nb", "{}"))
        out = {}
        for k, v in js.items():
            start, end = v["data_offsets"]
            out[k] = (tuple(v["shape"]), from_safetensors(v["dtype"]), start, end - start)
        size = fs.size(path)
        need = max((o + n for (_, _, o, n) in out.values()), default=0)
        if size < need:
            raise ValueError(f"file is truncated: {size} bytes, tensors need more than {need}")
        return meta, out
    import torch

    from .storage import is_local

    if is_local(fs):
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    else:
        with fs.open(path, "rb") as f:
            obj = torch.load(f, map_location="cpu", weights_only=True)
    out = {}
    flat = [(MODEL + k, v) for k, v in obj.get("model", {}).items()]
    flat += [(f, v) for f, _, _, v in flat_optim_state((obj.get("optim") or {}).get("state", {}))]
    for key, t in flat:
        if isinstance(t, torch.Tensor):
            out[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), None, t.numel() * t.element_size())
    return obj.get("fsdp_nb", {}), out
