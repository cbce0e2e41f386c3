"""The device mesh a wrap builds on every rank: ``MeshPlan``, and ``plan_mesh`` which
makes it on the notebook.

``plan_mesh`` turns (world size, backend, hosts, options) into the ``MeshPlan`` every
rank builds: 1-D ``("dp",)`` for ``"full"`` and ``"grad_op"``; 2-D ``("dp_replicate",
"dp_shard")`` for ``"hybrid"`` (by default shard within a host, replicate across hosts)
and for ``"none"`` (``(N, 1)``: FSDP2 replicates along the first dimension); ``("dp",
"tp")`` with tensor parallelism. Plain data and a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass

from .wire_wrap_options import WrapOptions

__all__ = ["MeshPlan", "plan_mesh"]

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
    dp_option = options.data_parallel_size
    if options.sharding == "hybrid":
        if isinstance(dp_option, tuple):  # WrapOptions checked: a (replicate, shard) pair with "hybrid"
            rep, shard = dp_option
        else:
            shard = min(hosts.count(h) for h in set(hosts))
            if world % shard:
                raise ValueError(
                    f"cannot split {world} ranks into hosts of {shard}; pass "
                    "data_parallel_size=(replicate, shard)"
                )
            rep = world // shard
        if rep * shard != world:
            raise ValueError(
                f"data_parallel_size={(rep, shard)} has {rep * shard} ranks, the world has {world}"
            )
        names = ("dp_replicate", "dp_shard")
        return MeshPlan(device_type, (rep, shard), names, names)
    dp = dp_option if isinstance(dp_option, int) else dp_default  # an int without "hybrid" (WrapOptions checked)
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
