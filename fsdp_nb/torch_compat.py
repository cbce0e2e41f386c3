"""Every use of torch's private API, and every branch on torch's version, in one place.

A new torch breaks private names first (``_world``, a module moved under ``_composable``),
so fsdp_nb touches them only here, each behind a small function that says what it is for
(``tests/unit/test_structure.py`` reads the package's source for any other use);
``tests/unit/test_torch_compat.py`` calls each one on every torch CI runs (the lowest
supported and the newest), so a rename fails CI in one place. Nothing here imports torch
at import time: the notebook side imports this module without paying for torch.

Supported: torch 2.11 to the newest release (``pyproject.toml``); where a torch has a public
call for what an older one needs private names for, the function uses it when it is there."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "DCP_METADATA_GLOBALS", "FLIGHT_RECORDER_ENV", "PICKLED_TENSOR", "TORCH_PRELOAD", "activation_checkpoint",
    "collective_call", "compute_local_shape_and_global_offset", "dcp_load_into", "dcp_metadata_path", "default_group",
    "default_store", "drop_unsynced_gradients", "empty_state_dict_planner", "flight_recorder",
    "fsdp_roots", "fsspec_reader", "fsspec_writer", "group_backend", "group_sequence_numbers",
    "kept_open_stager", "local_tensor", "making_group", "mesh_group_names", "narrow_tensor_by_index",
    "non_persistent_buffers", "parameter_initialiser", "process_groups", "repoint_fsdp_groups", "reset_fsdp_iteration",
    "resolve_process_group", "set_element", "set_mesh_group_names", "tree_leaves", "tree_map_only",
    "weights_only_unpickler",
]

FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
"""The variable every supported torch reads for the flight recorder's size, NCCL included (2.11 warns
about ``TORCH_NCCL_TRACE_BUFFER_SIZE``, the name it replaces, never set here)."""

TORCH_PRELOAD = ("torch._dynamo",)
"""What a rank imports up front: else the first ``fully_shard`` imports it (about 1 s)."""
log = logging.getLogger("fsdp_nb")

# -- process groups -------------------------------------------------------------------


def process_groups() -> list[Any]:
    """Every process group this rank belongs to (the default group and each subgroup,
    a device mesh's among them), in creation order."""
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map)


def default_group() -> Any:
    """The default process group (raises when none is formed)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_group()


def default_store() -> Any:
    """The store the default group formed on, for keys the ranks share beside it."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def group_sequence_numbers(pg: Any) -> dict[str, int]:
    """How many collectives ``pg`` has issued on this rank, per backend (``{"nccl": n}``,
    ``{"gloo": n}``, both in a ``cpu:gloo,cuda:nccl`` group): a member that issued fewer
    than the others is behind them. A read of a counter; nothing per collective."""
    out: dict[str, int] = {}
    for device in sorted({str(d.type) for d in getattr(pg, "_device_types", ())}):
        try:
            backend = group_backend(pg, device)
            name = type(backend).__name__.lower().removeprefix("processgroup") or device
            if name not in out:  # plain gloo serves cpu and cuda tensors: one backend
                out[name] = int(backend._get_sequence_number_for_group())
        except (RuntimeError, AttributeError):  # no backend for that device in this group
            continue
    if not out:
        out[str(pg.name())] = int(pg._get_sequence_number_for_group())
    return out


def group_backend(pg: Any, device: str) -> Any:
    """The backend that carries ``device`` tensors in ``pg`` (RuntimeError if none)."""
    import torch

    return pg._get_backend(torch.device(device))


def resolve_process_group(name: str) -> Any:
    """The live process group registered under ``name``."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(name)  # type: ignore[arg-type]  # a GroupName is a str


def mesh_group_names(mesh: Any) -> list[str]:
    """The process-group name of each dimension of device mesh ``mesh`` ([]: it has no groups)."""
    return list(getattr(mesh, "_dim_group_names", None) or ())


def set_mesh_group_names(mesh: Any, names: list[str]) -> None:
    """Point ``mesh``'s dimensions, and its group cache, at the groups ``names`` (re-formed)."""
    mesh._dim_group_names = list(names)
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()
        for n in names:
            try:
                registry[n] = resolve_process_group(n)
            except Exception as exc:  # noqa: BLE001 - a group not formed yet is resolved on the next pass
                log.debug("mesh group %s not resolvable yet: %s", n, exc)


