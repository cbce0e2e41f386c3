"""Engine side of ``sess.wrap``: build, shard and bind a model on this rank.

What other features read (checkpoints, layout, recovery), this rank's part
:class:`WrappedModels`::

    wrapped()[name] -> Wrapped(module, mesh, options)

``module`` is the FSDP2 module (also the engine global ``name``), ``mesh`` the
``DeviceMesh`` it was sharded on (the full mesh: ``("dp",)``, ``("dp_replicate",
"dp_shard")`` or ``("dp", "tp")``), ``options`` the ``fsdp_nb.models.wire_wrap_options.WrapOptions``.

How a model is built (every rank runs the same steps, so collectives line up):

- class / factory spec: constructed under ``torch.device("meta")`` (no memory),
  tensor parallelism (``parallelize``), activation checkpointing, ``fully_shard``
  on each auto-wrap unit (innermost first) then the root, ``to_empty`` onto the
  rank's device — now each rank holds only its shards — then ``reset_parameters()``
  on every submodule that has one, or ``init_fn`` on every submodule (a Hugging Face
  ``PreTrainedModel``: transformers' own ``initialize_weights``). Buffers are
  allocated empty by ``to_empty``: modules must (re)compute them in
  ``reset_parameters`` (as ``nn.BatchNorm`` does) or ``init_fn`` must; e.g. a RoPE
  table registered with ``persistent=False`` is recomputed there. Initialisation
  runs under a forked RNG seeded with ``seed + rank`` (shards differ, the user's
  RNG is untouched); afterwards every replicated piece (``Replicate`` placements,
  plain buffers) is broadcast from the first rank of its group so replicas agree.
- instance spec: every rank receives a copy whose parameters are on the meta
  device (buffers shipped as they are); all shard the same way and ``to_empty``;
  then the notebook streams the weights to rank 0 in chunks (``models.rank_weights.load_full_chunk``:
  broadcast one tensor, every rank keeps its piece), so no rank ever holds the whole
  model (torch's ``set_model_state_dict(..., broadcast_from_rank0=True)`` does
  the same per tensor but needs the whole state dict on rank 0).
- string spec: the engine global module; rank 0's weights win (same broadcast).
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, NamedTuple

from ..engine.namespace import rank_device, unship, user_ns
from ..engine.registry import Part, part
from ..engine.step import owner
from ..torch_compat import (
    activation_checkpoint,
    local_tensor,
    non_persistent_buffers,
    parameter_initialiser,
)
from ..wire.calls import ByValue
from .rank_hugging_face import hf_init_weights, initialize_weights, is_hugging_face
from .rank_wrap_policies import compile_units, policies, root
from .wire_mesh_plan import MeshPlan
from .wire_wrap import ShippedWrap, WrapSummary
from .wire_wrap_options import WrapOptions

__all__ = [
    "WrappedModels",
    "Wrapped",
    "build",
    "check_classes",
    "construct",
    "check_spec",
    "forget_all",
    "get",
    "mesh_of",
    "name_status",
    "param_sizes",
    "resolve",
    "shard",
    "wrapped",
    "wrapped_models",
]


class Wrapped(NamedTuple):
    """One wrapped model on this rank."""

    module: Any
    """The FSDP2 module."""
    mesh: Any
    """Its ``DeviceMesh``."""
    options: WrapOptions
    """The options it was wrapped with."""
    summary: WrapSummary | None = None
    """What its build returned."""
    shipped: ShippedWrap | None = None
    """What the notebook sent: a kernel that attaches later rebuilds its ``WrapRecord``
    from this (``wrapped_models``)."""


class WrappedModels(Part):
    """The models ``sess.wrap`` built on this rank (the registry's part for wraps)."""

    def __init__(self) -> None:
        self.models: dict[str, Wrapped] = {}
        """Engine global name -> the wrapped model on this rank."""


def wrapped() -> dict[str, Wrapped]:
    """Engine global name -> the wrapped model on this rank."""
    return part(WrappedModels).models


def _key(cls: type) -> tuple[str, str]:
    return (getattr(cls, "__module__", ""), getattr(cls, "__qualname__", cls.__name__))


def matches(module: Any, classes: frozenset[type]) -> bool:
    """``isinstance``, or the same module + qualified name in its MRO.

    A notebook class reaches the engines once per shipment (and once more when
    ``%%px`` defined it), so identity alone would miss equal classes.
    """
    if isinstance(module, tuple(classes)):
        return True
    keys = {_key(c) for c in classes}
    return any(_key(c) in keys for c in type(module).__mro__)


def check_classes(model: Any, options: WrapOptions) -> str | None:
    """A message if an ``auto_wrap`` / ``activation_checkpointing`` class is absent."""
    present = {_key(c) for m in model.modules() for c in type(m).__mro__}
    for opt in ("auto_wrap", "activation_checkpointing"):
        classes = getattr(options, opt)
        if not isinstance(classes, frozenset):
            continue
        missing = sorted(c.__qualname__ for c in classes if _key(c) not in present)
        if missing:
            found = sorted({type(m).__qualname__ for m in model.modules()})
            return (
                f"{opt} class(es) {', '.join(missing)} do not occur in the model "
                f"{type(model).__qualname__}; its module classes are: {', '.join(found)}"
            )
    return None


def name_status(name: str) -> str | None:
    """None if ``name`` is free (or holds a model ``sess.wrap`` bound), else what it is."""
    ns = user_ns()
    if name in wrapped() or name not in ns:
        return None
    return f"holds a {type(ns[name]).__name__}"


def construct(kind: str, spec: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    if kind in ("class", "factory"):
        with torch.device("meta"):
            model = spec(*args, **kwargs)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"the factory {getattr(spec, '__qualname__', spec)!r} returned a "
                f"{type(model).__name__}, not a torch.nn.Module"
            )
        return model
    if kind == "string":
        ns = user_ns()
        if spec not in ns:
            raise NameError(f"no engine global named {spec!r} (build it with %%px first)")
        model = ns[spec]
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            raise ValueError(
                f"engine global {spec!r} is already an FSDP module; wrap an unwrapped module"
            )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"engine global {spec!r} is a {type(model).__name__}, not an nn.Module")
        return model
    return spec


