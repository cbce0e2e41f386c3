"""Loading a checkpoint on the ranks: verify, check, read everything, then copy.

Called by ``fsdp_nb.checkpoint.load`` on every rank at once. Files are verified first
(``fsdp_nb.checkpoint.format.reader``: sizes up front, each stored item's checksum as it is
read), keys and shapes are checked against the model, every problem is agreed by all
ranks (one clear error), and every rank reads all it needs before any rank copies a
byte into its model, so a failure leaves every model as it was.

- a DCP folder (fsdp_nb's, or plain ``dcp.save``'s): DCP reads and reshards; the
  reader reads and checks this rank's items, and once every rank has, reads them again
  (from the page cache) into the model's own shards (``checkpoint.dcp_reader``);
- safetensors (fsdp_nb's full file, a Hugging Face file or folder): each rank reads
  the slice of every tensor it owns (``safetensors_layout.PieceReader``);
- a ``.pt`` file: rank 0 reads it and broadcasts.

Collectives run on the checkpoint group (``checkpoint_save.checkpoint_group``).
"""

from __future__ import annotations

import json
import logging
import posixpath
import time
from typing import Any

from ..checkpoint.format.atomic import read_marker
from ..checkpoint.format.dcp_reader import can_stage, safe_reader
from ..checkpoint.format.fullfile import full_suffix, read_full
from ..checkpoint.format.inspect import dcp_files_problem, read_dcp_metadata
from ..checkpoint.format.keys import (
    MODEL,
    flat_optim_state,
    is_bare,
    is_model_key,
    optim_key,
    optim_root,
)
from ..checkpoint.format.metadata import META_FILE
from ..checkpoint.format.pickles import load_planner, refuse_code
from ..checkpoint.format.reader import named_corruption, open_sharded
from ..checkpoint.format.safetensors_layout import (
    PieceReader,
    Stored,
    is_safetensors_folder,
    optim_state,
    read_layout,
)
from ..checkpoint.format.side_files import data_folder, side_extra
from ..checkpoint.format.storage import is_temporary, url_to_fs
from ..errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ..wire.checkpoint import LoadSpec, Outcome
from . import progress_feed
from .checkpoint_save import agree, any_rank, begin, checkpoint_group, rank_and_world, state_bytes
from .hugging_face import tied_parameters

__all__ = ["load"]

log = logging.getLogger("fsdp_nb")


def _agree(problem: str | None, cls: type[BaseException] = CheckpointError) -> Outcome | None:
    """All ranks learn every rank's problem; the same failure outcome (or None) on each."""
    return agree(Outcome.failed(problem, cls) if problem else None)


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


def _match(url: str, strict: bool, msd: dict, osd: dict, optim: Any, prefix: str,
           model_found: dict[str, tuple], optim_found: dict[str, tuple] | None,
           no_optim: str, tied: dict[str, str] | None = None) -> tuple[str | None, set[str]]:
    """(problem or None, stored model keys to load): the stored keys and shapes against this
    rank's model state dict (keys spelled ``prefix + fqn``) and, when loading one, optimizer.
    ``optim_found`` is None when the checkpoint has no optimizer state (``no_optim`` says why).
    ``tied``: a tied copy (``lm_head.weight``) the checkpoint leaves out, as
    ``save_pretrained`` does, is filled by loading the tensor it shares."""
    import torch

    expected = {prefix + k: tuple(v.shape) for k, v in msd.items() if isinstance(v, torch.Tensor)}
    for dup, src in (tied or {}).items():
        if prefix + dup not in model_found and prefix + src in model_found:
            expected.pop(prefix + dup, None)
    problem, usable = _shape_problems(url, expected, model_found, "model", strict)
    if problem is None and optim is not None:
        if optim_found is None:
            problem = f"checkpoint {url!r} has no optimizer state ({no_optim})"
        else:
            exp_o = {k: tuple(v.shape) for k, v in _flat_optim(osd).items() if isinstance(v, torch.Tensor)}
            problem, _ = _shape_problems(url, exp_o, optim_found, "optimizer", True)
    return problem, usable


def load(spec: LoadSpec) -> Outcome:
    """Load a checkpoint into the model (and optimizer) on every rank."""
    got = begin(spec)
    if isinstance(got, Outcome):
        return got
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
    try:
        if isdir and is_safetensors_folder(fs, p):
            out = _load_safetensors(spec, fs, p, model, optim)
        elif isdir:
            out = _load_sharded(spec, fs, *data_folder(fs, p), model, optim)
        elif full_suffix(p) == ".safetensors":
            out = _load_safetensors(spec, fs, p, model, optim)
        elif full_suffix(p):
            out = _load_full(spec, fs, p, model, optim)
        else:
            return Outcome.failed(f"{spec.url!r} is neither a checkpoint folder nor a .pt / .safetensors file")
    except BaseException as exc:  # every failure but Ctrl-C becomes the rank's outcome, agreed
        if isinstance(exc, KeyboardInterrupt):
            raise
        return Outcome.failed(f"loading {spec.url!r} failed: {type(exc).__name__}: {exc}")
    finally:
        progress_feed.finish()
    out.seconds = time.perf_counter() - t0
    return out


