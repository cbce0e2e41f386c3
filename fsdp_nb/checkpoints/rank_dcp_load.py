"""Loading a DCP folder on the ranks, in whichever trainer's layout it was written.

fsdp_nb's own folders, plain ``dcp.save`` folders, and those of Lightning (Fabric and
Trainer), torchtitan, OLMo-core and Accelerate (``formats.layouts``): the
layout says under which keys the model and optimizer are stored, and where the rest of
the trainer's state is; it is returned as ``extra``. DCP reads and reshards; the
checked reader reads and verifies this rank's items, and once every rank has, reads
them again (from the page cache; a remote store's, from the copy it fetched once) into
the model's own shards.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
from typing import Any

from ..engine.checkpoint_group import any_rank, checkpoint_group, rank_and_world
from ..errors import CheckpointError, CorruptCheckpointError
from ..formats.atomic import read_marker
from ..formats.dcp_reader import can_stage, safe_reader
from ..formats.inspect import dcp_files_problem, read_dcp_metadata
from ..formats.keys import nest_keys, rekey_optim
from ..formats.layouts import Layout, find_layout
from ..formats.metadata import META_FILE
from ..formats.pickles import load_planner, refuse_code
from ..formats.reader import named_corruption, open_sharded
from ..formats.side_files import side_extra
from ..formats.storage import is_temporary
from ..formats.titan_loader import LOADER
from ..models.rank_hugging_face import tied_parameters
from ..torch_compat import tree_map_only
from . import rank_progress as progress_feed
from .rank_load_checks import agree_problem, apply_read, match, optim_entries, shapes
from .rank_save import state_bytes
from .wire_checkpoint import LoadSpec, Outcome

__all__ = ["load_dcp"]

log = logging.getLogger("fsdp_nb")


def _open_folder(spec: LoadSpec, fs: Any, p: str) -> tuple[Any, Any, dict]:
    """(DCP metadata, reader, fsdp_nb metadata) of the DCP folder ``p``, checked as far
    as ``spec.verify`` asks; CheckpointError / CorruptCheckpointError saying why not."""
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


def over_model(model: Any, msd: dict[str, Any]) -> bool:
    """Whether every entry of state dict ``msd`` is a tensor over the model's own
    parameter or buffer memory, so that loading into it loads the model."""
    import itertools

    import torch

    def base(t: Any) -> int:
        return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr()

    live = {base(t) for t in itertools.chain(model.parameters(), model.buffers())}
    return all(isinstance(v, torch.Tensor) and base(v) in live for v in msd.values())


class _Plan:
    """What one rank found before reading: the layout, the opened folders, the model's
    and optimizer's state dicts, and the stored model keys to load."""

    def __init__(self, spec: LoadSpec, fs: Any, p: str, model: Any, optim: Any) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        url = spec.url
        self.msd: dict[str, Any] = get_model_state_dict(model)
        self.layout: Layout = find_layout(
            fs, p, lambda f: read_dcp_metadata(fs, f, url, weights_only=spec.weights_only).state_dict_metadata,
            url, expected=self.msd, part=spec.model)
        lay = self.layout
        self.md, self.reader, self.meta = _open_folder(spec, fs, lay.folder)
        self.optim_md, self.optim_reader = self.md, self.reader
        if optim is not None and lay.optim_in_own_folder:
            self.optim_md, self.optim_reader, _ = _open_folder(spec, fs, lay.optim_folder)
        self.osd = get_optimizer_state_dict(
            model, optim, options=StateDictOptions(flatten_optimizer_state_dict=lay.flat_optim)
        ) if optim is not None else None
        stored = {k: tuple(v.size) for k, v in self.md.state_dict_metadata.items() if hasattr(v, "size")}
        found = {k: s for k, s in stored.items() if lay.fqn(k) is not None}
        opt_keys = self.optim_md.state_dict_metadata
        found_o = {k: tuple(v.size) for k, v in opt_keys.items() if hasattr(v, "size") and lay.optim_fqn(k)}
        has_optim = lay.optim_root is not None and any(k.startswith(lay.optim_root + ".") for k in opt_keys)
        tied = {lay.model_key(d): lay.model_key(s) for d, s in tied_parameters(model).items()}
        exp_o = None if self.osd is None else {
            lay.optim_key(fqn, key): tuple(v.shape) for fqn, key, v in optim_entries(self.osd, lay.flat_optim)
            if hasattr(v, "shape")}
        self.problem, self.usable = match(url, spec.strict, shapes(self.msd, lay.model_key), found, tied,
                                          exp_o, found_o if has_optim else None, "it was saved without optimizer=")
        # torchtitan's loader keeps one entry per rank: each rank reads its own alone
        others = re.compile(rf"^{LOADER}\.dp_rank_(?!{rank_and_world()[0]}$)\d+$")
        self.extra_keys = [k for k in self.md.state_dict_metadata
                           if k.split(".", 1)[0] in lay.extra_roots and not others.match(k)]

    def extra(self) -> dict[str, Any]:
        """The trainer's other state: its side files, then the DCP keys it keeps it under
        (placeholders here, filled by the load)."""
        return dict(self.meta.get("extra") or {})