def check_spec(kind: str, payload: Any) -> str | None:
    """Build a class/factory spec on the meta device (or look up a string spec) and
    check it; returns a problem message or None. Binds nothing."""
    spec, args, kwargs, options = unship(payload)
    try:
        model = construct(kind, spec, args, kwargs)
    except (NameError, TypeError, ValueError) as exc:
        return str(exc)
    return check_classes(model, options)


def mesh_of(plan: MeshPlan) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(plan.device_type, plan.shape, mesh_dim_names=plan.dim_names)


def _checkpoint(model: Any, classes: frozenset[type]) -> tuple[str, ...]:
    """Activation checkpointing on matching submodules (composable API: FQNs unchanged)."""
    done = []
    for fqn, m in list(model.named_modules()):
        if matches(m, classes):
            activation_checkpoint(m)
            done.append(fqn)
    return tuple(done)


def _units(model: Any, auto_wrap: Any) -> list[tuple[str, Any]]:
    if auto_wrap is None:
        return []
    pick = (lambda m: matches(m, auto_wrap)) if isinstance(auto_wrap, frozenset) else auto_wrap
    chosen = [(fqn, m) for fqn, m in model.named_modules() if fqn and pick(m)]
    return list(reversed(chosen))  # innermost first


def _sync_replicas(model: Any, plan: MeshPlan) -> None:
    """Make replicated pieces equal across ranks: broadcast from each group's first rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if isinstance(t, DTensor):
                local = local_tensor(t)
                for dim, pl in enumerate(t.placements):
                    if isinstance(pl, Replicate) and t.device_mesh.size(dim) > 1 and local.numel():
                        g = t.device_mesh.get_group(dim)
                        dist.broadcast(local, group=g, group_src=0)
            elif t.numel():
                dist.broadcast(t.data, src=0)


def _init(model: Any, options: WrapOptions, seed: int, plan: MeshPlan) -> None:
    import torch
    import torch.distributed as dist

    devices = [torch.cuda.current_device()] if plan.device_type == "cuda" else []
    with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
        # DTensor warns that its random ops are local on a CPU mesh: that is what we
        # want (each shard from its own seeded stream; replicas synced below)
        warnings.filterwarnings("ignore", message="DTensor random operators")
        torch.manual_seed(seed + dist.get_rank())
        with torch.no_grad():
            # poison first, so a parameter no initialiser touched is caught below
            # instead of training on uninitialised memory
            for p in model.parameters():
                if p.is_floating_point():
                    local_tensor(p).fill_(float("nan"))
            if options.init_fn is not None:
                model.apply(options.init_fn)
            elif is_hugging_face(model):
                initialize_weights(model)
            else:
                for m in model.modules():
                    reset = parameter_initialiser(m)
                    if reset is not None:
                        reset()
    missing = [n for n, p in model.named_parameters() if p.is_floating_point() and local_tensor(p).isnan().any()]
    if missing:
        how = ("init_fn" if options.init_fn is not None else
               "transformers' initialize_weights()" if is_hugging_face(model) else "reset_parameters()")
        raise RuntimeError(
            f"parameter(s) {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} were not "
            f"initialised by {how} after the meta-device build; give their modules a "
            "reset_parameters() or pass init_fn=fn(module) to sess.wrap"
        )
    _sync_replicas(model, plan)


def _init_buffers(model: Any) -> None:
    """Compute the buffers a checkpoint does not hold (non-persistent: rotary tables),
    for a model whose parameters a load fills next: the initialiser runs only on the
    modules that own such buffers (their parameters, if any, are overwritten by the load)."""
    import torch

    hf = is_hugging_face(model)
    with torch.no_grad():
        for m in model.modules():
            if not non_persistent_buffers(m):
                continue
            if hf:
                hf_init_weights(model, m)
            elif callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()


def _forget(*names: str) -> None:
    """Drop models ``names`` from the registry and the engine globals, then collect
    once (their memory freed before another is built); nothing to drop, no collection
    (a pass takes a few hundred ms with torch loaded)."""
    ns = user_ns()
    dropped = 0
    for name in names:
        old = wrapped().pop(name, None)
        if old is not None:
            dropped += 1
            if ns.get(name) is old.module:
                del ns[name]
        del old
    if dropped:
        gc.collect()


def forget_all(names: tuple[str, ...]) -> None:
    """Drop wrapped models ``names`` from this rank (registry and engine global)."""
    _forget(*names)


def shard(model: Any, options: WrapOptions, plan: MeshPlan, mesh: Any,
          ) -> tuple[Any, list[tuple[str, Any]], tuple[str, ...], bool]:
    """Apply ``options`` to a model whose parameters are not allocated yet (meta or fake):
    bf16-true's cast, tensor parallelism, activation checkpointing, ``compile``, then
    ``fully_shard`` on each unit (innermost first) and the root. Returns the model, its units, the
    checkpointed FQNs and whether it is offloaded to the CPU (what ``to_empty`` needs)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    if options.mixed_precision == "bf16-true":
        model.to(torch.bfloat16)
    if plan.tp_dim is not None:
        if options.parallelize is None:  # WrapOptions refuses tensor parallelism without it
            raise ValueError("a tensor-parallel mesh needs parallelize=fn(model, device_mesh)")
        model = options.parallelize(model, mesh)
        if not isinstance(model, torch.nn.Module):
            raise TypeError("parallelize(model, device_mesh) must return the nn.Module")
    fsdp_mesh = mesh[plan.fsdp_dims[0]] if len(plan.fsdp_dims) == 1 and mesh.ndim > 1 else mesh
    checkpointed: tuple[str, ...] = ()
    if options.activation_checkpointing:
        checkpointed = _checkpoint(model, options.activation_checkpointing)
    kw = policies(options, plan.device_type)
    units = _units(model, options.auto_wrap)
    if options.compile:  # as torchtitan: each unit its own graph, compiled before it is sharded
        compile_units([m for _, m in units] or [model])
    for _fqn, m in units:
        fully_shard(m, mesh=fsdp_mesh, **kw)
    fully_shard(model, mesh=fsdp_mesh, **root(kw, options.mixed_precision))
    return model, units, checkpointed, bool(kw.get("offload_policy"))


