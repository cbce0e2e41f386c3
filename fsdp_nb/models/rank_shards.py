"""Engine side of ``ShardedModel.shards()``: this rank's piece of every parameter.

Read from the DTensor itself: ``placements``, ``device_mesh`` and
``compute_local_shape_and_global_offset`` (what DTensor says this rank owns,
uneven shards as they are — FSDP2's padding is not counted).
"""

from __future__ import annotations

import math

from ..torch_compat import compute_local_shape_and_global_offset
from .rank_wrap import get
from .wire_shards import ParamShard

__all__ = ["local_shards"]


def local_shards(name: str) -> list[ParamShard]:
    """This rank's row for every parameter of the model wrapped as ``name``: a
    ``ParamShard`` whose per-rank fields hold this rank's piece only (one entry);
    ``ShardedModel.shards()`` joins the ranks' rows."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    entry = get(name)
    rows = []
    for fqn, p in entry.module.named_parameters():
        dtype = str(p.dtype).removeprefix("torch.")
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
            rows.append(
                ParamShard(
                    fqn, tuple(p.shape), dtype, tuple(_placement(pl) for pl in p.placements),
                    tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()),
                    (tuple(shape),), (tuple(offset),), (math.prod(shape) * p.element_size(),),
                )
            )
        else:
            rows.append(
                ParamShard(
                    fqn, tuple(p.shape), dtype, (), (dist.get_world_size(),), (),
                    (tuple(p.shape),), ((0,) * p.dim(),), (p.numel() * p.element_size(),),
                )
            )
    return rows


def _placement(pl: object) -> str:
    """``"Shard(0)"``, ``"Replicate()"``, ``"Partial()"``; others as DTensor prints them."""
    from torch.distributed.tensor import Replicate, Shard

    if type(pl) is Shard:
        return f"Shard({pl.dim})"
    if isinstance(pl, Replicate):
        return "Replicate()"
    return str(pl)
