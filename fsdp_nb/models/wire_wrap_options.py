"""What a wrap asks for: ``WrapOptions``, which every rank receives with the wrap.

Plain data and pure functions: ``WrapOptions`` holds the options of Lightning's FSDP and
ModelParallel strategies and validates itself (an invalid one cannot be built), on the
notebook before a wrap or a plan starts; the ranks shard by it (``fsdp_nb.models.rank_wrap``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

__all__ = [
    "MIXED_PRECISION",
    "OPTION_NAMES",
    "SHARDING",
    "ClassNames",
    "WrapOptions",
    "make_options",
    "no_split_default",
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
    ``None``: only the root is wrapped. Each class must occur in the model. Not given,
    for a model that declares ``_no_split_modules`` (Hugging Face models do): those
    classes (:class:`ClassNames`), as Accelerate and transformers' FSDP integration do."""
    mixed_precision: str | MixedPrecisionPolicy = "32-true"
    """``"bf16-mixed"`` / ``"16-mixed"``: compute in bf16 / fp16, keep fp32
    sharded parameters, reduce gradients in fp32 and return the output in fp32 (the loss
    in fp32, as under autocast). ``"16-mixed"`` also gives every rank a sharded
    gradient scaler, the engine global ``scaler`` (fp16 gradients underflow without
    loss scaling): ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``.
    ``"bf16-true"``: parameters themselves bf16; ``"32-true"``: plain fp32; or a
    ``MixedPrecisionPolicy``."""
    cpu_offload: bool | CPUOffloadPolicy = False
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
    compile: bool = False
    """Compile each FSDP unit of ``auto_wrap`` with ``torch.compile`` (``module.compile()``)
    before its ``fully_shard``, as torchtitan does: each block becomes one graph of its
    own, with FSDP's gathers and reductions between the graphs, so the blocks run fused
    kernels (blocks of one class reuse one graph where dynamo's guards allow). With no
    ``auto_wrap`` unit the whole model is compiled. Compilation happens at the first
    forward (slow once); on CPU inductor needs a C++ compiler (``g++``) on the ranks'
    ``PATH``."""

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
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be True or False, got {self.compile!r}")
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


@dataclass(frozen=True)
class ClassNames:
    """An ``auto_wrap`` that picks modules by class name: a module whose class (or a
    base class) is named in ``names``. How transformers names a model's blocks
    (``_no_split_modules``), so the classes need not be importable where it is made."""

    names: tuple[str, ...]
    """Class names, e.g. ``("LlamaDecoderLayer",)``."""

    def __call__(self, module: Any) -> bool:
        return any(c.__name__ in self.names for c in type(module).__mro__)


def no_split_default(model: Any) -> ClassNames | None:
    """The ``auto_wrap`` a model declares: its (or its class's) ``_no_split_modules``
    names, as a :class:`ClassNames`; None when it declares none. ``model`` may be a
    module, a module class, or a bound constructor such as ``Cls.from_config``."""
    owner = getattr(model, "__self__", model)
    names = getattr(owner, "_no_split_modules", None)
    if not names or isinstance(names, str):
        return None
    return ClassNames(tuple(sorted(names)))


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