def flight_recorder(collectives: bool) -> dict[str, Any] | None:
    """torch's flight recorder, read from its JSON dump (nothing is unpickled): each group's
    status (``pg_status``, keyed by the records' ``pg_id``) and (``collectives``) its records
    (``entries``; asked for the active ones, but on gloo ended ones come too, each saying
    ``retired``); None where this torch has no such dump or it does not record."""
    import torch

    try:
        dump = torch._C._distributed_c10d._dump_fr_trace_json  # type: ignore[attr-defined]  # not in the stubs
        return json.loads(dump(includeCollectives=collectives, onlyActive=True))
    except (AttributeError, RuntimeError, ValueError):
        return None


def repoint_fsdp_groups(instances: Callable[..., list[Any]]) -> int:
    """Point every live FSDP2 mesh info at its mesh's process groups now (after a re-form);
    how many there were. ``instances(*classes)`` finds live objects of classes (a heap scan)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

    found = instances(FSDPMeshInfo, DDPMeshInfo)
    for o in found:  # HSDP infos are both
        if isinstance(o, FSDPMeshInfo):
            o.shard_process_group = o.mesh.get_group(o.shard_mesh_dim)
            if getattr(o, "reduce_scatter_process_group", None) is not None:
                o.reduce_scatter_process_group = None
        if isinstance(o, DDPMeshInfo):
            o.replicate_process_group = o.mesh.get_group(o.replicate_mesh_dim)
    return len(found)


def fsdp_roots(instances: Callable[[type], list[Any]]) -> list[Any]:
    """The live FSDP2 root modules (each top-level ``fully_shard`` whose forward has run);
    ``instances(cls)`` finds the live objects of a class (a heap scan)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in instances(FSDPModule) if getattr(m._get_fsdp_state(), "_is_root", None) is True]


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list from torch 2.13, one or None before."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def drop_unsynced_gradients(module: Any) -> int:
    """Drop the gradients the FSDP2 units under ``module`` hold unreduced: a backward under
    ``set_requires_gradient_sync(False)`` (unsharded, in the unsharded parameter's ``.grad``,
    or before torch 2.15 upcast apart) or, under HSDP, ``set_requires_all_reduce(False)`` (reduce-scattered,
    not all-reduced). Not in ``.grad``: ``zero_grad`` leaves them, and the next synced
    backward would add them in. On torch 2.15 the group's pending no-sync reduction
    (``_post_backward_pending``) goes too. Returns how many tensors were dropped."""
    from torch.distributed.fsdp import FSDPModule

    groups = {id(g): g for m in module.modules() if isinstance(m, FSDPModule) for g in _param_groups(m._get_fsdp_state())}
    params = [p for g in groups.values() for p in g.fsdp_params]
    # the leaf's ``.grad`` first: before torch 2.15 an upcast gradient is a tensor of its own in
    # ``unsharded_accumulated_grad``; from 2.15 that name is a read-only property returning the
    # leaf's ``.grad`` (the leaf accumulates in its grad dtype), taken once, by identity. A
    # read-only name that held a tensor of its own would fail loudly, not be skipped.
    held = [(p._unsharded_param, "grad") for p in params if getattr(p, "_unsharded_param", None) is not None]
    held += [(p, "unsharded_accumulated_grad") for p in params]
    held += [(g, "_partial_reduce_output") for g in groups.values()]
    dropped: dict[int, Any] = {}
    for owner, name in held:
        tensor = getattr(owner, name, None)
        if tensor is not None and id(tensor) not in dropped:
            dropped[id(tensor)] = tensor  # kept alive to the end, so no id is reused
            setattr(owner, name, None)
    for group in groups.values():
        if getattr(group, "_post_backward_pending", False):  # torch 2.15: the no-sync backward's reduction, now void
            group._post_backward_pending = False
    return len(dropped)


