"""``sess.load``: load a checkpoint onto the session's world size.

Sharded folders (fsdp_nb's, or plain ``dcp.save``'s), full files and safetensors
weights (a Hugging Face folder too). Each rank reads only the pieces of the stored
tensors that overlap its own shards, whatever the world size that wrote them (DCP's
resharding; a safetensors slice per tensor). Files are verified and keys/shapes
checked on the ranks first; the model is written only after every rank has read
everything into fresh tensors, so a failure leaves it as it was.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Any

from ..display.progress import check_progress, follow, may_show
from ..formats.storage import options_for, url_to_fs
from .arguments import (
    check_state,
    check_titan_loader,
    models_and_optimizers,
    raise_outcomes,
    several_optimizers,
)
from .async_saves import wait_pending
from .wire_checkpoint import LoadSpec

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["check_autosave_step", "check_trainer_state", "fill_weights", "load"]


def load(
    ctx: SessionContext,
    path: str,
    model: Any,
    *,
    optimizer: str | list[str | None] | tuple[str, ...] | None = None,
    state: list[str] | tuple[str, ...] | None = None,
    rng: bool | None = None,
    strict: bool = True,
    verify: bool = True,
    progress: bool | None = None,
    weights_only: bool = True,
    fill: bool = False,
) -> dict[str, Any]:
    """Load ``path`` into engine module ``model`` (and optimizer); returns the saved ``extra``.

    Raises FileNotFoundError (nothing there), CheckpointError (incomplete, keys or
    shapes differ: listed), CorruptCheckpointError (a file is damaged: named),
    UnsafeCheckpointError (a pickled item could run code: named; nothing loaded).
    ``verify=False`` loads a checkpoint that cannot be verified (no marker; a plain
    DCP folder whose files look incomplete) and skips the per-item checksums.
    ``progress``: a bar of the bytes read (default: in a notebook, above a few hundred MB).
    ``weights_only=False`` trusts the checkpoint: its pickles are unpickled as plain
    ``torch.load`` does, which can run arbitrary code (only for files from someone you trust).
    ``fill``: the model was just built for this load (``wrap(weights=)``); pieces go
    straight into it (``LoadSpec.fill``). ``state``: engine globals whose saved
    ``state_dict`` each rank takes back from its own file; ``rng``: put back each rank's
    random state (``LoadSpec.rng``). Per-rank state from another world size is refused
    by name (CheckpointError) before anything is loaded.
    """
    from . import rank_load as checkpoint_load

    name, optim, parts = models_and_optimizers(model, optimizer)
    names = check_state(state)
    for flag, v in (("strict", strict), ("verify", verify), ("weights_only", weights_only)):
        if not isinstance(v, bool):
            raise TypeError(f"{flag} must be True or False, got {v!r}")
    if rng is not None and not isinstance(rng, bool):
        raise TypeError(f"rng must be True, False or None, got {rng!r}")
    check_progress(progress)
    url_to_fs(path)
    if names:
        check_trainer_state(path, names, ctx.world_size, weights_only, ctx.models.get(name))
    wait_pending(ctx)
    spec = LoadSpec(url=path, storage_options=options_for(path), model=name, optimizer=optim, parts=parts,
                    optimizers=several_optimizers(model, optimizer),
                    state=names, rng=rng,
                    strict=strict,
                    verify=verify, report_progress=may_show(progress), weights_only=weights_only, fill=fill)
    d = ctx.dispatcher
    pending = d.apply("checkpoint load", checkpoint_load.load, args=(spec,))
    with follow(pending, f"load {posixpath.basename(path.rstrip('/'))}", enabled=progress):
        outs = d.gather(pending)
    raise_outcomes(outs)
    return outs[0].extra or {}


def check_autosave_step(ctx: SessionContext, path: str) -> None:
    """Refuse, before any rank reads, a ``sess.load`` of a checkpoint that keeps no step
    (``extra["step"]``) while an autosave is armed: the autosave counts on from the loaded
    step, and without one its next ``step-<N>`` folder would name a step the run is not
    at. ``restart``'s own restore is not checked here: it arms the autosave again from the
    step it restored.

    Args:
        ctx: the session (``ctx.autosave``: the autosave armed, if one is).
        path: the checkpoint to load.
    """
    from ..errors import CheckpointError
    from ..formats.inspect import inspect

    spec = ctx.autosave
    if spec is None:
        return
    try:
        info = inspect(path, storage_options=options_for(path))
    except FileNotFoundError:
        return  # the ranks say so, as for any load
    step = info.extra.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return
    raise CheckpointError(
        f"sess.load({path!r}) while the autosave to {spec.root!r} is armed: the checkpoint keeps no step "
        "(extra['step']), and the autosave counts on from the step a load brings back, so its next step-<N> "
        "folder would name a step the run is not at. Nothing was loaded. Stop the autosave first "
        "(sess.stop_autosave()), load, then arm it again; or save checkpoints with extra={'step': N}"
    )


def fill_weights(ctx: SessionContext, path: str, name: str) -> None:
    """Fill model ``name``, just built for it, from the checkpoint or weights folder at
    ``path``: every key required, each rank reading only the slices it owns
    (``sess.wrap(..., weights=path)`` and its replay; ``SessionContext.fill_weights``)."""
    load(ctx, path, name, strict=True, fill=True)


def check_trainer_state(path: str, names: tuple[str, ...], world_size: int, weights_only: bool = True,
                        model: Any = None) -> None:
    """Refuse, before any rank reads, ``state=`` names a checkpoint in another trainer's
    layout does not keep: there, each is an entry of the trainer's other state (Lightning's
    ``meta.pt``, torchtitan's ``lr_scheduler`` / ``train_state`` / ``dataloader``), taken
    by its name. torchtitan's ``dataloader`` is each rank's own: every rank's entry is
    read now (``formats.titan_loader``), so another world size or a pickle that could
    run code is refused before any work. fsdp_nb's own checkpoints are checked by the
    ranks, which read their own files.

    Args:
        path: the checkpoint.
        names: the engine globals ``state=`` names.
        world_size: this session's.
        weights_only: read torchtitan's loader pickles with the restricted unpickler.
        model: the ``ShardedModel`` loaded into (None: not known): torchtitan's loader
            is refused for one with more than one mesh dimension (``check_titan_loader``).
    """
    from ..errors import CheckpointError
    from ..formats.inspect import inspect
    from ..formats.titan_loader import decode, is_encoded

    try:
        info = inspect(path, storage_options=options_for(path))
    except FileNotFoundError:
        return  # the ranks say so, as for any load
    if info.run_state or not info.valid:
        return
    missing = [n for n in names if n not in info.extra]
    if missing:
        held = ", ".join(map(repr, sorted(info.extra))) or "nothing"
        raise CheckpointError(
            f"checkpoint {path!r} ({info.layout}) keeps no {', '.join(map(repr, missing))}: its other state holds "
            f"{held}; state= takes those by name, each into the engine global of the same name (nothing was loaded)"
        )
    for n in names:
        if is_encoded(info.extra[n]):
            check_titan_loader(names, "torchtitan", model)
            for rank in range(world_size):
                decode(info.extra[n], rank, world_size, path, weights_only)
