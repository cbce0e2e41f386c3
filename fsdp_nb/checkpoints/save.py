"""``sess.save``: validate in the notebook, then run ``fsdp_nb.checkpoints.rank_save`` on every rank.

Every argument is checked, ``extra`` included, and the target's existence too,
before any rank writes a byte. ``async_save=True`` returns an ``AsyncCheckpoint``
(``fsdp_nb.checkpoints.async_saves``) as soon as every rank has staged its state (a CPU
copy); the write and the commit continue in the background on the engines.
"""

from __future__ import annotations

import posixpath
import uuid
from typing import TYPE_CHECKING, Any

from ..display.progress import check_progress, follow, may_show
from ..errors import CheckpointError
from ..formats.fullfile import full_suffix
from ..formats.info import CheckpointInfo
from ..formats.metadata import base_metadata, validate_extra
from ..formats.run_state import run_meta
from ..formats.storage import options_for, url_to_fs
from .arguments import (
    check_layout,
    check_shared_state,
    check_state,
    check_titan_loader,
    models_and_optimizers,
    raise_outcomes,
    several_optimizers,
)
from .async_saves import AsyncCheckpoint, register, wait_pending
from .wire_checkpoint import SaveSpec

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["save"]


def save(
    ctx: SessionContext,
    path: str,
    model: Any,
    *,
    optimizer: str | list[str | None] | tuple[str, ...] | None = None,
    state: list[str] | tuple[str, ...] | None = None,
    extra: dict[str, Any] | None = None,
    sharded: bool = True,
    overwrite: bool = False,
    async_save: bool = False,
    keep_last: int | None = None,
    progress: bool | None = None,
    layout: str = "fsdp_nb",
) -> CheckpointInfo | AsyncCheckpoint:
    """Write a checkpoint of engine module ``model`` (and optimizer) at ``path``, atomically.

    A sharded save in fsdp_nb's layout keeps each rank's random state and the
    ``state_dict`` of each engine global named in ``state`` in that rank's own file
    (``fsdp_nb.formats.run_state``).

    ``sharded=True``: a folder, one DCP file per rank. ``sharded=False``: one file
    written by rank 0, ``.pt`` or ``.safetensors`` by the path's suffix. An existing
    path raises FileExistsError unless ``overwrite``. ``keep_last=k`` keeps the newest
    k checkpoints in the path's folder. Returns the CheckpointInfo, or with
    ``async_save=True`` an ``AsyncCheckpoint`` (``wait()`` / ``done()``). ``progress``:
    a bar of the bytes written (default: in a notebook, for more than a few hundred MB).
    ``layout``: fsdp_nb's, or the one Lightning Fabric (``"lightning"``) or torchtitan
    (``"torchtitan"``) resumes from (``check_layout``).
    """
    from . import rank_save as cio

    name, optim, parts = models_and_optimizers(model, optimizer)
    names = check_state(state)
    extra = validate_extra(extra)
    for flag, v in (("sharded", sharded), ("overwrite", overwrite), ("async_save", async_save)):
        if not isinstance(v, bool):
            raise TypeError(f"{flag} must be True or False, got {v!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    check_progress(progress)
    url_to_fs(path)  # a bad URL or a missing filesystem package fails here
    check_layout(layout, path, sharded, extra)
    suffix = full_suffix(path)
    if not sharded and suffix is None:
        raise ValueError(
            f"a full checkpoint (sharded=False) is one file: {path!r} must end in .pt or .safetensors"
        )
    if sharded and suffix is not None:
        raise ValueError(
            f"a sharded checkpoint is a folder, but {path!r} ends in {suffix}; "
            "drop the suffix, or pass sharded=False for one file"
        )
    check_shared_state(names, layout, sharded, extra)
    check_titan_loader(names, layout, ctx.models.get(name))
    if parts and (not sharded or layout != "fsdp_nb"):
        raise ValueError(
            f"several models ({', '.join(n for n, _ in parts)}) are saved in one sharded checkpoint of fsdp_nb's "
            "layout, each under its own name; save them with sharded=True, layout='fsdp_nb' (nothing was written)"
        )
    rng = sharded and layout == "fsdp_nb"
    meta = {**base_metadata(extra, "sharded" if sharded else "full"), "layout": layout}
    if rng:
        meta.update(run_meta(names))
    wait_pending(ctx)
    spec = SaveSpec(
        url=path, storage_options=options_for(path), model=name, optimizer=optim, parts=parts, state=names, rng=rng,
        optimizers=several_optimizers(model, optimizer),
        sharded=sharded, async_save=async_save, keep_last=keep_last, token=uuid.uuid4().hex[:12], meta=meta,
        check_exists=not overwrite, report_progress=may_show(progress) and not async_save, layout=layout,
    )
    d = ctx.dispatcher
    # an async save publishes no progress (its bar would have nothing to follow), so it
    # may take the direct call path
    pending = d.apply("checkpoint save", cio.save, args=(spec,), fast=async_save)
    name = f"save {posixpath.basename(path.rstrip('/'))}"
    with follow(pending, name, enabled=False if async_save else progress):
        outs = d.gather(pending)
    raise_outcomes(outs)
    if outs[0].exists:  # the ranks agreed on it before writing anything
        raise FileExistsError(
            f"a checkpoint already exists at {path!r}; pass overwrite=True to replace it "
            "(nothing was written)"
        )
    if async_save:
        return register(ctx, AsyncCheckpoint(ctx, path, spec.token, max(o.blocked or 0.0 for o in outs)))
    info = outs[0].info
    if info is None:  # pragma: no cover - rank 0 always returns it
        raise CheckpointError(f"save of {path!r} returned no description from rank 0")
    return info
