"""Checkpoint I/O on the ranks: save and load FSDP2 models and optimizers.

Called by ``fsdp_nb.checkpoint.save`` / ``load`` on every rank at once. Functions
return an ``Outcome`` (``fsdp_nb.checkpoint.contract``), which carries the exception
class of an expected failure (a missing file, a key mismatch), so the
notebook raises one clear error instead of a wall of per-rank tracebacks; the
outcome of every check is agreed by all ranks before anything is written or any
model tensor is touched.

- sharded: ``torch.distributed.checkpoint`` (one ``__{rank}_0.distcp`` per rank)
  into a temporary sibling, then every rank's file sizes and CRC-32s are gathered
  and rank 0 commits (``fsdp_nb.checkpoint.atomic``).
- full: ``get_state_dict(full_state_dict=True, cpu_offload=True)`` gathers to rank
  0 only (the others hold nothing), which writes one ``.pt`` / ``.safetensors``.
- async: staging (a CPU copy of this rank's shards) happens in the call; the
  write and the commit run in a background thread.
- checkpoint collectives (DCP's planning, the commit's gather, load's agreement) run
  on a dedicated gloo group (``_ckpt_group``), as torchtitan's do: it has the CPU
  backend DCP's async save requires on NCCL worlds, and background writes never
  interleave with training collectives on the default group.
- load: files verified (size, CRC-32; each rank checks a share), keys and shapes
  checked, data read into fresh tensors, and only then copied into the model.
"""

from __future__ import annotations

import logging
import posixpath
import time
from typing import Any

from ..checkpoint.atomic import commit_full, commit_sharded, read_marker, retain_last
from ..checkpoint.contract import LoadSpec, Outcome, SaveSpec
from ..checkpoint.fullfile import full_suffix, read_full, write_full
from ..checkpoint.info import CheckpointError, CorruptCheckpointError
from ..checkpoint.inspect import inspect, read_dcp_metadata, verify_checksums
from ..checkpoint.keys import MODEL, OPTIM_STATE, flat_optim_state
from ..checkpoint.restricted import safe_reader
from ..checkpoint.storage import dcp_writer, file_record, sibling, url_to_fs
from .async_saves import drain, stager, submit
from .namespace import user_ns
from .wrap import param_sizes

log = logging.getLogger("fsdp_nb")

__all__ = ["load", "preflight", "save"]

_GROUP: tuple[Any, Any] | None = None


def _objects(model_name: str, optim_name: str | None) -> tuple[Any, Any]:
    import torch

    ns = user_ns()
    if model_name not in ns:
        raise NameError(f"no model named {model_name!r} on this rank (wrap it with sess.wrap first)")
    model = ns[model_name]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"engine global {model_name!r} is a {type(model).__name__}, not an nn.Module")
    optim = None
    if optim_name is not None:
        if optim_name not in ns:
            raise NameError(f"no optimizer named {optim_name!r} on this rank")
        optim = ns[optim_name]
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"engine global {optim_name!r} is a {type(optim).__name__}, not a torch.optim.Optimizer")
    return model, optim


def _rank_ws() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def preflight(spec: SaveSpec) -> Outcome:
    """Check names and the target before anything is written."""
    try:
        _objects(spec.model, spec.optimizer)
    except (NameError, TypeError) as exc:
        return Outcome.failed(exc)
    drain()
    rank, _ = _rank_ws()
    if rank == 0 and spec.check_exists:
        fs, p = url_to_fs(spec.url, spec.storage_options)
        if fs.exists(p.rstrip("/")):
            return Outcome(exists=True)
    return Outcome()


def _ckpt_group() -> Any:
    """A gloo group of all ranks for checkpoint collectives (made once per world).

    Saves run their collectives here, as torchtitan's checkpointer does: DCP's async
    save refuses a group without a CPU backend (a plain NCCL world), and the
    background write and commit must not interleave with training collectives on
    the default group. Also for one rank: that world may be NCCL too.
    """
    global _GROUP
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if _GROUP is None or _GROUP[0] is not world:
        _GROUP = (world, dist.new_group(backend="gloo"))
    return _GROUP[1]