def reset_fsdp_iteration(root: Any) -> None:
    """Put FSDP2 root ``root`` and its modules back between iterations: every parameter
    group sharded and idle, nothing pending, the failed iteration's unreduced gradients
    dropped; ``.grad`` is kept, as in plain torch, on every torch (2.15's own reset clears
    it). A step a failure cut short leaves units where it caught them, and the next
    step's collectives would not match across ranks. Called after the group was re-formed
    (what was pending was the destroyed group's: dropped, never waited on). torch 2.13+
    has the public ``FSDPModule.reset_iter_state``; on older ones these fields are reset."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = root._get_fsdp_state()
    states = list(state._state_ctx.all_states)
    for s in states:  # their work is the destroyed group's: waiting on it would raise
        for group in _param_groups(s):
            group._all_gather_result = None
    drop_unsynced_gradients(root)  # a cut-short accumulation's: reset_iter_state keeps them before 2.15
    if hasattr(root, "reset_iter_state"):
        grads = [(p.sharded_param, p.sharded_param.grad)
                 for s in states for g in _param_groups(s) for p in g.fsdp_params]
        try:
            root.reset_iter_state()
        finally:  # torch 2.15's reset clears .grad too: kept, as on 2.11 and 2.13
            for param, grad in grads:
                param.grad = grad
        return
    comm = state._comm_ctx
    comm.all_gather_state = None
    comm.reduce_scatter_state = None
    comm.post_forward_order.clear()
    for s in states:
        s._modules_to_run_forward.clear()
        s._training_state = TrainingState.IDLE
        for group in _param_groups(s):
            group._post_reduce_event = None
            group._all_reduce_state = None
            group._reshard_after_forward_event = None
            group._partial_reduce_output = None
            group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


_GROUP_MAKERS = frozenset({"init_process_group", "new_group", "_new_process_group_helper", "new_subgroups",
                           "new_subgroups_by_enumeration", "split_group", "init_device_mesh", "_init_process_groups"})
"""torch.distributed's functions that make a process group (the flight recorder's table of
groups grows while one runs)."""
_COLLECTIVES = frozenset({"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
                          "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                          "barrier", "gather", "scatter", "send", "recv", "broadcast_object_list", "monitored_barrier"})
"""``distributed_c10d``'s collectives whose frame the hang watch reads."""
_TENSOR_ARGS = ("tensor", "input_tensor", "output_tensor", "tensor_list", "input", "output")
"""The names ``distributed_c10d``'s collectives give their tensor arguments."""


def _in_torch_distributed(filename: str) -> bool:
    dist = sys.modules.get("torch.distributed")
    here = getattr(dist, "__file__", None)
    return bool(here) and filename.startswith(here.rsplit("/", 1)[0] + "/")  # type: ignore[union-attr]


def making_group(frame: Any) -> bool:
    """Whether ``frame`` or a frame under it (a thread's stack) is in torch.distributed
    making a process group."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in _GROUP_MAKERS and _in_torch_distributed(code.co_filename):
            return True
        frame = frame.f_back
    return False


def collective_call(frame: Any) -> tuple[str, Any, list[Any]] | None:
    """The collective of ``distributed_c10d`` that ``frame`` (a thread's stack, innermost
    first) is inside, read from that call's own frame: (its op, its group argument or
    None for the default group, its tensor arguments); None when it is in none."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in _COLLECTIVES and code.co_filename.endswith("distributed_c10d.py"):
            local = frame.f_locals
            tensors = []
            for k in _TENSOR_ARGS:
                v = local.get(k)
                tensors += [t for t in (v if isinstance(v, list) else [v]) if hasattr(t, "shape") and hasattr(t, "dtype")]
            return code.co_name, local.get("group") or local.get("pg"), tensors
        frame = frame.f_back
    return None


# -- tensors and modules -------------------------------------------------------------


def local_tensor(t: Any) -> Any:
    """This rank's view of DTensor ``t``'s shard (writing to it writes the shard), by the
    public ``to_local`` outside autograd; ``t`` itself when it is a plain tensor."""
    to_local = getattr(t, "to_local", None)
    if to_local is None:
        return t
    import torch

    with torch.no_grad():
        return to_local()


