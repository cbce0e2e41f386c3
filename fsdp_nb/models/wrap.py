"""The notebook side of ``sess.wrap``: validate, ship, build on every rank, record.

``wrap(sess, model, args, name=..., **options)`` (what ``Session.wrap`` calls):

1. validates everything it can in the notebook — option names and values
   (:class:`WrapOptions`), the engine global ``name``, the kind of ``model``, the
   mesh sizes — and ships the model spec by value; then asks the engines whether
   ``name`` is free and (for class, factory and string specs) builds the model on
   the meta device on rank 0 to check that every ``auto_wrap`` /
   ``activation_checkpointing`` class occurs in it. Any problem raises a
   ``ValueError`` / ``TypeError`` here, before any rank has built or bound anything;
2. plans the device mesh (``fsdp_nb.models.wire_mesh_plan.plan_mesh``);
3. builds on every rank (``fsdp_nb.models.rank_wrap.build``), binds the FSDP2 module as
   engine global ``name`` and records the wrap on the session (``sess.wraps``) so
   :func:`replay_wraps` can rebuild it after ``sess.restart()``. An instance's
   weights are streamed from the notebook's module as it is; the record keeps no
   copy (it would pin the whole model in the notebook), so replaying an instance
   wrap needs a checkpoint (``restart(restore=...)``).

Re-wrapping an existing ``name`` that holds a wrapped model replaces it (the old
module is dropped on every rank first, freeing its memory); a ``name`` that holds
anything else on the engines (``rank``, ``torch``, a user's tensor) is refused.
"""

from __future__ import annotations

import dataclasses
import keyword
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..runtime.shipping import ByValue, by_value, register_local_modules
from . import rank_weights as _weights
from . import rank_wrap as _ew
from .model_spec import check_call, meta_clone, model_kind
from .wire_mesh_plan import MeshPlan, plan_mesh
from .wire_wrap_options import OPTION_NAMES, WrapOptions, make_options, no_split_default

if TYPE_CHECKING:
    from ..context import SessionContext
    from ..runtime.dispatch import Dispatcher
    from .sharded_model import ShardedModel

__all__ = ["WrapRecord", "check_replayable", "replay_wraps", "wrap"]

# -- the record --------------------------------------------------------------------------


@dataclass
class WrapRecord:
    """One wrap as shipped, enough to build it again (``replay_wraps``)."""

    name: str
    """Engine global name."""
    kind: str
    """``"instance"``, ``"class"``, ``"factory"`` or ``"string"``."""
    payload: ByValue
    """The shipped ``(spec, args, kwargs, options)``, the same for every rank; for an
    instance, a copy whose parameters are on the meta device."""
    options: WrapOptions
    """The validated options."""
    plan: MeshPlan
    """The mesh."""
    seed: int
    """Base seed for initialising class-built models (rank r uses seed + r)."""
    weights: str | None = None
    """Where a class-built model's parameters come from instead of an initialiser: a
    Hugging Face folder, a safetensors file, an fsdp_nb or plain DCP checkpoint."""


# -- the entry point ---------------------------------------------------------------------


def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (an engine global), got {type(name).__name__}")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(
            f"name={name!r} is not a valid Python identifier; the model is bound as an engine "
            "global, e.g. name='model'"
        )
    return name


def _check_weights(weights: Any, kind: str) -> None:
    """``weights=`` names something ``sess.load`` reads (a Hugging Face folder, a
    safetensors file, an fsdp_nb or plain DCP checkpoint), valid, for a model built from a
    class or factory; checked offline, before any rank builds anything."""
    if weights is None:
        return
    if not isinstance(weights, str) or not weights:
        raise TypeError(f"weights must be a path or fsspec URL (str), got {weights!r}")
    if kind not in ("class", "factory"):
        raise TypeError(
            f"weights= fills a model built from a class or factory; a {'module instance' if kind == 'instance' else 'name'} "
            "brings its own weights (or load them with sess.load)")
    from ..errors import CheckpointError
    from ..formats.inspect import inspect

    info = inspect(weights)
    if not info.valid:
        raise CheckpointError(f"weights={weights!r} cannot be read: {info.problem}")


def _raise_problem(problem: str | None, exc: type[Exception] = ValueError) -> None:
    if problem:
        raise exc(problem)