def build(name: str, kind: str, payload: ByValue, plan: MeshPlan, seed: int, init: bool = True) -> WrapSummary:
    """Build, shard and bind one model on this rank (every rank calls it together).
    ``init=False`` (weights come from a checkpoint next): a class or factory spec's
    parameters are left as allocated; only buffers outside the state dict are computed."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    _forget(name)
    spec, args, kwargs, options = unship(payload)
    shipped = payload  # kept: a kernel that attaches later reads it (wrapped_models)
    model = construct(kind, spec, args, kwargs)
    del spec
    ns = user_ns()
    device = torch.device(rank_device())
    mesh = mesh_of(plan)
    full_sd = None
    saved_buffers: dict[str, Any] = {}
    if kind in ("instance", "string"):
        # every rank goes on with parameters on the meta device, exactly as for a class
        # spec, so collectives inside parallelize / fully_shard see the same tensors on
        # every rank. A string spec's rank-0 weights are kept aside (references, no
        # copy); an instance's weights are streamed afterwards (load_full_chunk)
        if kind == "string" and dist.get_rank() == 0:
            full_sd = dict(model.state_dict())
        saved_buffers = {k: b for k, b in model.named_buffers() if not b.is_meta}
        model.to("meta")
    model, units, checkpointed, offload = shard(model, options, plan, mesh)
    model.to_empty(device=device if not offload else "cpu")
    if kind in ("class", "factory"):
        _init(model, options, seed, plan) if init else _init_buffers(model)
    else:
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k in saved_buffers:
                    b.copy_(saved_buffers[k])
        saved_buffers.clear()
        if kind == "string":
            set_model_state_dict(
                model,
                full_sd if full_sd is not None else {},
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            )
            full_sd = None
    gc.collect()
    summary = _summary(model, units, checkpointed, mesh)
    wrapped()[name] = Wrapped(model, mesh, options, summary, ShippedWrap(kind=kind, payload=shipped, plan=plan, seed=seed))
    ns[name] = model
    owner().watch(model)  # the one forward pre-hook fsdp_nb puts on a model; the features hear of it
    if options.mixed_precision == "16-mixed":  # fp16 gradients need loss scaling
        from .rank_grad_scaler import install

        install(device.type)
    return summary


def param_sizes(model: Any) -> tuple[int, int, int]:
    """(parameters, bytes, bytes this rank holds) of ``model``'s parameters, unsharded
    sizes from the DTensors' global shapes."""
    num = total = local = 0
    for p in model.parameters():
        num += p.numel()
        total += p.numel() * p.element_size()
        lt = local_tensor(p)
        local += lt.numel() * lt.element_size()
    return num, total, local


