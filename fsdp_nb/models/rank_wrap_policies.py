"""The FSDP2 policies a wrap applies: mixed precision, CPU offload, resharding, compiling.

``policies`` turns ``WrapOptions`` into ``fully_shard`` keywords for every unit;
``root`` adjusts them for the root module, whose output a "-mixed" model hands back
in fp32; ``compile_units`` compiles the units before they are sharded.
"""

from __future__ import annotations

from typing import Any

from .wire_wrap_options import WrapOptions

__all__ = ["compile_units", "policies", "root"]


def policies(options: WrapOptions, device_type: str) -> dict[str, Any]:
    """``fully_shard`` keywords for ``options`` on a ``device_type`` mesh: resharding,
    mixed precision and CPU offload policies."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kw: dict[str, Any] = {"reshard_after_forward": options.sharding != "grad_op"}
    mp = options.mixed_precision
    if isinstance(mp, MixedPrecisionPolicy):
        kw["mp_policy"] = mp
    elif mp in ("bf16-mixed", "16-mixed"):  # the root's output in fp32 (``root``)
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if mp == "bf16-mixed" else torch.float16, reduce_dtype=torch.float32)
    off = options.cpu_offload
    if off is True:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type != "cpu")
    elif isinstance(off, CPUOffloadPolicy):
        kw["offload_policy"] = off
    return kw


def root(kw: dict[str, Any], mixed_precision: Any) -> dict[str, Any]:
    """The root module's policies: a "-mixed" model hands its output back in fp32, so the
    loss is fp32 as under autocast (torch 2.11's mse_loss backward fails on bf16 against
    fp32); the inner units keep bf16 between them."""
    import dataclasses

    import torch

    if mixed_precision not in ("bf16-mixed", "16-mixed"):
        return kw
    return kw | {"mp_policy": dataclasses.replace(kw["mp_policy"], output_dtype=torch.float32)}


def compile_units(modules: list[Any]) -> None:
    """``module.compile()`` on each of ``modules``, in place (``WrapOptions.compile``).

    Each is compiled on its own, before ``fully_shard`` (torchtitan's order): its forward
    becomes one graph, and FSDP's hooks, which dynamo leaves out of graphs, gather and
    reduce between the graphs. Compiling is lazy: the first forward traces it; modules
    of one class reuse one another's graphs where dynamo's guards allow.
    """
    for m in modules:
        m.compile()
