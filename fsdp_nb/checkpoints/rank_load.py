"""Loading a checkpoint on the ranks: verify, check, read everything, then copy.

Called by ``fsdp_nb.checkpoints.load`` on every rank at once. Files are verified first
(``fsdp_nb.formats.reader``: sizes up front, each stored item's checksum as it is
read), keys and shapes are checked against the model, every problem is agreed by all
ranks (one clear error), and every rank reads all it needs before any rank copies a
byte into its model, so a failure leaves every model as it was.

- a DCP folder (fsdp_nb's, plain ``dcp.save``'s, another trainer's): ``dcp_load``;
- safetensors (fsdp_nb's full file, a Hugging Face file or folder): each rank reads
  the slice of every tensor it owns (``safetensors_layout.PieceReader``);
- a ``.pt`` file: rank 0 reads it and broadcasts.

Collectives run on the checkpoint group (``checkpoint_group.checkpoint_group``).
"""

from __future__ import annotations

import time
from typing import Any

from ..engine.checkpoint_group import agree, rank_and_world
from ..engine.step import owner, taking_state
from ..errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ..formats.fullfile import full_suffix, read_full
from ..formats.keys import optim_key
from ..formats.run_state import RNG, state_file
from ..formats.safetensors_layout import (
    PieceReader,
    Stored,
    is_safetensors_folder,
    optim_state,
    read_layout,
)
from ..formats.storage import url_to_fs
from ..models.rank_hugging_face import tied_parameters
from ..torch_compat import compute_local_shape_and_global_offset, local_tensor
from . import rank_progress as progress_feed
from .rank_dcp_load import load_dcp
from .rank_layout_state import trainer_states
from .rank_load_checks import (
    agree_problem,
    apply_read,
    match,
    optim_entries,
    shape_problems,
    shapes,
)
from .rank_run_state import cuda_rng_problem, read_part, restore
from .rank_save import begin, named_objects, optimizer_list, state_bytes
from .wire_checkpoint import LoadSpec, Outcome

__all__ = ["load"]



def load(spec: LoadSpec) -> Outcome:
    """Load a checkpoint into the model (and optimizer) on every rank."""
    with taking_state():
        return _load(spec)


def _load(spec: LoadSpec) -> Outcome:
    got = begin(spec)
    # a name missing on one rank only (a replaced rank a setup did not give it) must not
    # leave the others in the next collective: every rank learns it here
    bad = agree(got if isinstance(got, Outcome) else None)
    if bad is not None or isinstance(got, Outcome):
        return bad or Outcome.failed("checkpoint load: the ranks did not agree on its objects")
    model, optim = got
    fs, p = url_to_fs(spec.url, spec.storage_options)
    p = p.rstrip("/")
    try:
        exists = fs.exists(p)
        isdir = exists and fs.isdir(p)
    except Exception as exc:  # noqa: BLE001 - whatever the store raises, the ranks agree on one clear outcome
        return Outcome.failed(f"cannot reach {spec.url!r}: {type(exc).__name__}: {exc}", FileNotFoundError)
    if not exists:
        return Outcome.failed(f"no checkpoint at {spec.url!r}", FileNotFoundError)
    t0 = time.perf_counter()
    # this rank's own part (random state, named objects) is read and checked with the
    # rest, before anything changes, and given back once the model and optimizer are
    part, rng, problem, cls = _own_part(spec, fs, p, isdir)
    bad = agree_problem(problem, cls)
    if bad:
        return bad
    try:
        if isdir and is_safetensors_folder(fs, p):
            out = _load_safetensors(spec, fs, p, model, optim)
        elif isdir:
            out = _load_parts(spec, fs, p) if spec.parts else load_dcp(spec, fs, p, model, optim)
        elif spec.parts:
            return Outcome.failed(f"{spec.url!r} is one file, which holds one model: several load from a sharded "
                                  "checkpoint saved with them")
        elif full_suffix(p) == ".safetensors":
            out = _load_safetensors(spec, fs, p, model, optim)
        elif full_suffix(p):
            out = _load_full(spec, fs, p, model, optim)
        else:
            return Outcome.failed(f"{spec.url!r} is neither a checkpoint folder nor a .pt / .safetensors file")
        if out.ok and part is not None:
            states = part["state"] if part["state"] is not None else trainer_states(out.extra or {}, spec.url,
                                                                                     spec.weights_only)
            restore(states, spec.state, part.get(RNG) if rng else None)
        if out.ok:
            owner().loaded(out.extra)
    except BaseException as exc:  # every failure but Ctrl-C becomes the rank's outcome, agreed
        if isinstance(exc, KeyboardInterrupt):
            raise
        return Outcome.failed(f"loading {spec.url!r} failed: {type(exc).__name__}: {exc}")
    finally:
        progress_feed.finish()
    out.seconds = time.perf_counter() - t0
    return out


def _own_part(spec: LoadSpec, fs: Any, p: str, isdir: bool,
              ) -> tuple[dict[str, Any] | None, bool, str | None, type[BaseException]]:
    """This rank's own part of the checkpoint at ``p`` (``read_part``), whether to put its
    random state back, and the problem that refuses the load (None) and its class: a
    CheckpointError of ``read_part``, or a CUDA random state this rank cannot place."""
    rank, ws = rank_and_world()
    try:
        part, rng = read_part(spec, fs, p, isdir, rank, ws)
    except CheckpointError as exc:
        return None, False, str(exc), type(exc)
    problem = None
    if rng and part is not None:
        problem = cuda_rng_problem(part.get(RNG), f"checkpoint {spec.url!r}: file {state_file(rank)!r}")
    return part, rng, problem, CheckpointError


