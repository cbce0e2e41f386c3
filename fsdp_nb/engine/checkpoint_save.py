"""Checkpoint I/O on the ranks: save and load FSDP2 models and optimizers.

Called by ``fsdp_nb.checkpoint.save`` / ``load`` on every rank at once. Functions
return an ``Outcome`` (``fsdp_nb.wire.checkpoint``), which carries the exception
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
  job that starts once the call has answered (``call_channel.after_reply``), and the
  optimizer's next step waits for the copy (``fsdp_nb.engine.async_saves``).
- checkpoint collectives (DCP's planning, the commit's gather, load's agreement) run
  on a dedicated gloo group (``checkpoint_group``), as torchtitan's do: it has the CPU
  backend DCP's async save requires on NCCL worlds, and background writes never
  interleave with training collectives on the default group.
- load: ``fsdp_nb.engine.checkpoint_load``, on the same checkpoint group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from ..formats.atomic import commit_sharded, retain_last
from ..formats.checksums import record_writer
from ..formats.fullfile import write_full
from ..formats.inspect import inspect
from ..formats.storage import dcp_writer, sibling, url_to_fs
from ..torch_compat import tree_leaves
from ..wire.checkpoint import LoadSpec, Outcome, SaveProgress, SaveSpec
from . import progress_feed
from .async_saves import copied, drain, hold_until_staged, stager, submit
from .call_channel import after_reply
from .hugging_face import hugging_face_meta
from .namespace import user_ns
from .wrap import param_sizes

log = logging.getLogger("fsdp_nb")

__all__ = [
    "agree", "any_rank", "begin", "checkpoint_group", "named_objects", "rank_and_world", "save", "state_bytes",
]

_GROUP: tuple[Any, Any] | None = None


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


def rank_and_world() -> tuple[int, int]:
    """(rank, world size), or (0, 1) outside a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def begin(spec: SaveSpec | LoadSpec) -> tuple[Any, Any] | Outcome:
    """The spec's model and optimizer on this rank, once this rank's async saves have
    finished; or the failure outcome naming what is missing or wrong."""
    try:
        objects = named_objects(spec.model, spec.optimizer)
    except (NameError, TypeError) as exc:
        return Outcome.failed(exc)
    drain()
    return objects


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: one all-reduce on the checkpoint group."""
    import torch
    import torch.distributed as dist

    _, ws = rank_and_world()
    if ws == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=checkpoint_group())
    return bool(t.item())


def agree(mine: Outcome | None) -> Outcome | None:
    """Every rank learns every rank's outcome so far (None: nothing to report) and
    returns the same one: the first failure, else the first report, else None. Run
    before anything is written or changed, so no rank goes on alone into a collective.

    When no rank has anything to report (every call that goes ahead) this is one
    all-reduce of a flag; the outcomes are gathered only when some rank has one.
    """
    import torch.distributed as dist

    if not any_rank(mine is not None):
        return None
    _, ws = rank_and_world()
    parts: list[Any] = [mine]
    if ws > 1:
        parts = [None] * ws
        dist.all_gather_object(parts, mine, group=checkpoint_group())
    reported = [p for p in parts if p is not None]
    return next((p for p in reported if not p.ok), reported[0] if reported else None)


def _checked(spec: SaveSpec) -> tuple[Any, Any] | Outcome:
    """The spec's model and optimizer once every rank found them and rank 0 found no
    checkpoint in the way (unless overwriting); else the same outcome on every rank."""
    got = begin(spec)
    mine = got if isinstance(got, Outcome) else None
    rank, _ = rank_and_world()
    if mine is None and rank == 0 and spec.check_exists:
        try:
            fs, p = url_to_fs(spec.url, spec.storage_options)
            if fs.exists(p.rstrip("/")):
                mine = Outcome(exists=True)
        except Exception as exc:  # noqa: BLE001 - whatever the store raises, the ranks agree on one clear outcome
            mine = Outcome.failed(f"cannot reach {spec.url!r}: {type(exc).__name__}: {exc}", OSError)
    return agree(mine) or got


def checkpoint_group() -> Any:
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
    cls = type(model)
    meta.update(
        world_size=ws,
        mesh=mesh,
        model=spec.model,
        optimizer=spec.optimizer,
        model_class=f"{cls.__module__}.{cls.__qualname__}",
        param_count=param_sizes(model)[0],
        **hugging_face_meta(model),
    )
    return meta


# -- save -------------------------------------------------------------------------


def save(spec: SaveSpec) -> Outcome:
    """Save the model (and optimizer) on every rank; returns timings and, on rank 0, the info.

    Names and the target are checked and agreed first, in the same call (an existing
    target comes back as ``exists`` from every rank, nothing written).
    """
    got = _checked(spec)
    if isinstance(got, Outcome):
        return got
    model, optim = got
    t0 = time.perf_counter()
    try:
        if spec.sharded:
            return _save_sharded(spec, model, optim, t0)
        return _save_full(spec, model, optim, t0)
    except BaseException as exc:  # CheckpointException derives from BaseException
        if isinstance(exc, KeyboardInterrupt):
            raise
        return Outcome.failed(f"saving {spec.url!r} failed: {type(exc).__name__}: {exc}")
    finally:
        progress_feed.finish()


def _finish_sharded(spec: SaveSpec, model_meta: dict[str, Any], group: Any,
                    written: dict[str, dict[str, Any]]) -> Outcome:
    """After this rank's files are written: gather their sizes and checksums (taken as
    they were written, ``written``: nothing is read back), rank 0 commits."""
    import torch.distributed as dist

    fs, target = url_to_fs(spec.url, spec.storage_options)
    target = target.rstrip("/")
    tmp = sibling(target, "tmp", spec.token)
    rank, ws = rank_and_world()
    mine = {n: rec for n, rec in written.items()
            if (n.startswith(f"__{rank}_") and n.endswith(".distcp")) or (rank == 0 and n == ".metadata")}
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
    commit_sharded(fs, tmp, target, model_meta, files, spec.token, _side_files(spec))
    removed = retain_last(fs, target, spec.keep_last) if spec.keep_last else []
    return Outcome(info=inspect(spec.url, storage_options=spec.storage_options), removed=removed)


def _save_sharded(spec: SaveSpec, model: Any, optim: Any, t0: float) -> Outcome:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    fs, target = url_to_fs(spec.url, spec.storage_options)
    tmp = sibling(target.rstrip("/"), "tmp", spec.token)
    flat = StateDictOptions(flatten_optimizer_state_dict=spec.layout == "torchtitan")  # as torchtitan keeps it
    msd, osd = get_state_dict(model, [optim] if optim is not None else [], options=flat)
    sd = _layout_state(spec, msd, osd if optim is not None else None)
    meta = _model_meta(model, spec)
    writer = dcp_writer(fs, tmp, spec.storage_options)
    recorder = record_writer(writer, None if spec.async_save else progress_feed.add)
    written = recorder.records
    rank, _ = rank_and_world()
    group = checkpoint_group()
    if not spec.async_save:
        progress_feed.start(state_bytes(sd), spec.report_progress)
        try:
            dcp.save(sd, storage_writer=writer, process_group=group)
        except BaseException:  # remove the unfinished folder, then re-raise
            if rank == 0:
                _cleanup(fs, tmp)
            raise
        out = _finish_sharded(spec, meta, group, written)
        out.seconds = time.perf_counter() - t0
        return out
    progress = SaveProgress(phase="staging", total=state_bytes(sd))
    cuda = any(p.device.type == "cuda" for p in model.parameters())
    if cuda:
        torch.cuda.current_stream().synchronize()  # the side stream copies finished values
    device = torch.cuda.current_device() if cuda else None
    copier = stager(cuda)
    # DCP's async_save (the copy and the upload thread) runs in the job, which starts
    # once this call has answered: started before, its threads held the GIL and the
    # cores against the reply for tens of ms on a busy host. Training waits on
    # ``staged`` before it changes a saved tensor.
    staged: Future = Future()
    buffers = set(msd) - {n for n, _ in model.named_parameters()}
    hold_until_staged(staged, optim, model if buffers else None)
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
        except BaseException as exc:  # noqa: BLE001 - handed to the staging future and re-raised from it: training must not wait forever
            if not staged.done():  # async_save itself failed: training must not wait
                staged.set_exception(exc)
            if rank == 0:
                _cleanup(fs, tmp)
            return Outcome.failed(f"async save of {spec.url!r} failed: {type(exc).__name__}: {exc}")
        progress.phase = "committing"
        out = _finish_sharded(spec, meta, group, written)
        out.seconds = time.perf_counter() - t0
        return out

    after_reply(lambda: submit(spec.token, finish, progress, lambda: recorder.written))
    return Outcome(blocked=blocked, pending=True)


def _layout_state(spec: SaveSpec, msd: dict[str, Any], osd: dict[str, Any] | None) -> dict[str, Any]:
    """What DCP writes for ``spec.layout``: ``{"model", "optim"}`` (fsdp_nb's),
    ``{"model", "optimizer"}`` (Lightning Fabric's), or torchtitan's model keys at the
    top beside ``optimizer`` (flat) and each ``extra`` entry as one of its states."""
    if spec.layout == "lightning":
        return {"model": msd, **({"optimizer": osd} if osd is not None else {})}
    if spec.layout != "torchtitan":
        return {"model": msd, **({"optim": osd} if osd is not None else {})}
    extra = spec.meta.get("extra", {})
    clash = sorted({k.split(".", 1)[0] for k in msd} & (set(extra) | {"optimizer"}))
    if clash:
        raise ValueError(
            f"the model's own names start with {', '.join(map(repr, clash))}, which torchtitan's layout "
            "keeps for the optimizer and the extra states; rename the extra entries"
        )
    return {**msd, **extra, **({"optimizer": osd} if osd is not None else {})}


def _side_files(spec: SaveSpec) -> dict[str, bytes]:
    """Lightning's ``meta.pt``: everything ``fabric.load`` returns besides the model and
    the optimizer (``extra``), as ``torch.save`` writes it."""
    if spec.layout != "lightning":
        return {}
    import io

    import torch

    buf = io.BytesIO()
    torch.save(dict(spec.meta.get("extra", {})), buf)
    return {"meta.pt": buf.getvalue()}


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
    msd, osd = get_state_dict(model, [optim] if optim is not None else [], options=opts)
    meta = _model_meta(model, spec)
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