def wrap(
    ctx: SessionContext, model: Any, args: tuple, *, name: str = "model", weights: str | None = None,
    **options: Any,
) -> ShardedModel:
    """Shard ``model`` over ``sess``'s ranks with FSDP2; bind it as engine global ``name``.

    See :class:`WrapOptions` for the options and the module docstring for the steps.
    ``weights``: fill a class-built model from this checkpoint or weights folder instead
    of initialising it (:func:`_check_weights`). Everything is validated before any rank
    builds anything.
    """
    name = _check_name(name)
    kind = model_kind(model)
    _check_weights(weights, kind)
    kwargs = {k: v for k, v in options.items() if k not in OPTION_NAMES}
    opts = make_options(**{k: v for k, v in options.items() if k in OPTION_NAMES})
    if "auto_wrap" not in options and kind != "string" and (split := no_split_default(model)):
        opts = dataclasses.replace(opts, auto_wrap=split)
    if kind in ("instance", "string") and (args or kwargs):
        if kwargs:
            raise TypeError(
                f"unknown wrap option(s) {', '.join(map(repr, sorted(kwargs)))}; "
                f"allowed: {', '.join(OPTION_NAMES)}"
            )
        raise TypeError(
            f"positional arguments are for a class or factory spec; got {len(args)} with a "
            f"{'module instance' if kind == 'instance' else 'name'}"
        )
    if kind in ("class", "factory"):
        check_call(model, args, kwargs)
    if ctx.backend is None:  # set when the session formed its group, before any wrap can run
        raise RuntimeError("this session has no process group to wrap a model over")
    plan = plan_mesh(ctx.world_size, ctx.backend, [r.host for r in ctx.ranks], opts)
    import torch

    # classes in the model, auto_wrap classes and callables may live in a user's
    # module the engines cannot import: ship those by value too
    register_local_modules((model, args, kwargs, opts))
    seed = int(torch.randint(0, 2**62, ()).item())
    if kind == "instance":
        problem = _ew.check_classes(model, opts)
        _raise_problem(problem)
        payload = by_value((meta_clone(model), (), kwargs, opts))
    else:
        payload = by_value((model, tuple(args), kwargs, opts))
    record = WrapRecord(name, kind, payload, opts, plan, seed, weights)
    d = ctx.dispatcher
    clashes = d.gather(d.apply(f"check name {name!r}", _ew.name_status, args=(name,)))
    bad = [(r, c) for r, c in enumerate(clashes) if c]
    if bad:
        r, what = bad[0]
        raise ValueError(
            f"name={name!r} is already an engine global on rank {r} ({what}); "
            "pick another name (re-wrapping replaces only a model that sess.wrap bound)"
        )
    if kind != "instance":
        ranks = list(range(ctx.world_size)) if kind == "string" else [0]
        problems = d.gather(
            d.apply(f"check model for {name!r}", _ew.check_spec, args=(kind, payload), ranks=ranks)
        )
        for p in problems:
            _raise_problem(p)
    return _build(ctx, record, model if kind == "instance" else None)


def _build(
    ctx: SessionContext, record: WrapRecord, source: Any = None, dispatcher: Dispatcher | None = None
) -> ShardedModel:
    """Build ``record`` on every rank through ``dispatcher`` (the session's by default);
    an instance's weights come from ``source`` (the notebook's module), or are left for
    a checkpoint load when it is None (replay)."""
    from .sharded_model import ShardedModel

    d = dispatcher or ctx.dispatcher
    summaries = d.gather(
        d.apply(
            f"wrap({record.name!r})",
            _ew.build,
            args=(record.name, record.kind, record.payload, record.plan, record.seed,
                  record.weights is None),
        )
    )
    if source is not None:
        _stream_weights(d, ctx.world_size, record.name, source.state_dict())
    if record.weights is not None:
        _load_weights(ctx, d, record.name, record.weights)
    ctx.wraps[record.name] = record
    model = ctx.models[record.name] = ShardedModel(ctx, record.name, record.options, summaries[0])
    return model