def compute_local_shape_and_global_offset(shape: Any, mesh: Any, placements: Any) -> tuple[Any, Any]:
    """(local shape, global offset) of this rank's piece of a tensor of global
    ``shape`` placed on ``mesh`` with ``placements``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as f

    return f(shape, mesh, placements)


def activation_checkpoint(module: Any) -> Any:
    """Activation checkpointing on ``module`` through the composable API (parameter
    names unchanged, unlike the wrapper class)."""
    from torch.distributed._composable import checkpoint

    return checkpoint(module)


def non_persistent_buffers(module: Any) -> set[str]:
    """The names of ``module``'s own buffers that its state dict leaves out (rotary
    tables): they are recomputed, never loaded."""
    return set(getattr(module, "_non_persistent_buffers_set", ()) or ())


def parameter_initialiser(module: Any) -> Callable[[], None] | None:
    """What initialises ``module``'s own parameters: its ``reset_parameters``, or the
    private one some torch modules use instead (``nn.MultiheadAttention``); None if neither."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def tree_map_only(cls: Any, fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` (a nested dict / list / tuple) with each leaf of type ``cls`` replaced by ``fn(leaf)``."""
    from torch.utils import _pytree

    return _pytree.tree_map_only(cls, fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a nested dict / list / tuple."""
    from torch.utils import _pytree

    return _pytree.tree_leaves(tree)


# -- checkpoints ---------------------------------------------------------------------


def fsspec_writer() -> type:
    """DCP's storage writer over an fsspec file system (remote URLs)."""
    from torch.distributed.checkpoint import _fsspec_filesystem

    return _fsspec_filesystem.FsspecWriter


def fsspec_reader() -> type:
    """DCP's storage reader over an fsspec file system (remote URLs)."""
    from torch.distributed.checkpoint import _fsspec_filesystem

    return _fsspec_filesystem.FsspecReader


def narrow_tensor_by_index(tensor: Any, offsets: Any, sizes: Any) -> Any:
    """The view of ``tensor`` that starts at ``offsets`` and spans ``sizes``."""
    from torch.distributed._shard._utils import narrow_tensor_by_index as f

    return f(tensor, offsets, sizes)


def set_element(root: Any, path: Any, value: Any) -> None:
    """Put ``value`` at DCP object path ``path`` in state dict ``root``."""
    from torch.distributed.checkpoint._traverse import set_element as f

    f(root, path, value)


def dcp_metadata_path(reader: Any, rank: int | None) -> str:
    """Where DCP file-system reader ``reader`` keeps the ``.metadata`` of ``rank`` (None:
    the checkpoint's one metadata file)."""
    return str(reader._get_metadata_path(rank))


def dcp_load_into(state_dict: dict[str, Any], reader: Any, planner: Any) -> None:
    """DCP's load into ``state_dict`` itself, in this process alone (no process group).
    ``dcp.load`` loads into a copy of the dict's keys, so a planner that builds the whole
    nested state dict from the metadata (``empty_state_dict_planner``) would fill the copy;
    this fills ``state_dict`` (as DCP's own ``dcp_to_torch_save`` does)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state_dict, storage_reader=reader, planner=planner, no_dist=True)


def empty_state_dict_planner() -> type:
    """DCP's load planner that rebuilds a whole checkpoint's nested state dict from its
    metadata, into an empty dict (what ``dcp_to_torch_save`` uses)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    return _EmptyStateDictLoadPlanner


DCP_METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                        "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                        "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed.checkpoint._extension": frozenset({"ExtensionRegistry"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size", "device", "layout", "memory_format", "strided", "sparse_coo"}),
}
"""The classes and functions of torch that a DCP ``.metadata`` pickle names (the
supported torch versions' writers, private ones among them): what the restricted
unpickler may resolve from torch (``formats.restricted``)."""


def kept_open_stager(cuda: bool) -> Any:
    """DCP's ``DefaultStager``, copying in its own thread (from ``cuda`` tensors into pinned
    memory, non-blocking), that stays open across saves: torch 2.11 closes its inner copier
    after every staging (``DefaultStager._stage``), which empties its copy tables (the next
    save failed with "KeyError: <class 'type'>", and no buffer was reused)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    class KeptStager(DefaultStager):
        def close(self) -> None:  # kept for the engine's life
            pass

    stager = KeptStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                                       use_non_blocking_copy=cuda))
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is not None:
        inner.close = lambda: None
    return stager


PICKLED_TENSOR = frozenset({("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes")})
"""What ``pickle.dumps`` of a CPU tensor names: its rebuild, its storage as ``torch.save`` bytes."""


def weights_only_unpickler() -> type:
    """The unpickler ``torch.load(weights_only=True)`` uses, to read a pickle in place."""
    from torch._weights_only_unpickler import Unpickler

    return Unpickler
