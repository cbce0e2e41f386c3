"""Checkpoint I/O on the ranks: save and load FSDP2 models and optimizers.

Called by ``fsdp_nb.checkpoints.save`` / ``load`` on every rank at once. Functions
return an ``Outcome`` (``fsdp_nb.checkpoints.wire_checkpoint``), which carries the exception
class of an expected failure (a missing file, a key mismatch), so the
notebook raises one clear error instead of a wall of per-rank tracebacks; the
outcome of every check is agreed by all ranks before anything is written or any
model tensor is touched.

- sharded: ``torch.distributed.checkpoint`` (one ``__{rank}_0.distcp`` per rank)
  into a temporary sibling, then every rank's file sizes and checksums (taken as the
  bytes were written: nothing is read back) are gathered and rank 0 commits
  (``fsdp_nb.formats.atomic``).
- full: ``get_state_dict(full_state_dict=True, cpu_offload=True)`` gathers to rank
  0 only (the others hold nothing), which writes one ``.pt`` / ``.safetensors``.
- async: the call returns once every rank holds its state dict; DCP's async save (the
  CPU copy of this rank's shards, then the write) and the commit run in a background
  job that starts once the call has answered (``call_channel.after_reply``), and every
  optimizer's next step (and the forward of a saved model whose buffers are copied) waits
  for the copy (``fsdp_nb.checkpoints.rank_async_saves``).
- checkpoint collectives (DCP's planning, the commit's gather, load's agreement) run
  on a dedicated gloo group (``checkpoint_group``), as torchtitan's do: it has the CPU
  backend DCP's async save requires on NCCL worlds, and background writes never
  interleave with training collectives on the default group.
- load: ``fsdp_nb.checkpoints.rank_load``, on the same checkpoint group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from ..engine.call_channel import after_reply
from ..engine.checkpoint_group import agree, checkpoint_group, rank_and_world
from ..engine.namespace import user_ns
from ..engine.step import taking_state
from ..errors import CheckpointError, UnsafeCheckpointError
from ..formats.atomic import commit_sharded, retain_last
from ..formats.checksums import record_writer
from ..formats.fullfile import write_full
from ..formats.inspect import inspect
from ..formats.layouts import PARTS
from ..formats.run_state import decode, encode, state_file, write
from ..formats.storage import dcp_writer, sibling, url_to_fs
from ..models.rank_hugging_face import hugging_face_meta
from ..models.rank_wrap import param_sizes
from ..torch_compat import tree_leaves
from . import rank_progress as progress_feed
from .rank_async_saves import copied, drain, hold_until_staged, stager, submit
from .rank_layout_state import layout_state, shared_state, side_files
from .rank_run_state import capture, check_objects
from .wire_checkpoint import LoadSpec, Outcome, SaveProgress, SaveSpec

log = logging.getLogger("fsdp_nb")

__all__ = ["begin", "named_objects", "optimizer_list", "save", "state_bytes"]

_FAILED = "!failed"  # the entry a rank's written files carry when it could not write them


def named_objects(model_name: str, optim_name: str | None) -> tuple[Any, Any]:
    """The engine globals ``model_name`` (an nn.Module) and ``optim_name`` (an Optimizer,
    or None); NameError / TypeError naming what is missing or wrong."""
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


def begin(spec: SaveSpec | LoadSpec) -> tuple[Any, Any] | Outcome:
    """The spec's model and optimizer on this rank, once this rank's async saves have
    finished; or the failure outcome naming what is missing or wrong (the model, the
    optimizer, or an engine global named in ``state``). The saves finish first, on every
    rank, failing or not: a background save's collectives on the checkpoint group must
    not meet the ones that follow (gloo pairs them by call order)."""
    drain()
    try:
        objects = named_objects(spec.model, spec.optimizer)
        if spec.optimizers:  # one model, several optimizers: saved and loaded together
            objects = (objects[0], [named_objects(spec.model, o)[1] for o in spec.optimizers])
        for model, optim in spec.parts[1:]:
            named_objects(model, optim)
        check_objects(spec.state)
    except (NameError, TypeError) as exc:
        return Outcome.failed(exc)
    return objects


def optimizer_list(optim: Any) -> list[Any]:
    """``optim`` as the list torch's ``get_state_dict`` takes: ``[]`` for None, a list of
    several optimizers of one model as it is (``SaveSpec.optimizers``), else ``[optim]``."""
    if optim is None:
        return []
    return list(optim) if isinstance(optim, list) else [optim]


def _own(spec: SaveSpec, taken: dict[str, Any] | None) -> tuple[bytes | None, dict[str, Any]]:
    """(this rank's own file, ``train/rank{r}.pt``, or None; the named objects' states for
    another trainer's layout), taken now: an async save keeps the moment it was called.
    The file is read back weights-only here, so a ``state_dict`` a load would refuse is
    refused by name before anything is written (UnsafeCheckpointError)."""
    shared = shared_state(spec)
    if not _keeps_rank_state(spec):
        return None, shared
    part = encode(capture(spec.state, spec.rng, taken))
    try:
        decode(part, spec.url, state_file(rank_and_world()[0]))
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(
            f"an object named in state= gives a state_dict that a load would refuse ({exc}); nothing was "
            "written: make its state_dict plain values, tensors and containers"
        ) from None
    return part, shared


def _checked(spec: SaveSpec, taken: dict[str, Any] | None) -> tuple[Any, Any, bytes | None, dict] | Outcome:
    """The spec's model and optimizer and this rank's own state (``_own``), once every rank
    found them and took its state and rank 0 found no checkpoint in the way (unless
    overwriting); else the same outcome on every rank: a failure on one rank (a loader's
    ``state_dict`` that raised) never leaves the others in the save's collectives."""
    got = begin(spec)
    mine = got if isinstance(got, Outcome) else None
    own: tuple[bytes | None, dict] = (None, {})
    if mine is None:
        try:
            own = _own(spec, taken)
        except Exception as exc:  # noqa: BLE001 - whatever the user's state_dict raised, agreed below
            mine = Outcome.failed(exc if isinstance(exc, (CheckpointError, TypeError)) else
                                  f"taking the state to save failed: {type(exc).__name__}: {exc}")
    rank, _ = rank_and_world()
    if mine is None and rank == 0 and spec.check_exists:
        try:
            fs, p = url_to_fs(spec.url, spec.storage_options)
            if fs.exists(p.rstrip("/")):
                mine = Outcome(exists=True)
        except Exception as exc:  # noqa: BLE001 - whatever the store raises, the ranks agree on one clear outcome
            mine = Outcome.failed(f"cannot reach {spec.url!r}: {type(exc).__name__}: {exc}", OSError)
    return agree(mine) or (got if isinstance(got, Outcome) else (*got, *own))


def _keeps_rank_state(spec: SaveSpec) -> bool:
    """Whether each rank writes its own file (fsdp_nb's layout, with state or random state)."""
    return spec.layout == "fsdp_nb" and bool(spec.state or spec.rng)


def _model_meta(model: Any, spec: SaveSpec, saved: list[tuple[Any, Any]]) -> dict[str, Any]:
    meta = dict(spec.meta)
    _, ws = rank_and_world()
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
    meta.update(world_size=ws, mesh=mesh)
    if not spec.parts:  # one model: what it is; several: each in meta[PARTS]
        meta.update(**_part_meta(model, spec.optimizer), **hugging_face_meta(model), model=spec.model)
        if spec.optimizers:  # several optimizers of the one model: each by name (``optimizer``: the first)
            meta["optimizers"] = list(spec.optimizers)
    else:
        meta[PARTS] = {name: {**_part_meta(m, o), **hugging_face_meta(m)} for (name, o), (m, _) in zip(spec.parts, saved)}
    return meta


def _part_meta(model: Any, optimizer: str | None) -> dict[str, Any]:
    """What the metadata says of one saved model: its class, size and optimizer."""
    cls = type(model)
    return {"model_class": f"{cls.__module__}.{cls.__qualname__}", "param_count": param_sizes(model)[0],
            "optimizer": optimizer}


# -- save -------------------------------------------------------------------------


def save(spec: SaveSpec, taken: dict[str, Any] | None = None) -> Outcome:
    """Save the model (and optimizer) on every rank; returns timings and, on rank 0, the info.

    Names and the target are checked and agreed first, in the same call (an existing
    target comes back as ``exists`` from every rank, nothing written). ``taken``: states
    of named objects taken earlier (an autosave's loaders), kept instead of taking them
    now; an async save given it starts its write at once, not after a call's reply.
    """
    got = _checked(spec, taken)
    if isinstance(got, Outcome):
        return got
    model, optim, part, shared = got
    t0 = time.perf_counter()
    try:
        with taking_state():
            if spec.sharded:
                return _save_sharded(spec, model, optim, t0, part, shared, taken is not None)
            return _save_full(spec, model, optim, t0)
    except BaseException as exc:  # CheckpointException derives from BaseException
        if isinstance(exc, KeyboardInterrupt):
            raise
        return Outcome.failed(f"saving {spec.url!r} failed: {type(exc).__name__}: {exc}")
    finally:
        progress_feed.finish()


def _finish_sharded(spec: SaveSpec, model_meta: dict[str, Any], group: Any,
                    written: dict[str, dict[str, Any]], side: dict[str, bytes]) -> Outcome:
    """After this rank's files are written: gather their sizes and checksums (taken as
    they were written, ``written``: nothing is read back), rank 0 commits."""
    import torch.distributed as dist

    fs, target = url_to_fs(spec.url, spec.storage_options)
    target = target.rstrip("/")
    tmp = sibling(target, "tmp", spec.token)
    rank, ws = rank_and_world()
    mine = {n: rec for n, rec in written.items()
            if (n.startswith(f"__{rank}_") and n.endswith(".distcp")) or (rank == 0 and n == ".metadata")
            or n in (state_file(rank), _FAILED)}
    parts: list[Any] = [None] * ws
    if ws > 1:
        dist.all_gather_object(parts, mine, group=group)
    else:
        parts = [mine]
    failed = next((part[_FAILED]["error"] for part in parts if _FAILED in part), None)
    if failed is not None:
        if rank == 0:
            _cleanup(fs, tmp)
        return Outcome.failed(f"saving {spec.url!r} failed: {failed}")
    if rank != 0:
        return Outcome()
    files: dict[str, dict[str, int]] = {}
    for part in parts:
        files.update(part)
    commit_sharded(fs, tmp, target, model_meta, files, spec.token, side)
    removed = retain_last(fs, target, spec.keep_last) if spec.keep_last else []
    return Outcome(info=inspect(spec.url, storage_options=spec.storage_options), removed=removed)


def _to_write(spec: SaveSpec, saved: list[tuple[Any, Any]], shared: dict[str, Any],
              ) -> tuple[list[tuple[Any, Any]], dict[str, Any], dict[str, bytes]]:
    """(each saved model's and optimizer's state dicts, what DCP writes, the side files
    rank 0 writes) of ``spec``'s models: one in ``spec.layout``, or several, each under
    its own name (``formats.layouts.PARTS``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    flat = StateDictOptions(flatten_optimizer_state_dict=spec.layout == "torchtitan")  # as torchtitan keeps it
    states = [get_state_dict(m, optimizer_list(o), options=flat) for m, o in saved]
    if spec.parts:
        sd = {name: {"model": msd, **({"optim": osd} if o is not None else {})}
              for (name, o), (msd, osd) in zip(spec.parts, states)}
    else:
        sd = layout_state(spec, states[0][0], states[0][1] if saved[0][1] is not None else None, shared)
    return states, sd, side_files(spec, shared) if rank_and_world()[0] == 0 else {}


def _save_sharded(spec: SaveSpec, model: Any, optim: Any, t0: float, part: bytes | None, shared: dict[str, Any],
                  now: bool) -> Outcome:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    fs, target = url_to_fs(spec.url, spec.storage_options)
    tmp = sibling(target.rstrip("/"), "tmp", spec.token)
    saved = [(model, optim)] if not spec.parts else [named_objects(m, o) for m, o in spec.parts]
    states, sd, side = _to_write(spec, saved, shared)
    meta = _model_meta(model, spec, saved)
    writer = dcp_writer(fs, tmp, spec.storage_options)
    recorder = record_writer(writer, None if spec.async_save else progress_feed.add)
    written = recorder.records
    rank, _ = rank_and_world()

    def write_part() -> None:
        # a failure here is one rank's: it travels in the commit's gather, so that every
        # rank learns it there and none waits for a rank that gave up
        if part is not None:
            try:
                name, record = write(fs, tmp, rank, part)
                written[name] = record
            except Exception as exc:  # noqa: BLE001 - reported to every rank by _finish_sharded
                written[_FAILED] = {"error": f"rank {rank} could not write {state_file(rank)}: {exc}"}

    group = checkpoint_group()
    if not spec.async_save:
        progress_feed.start(state_bytes(sd), spec.report_progress)
        try:
            dcp.save(sd, storage_writer=writer, process_group=group)
            write_part()
        except BaseException:  # remove the unfinished folder, then re-raise
            if rank == 0:
                _cleanup(fs, tmp)
            raise
        out = _finish_sharded(spec, meta, group, written, side)
        out.seconds = time.perf_counter() - t0
        return out
    progress = SaveProgress(phase="staging", total=state_bytes(sd))
    cuda = any(p.device.type == "cuda" for m, _ in saved for p in m.parameters())
    if cuda:
        torch.cuda.current_stream().synchronize()  # the side stream copies finished values
    device = torch.cuda.current_device() if cuda else None
    copier = stager(cuda)
    # DCP's async_save (the copy and the upload thread) runs in the job, which starts
    # once this call has answered: started before, its threads held the GIL and the
    # cores against the reply for tens of ms on a busy host. Training waits on
    # ``staged`` before it changes a saved tensor.
    staged: Future = Future()
    hold_until_staged(staged, [(m, bool(set(msd) - {n for n, _ in m.named_parameters()}))
                               for (m, _), (msd, _) in zip(saved, states)])
    blocked = time.perf_counter() - t0

    def finish() -> Outcome:
        try:
            if device is not None:
                torch.cuda.set_device(device)  # a new thread starts on device 0
            resp = dcp.async_save(sd, storage_writer=writer, process_group=group, async_stager=copier)
            if not isinstance(resp, AsyncSaveResponse):  # what DCP returns when the stager copies in its thread
                raise TypeError(f"dcp.async_save returned a {type(resp).__name__}, not its two completions")
            resp.staging_completion.add_done_callback(lambda f: copied(f, staged, progress))
            resp.upload_completion.result()  # after the staging: ``staged`` is set by then
            write_part()
        except BaseException as exc:  # noqa: BLE001 - handed to the staging future and re-raised from it: training must not wait forever
            if not staged.done():  # async_save itself failed: training must not wait
                staged.set_exception(exc)
            if rank == 0:
                _cleanup(fs, tmp)
            return Outcome.failed(f"async save of {spec.url!r} failed: {type(exc).__name__}: {exc}")
        progress.phase = "committing"
        out = _finish_sharded(spec, meta, group, written, side)
        out.seconds = time.perf_counter() - t0
        return out

    def job() -> None:
        submit(spec.token, finish, progress,
               lambda: progress_feed.counted(recorder.written, progress.total, progress.phase == "committing"))

    job() if now else after_reply(job)
    return Outcome(blocked=blocked, pending=True)


def state_bytes(sd: Any) -> int:
    """Bytes of this rank's tensors in state dict ``sd`` (a DTensor counts its local shard)."""
    import torch

    n = 0
    for t in tree_leaves(sd):
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            n += local.numel() * local.element_size()
    return n


def _cleanup(fs: Any, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as exc:  # noqa: BLE001 - cleanup after a failed save; the save's own outcome says what failed
        log.warning("could not remove the unfinished checkpoint folder: %s", exc)


def _state_copy(osd: Mapping[str, Any]) -> dict[str, Any]:
    """Optimizer state dict ``osd`` with each parameter's state tensors cloned (its
    ``param_groups`` kept as they are)."""
    import torch

    return {
        "state": {f: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                  for f, s in osd["state"].items()},
        "param_groups": osd["param_groups"],
    }


def _save_full(spec: SaveSpec, model: Any, optim: Any, t0: float) -> Outcome:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer_list(optim), options=opts)
    meta = _model_meta(model, spec, [(model, optim)])
    rank, _ = rank_and_world()
    if rank != 0:
        took = time.perf_counter() - t0
        return Outcome(blocked=took, seconds=took)
    fs, target = url_to_fs(spec.url, spec.storage_options)
    if spec.async_save:
        # The background write must not see training's in-place updates: copy
        # anything that still shares storage with the live model or optimizer.
        live = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
        msd = {k: (v.clone() if isinstance(v, torch.Tensor) and v.data_ptr() in live else v) for k, v in msd.items()}
        if optim is not None:
            osd = _state_copy(osd)

    def write() -> Outcome:
        try:
            write_full(fs, target, spec.token, msd, osd if optim is not None else None, meta)
        except BaseException as exc:  # noqa: BLE001 - becomes the rank's failed outcome, agreed across ranks
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
    nbytes = state_bytes([msd, osd])
    progress_feed.start(nbytes, spec.report_progress)  # one file, written at once: the bar jumps to the end
    out = write()
    progress_feed.add(nbytes)
    out.blocked = out.seconds or 0.0
    return out
