"""Weights in and out of a wrapped model on a rank, one full tensor at a time.

``load_full_chunk``: the notebook streams a notebook instance's weights to rank 0 in
chunks; each full tensor is broadcast and every rank keeps its own piece, so no rank
holds the whole model. ``full_state_dict``: the reverse, gathered to rank 0 one
tensor at a time (``ShardedModel.state_dict()``).
"""

from __future__ import annotations

import warnings
from typing import Any

from ..torch_compat import local_tensor
from .rank_wrap import get

__all__ = ["full_state_dict", "load_full_chunk"]


def load_full_chunk(name: str, chunk: dict[str, Any] | None) -> int:
    """Scatter some full tensors from rank 0 into the shards of model ``name``.

    Every rank calls it together; rank 0 passes ``{fqn: full tensor}``, the others
    ``None``. The notebook streams an instance's weights in chunks this way, so rank
    0 never holds more than one chunk of full tensors besides its shards, and the
    other ranks one full tensor at a time: each is broadcast, then every rank keeps
    its own piece (``distribute_tensor`` with ``src_data_rank=None``, no further
    communication). (``set_model_state_dict`` would also copy every untouched
    shard onto itself on each call.)
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    entry = get(name)
    module = entry.module
    rank0 = dist.get_rank() == 0
    if rank0 and chunk:  # numpy arrays arrive as read-only zero-copy buffers
        chunk = {k: v if isinstance(v, torch.Tensor) else _from_readonly(v) for k, v in chunk.items()}
    meta = [(k, tuple(v.shape), v.dtype) for k, v in chunk.items()] if rank0 and chunk else None
    box = [meta]
    dist.broadcast_object_list(box, src=0)
    meta = box[0] or []
    targets = dict(module.named_parameters(remove_duplicate=False))
    targets.update(module.named_buffers(remove_duplicate=False))
    comm_device = torch.device(
        entry.mesh.device_type if entry.mesh.device_type == "cpu" else torch.cuda.current_device()
    )
    with torch.no_grad():
        for key, shape, dtype in meta:
            if key not in targets:
                raise KeyError(f"{key!r} is not a parameter or buffer of {name!r}")
            target = targets[key]
            if rank0 and chunk:  # meta came from rank 0's chunk, so it holds every key
                full = chunk[key].to(comm_device)
            else:
                full = torch.empty(shape, dtype=dtype, device=comm_device)
            dist.broadcast(full, src=0)
            if isinstance(target, DTensor):
                piece = distribute_tensor(
                    full.to(target.dtype), target.device_mesh, target.placements,
                    src_data_rank=None,
                ).to_local()
                local_tensor(target).copy_(piece)
            else:
                target.copy_(full)
            del full
    return len(meta)


def _from_readonly(array: Any) -> Any:
    """A tensor on a numpy array that arrived as a read-only zero-copy buffer.

    The tensor is only read (broadcast from this rank, sliced into its shard), so no
    copy is made; torch's warning about non-writable arrays is silenced for that call.
    """
    import torch

    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def full_state_dict(name: str) -> dict[str, Any] | None:
    """The full state dict on rank 0 (CPU tensors), None on the other ranks.

    Gathers one tensor at a time (``DTensor.full_tensor``), so no rank ever holds
    more than its shards plus one full tensor.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    entry = get(name)
    rank0 = dist.get_rank() == 0
    out: dict[str, Any] | None = {} if rank0 else None
    with torch.no_grad():
        for k, v in entry.module.state_dict().items():
            if isinstance(v, DTensor):
                if v.device.type != entry.mesh.device_type:
                    v = v.to(entry.mesh.device_type)
                full = v.full_tensor()
            else:
                full = v
            if out is not None:
                out[k] = full.detach().to("cpu", copy=True)
            del full
    return out
