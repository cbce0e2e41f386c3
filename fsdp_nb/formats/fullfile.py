"""One-file ("full") checkpoints: ``.pt`` (torch.save) or ``.safetensors``, by suffix.

- ``.pt``: ``{"model": {fqn: tensor}, "optim": {"state": ..., "param_groups": ...}, "fsdp_nb": meta}``,
  loaded with ``torch.load(weights_only=True)``.
- ``.safetensors``: the model's weights under their own names, so ``safetensors`` +
  ``model.load_state_dict`` and Hugging Face tools read it; fsdp_nb's metadata in the
  header. The optimizer state goes beside it, never inside: ``X.optim.safetensors``
  (``fsdp_nb.formats.safetensors_layout``).

``write_full`` writes to hidden siblings and renames them into place (the optimizer
file first, the model file last, both carrying the save's token), so a reader sees
the old pair, or the new one, or a mismatch it refuses; never a half-written file.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from typing import Any

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from .direct_io import durable
from .keys import MODEL, OPTIM_STATE, flat_optim_state, split_optim_key
from .pickles import load_pt
from .safetensors_layout import OPTIM_TENSOR, PieceReader, optim_file, optim_state, read_layout
from .safetensors_write import write_safetensors
from .storage import fsync_dir, is_local, sibling

__all__ = ["FULL_SUFFIXES", "commit_full", "full_suffix", "read_full", "read_full_meta", "write_full"]

log = logging.getLogger("fsdp_nb")

FULL_SUFFIXES = (".pt", ".safetensors")
"""File suffixes of full checkpoints."""

_Entry = tuple[tuple[int, ...], str, str, int | None, int]
"""A stored tensor without its data: (shape, dtype, file name, byte offset or None, length)."""


def full_suffix(path: str) -> str | None:
    """``.pt`` / ``.safetensors`` when ``path`` names a full checkpoint file, else None."""
    for s in FULL_SUFFIXES:
        if path.rstrip("/").endswith(s):
            return s
    return None


def _unshared(tensors: dict[str, Any]) -> dict[str, Any]:
    """safetensors refuses tensors sharing storage: clone those that do."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        v = v.detach().contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen and v.numel() else v
        seen.add(ptr)
    return out


def _safetensors_parts(model_sd: dict, optim_sd: dict | None, meta: dict, token: str,
                       optim_name: str) -> tuple[dict, dict, tuple[dict, dict] | None]:
    """(model tensors, model header, (optimizer tensors, optimizer header) or None)."""
    import torch

    for k, v in model_sd.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"model state {k!r} is not a tensor; use a .pt file")
    meta = dict(meta, token=token, optimizer_file=optim_name if optim_sd else None)
    header = {"format": "pt", "fsdp_nb": json.dumps(meta)}
    if not optim_sd:
        return _unshared(model_sd), header, None
    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for flat, fqn, key, v in flat_optim_state(optim_sd.get("state", {})):
        if isinstance(v, torch.Tensor):
            tensors[OPTIM_TENSOR + flat[len(OPTIM_STATE):]] = v
        else:
            scalars.setdefault(fqn, {})[key] = v
    other = {"param_groups": optim_sd.get("param_groups", []), "scalars": scalars}
    oheader = {"format": "pt", "fsdp_nb.optim": json.dumps(other), "fsdp_nb.token": token}
    return _unshared(model_sd), header, (_unshared(tensors), oheader)


def _create(fs: Any, path: str) -> Any:
    """``path`` opened for writing: a local one by ``direct_io.durable`` (on the disk
    when closed), a remote one by its filesystem."""
    return durable(path) if is_local(fs) else fs.open(path, "wb")


def _write_safetensors(fs: Any, path: str, tensors: dict, header: dict) -> None:
    with _create(fs, path) as f:
        write_safetensors(f, tensors, header)


def commit_full(fs: Any, tmp: str, target: str) -> None:
    """Rename a fully written temporary file over ``target``."""
    if is_local(fs):
        os.replace(tmp, target)
        fsync_dir(os.path.dirname(target) or ".")
    else:
        fs.mv(tmp, target)


