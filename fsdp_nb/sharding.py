"""Wrap options → FSDP2 / DeviceMesh calls: the notebook side of ``sess.wrap``.

``wrap(sess, model, args, name=..., **options)`` (what ``Session.wrap`` calls):

1. validates everything it can in the notebook — option names and values
   (:class:`WrapOptions`), the engine global ``name``, the kind of ``model``, the
   mesh sizes — and ships the model spec by value; then asks the engines whether
   ``name`` is free and (for class, factory and string specs) builds the model on
   the meta device on rank 0 to check that every ``auto_wrap`` /
   ``activation_checkpointing`` class occurs in it. Any problem raises a
   ``ValueError`` / ``TypeError`` here, before any rank has built or bound anything;
2. plans the device mesh (:class:`MeshPlan`): 1-D ``("dp",)`` for ``"full"`` and
   ``"grad_op"``; 2-D ``("dp_replicate", "dp_shard")`` for ``"hybrid"`` (by default
   shard within a host, replicate across hosts) and for ``"none"`` (``(N, 1)``:
   FSDP2 replicates along the first dimension and "shards" over one rank, which is
   plain data parallelism with FSDP2's hooks); ``("dp", "tp")`` with tensor
   parallelism, as Lightning's ModelParallelStrategy;
3. builds on every rank (``fsdp_nb.engine.wrap.build``), binds the FSDP2 module as
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

import copy
import dataclasses
import keyword
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .engine import wrap as _ew
from .shipping import ByValue, by_value, register_local_modules

if TYPE_CHECKING:
    from .dispatch import Dispatcher
    from .session import Session
    from .sharded_model import ShardedModel

__all__ = [
    "MIXED_PRECISION",
    "SHARDING",
    "MeshPlan",
    "WrapOptions",
    "WrapRecord",
    "check_replayable",
    "make_options",
    "plan_mesh",
    "replay_wraps",
    "wrap",
]

SHARDING = ("full", "grad_op", "none", "hybrid")
"""Allowed values of ``sharding``."""
MIXED_PRECISION = ("bf16-mixed", "16-mixed", "bf16-true", "32-true")
"""Allowed strings for ``mixed_precision`` (or pass a ``MixedPrecisionPolicy``)."""


@dataclass(frozen=True, kw_only=True)
class WrapOptions:
    """How ``sess.wrap`` shards a model (names as in Lightning's FSDP strategies)."""

    sharding: str = "full"
    """``"full"``: shard parameters, gradients and optimizer state, reshard after
    forward (ZeRO-3); ``"grad_op"``: keep parameters unsharded between forward and
    backward (ZeRO-2-like, ``reshard_after_forward=False``); ``"none"``: replicate
    (data parallel); ``"hybrid"``: shard within a group, replicate across groups
    (HSDP on a 2-D mesh)."""
    auto_wrap: frozenset[type] | Callable[[Any], bool] | None = None
    """Submodules that get their own ``fully_shard`` (one unit each, gathered one
    at a time): a set of module classes (``isinstance``), or ``fn(module) -> bool``.
    ``None``: only the root is wrapped. Each class must occur in the model."""
    mixed_precision: str | Any = "32-true"
    """``"bf16-mixed"`` / ``"16-mixed"``: compute in bf16 / fp16, keep fp32
    sharded parameters and reduce gradients in fp32; ``"bf16-true"``: parameters
    themselves bf16; ``"32-true"``: plain fp32; or a ``MixedPrecisionPolicy``."""
    cpu_offload: bool | Any = False
    """Keep sharded parameters, gradients and optimizer state on the CPU: ``True``
    or a ``CPUOffloadPolicy`` (pinned memory only where there is an accelerator)."""
    activation_checkpointing: frozenset[type] | None = None
    """Module classes whose forward activations are recomputed in backward
    (applied before ``fully_shard``; parameter names are unchanged)."""
    parallelize: Callable[[Any, Any], Any] | None = None
    """``fn(model, device_mesh) -> model`` applying tensor parallelism (e.g.
    ``parallelize_module(model, device_mesh["tp"], plan)``); gets the ``("dp",
    "tp")`` mesh, runs before FSDP shards over ``device_mesh["dp"]``."""
    data_parallel_size: int | tuple[int, int] | None = None
    """Ranks in the data-parallel dimension (default: world / tensor_parallel_size).
    For ``"hybrid"`` a ``(replicate, shard)`` pair (default: hosts × ranks per host)."""
    tensor_parallel_size: int = 1
    """Ranks in the tensor-parallel dimension; > 1 needs ``parallelize``."""
    init_fn: Callable[[Any], None] | None = None
    """For class / factory specs: called on every submodule after ``to_empty``
    (``model.apply(init_fn)``) instead of ``reset_parameters``; it must also
    (re)compute buffers that are not in the state dict."""

    def __post_init__(self) -> None:
        """Check every option and normalise class sets, so an invalid ``WrapOptions``
        cannot exist: ``TypeError`` for wrong types, ``ValueError`` for values outside
        the allowed ones, each naming what is allowed."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        sharding = self.sharding
        if sharding not in SHARDING:
            raise ValueError(f"sharding={sharding!r} is not allowed; allowed: {', '.join(SHARDING)}")
        put("auto_wrap", _class_set("auto_wrap", self.auto_wrap, allow_callable=True))
        put("activation_checkpointing", _class_set(
            "activation_checkpointing", self.activation_checkpointing, allow_callable=False))
        mp = self.mixed_precision
        if not (isinstance(mp, MixedPrecisionPolicy) or (isinstance(mp, str) and mp in MIXED_PRECISION)):
            raise ValueError(
                f"mixed_precision={mp!r} is not allowed; allowed: "
                f"{', '.join(MIXED_PRECISION)} or a torch.distributed.fsdp.MixedPrecisionPolicy"
            )
        if not isinstance(self.cpu_offload, (bool, CPUOffloadPolicy)):
            raise TypeError(
                f"cpu_offload must be True, False or a CPUOffloadPolicy, got {self.cpu_offload!r}"
            )
        for fn_opt in ("parallelize", "init_fn"):
            if getattr(self, fn_opt) is not None and not callable(getattr(self, fn_opt)):
                raise TypeError(f"{fn_opt} must be a callable, got {getattr(self, fn_opt)!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}")
        if tp > 1 and self.parallelize is None:
            raise ValueError(
                f"tensor_parallel_size={tp} needs parallelize=fn(model, device_mesh) that applies "
                "tensor parallelism on device_mesh['tp']"
            )
        if tp > 1 and sharding not in ("full", "grad_op"):
            raise ValueError(
                f"tensor parallelism combines with sharding 'full' or 'grad_op', not {sharding!r}"
            )
        dp = self.data_parallel_size
        if dp is None:
            return
        if sharding == "hybrid":
            ok = (
                isinstance(dp, tuple) and len(dp) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in dp)
            )
            if not ok:
                raise ValueError(
                    f"with sharding='hybrid', data_parallel_size is a (replicate, shard) pair of "
                    f"positive ints, got {dp!r}"
                )
        elif isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got {dp!r}")

    def describe(self) -> dict[str, str]:
        """Options that differ from the defaults, as short strings (for reprs)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                out[f.name] = _short(v)
        return out


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(WrapOptions))


