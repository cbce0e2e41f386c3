"""What a wrap carries to the ranks and back: :class:`ShippedWrap`, what the notebook sent
(each rank keeps it, so a kernel that attaches later can wrap the model again), and
:class:`WrapSummary`, what the build did, which ``ShardedModel.summary`` keeps."""

from __future__ import annotations

from dataclasses import dataclass

from ..wire.calls import ByValue
from .wire_mesh_plan import MeshPlan

__all__ = ["ShippedWrap", "WrapSummary"]


@dataclass(frozen=True, kw_only=True)
class ShippedWrap:
    """One wrap as the notebook shipped it to every rank (``fsdp_nb.models.rank_wrap.build``)."""

    kind: str
    """How the model was given: ``"instance"``, ``"class"``, ``"factory"`` or ``"string"``."""
    payload: ByValue
    """``(spec, args, kwargs, WrapOptions)``, by value."""
    plan: MeshPlan
    """The mesh every rank builds."""
    seed: int
    """Base seed for initialising class-built models (rank r uses seed + r)."""


@dataclass(frozen=True)
class WrapSummary:
    """What a build did, returned to the notebook (plain data)."""

    num_params: int
    """Parameters of the whole (unsharded) model."""
    total_bytes: int
    """Bytes of all parameters, unsharded."""
    local_bytes: int
    """Bytes of parameters this rank holds after sharding."""
    units: tuple[str, ...]
    """FQNs given their own ``fully_shard`` (``""`` is the root)."""
    checkpointed: tuple[str, ...]
    """FQNs with activation checkpointing."""
    mesh_shape: tuple[int, ...]
    """Shape of the device mesh."""
    mesh_dims: tuple[str, ...]
    """Its dimension names."""
    param_dtype: str
    """dtype of the sharded parameters (first parameter)."""
    model_class: str
    """Qualified class name of the model."""
