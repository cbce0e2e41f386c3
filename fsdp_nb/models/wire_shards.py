"""Who holds what: the per-parameter shard table of a wrapped model.

Filled on the engines (``fsdp_nb.engine``) from DTensor placements, read by
``ShardedModel.shards()`` and rendered by the layout widget. Plain data only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..formats.dtypes import itemsize

__all__ = ["ParamShard", "ShardTable"]


@dataclass(frozen=True)
class ParamShard:
    """One parameter (or buffer) and each rank's piece of it."""

    name: str
    """Fully qualified name, as in the unwrapped model's state dict."""
    global_shape: tuple[int, ...]
    """Shape of the whole tensor."""
    dtype: str
    """torch dtype name, e.g. ``"float32"``."""
    placements: tuple[str, ...]
    """DTensor placements per mesh dimension, e.g. ``("Shard(0)",)``; ``()`` if not a DTensor."""
    mesh_shape: tuple[int, ...]
    """Shape of the device mesh it lives on (``(world,)`` for 1-D FSDP)."""
    mesh_dims: tuple[str, ...]
    """Names of the mesh dimensions, e.g. ``("dp_replicate", "dp_shard")``."""
    local_shapes: tuple[tuple[int, ...], ...]
    """Each rank's local shape, index = rank (uneven shards as they are; 0-sized allowed)."""
    local_offsets: tuple[tuple[int, ...], ...]
    """Each rank's offset into the global tensor, index = rank."""
    local_bytes: tuple[int, ...]
    """Bytes each rank holds of it, index = rank."""

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)


@dataclass(frozen=True)
class ShardTable:
    """The shard layout of one wrapped model."""

    model: str
    """Engine global name of the model."""
    world_size: int
    """Number of ranks."""
    mesh_shape: tuple[int, ...]
    """Shape of the model's device mesh."""
    mesh_dims: tuple[str, ...]
    """Names of its dimensions."""
    params: tuple[ParamShard, ...]
    """One row per parameter, in ``named_parameters`` order."""

    def bytes_per_rank(self) -> list[int]:
        """Total bytes each rank holds."""
        return [sum(p.local_bytes[r] for p in self.params) for r in range(self.world_size)]

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole (unsharded) model at its stored dtypes."""
        return sum(p.numel * itemsize(p.dtype) for p in self.params)