def load_dcp(spec: LoadSpec, fs: Any, p: str, model: Any, optim: Any) -> Outcome:
    """Load the DCP checkpoint folder ``p`` (any layout) into ``model`` and ``optim``."""
    import torch
    import torch.distributed.checkpoint as dcp

    url, strict = spec.url, spec.strict
    problem: str | None = None
    cls: type[BaseException] = CheckpointError
    plan: _Plan | None = None
    try:
        plan = _Plan(spec, fs, p, model, optim)
        problem = plan.problem
        if problem is None and (side := side_extra(fs, plan.layout, url, spec.weights_only)):
            plan.meta = {**plan.meta, "extra": {**side, **plan.meta.get("extra", {})}}
    except CheckpointError as exc:
        problem, cls = str(exc), type(exc)
    bad = agree_problem(problem, cls)
    if bad:
        return bad
    assert plan is not None
    lay, msd, osd = plan.layout, plan.msd, plan.osd
    # The reader reads and checks everything before it copies anything, on every rank
    # (``_every_rank_read``), so DCP may load straight into the model's own tensors. Where
    # it cannot (a compressed item; a state dict that is not over the model's memory; an
    # optimizer in a folder of its own, read after the model), read into fresh tensors,
    # and copy them into the model once every rank has all.
    in_place = can_stage(plan.md) and over_model(model, msd) and not (optim is not None and lay.optim_in_own_folder)
    into_m = {k: v if in_place else torch.empty_like(v) for k, v in msd.items() if lay.model_key(k) in plan.usable}
    into_o = None
    if osd is not None:
        into_o = osd if in_place else tree_map_only(torch.Tensor, torch.empty_like, osd)
        into_o = rekey_optim(into_o, lay.flat_optim, lambda fqn: lay.inner + fqn)
    sd: dict[str, Any] = {lay.model_key(k): v for k, v in into_m.items()}
    sd.update(_extra_targets(plan))
    if into_o is not None and lay.optim_root is None:  # match() refused a layout without one
        raise CheckpointError(f"{spec.url}: its layout keeps no optimizer state to load into {spec.optimizer!r}")
    optim_sd = {lay.optim_root: into_o} if into_o is not None and lay.optim_root is not None else {}
    if not lay.optim_in_own_folder:
        sd.update(optim_sd)
    progress_feed.start(state_bytes([sd, optim_sd]), spec.report_progress)
    # dcp.load ends in a collective that raises on every rank if any rank failed
    try:
        with named_corruption(url):
            planner = load_planner(spec.weights_only, allow_partial_load=not strict)
            dcp.load(sd, storage_reader=plan.reader, planner=planner, process_group=checkpoint_group())
            if optim_sd and lay.optim_in_own_folder:
                dcp.load(optim_sd, storage_reader=plan.optim_reader,
                         planner=load_planner(spec.weights_only), process_group=checkpoint_group())
    except CorruptCheckpointError as exc:
        return Outcome.failed(exc)
    if plan.extra_keys:
        found = nest_keys({k: sd[k] for k in plan.extra_keys}, plan.md.planner_data)
        plan.meta = {**plan.meta, "extra": {**plan.extra(), **found}}
    if into_o is not None:
        into_o = rekey_optim(into_o, lay.flat_optim, lambda fqn: fqn[len(lay.inner):])
    return apply_read(model, optim, None if in_place else into_m, into_o, strict, plan.meta, lay.flat_optim)


def _extra_targets(plan: _Plan) -> dict[str, Any]:
    """Where DCP loads the trainer state the layout keeps in the folder (torchtitan's
    ``train_state``): an empty tensor of each stored tensor's shape, None for the rest."""
    import torch

    out: dict[str, Any] = {}
    for k in plan.extra_keys:
        md = plan.md.state_dict_metadata[k]
        out[k] = torch.empty(tuple(md.size), dtype=md.properties.dtype) if hasattr(md, "size") else None
    return out
