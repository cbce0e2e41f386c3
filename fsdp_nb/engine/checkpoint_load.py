"""Loading a checkpoint on the ranks: verify, check, read into fresh tensors, then copy.

Called by ``fsdp_nb.checkpoint.load`` on every rank at once. Files are verified first
(``fsdp_nb.checkpoint.reader``: sizes up front, each stored item's checksum as it is
read), keys and shapes are checked against the model, every problem is agreed by all ranks (one clear error), and the data is read
into fresh tensors; only when every rank read everything is it copied into the model,
so a failure leaves the model as it was. Resharding is DCP's. Collectives run on the
checkpoint group (``checkpoint_io.checkpoint_group``).
"""

from __future__ import annotations

import posixpath
import time
from typing import Any

from ..checkpoint.atomic import read_marker
from ..checkpoint.contract import LoadSpec, Outcome
from ..checkpoint.fullfile import full_suffix, read_full
from ..checkpoint.info import CheckpointError, CorruptCheckpointError
from ..checkpoint.keys import MODEL, OPTIM_STATE, flat_optim_state
from ..checkpoint.metadata import META_FILE
from ..checkpoint.reader import named_corruption, open_sharded
from ..checkpoint.storage import url_to_fs
from .checkpoint_io import begin, checkpoint_group, rank_and_world

__all__ = ["load"]



def _agree(problem: str | None, cls: type[BaseException] = CheckpointError) -> Outcome | None:
    """All ranks learn every rank's problem; the same failure outcome (or None) on each."""
    import torch.distributed as dist

    rank, ws = rank_and_world()
    parts: list[Any] = [(problem, cls)]
    if ws > 1:
        parts = [None] * ws
        dist.all_gather_object(parts, (problem, cls), group=checkpoint_group())
    for p, c in parts:
        if p:
            return Outcome.failed(p, c)
    return None


def _flat_optim(osd: dict[str, Any]) -> dict[str, Any]:
    return {flat: v for flat, _, _, v in flat_optim_state(osd.get("state", {}))}