def _model_meta(model: Any, spec: SaveSpec) -> dict[str, Any]:
    meta = dict(spec.meta)
    _, ws = _rank_ws()
    mesh: dict[str, Any] = {}
    for prm in model.parameters():
        dm = getattr(prm, "device_mesh", None)
        if dm is not None:
            mesh = {
                "shape": list(dm.shape),
                "dim_names": list(dm.mesh_dim_names or ()),
                "device_type": dm.device_type,
            }
            break
    inner = model
    cls = type(inner)
    meta.update(
        world_size=ws,
        mesh=mesh,
        model=spec.model,
        optimizer=spec.optimizer,
        model_class=f"{cls.__module__}.{cls.__qualname__}",
        param_count=param_sizes(model)[0],
    )
    return meta


# -- save -------------------------------------------------------------------------


def save(spec: SaveSpec) -> Outcome:
    """Save the model (and optimizer) on every rank; returns timings and, on rank 0, the info."""
    try:
        model, optim = _objects(spec.model, spec.optimizer)
    except (NameError, TypeError) as exc:
        return Outcome.failed(exc)
    drain()
    t0 = time.perf_counter()
    try:
        if spec.sharded:
            return _save_sharded(spec, model, optim, t0)
        return _save_full(spec, model, optim, t0)
    except BaseException as exc:  # CheckpointException derives from BaseException
        if isinstance(exc, KeyboardInterrupt):
            raise
        return Outcome.failed(f"saving {spec.url!r} failed: {type(exc).__name__}: {exc}")


def _finish_sharded(spec: SaveSpec, model_meta: dict[str, Any], group: Any) -> Outcome:
    """After this rank's files are written: gather sizes/CRCs, rank 0 commits."""
    import torch.distributed as dist

    fs, target = url_to_fs(spec.url, spec.storage_options)
    target = target.rstrip("/")
    tmp = sibling(target, "tmp", spec.token)
    rank, ws = _rank_ws()
    mine: dict[str, dict[str, int]] = {}
    names = [".metadata"] if rank == 0 else []
    for e in fs.ls(tmp, detail=False):
        n = posixpath.basename(e.rstrip("/"))
        if n.startswith(f"__{rank}_") and n.endswith(".distcp"):
            names.append(n)
    for n in names:
        fp = posixpath.join(tmp, n)
        mine[n] = file_record(fs, fp)
    parts: list[Any] = [None] * ws
    if ws > 1:
        dist.all_gather_object(parts, mine, group=group)
    else:
        parts = [mine]
    if rank != 0:
        return Outcome()
    files: dict[str, dict[str, int]] = {}
    for part in parts:
        files.update(part)
    commit_sharded(fs, tmp, target, model_meta, files, spec.token)
    removed = retain_last(fs, target, spec.keep_last) if spec.keep_last else []
    return Outcome(info=inspect(spec.url, storage_options=spec.storage_options), removed=removed)


def _save_sharded(spec: SaveSpec, model: Any, optim: Any, t0: float) -> Outcome:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    fs, target = url_to_fs(spec.url, spec.storage_options)
    tmp = sibling(target.rstrip("/"), "tmp", spec.token)
    msd, osd = get_state_dict(model, [optim] if optim is not None else [])
    sd: dict[str, Any] = {"model": msd}
    if optim is not None:
        sd["optim"] = osd
    meta = _model_meta(model, spec)
    writer = dcp_writer(fs, tmp, spec.storage_options)
    rank, _ = _rank_ws()
    group = _ckpt_group()
    if not spec.async_save:
        try:
            dcp.save(sd, storage_writer=writer, process_group=group)
        except BaseException:
            if rank == 0:
                _cleanup(fs, tmp)
            raise
        out = _finish_sharded(spec, meta, group)
        out.seconds = time.perf_counter() - t0
        return out
    resp = dcp.async_save(sd, storage_writer=writer, process_group=group, async_stager=stager())
    upload = getattr(resp, "upload_completion", resp)
    staging = getattr(resp, "staging_completion", None)
    if staging is not None:
        staging.result()
    blocked = time.perf_counter() - t0

    def finish() -> Outcome:
        try:
            upload.result()
        except BaseException as exc:
            if rank == 0:
                _cleanup(fs, tmp)
            return Outcome.failed(f"async save of {spec.url!r} failed: {type(exc).__name__}: {exc}")
        out = _finish_sharded(spec, meta, group)
        out.seconds = time.perf_counter() - t0
        return out

    submit(spec.token, finish)
    return Outcome(blocked=blocked, pending=True)