def _open_folder(spec: LoadSpec, fs: Any, p: str, side: str) -> tuple[Any, Any, dict]:
    """(DCP metadata, reader, fsdp_nb metadata) of a sharded folder, checked as far as
    ``spec.verify`` asks; CheckpointError / CorruptCheckpointError saying why not."""
    url = spec.url
    rank, ws = rank_and_world()
    marker = read_marker(fs, p)
    try:
        meta = json.loads(fs.cat_file(posixpath.join(p, META_FILE)))
    except (FileNotFoundError, ValueError):
        meta = {}
    anyway = "; pass verify=False to load it anyway"
    if marker is not None and spec.verify:
        md, reader = open_sharded(fs, p, url, marker, spec.storage_options,
                                  share=sorted(marker.get("files", {}))[rank::ws], on_read=progress_feed.add,
                                  before_commit=_every_rank_read, weights_only=spec.weights_only)
        return md, reader, meta
    if marker is None and (meta or is_temporary(p)) and spec.verify:
        raise CheckpointError(
            f"checkpoint {url!r} is incomplete: it has no completion marker "
            f"(an interrupted or unfinished save); refusing to load it{anyway}"
        )
    md = read_dcp_metadata(fs, p, url, weights_only=spec.weights_only)
    if spec.weights_only:
        refuse_code(fs, p, url, md)
    if not meta and (extra := side_extra(fs, side, url, spec.weights_only)) is not None:
        meta = {"extra": extra}  # another trainer's folder: its other state
    if marker is None and spec.verify:  # a plain dcp.save folder: what can be checked is
        problem = dcp_files_problem(fs, p, md)
        if problem:
            raise CheckpointError(
                f"checkpoint {url!r} (written by plain dcp.save, without checksums) cannot be "
                f"verified: {problem}{anyway}"
            )
        log.info("%s was written by plain dcp.save: its files are complete, but carry no checksums", url)
    return md, safe_reader(fs, p, spec.storage_options or {}, metadata=md, on_read=progress_feed.add,
                           before_commit=_every_rank_read, weights_only=spec.weights_only), meta


def _every_rank_read(read_all: bool) -> bool:
    """Told by the reader whether this rank read (and checked) its whole share; whether
    every rank did, so that the copy into the model happens on all ranks or none."""
    return not any_rank(not read_all)


def _over_model(model: Any, msd: dict[str, Any]) -> bool:
    """Whether every entry of state dict ``msd`` is a tensor over the model's own
    parameter or buffer memory, so that loading into it loads the model."""
    import itertools

    import torch

    def base(t: Any) -> int:
        return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr()

    live = {base(t) for t in itertools.chain(model.parameters(), model.buffers())}
    return all(isinstance(v, torch.Tensor) and base(v) in live for v in msd.values())