def write_full(fs: Any, target: str, token: str, model_sd: dict, optim_sd: dict | None, meta: dict) -> None:
    """Write the full checkpoint ``target`` on ``fs`` atomically (``.safetensors``: with its
    optimizer file beside it); temporaries are removed if anything fails."""
    import torch

    suffix = full_suffix(target) or ""
    tmp = sibling(target, "tmp", token) + suffix
    moves = [(tmp, target)]
    try:
        if suffix == ".safetensors":
            opath = optim_file(target)
            tensors, header, optim_part = _safetensors_parts(
                model_sd, optim_sd, meta, token, posixpath.basename(opath))
            if optim_part is not None:
                otmp = sibling(opath, "tmp", token) + suffix
                moves.insert(0, (otmp, opath))
                _write_safetensors(fs, otmp, *optim_part)
            _write_safetensors(fs, tmp, tensors, header)
        else:
            obj = {"model": model_sd, "fsdp_nb": dict(meta, token=token)}
            if optim_sd:
                obj["optim"] = optim_sd
            with _create(fs, tmp) as f:
                torch.save(obj, f)
        for src, dst in moves:
            commit_full(fs, src, dst)
    except BaseException:  # remove the temporaries, then re-raise
        for src, _ in moves:
            try:
                if fs.exists(src):
                    fs.rm(src)
            except Exception as exc:  # noqa: BLE001 - cleanup of a failed write: the write's own error is re-raised below
                log.warning("could not remove the unfinished file %s: %s", src, exc)
        raise
    if suffix == ".safetensors" and not optim_sd and fs.exists(optim_file(target)):
        fs.rm(optim_file(target))  # the replaced checkpoint's optimizer state, now stale


def read_full(fs: Any, path: str, url: str, weights_only: bool = True) -> tuple[dict, dict | None, dict]:
    """(model state dict, optimizer state dict or None, metadata) of a full checkpoint, in memory.

    Any failure to parse raises CorruptCheckpointError naming the file; a ``.pt`` whose
    pickle weights-only loading refuses raises UnsafeCheckpointError, unless
    ``weights_only`` is False (a trusted file, which can then run code).
    """
    name = posixpath.basename(path)
    if full_suffix(path) == ".safetensors":
        ck = read_layout(fs, path, url)
        try:
            with PieceReader(fs) as r:
                model_sd = {k: r.read(s) for k, s in ck.model.items()}
                optim_sd = None if ck.optim_other is None else optim_state(
                    ck.optim_other, ((*split_optim_key(flat), r.read(s)) for flat, s in ck.optim.items()))
        except Exception as exc:  # any parse failure is a corrupt file, named
            raise CorruptCheckpointError(
                f"checkpoint {url!r}: file {name!r} is corrupt or truncated ({type(exc).__name__}: {exc})"
            ) from exc
        return model_sd, optim_sd, ck.meta
    try:
        obj = load_pt(fs, path, url, weights_only)
    except (FileNotFoundError, UnsafeCheckpointError):
        raise
    except Exception as exc:  # any unpickling failure is a corrupt file, named
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


def read_full_meta(
    fs: Any, path: str, url: str | None = None, weights_only: bool = True,
) -> tuple[dict, dict[str, _Entry], dict[str, int]]:
    """(metadata, key -> (shape, dtype, file name, byte offset, length), file name -> size)
    without tensor data.

    Keys are spelled as in a sharded checkpoint (``model.<fqn>``, ``optim.state.<fqn>.<key>``).
    ``path``: a ``.safetensors`` / ``.pt`` file, or a Hugging Face safetensors folder.
    ``weights_only=False``: a ``.pt`` is unpickled without restriction (trusted).
    """
    if full_suffix(path) != ".pt":
        ck = read_layout(fs, path, url or path)
        out: dict[str, _Entry] = {}
        for prefix, entries in ((MODEL, ck.model), ("", ck.optim)):
            for k, s in entries.items():
                out[prefix + k] = (s.shape, s.dtype, posixpath.basename(s.file), s.offset, s.length)
        return ck.meta, out, {posixpath.basename(f): n for f, n in ck.files.items()}
    import torch

    obj = load_pt(fs, path, url or path, weights_only)
    name = posixpath.basename(path)
    outp: dict[str, _Entry] = {}
    flat = [(MODEL + k, v) for k, v in obj.get("model", {}).items()]
    flat += [(f, v) for f, _, _, v in flat_optim_state((obj.get("optim") or {}).get("state", {}))]
    for key, t in flat:
        if isinstance(t, torch.Tensor):
            outp[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), name, None,
                         t.numel() * t.element_size())
    return obj.get("fsdp_nb", {}), outp, {name: fs.size(path)}