def _short(v: Any) -> str:
    if isinstance(v, frozenset):
        return "{" + ", ".join(sorted(getattr(c, "__name__", repr(c)) for c in v)) + "}"
    if callable(v) and hasattr(v, "__qualname__"):
        return v.__qualname__
    return repr(v)


def _class_set(option: str, value: Any, *, allow_callable: bool) -> Any:
    if value is None:
        return None
    if isinstance(value, type):
        value = {value}
    if allow_callable and callable(value) and not isinstance(value, (set, frozenset, list, tuple)):
        return value
    import torch

    if not isinstance(value, (set, frozenset, list, tuple)) or not all(
        isinstance(c, type) and issubclass(c, torch.nn.Module) for c in value
    ):
        also = " or a callable(module) -> bool" if allow_callable else ""
        raise TypeError(
            f"{option} must be a set of torch.nn.Module subclasses{also}, got {value!r}"
        )
    if not value:
        raise ValueError(f"{option} is an empty set; pass None to disable it")
    return frozenset(value)


def make_options(**options: Any) -> WrapOptions:
    """``sess.wrap`` keyword options as a :class:`WrapOptions` (which checks the values).

    Raises ``TypeError`` for unknown names, naming the allowed ones.
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(
            f"unknown wrap option(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(OPTION_NAMES)}"
        )
    return WrapOptions(**options)


# -- the mesh --------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshPlan:
    """The DeviceMesh every rank builds for one wrap (plain data, shipped to engines)."""

    device_type: str
    """``"cpu"`` (gloo) or ``"cuda"`` (nccl)."""
    shape: tuple[int, ...]
    """Mesh shape; its product is the world size."""
    dim_names: tuple[str, ...]
    """Mesh dimension names."""
    fsdp_dims: tuple[str, ...]
    """The dimensions ``fully_shard`` uses (1 name: shard; 2: replicate, shard)."""
    tp_dim: str | None = None
    """The tensor-parallel dimension, if any."""


def plan_mesh(world: int, backend: str, hosts: list[str], options: WrapOptions) -> MeshPlan:
    """The mesh for ``options`` on ``world`` ranks of ``backend`` whose hosts (in rank
    order) are ``hosts``; ValueError if the sizes do not fit. A pure function."""
    device_type = "cuda" if backend == "nccl" else "cpu"
    tp = options.tensor_parallel_size
    if world % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the world size {world}")
    dp_default = world // tp
    if options.sharding == "hybrid":
        if options.data_parallel_size is not None:
            rep, shard = options.data_parallel_size
        else:
            shard = min(hosts.count(h) for h in set(hosts))
            rep = world // shard if world % shard == 0 else None
            if rep is None:
                raise ValueError(
                    f"cannot split {world} ranks into hosts of {shard}; pass "
                    "data_parallel_size=(replicate, shard)"
                )
        if rep * shard != world:
            raise ValueError(
                f"data_parallel_size={(rep, shard)} has {rep * shard} ranks, the world has {world}"
            )
        names = ("dp_replicate", "dp_shard")
        return MeshPlan(device_type, (rep, shard), names, names)
    dp = options.data_parallel_size or dp_default
    if dp * tp != world:
        raise ValueError(
            f"data_parallel_size={dp} × tensor_parallel_size={tp} = {dp * tp} ranks, "
            f"but the world has {world}"
        )
    if options.sharding == "none":
        names = ("dp_replicate", "dp_shard")
        return MeshPlan(device_type, (dp, 1), names, names)
    if tp > 1:
        return MeshPlan(device_type, (dp, tp), ("dp", "tp"), ("dp",), "tp")
    return MeshPlan(device_type, (dp,), ("dp",), ("dp",))


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


def _kind(model: Any) -> str:
    import torch

    if isinstance(model, str):
        return "string"
    if isinstance(model, torch.nn.Module):
        return "instance"
    if isinstance(model, type):
        if issubclass(model, torch.nn.Module):
            return "class"
        raise TypeError(
            f"model class {model.__qualname__} is not a torch.nn.Module subclass; "
            "pass an nn.Module instance, subclass, factory callable, or an engine global name"
        )
    if callable(model):
        return "factory"
    raise TypeError(
        f"cannot wrap a {type(model).__name__}: model must be an nn.Module instance, an "
        "nn.Module subclass or factory callable (built on every rank), or the name (str) of "
        "a module %%px code built on the engines"
    )


def _check_call(spec: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """Keyword arguments that are not wrap options go to the constructor: check they fit."""
    import inspect

    try:
        sig = inspect.signature(spec)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        what = getattr(spec, "__qualname__", repr(spec))
        unknown = [
            k for k in kwargs
            if k not in sig.parameters
            and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        ]
        if unknown:
            raise TypeError(
                f"unknown wrap option(s) {', '.join(map(repr, sorted(unknown)))}: neither a wrap "
                f"option (allowed: {', '.join(OPTION_NAMES)}) nor a parameter of {what}{sig}"
            ) from None
        raise TypeError(f"cannot build {what}{sig} from these arguments: {exc}") from None


def _meta_clone(model: Any) -> Any:
    """A copy of ``model`` whose parameters are on the meta device (no weight copies).

    Buffers are copied (they are small and may be non-persistent, which a state-dict
    broadcast would not restore).
    """
    import torch

    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = torch.nn.Parameter(
                torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
            )
    return copy.deepcopy(model, memo)


def _raise_problem(problem: str | None, exc: type[Exception] = ValueError) -> None:
    if problem:
        raise exc(problem)


def wrap(
    sess: Session, model: Any, args: tuple, *, name: str = "model", **options: Any
) -> ShardedModel:
    """Shard ``model`` over ``sess``'s ranks with FSDP2; bind it as engine global ``name``.

    See :class:`WrapOptions` for the options and the module docstring for the steps.
    Everything is validated before any rank builds anything.
    """
    name = _check_name(name)
    kind = _kind(model)
    kwargs = {k: v for k, v in options.items() if k not in OPTION_NAMES}
    opts = make_options(**{k: v for k, v in options.items() if k in OPTION_NAMES})
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
        _check_call(model, args, kwargs)
    plan = plan_mesh(sess.world_size, sess.backend, [r.host for r in sess.ranks], opts)
    import torch

    # classes in the model, auto_wrap classes and callables may live in a user's
    # module the engines cannot import: ship those by value too
    register_local_modules((model, args, kwargs, opts))
    seed = int(torch.randint(0, 2**62, ()).item())
    if kind == "instance":
        problem = _ew.check_classes(model, opts)
        _raise_problem(problem)
        payload = by_value((_meta_clone(model), (), kwargs, opts))
    else:
        payload = by_value((model, tuple(args), kwargs, opts))
    record = WrapRecord(name, kind, payload, opts, plan, seed)
    d = sess.dispatcher
    clashes = d.gather(d.apply(f"check name {name!r}", _ew.name_status, args=(name,)))
    bad = [(r, c) for r, c in enumerate(clashes) if c]
    if bad:
        r, what = bad[0]
        raise ValueError(
            f"name={name!r} is already an engine global on rank {r} ({what}); "
            "pick another name (re-wrapping replaces only a model that sess.wrap bound)"
        )
    if kind != "instance":
        ranks = list(range(sess.world_size)) if kind == "string" else [0]
        problems = d.gather(
            d.apply(f"check model for {name!r}", _ew.check_spec, args=(kind, payload), ranks=ranks)
        )
        for p in problems:
            _raise_problem(p)
    return _build(sess, record, model if kind == "instance" else None)


def _build(
    sess: Session, record: WrapRecord, source: Any = None, dispatcher: Dispatcher | None = None
) -> ShardedModel:
    """Build ``record`` on every rank through ``dispatcher`` (the session's by default);
    an instance's weights come from ``source`` (the notebook's module), or are left for
    a checkpoint load when it is None (replay)."""
    from .sharded_model import ShardedModel

    d = dispatcher or sess.dispatcher
    summaries = d.gather(
        d.apply(
            f"wrap({record.name!r})",
            _ew.build,
            args=(record.name, record.kind, record.payload, record.plan, record.seed),
        )
    )
    if source is not None:
        _stream_weights(d, sess.world_size, record.name, source.state_dict())
    sess.wraps[record.name] = record
    return ShardedModel(sess, record.name, record.options, summaries[0])


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
            d.gather(d.apply(f"load weights of {name!r}", _ew.load_full_chunk, args))
            chunk, size = {}, 0


def check_replayable(
    sess: Session, restore: str | None, drop: tuple[str, ...], *, replaying: bool
) -> None:
    """Refuse, before any work, ``drop`` names that are not wraps and (``replaying``:
    engines are being replaced) a replay that would have to rebuild an instance wrap
    without a checkpoint for it.

    fsdp_nb keeps no copy of a notebook instance's weights, so after engines were
    replaced such a model comes back only as the target of ``restore=`` (the last
    wrap), or not at all if the user lets it go (``drop=``).
    """
    names = list(sess.wraps)
    unknown = sorted(set(drop) - set(names))
    if unknown:
        raise ValueError(
            f"drop={list(drop)!r} names model(s) {unknown} that this session did not wrap; "
            f"wrapped: {names or 'none'}"
        )
    if not replaying:
        return
    target = names[-1] if (restore is not None and names) else None
    lost = [
        n for n, r in sess.wraps.items()
        if r.kind == "instance" and n != target and n not in drop
    ]
    if lost:
        raise ValueError(
            f"sess.restart() must rebuild model(s) {', '.join(map(repr, lost))} on the new "
            "engine(s), but they were wrapped from a notebook instance and fsdp_nb keeps no "
            "copy of its weights (a copy would hold the whole model in the notebook). Pass "
            "restore='path/to/checkpoint' (loaded into the last wrapped model, "
            f"{names[-1]!r}), or drop=[...] to let them go and wrap them again. Nothing "
            "was changed."
        )


def replay_wraps(
    sess: Session, drop: tuple[str, ...] = (), dispatcher: Dispatcher | None = None
) -> dict[str, ShardedModel]:
    """Rebuild every wrap recorded on ``sess`` (after ``sess.restart()`` replaced engines).

    Class and factory specs are built and initialised afresh (same seed: same
    weights); string specs need the module to exist again on the engines; instance
    specs are built with uninitialised weights, for ``restore=`` to load (see
    :func:`check_replayable`). Wraps named in ``drop`` are forgotten on every rank
    and on the session. ``dispatcher``: recovery passes its plain one. Returns name ->
    ShardedModel.
    """
    d = dispatcher or sess.dispatcher
    if drop:
        d.gather(d.apply(f"drop {', '.join(drop)}", _ew.forget_all, args=(tuple(drop),)))
        for name in drop:
            sess.wraps.pop(name, None)
    return {r.name: _build(sess, r, dispatcher=d) for r in list(sess.wraps.values())}