def _cleanup(fs: Any, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as exc:
        log.warning("could not remove the unfinished checkpoint folder: %s", exc)


def _save_full(spec: SaveSpec, model: Any, optim: Any, t0: float) -> Outcome:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, [optim] if optim is not None else [], options=opts)
    meta = _model_meta(model, spec)
    rank, _ = _rank_ws()
    if rank != 0:
        took = time.perf_counter() - t0
        return Outcome(blocked=took, seconds=took)
    fs, target = url_to_fs(spec.url, spec.storage_options)
    tmp = sibling(target, "tmp", spec.token) + (full_suffix(target) or "")
    if spec.async_save:
        # The background write must not see training's in-place updates: copy
        # anything that still shares storage with the live model or optimizer.
        live = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
        msd = {k: (v.clone() if isinstance(v, torch.Tensor) and v.data_ptr() in live else v) for k, v in msd.items()}
        if optim is not None:
            osd = {
                "state": {f: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for f, s in osd["state"].items()},
                "param_groups": osd["param_groups"],
            }

    def write() -> Outcome:
        try:
            write_full(fs, tmp, msd, osd if optim is not None else None, meta)
            commit_full(fs, tmp, target)
        except BaseException as exc:
            _cleanup(fs, tmp)
            return Outcome.failed(f"saving {spec.url!r} failed: {type(exc).__name__}: {exc}")
        removed = retain_last(fs, target, spec.keep_last) if spec.keep_last else []
        return Outcome(
            info=inspect(spec.url, storage_options=spec.storage_options),
            removed=removed, seconds=time.perf_counter() - t0,
        )

    if spec.async_save:
        blocked = time.perf_counter() - t0
        submit(spec.token, write)
        return Outcome(blocked=blocked, pending=True)
    out = write()
    out.blocked = out.seconds or 0.0
    return out


# -- load -------------------------------------------------------------------------


def _agree(problem: str | None, cls: type[BaseException] = CheckpointError) -> Outcome | None:
    """All ranks learn every rank's problem; the same failure outcome (or None) on each."""
    import torch.distributed as dist

    rank, ws = _rank_ws()
    parts: list[Any] = [(problem, cls)]
    if ws > 1:
        parts = [None] * ws
        dist.all_gather_object(parts, (problem, cls), group=_ckpt_group())
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
    try:
        model, optim = _objects(spec.model, spec.optimizer)
    except (NameError, TypeError) as exc:
        return Outcome.failed(exc)
    drain()
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
    rank, ws = _rank_ws()
    marker = read_marker(fs, p)
    if marker is None:
        bad = _agree(
            f"checkpoint {url!r} is incomplete: it has no completion marker "
            "(an interrupted or unfinished save); refusing to load it"
        )
        return bad or Outcome(ok=False)
    problem = None
    try:
        names = sorted(marker.get("files", {}))
        verify_checksums(fs, p, url, marker, names=names[rank::ws])
        md = read_dcp_metadata(fs, p, url)
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
    reader = safe_reader(fs, p, spec.storage_options)
    # dcp.load ends in a collective that raises on every rank if any rank failed
    dcp.load(
        sd, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=not strict),
        process_group=_ckpt_group(),
    )
    set_state_dict(
        model, [optim] if optim is not None else [],
        model_state_dict=fresh_m,
        optim_state_dict=fresh_o if optim is not None else {},
        options=StateDictOptions(strict=strict),
    )
    meta = json.loads(fs.cat_file(posixpath.join(p, "fsdp_nb.json")))
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
    rank, ws = _rank_ws()
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