def _shape_problems(
    url: str, expected: dict[str, tuple], found: dict[str, tuple], what: str, strict: bool
) -> tuple[str | None, set[str]]:
    """(message or None, keys to load) comparing expected and stored shapes."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mism = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    usable = {k for k in set(expected) & set(found) if expected[k] == found[k]}
    if not strict and not mism:
        return None, usable
    if not (missing or unexpected or mism):
        return None, usable
    lines = [f"checkpoint {url!r} does not match the {what}:"]
    if missing:
        lines.append(f"  missing keys ({len(missing)}): {', '.join(missing[:20])}")
    if unexpected:
        lines.append(f"  unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}")
    for k in mism[:20]:
        lines.append(f"  shape mismatch {k}: checkpoint {list(found[k])}, model {list(expected[k])}")
    if strict and not mism:
        lines.append("  load with strict=False to load the keys both have.")
    return "\n".join(lines), usable


def load(spec: LoadSpec) -> Outcome:
    """Load a sharded or full checkpoint into the model (and optimizer) on every rank."""
    got = begin(spec)
    if isinstance(got, Outcome):
        return got
    model, optim = got
    fs, p = url_to_fs(spec.url, spec.storage_options)
    p = p.rstrip("/")
    try:
        exists = fs.exists(p)
        isdir = exists and fs.isdir(p)
    except Exception as exc:
        return Outcome.failed(f"cannot reach {spec.url!r}: {type(exc).__name__}: {exc}", FileNotFoundError)
    if not exists:
        return Outcome.failed(f"no checkpoint at {spec.url!r}", FileNotFoundError)
    t0 = time.perf_counter()
    try:
        if isdir:
            out = _load_sharded(spec, fs, p, model, optim)
        elif full_suffix(p):
            out = _load_full(spec, fs, p, model, optim)
        else:
            return Outcome.failed(f"{spec.url!r} is neither a checkpoint folder nor a .pt / .safetensors file")
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        return Outcome.failed(f"loading {spec.url!r} failed: {type(exc).__name__}: {exc}")
    out.seconds = time.perf_counter() - t0
    return out


def _load_sharded(spec: LoadSpec, fs: Any, p: str, model: Any, optim: Any) -> Outcome:
    import json

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.utils._pytree import tree_map_only

    url, strict = spec.url, spec.strict
    rank, ws = rank_and_world()
    marker = read_marker(fs, p)
    if marker is None:
        bad = _agree(
            f"checkpoint {url!r} is incomplete: it has no completion marker "
            "(an interrupted or unfinished save); refusing to load it"
        )
        return bad or Outcome(ok=False)
    problem = None
    try:
        md, reader = open_sharded(fs, p, url, marker, spec.storage_options,
                                  share=sorted(marker.get("files", {}))[rank::ws])
    except CorruptCheckpointError as exc:
        problem = str(exc)
    bad = _agree(problem, CorruptCheckpointError)
    if bad:
        return bad
    stored = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    msd, osd = get_state_dict(model, [optim] if optim is not None else [])
    expected = {MODEL + k: tuple(v.shape) for k, v in msd.items() if isinstance(v, torch.Tensor)}
    found = {k: s for k, s in stored.items() if k.startswith(MODEL)}
    problem, usable = _shape_problems(url, expected, found, "model", strict)
    if problem is None and optim is not None:
        exp_o = {k: tuple(v.shape) for k, v in _flat_optim(osd).items() if isinstance(v, torch.Tensor)}
        found_o = {k: s for k, s in stored.items() if k.startswith(OPTIM_STATE)}
        if not found_o and not any(k.startswith("optim.") for k in md.state_dict_metadata):
            problem = f"checkpoint {url!r} has no optimizer state (it was saved without optimizer=)"
        else:
            problem, _ = _shape_problems(url, exp_o, found_o, "optimizer", True)
    bad = _agree(problem)
    if bad:
        return bad
    # Read into fresh tensors; the model is touched only after every rank read everything.
    fresh_m = {k: torch.empty_like(v) for k, v in msd.items() if MODEL + k in usable}
    sd: dict[str, Any] = {"model": fresh_m}
    fresh_o = None
    if optim is not None:
        fresh_o = tree_map_only(torch.Tensor, torch.empty_like, osd)
        sd["optim"] = fresh_o
    # dcp.load ends in a collective that raises on every rank if any rank failed
    try:
        with named_corruption(url):
            dcp.load(
                sd, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=not strict),
                process_group=checkpoint_group(),
            )
    except CorruptCheckpointError as exc:
        return Outcome.failed(exc)
    set_state_dict(
        model, [optim] if optim is not None else [],
        model_state_dict=fresh_m,
        optim_state_dict=fresh_o if optim is not None else {},
        options=StateDictOptions(strict=strict),
    )
    meta = json.loads(fs.cat_file(posixpath.join(p, META_FILE)))
    return Outcome(extra=meta.get("extra", {}), world_size=meta.get("world_size"))


def _load_full(spec: LoadSpec, fs: Any, p: str, model: Any, optim: Any) -> Outcome:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    url, strict = spec.url, spec.strict
    rank, ws = rank_and_world()
    msd_local = get_model_state_dict(model)
    expected = {k: tuple(v.shape) for k, v in msd_local.items() if isinstance(v, torch.Tensor)}
    problem: str | None = None
    cls: type[BaseException] = CheckpointError
    full_m: dict[str, Any] = {}
    full_o: dict[str, Any] | None = None
    meta: dict[str, Any] = {}
    if rank == 0:
        try:
            full_m, full_o, meta = read_full(fs, p, url)
            found = {k: tuple(v.shape) for k, v in full_m.items() if isinstance(v, torch.Tensor)}
            problem, usable = _shape_problems(url, expected, found, "model", strict)
            if problem is None:
                full_m = {k: v for k, v in full_m.items() if k in usable}
                if set(usable) != set(expected):
                    problem = _partial_full_problem(url, expected, usable)
            if problem is None and optim is not None and not full_o:
                problem = f"checkpoint {url!r} has no optimizer state (it was saved without optimizer=)"
        except CorruptCheckpointError as exc:
            problem, cls = str(exc), CorruptCheckpointError
    bad = _agree(problem, cls)
    if bad:
        return bad
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(model, full_m if rank == 0 else {}, options=opts)
    if optim is not None:
        set_optimizer_state_dict(model, optim, full_o if rank == 0 else {}, options=opts)
    box = [meta.get("extra", {}), meta.get("world_size")]
    if ws > 1:
        dist.broadcast_object_list(box, src=0)
    return Outcome(extra=box[0], world_size=box[1])


def _partial_full_problem(url: str, expected: dict, usable: set) -> str | None:
    """Full checkpoints are broadcast from rank 0 key by key: a partial load is not supported."""
    missing = sorted(set(expected) - usable)
    return (
        f"checkpoint {url!r} lacks {len(missing)} of the model's keys ({', '.join(missing[:10])}); "
        "a full (.pt / .safetensors) checkpoint must hold every model key even with strict=False"
    )