def _load_weights(ctx: SessionContext, d: Dispatcher, name: str, weights: str) -> None:
    """Fill the just-built model ``name`` from ``weights``: each rank reads only the
    slices it owns (``sess.load``'s path, every key required). A failed load drops the
    half-built model from every rank before the error is raised."""
    if ctx.fill_weights is None:
        raise RuntimeError("this session cannot read weights= (its context has no checkpoint loader)")
    try:
        ctx.fill_weights(ctx, weights, name)
    except BaseException:  # drop the model nobody initialised, then re-raise
        d.gather(d.apply(f"drop {name}", _ew.forget_all, args=((name,),)))
        raise


CHUNK_BYTES = 64 * 2**20
"""Weights of an instance spec go to rank 0 in chunks of about this many bytes."""


def _stream_weights(d: Dispatcher, world_size: int, name: str, state: dict[str, Any]) -> None:
    """Send a notebook module's state dict to rank 0 chunk by chunk; every rank scatters
    each. CPU tensors go as they are (no copy); others are copied one at a time."""
    import torch

    chunk: dict[str, Any] = {}
    size = 0
    items = list(state.items())
    for i, (k, v) in enumerate(items):
        v = v.detach().cpu()
        # numpy arrays travel as zero-copy buffers in ipyparallel (~2.5x faster than a
        # pickled tensor); bfloat16 has no numpy dtype and goes as a tensor
        chunk[k] = v.numpy() if v.dtype != torch.bfloat16 else v
        size += v.numel() * v.element_size()
        if size >= CHUNK_BYTES or i == len(items) - 1:
            args = [(name, chunk)] + [(name, None)] * (world_size - 1)
            d.gather(d.apply(f"load weights of {name!r}", _weights.load_full_chunk, args))
            chunk, size = {}, 0


def check_replayable(
    ctx: SessionContext, restore: str | None, drop: tuple[str, ...], *, replaying: bool,
    target: str | tuple[str, ...] | None = None,
) -> None:
    """Refuse, before any work, ``drop`` names that are not wraps and (``replaying``:
    engines are being replaced) a replay that would have to rebuild an instance wrap
    without a checkpoint for it.

    fsdp_nb keeps no copy of a notebook instance's weights, so after engines were
    replaced such a model comes back only as a target of ``restore=`` (``target``,
    the model or models the checkpoint was saved from; else the last wrap), or not at all
    if the user lets it go (``drop=``).
    """
    names = list(ctx.wraps)
    unknown = sorted(set(drop) - set(names))
    if unknown:
        raise ValueError(
            f"drop={list(drop)!r} names model(s) {unknown} that this session did not wrap; "
            f"wrapped: {names or 'none'}"
        )
    if not replaying:
        return
    wanted = (target,) if isinstance(target, str) else tuple(target or ())
    targets = set() if restore is None or not names else ({t for t in wanted if t in names} or {names[-1]})
    lost = [
        n for n, r in ctx.wraps.items()
        if r.kind == "instance" and n not in targets and n not in drop
    ]
    if lost:
        raise ValueError(
            f"sess.restart() must rebuild model(s) {', '.join(map(repr, lost))} on the new "
            "engine(s), but they were wrapped from a notebook instance and fsdp_nb keeps no "
            "copy of its weights (a copy would hold the whole model in the notebook). Pass "
            "restore='path/to/checkpoint' (loaded into the model it was saved from, else the last "
            f"wrapped, {names[-1]!r}), or drop=[...] to let them go and wrap them again. Nothing "
            "was changed."
        )


def replay_wraps(
    ctx: SessionContext, drop: tuple[str, ...] = (), dispatcher: Dispatcher | None = None
) -> dict[str, ShardedModel]:
    """Rebuild every wrap recorded on ``sess`` (after ``sess.restart()`` replaced engines).

    Class and factory specs are built and initialised afresh (same seed: same
    weights); string specs need the module to exist again on the engines; instance
    specs are built with uninitialised weights, for ``restore=`` to load (see
    :func:`check_replayable`). Wraps named in ``drop`` are forgotten on every rank
    and on the session. ``dispatcher``: recovery passes its plain one. Returns name ->
    ShardedModel.
    """
    d = dispatcher or ctx.dispatcher
    if drop:
        d.gather(d.apply(f"drop {', '.join(drop)}", _ew.forget_all, args=(tuple(drop),)))
        for name in drop:
            ctx.wraps.pop(name, None)
            ctx.models.pop(name, None)
    return {r.name: _build(ctx, r, dispatcher=d) for r in list(ctx.wraps.values())}