def _load_sharded(spec: LoadSpec, fs: Any, p: str, side: str, model: Any, optim: Any) -> Outcome:
    """A DCP folder ``p`` (``side``: the file of a trainer's other state, ``data_folder``)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.utils._pytree import tree_map_only

    url, strict = spec.url, spec.strict
    problem: str | None = None
    cls: type[BaseException] = CheckpointError
    try:
        md, reader, meta = _open_folder(spec, fs, p, side)
    except CheckpointError as exc:
        problem, cls = str(exc), type(exc)
    usable: set[str] = set()
    bare, root = False, "optim"
    if problem is None:
        stored = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
        msd, osd = get_state_dict(model, [optim] if optim is not None else [])
        bare = is_bare(stored, msd)
        prefix = "" if bare else MODEL
        found = {k: s for k, s in stored.items() if is_model_key(k, bare)}
        root = optim_root(stored)  # "optimizer" in Lightning Fabric's and torchtitan's folders
        found_o = {"optim." + k[len(root) + 1:]: s for k, s in stored.items() if k.startswith(root + ".state.")}
        has_optim = bool(found_o) or any(k.startswith(root + ".") for k in md.state_dict_metadata)
        problem, usable = _match(url, strict, msd, osd, optim, prefix, found, found_o if has_optim else None,
                                 "it was saved without optimizer=", tied_parameters(model))
    bad = _agree(problem, cls)
    if bad:
        return bad
    # The reader reads and checks everything before it copies anything, on every rank
    # (``_every_rank_read``), so DCP may load straight into the model's own tensors. Where
    # it cannot (a compressed item; a state dict that is not over the model's memory),
    # read into fresh tensors, and copy them into the model once every rank has all.
    in_place = can_stage(md) and _over_model(model, msd)
    if in_place:
        into_m = {k: v for k, v in msd.items() if prefix + k in usable}
        into_o = osd if optim is not None else None
    else:
        into_m = {k: torch.empty_like(v) for k, v in msd.items() if prefix + k in usable}
        into_o = tree_map_only(torch.Tensor, torch.empty_like, osd) if optim is not None else None
    sd: dict[str, Any] = dict(into_m) if bare else {"model": into_m}
    if into_o is not None:
        sd[root] = into_o
    progress_feed.start(state_bytes(sd), spec.report_progress)
    # dcp.load ends in a collective that raises on every rank if any rank failed
    try:
        with named_corruption(url):
            dcp.load(
                sd, storage_reader=reader,
                planner=load_planner(spec.weights_only, allow_partial_load=not strict),
                process_group=checkpoint_group(),
            )
    except CorruptCheckpointError as exc:
        return Outcome.failed(exc)
    return _apply(model, optim, None if in_place else into_m, into_o, strict, meta)


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
        msd, osd = get_state_dict(model, [optim] if optim is not None else [])
        problem, usable = _match(
            url, strict, msd, osd, optim, "", {k: s.shape for k, s in ck.model.items()},
            {k: s.shape for k, s in ck.optim.items()} if ck.optim_other is not None else None,
            "model weights only", tied_parameters(model))
    bad = _agree(problem, cls)
    if bad:
        return bad
    fresh_o: dict[str, Any] = {}
    progress_feed.start(state_bytes([{k: msd[k] for k in usable}, osd]), spec.report_progress)
    if spec.fill and optim is None:
        return _fill(spec, fs, ck, msd, usable)
    try:
        with PieceReader(fs, progress_feed.add) as r:
            fresh_m = {k: _read_owned(r, ck.model[k], msd[k]) for k in usable}
            if optim is not None:
                fresh_o = optim_state(ck.optim_other, (
                    (fqn, key, _read_owned(r, ck.optim[optim_key(fqn, key)], like))
                    for fqn, entries in osd["state"].items() for key, like in entries.items()
                    if isinstance(like, torch.Tensor)))
    except Exception as exc:  # noqa: BLE001 - any read failure becomes the agreed CorruptCheckpointError; the model is unchanged
        problem, cls = (f"checkpoint {url!r}: reading failed ({type(exc).__name__}: {exc}); "
                        "the model is unchanged"), CorruptCheckpointError
    bad = _agree(problem, cls)
    if bad:
        return bad
    return _apply(model, optim, fresh_m, fresh_o, strict, ck.meta)


def _apply(model: Any, optim: Any, msd: dict | None, osd: dict | None, strict: bool, meta: dict) -> Outcome:
    """Set what this rank read (every rank read all of it) into the optimizer and, unless
    it was read in place (``msd`` None), the model; the outcome carries the checkpoint's
    ``extra`` and world size."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
        set_state_dict,
    )

    opts = StateDictOptions(strict=strict)
    if msd is not None:
        for dup, src in tied_parameters(model).items():  # left out of the file: it shares src's tensor
            if dup not in msd and src in msd:
                msd[dup] = msd[src]
        set_state_dict(model, [optim] if optim is not None else [], model_state_dict=msd,
                       optim_state_dict=osd if optim is not None else {}, options=opts)
    elif optim is not None:
        set_optimizer_state_dict(model, [optim], osd, options=opts)
    return Outcome(extra=meta.get("extra", {}), world_size=meta.get("world_size"))


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
                getattr(target, "_local_tensor", target).copy_(getattr(piece, "_local_tensor", piece))
                del piece
    except Exception as exc:  # noqa: BLE001 - any read failure becomes the agreed CorruptCheckpointError
        problem = f"checkpoint {spec.url!r}: reading failed ({type(exc).__name__}: {exc})"
    bad = _agree(problem, CorruptCheckpointError)
    return bad or Outcome(extra=ck.meta.get("extra", {}), world_size=ck.meta.get("world_size"))


def _read_owned(r: PieceReader, st: Stored, like: Any) -> Any:
    """The part of stored tensor ``st`` this rank owns in ``like`` (a DTensor shard, or a
    whole tensor), as a new tensor of ``like``'s kind, dtype and device."""
    from torch.distributed.tensor import DTensor

    if isinstance(like, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

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
            problem, usable = _shape_problems(url, expected, found, "model", strict)
            if problem is None:
                full_m = {k: v for k, v in full_m.items() if k in usable}
                if set(usable) != set(expected):
                    problem = _partial_full_problem(url, expected, usable)
            if problem is None and optim is not None and not full_o:
                problem = f"checkpoint {url!r} has no optimizer state (it was saved without optimizer=)"
        except (CorruptCheckpointError, UnsafeCheckpointError) as exc:
            problem, cls = str(exc), type(exc)
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
