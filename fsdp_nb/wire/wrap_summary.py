"""What a wrap did on one rank: :class:`WrapSummary`, returned by ``fsdp_nb.engine.wrap.build``
to the notebook, where ``ShardedModel.summary`` keeps it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WrapSummary"]


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