def _summary(model: Any, units: list, checkpointed: tuple[str, ...], mesh: Any) -> WrapSummary:
    num, total, local = param_sizes(model)
    first = next(iter(model.parameters()), None)
    dtype = str(first.dtype).removeprefix("torch.") if first is not None else "float32"
    return WrapSummary(
        num_params=num,
        total_bytes=total,
        local_bytes=local,
        units=tuple(f for f, _ in reversed(units)) + ("",),
        checkpointed=checkpointed,
        mesh_shape=tuple(mesh.shape),
        mesh_dims=tuple(mesh.mesh_dim_names or ()),
        param_dtype=dtype,
        model_class=type(model).__qualname__,
    )


def get(name: str) -> Wrapped:
    """The registry entry for ``name``, with a clear error when it was not wrapped here."""
    if name not in wrapped():
        held = ", ".join(sorted(wrapped())) or "none"
        raise NameError(
            f"no model wrapped as {name!r} on this rank (wrapped: {held}); use sess.wrap first"
        )
    return wrapped()[name]


def wrapped_models() -> dict[str, tuple[ShippedWrap | None, WrapSummary | None]]:
    """Name -> (what was shipped, its summary) of every model wrapped on this rank, in wrap
    order: what ``Session.attach`` needs to give a new kernel its ``sess.models``."""
    return {name: (w.shipped, w.summary) for name, w in wrapped().items()}


def resolve(name: str) -> Any:
    """The FSDP module wrapped as ``name`` (what a shipped ``ShardedModel`` becomes)."""
    return get(name).module