def _load_parts(spec: LoadSpec, fs: Any, p: str) -> Outcome:
    """Several models (``spec.parts``) from the DCP folder ``p``, one after another, each
    from the part of its own name; the first failure ends it (earlier ones stay loaded)."""
    import dataclasses

    out = Outcome()
    for name, optim_name in spec.parts:
        model, optim = named_objects(name, optim_name)
        out = load_dcp(dataclasses.replace(spec, model=name, optimizer=optim_name, parts=()), fs, p, model, optim)
        if not out.ok:
            return out
    return out


def _load_safetensors(spec: LoadSpec, fs: Any, p: str, model: Any, optim: Any) -> Outcome:
    """Safetensors weights (fsdp_nb's full file, or a Hugging Face file / folder): each rank
    reads only the slices of each tensor it owns, into fresh tensors, then sets them."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    url, strict = spec.url, spec.strict
    problem: str | None = None
    cls: type[BaseException] = CheckpointError
    try:
        ck = read_layout(fs, p, url)
    except CorruptCheckpointError as exc:
        problem, cls = str(exc), CorruptCheckpointError
    if problem is None:
        msd, osd = get_state_dict(model, optimizer_list(optim))
        exp_o = None if optim is None else {
            optim_key(fqn, key): tuple(v.shape) for fqn, key, v in optim_entries(osd) if isinstance(v, torch.Tensor)}
        problem, usable = match(
            url, strict, shapes(msd), {k: s.shape for k, s in ck.model.items()}, tied_parameters(model), exp_o,
            {k: s.shape for k, s in ck.optim.items()} if ck.optim_other is not None else None,
            "model weights only")
    bad = agree_problem(problem, cls)
    if bad:
        return bad
    fresh_o: dict[str, Any] = {}
    progress_feed.start(state_bytes([{k: msd[k] for k in usable}, osd]), spec.report_progress)
    if spec.fill and optim is None:
        return _fill(spec, fs, ck, msd, usable)
    try:
        with PieceReader(fs, progress_feed.add) as r:
            fresh_m = {k: _read_owned(r, ck.model[k], msd[k]) for k in usable}
            if optim is not None and ck.optim_other is not None:  # match() refused a file without optimizer state
                fresh_o = optim_state(ck.optim_other, (
                    (fqn, key, _read_owned(r, ck.optim[optim_key(fqn, key)], like))
                    for fqn, key, like in optim_entries(osd) if isinstance(like, torch.Tensor)))
    except Exception as exc:  # noqa: BLE001 - any read failure becomes the agreed CorruptCheckpointError; the model is unchanged
        problem, cls = (f"checkpoint {url!r}: reading failed ({type(exc).__name__}: {exc}); "
                        "the model is unchanged"), CorruptCheckpointError
    bad = agree_problem(problem, cls)
    if bad:
        return bad
    return apply_read(model, optim, fresh_m, fresh_o, strict, ck.meta)


def _fill(spec: LoadSpec, fs: Any, ck: Any, msd: dict, usable: set[str]) -> Outcome:
    """Read each stored piece this rank owns straight into the model's own shard (a
    model ``wrap(weights=)`` just built: nothing to keep if it fails): at most one piece
    in memory besides the model. The ranks agree on the outcome."""
    problem: str | None = None
    try:
        with PieceReader(fs, progress_feed.add) as r:
            for k in sorted(usable):
                target = msd[k]
                piece = _read_owned(r, ck.model[k], target)
                local_tensor(target).copy_(local_tensor(piece))
                del piece
    except Exception as exc:  # noqa: BLE001 - any read failure becomes the agreed CorruptCheckpointError
        problem = f"checkpoint {spec.url!r}: reading failed ({type(exc).__name__}: {exc})"
    bad = agree_problem(problem, CorruptCheckpointError)
    return bad or Outcome(extra=ck.meta.get("extra", {}), world_size=ck.meta.get("world_size"))


def _read_owned(r: PieceReader, st: Stored, like: Any) -> Any:
    """The part of stored tensor ``st`` this rank owns in ``like`` (a DTensor shard, or a
    whole tensor), as a new tensor of ``like``'s kind, dtype and device."""
    from torch.distributed.tensor import DTensor

    if isinstance(like, DTensor):
        shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
        local = r.read(st, tuple(offset), tuple(shape)).to(device=like.device, dtype=like.dtype)
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    return r.read(st).to(device=like.device, dtype=like.dtype)


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
            full_m, full_o, meta = read_full(fs, p, url, spec.weights_only)
            found = {k: tuple(v.shape) for k, v in full_m.items() if isinstance(v, torch.Tensor)}
            problem, usable = shape_problems(url, expected, found, "model", strict)
            if problem is None:
                full_m = {k: v for k, v in full_m.items() if k in usable}
                if set(usable) != set(expected):
                    problem = _partial_full_problem(url, expected, usable)
            if problem is None and optim is not None and not full_o:
                problem = f"checkpoint {url!r} has no optimizer state (it was saved without optimizer=)"
        except (CorruptCheckpointError, UnsafeCheckpointError) as exc:
            problem, cls = str(exc), type(exc)
    bad = agree_problem(problem, cls)
    if bad:
        return bad
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(model, full_m if rank == 0 else {}, options=opts)
    if optim is not None:
        set_optimizer_state_dict(model, optim, full_o if rank == 0 and full_o is not None else {}, options=opts)
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
