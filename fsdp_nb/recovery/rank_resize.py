"""Engine side of ``sess.resize``: carry wrapped models and their optimizers to a new world.

The notebook (``fsdp_nb.recovery.resize``) calls, in this order:

1. ``survey`` on every rank: which engine globals are optimizers over which wrapped
   model, which cannot be carried, and which other variables a user made.
2. ``recipes`` on rank 0: how to build each optimizer on a rank that never had it
   (checked there by building it over stand-in parameters).
3. ``watch_memory`` then ``stage`` on the ranks of the old world: each model's shards and
   its optimizers' state go into one DCP folder per model in the staging folder (a tmpfs,
   ``/dev/shm``), one file per rank; then the models are dropped and the optimizers
   detached (state cleared, parameter lists emptied: the objects stay, so a learning-rate
   scheduler that holds one keeps working), which frees their memory before the new
   shards are allocated.
4. ``leave`` on ranks that retire; the new group forms (``process_group.init``); the
   notebook rebuilds each model on the new mesh (``wrap.build``, ``init=False``).
5. ``restore`` on every rank of the new world, once per model: the optimizers get the new
   parameters by name (built from their recipe where the rank had none), then DCP reads
   the staged folder into the new shards, resharding as it reads.
6. ``memory_peak``: the highest resident memory each rank reached since ``watch_memory``.
"""

from __future__ import annotations

import inspect as _inspect
import logging
import os
import types
from typing import Any

from ..checkpoints.rank_async_saves import drain
from ..checkpoints.rank_save import state_bytes
from ..engine.checkpoint_group import checkpoint_group
from ..engine.namespace import unship, user_ns
from ..engine.registry import Part, part
from ..formats.dcp_reader import safe_reader
from ..formats.inspect import read_dcp_metadata
from ..formats.pickles import load_planner
from ..formats.storage import url_to_fs
from ..memory.rank_memory_sample import peak_resident, reset_peak_resident
from ..models.rank_grad_scaler import SCALER
from ..models.rank_grad_scaler import current as current_scaler
from ..models.rank_wrap import forget_all, wrapped
from ..torch_compat import local_tensor
from ..wire.calls import ByValue
from .wire_resize import OptimizerRecipe, RankSurvey

log = logging.getLogger("fsdp_nb")

__all__ = [
    "leave", "memory_peak", "recipe", "recipes", "restore", "stage", "state_size", "survey", "watch_memory",
]

OWN_NAMES = frozenset({"In", "Out", "exit", "quit", "get_ipython", "rank", "world_size", "device", "torch", "dist",
                       "fsdp_nb"})
"""Engine globals IPython and fsdp_nb bind themselves: never reported as a user's variables."""

class Detached(Part):
    """Optimizers ``stage`` detached on this rank, until ``restore`` (the registry's part
    for a resize)."""

    def __init__(self) -> None:
        self.optimizers: dict[str, Any] = {}
        """Engine global name -> the optimizer."""


def _optimizers() -> dict[str, Any]:
    import torch

    return {k: v for k, v in user_ns().items() if isinstance(v, torch.optim.Optimizer) and not k.startswith("_")}


def _owner(optim: Any, owners: dict[int, str]) -> tuple[str | None, str | None]:
    """(the wrapped model whose parameters ``optim`` steps, problem). An optimizer over no
    wrapped model's parameters (one left from a model wrapped again, one over the user's
    own tensors) is neither: it stays a variable of the ranks that have it."""
    found = {owners.get(id(p)) for g in optim.param_groups for p in g["params"]}
    models = sorted(m for m in found if m is not None)
    if len(models) > 1:
        return None, f"steps parameters of several wrapped models ({', '.join(models)})"
    if models and None in found:
        return None, f"steps parameters of wrapped model {models[0]!r} and others that no wrapped model holds"
    return (models[0] if models else None), None


def survey(models: tuple[str, ...]) -> RankSurvey:
    """What this rank holds that a resize carries (the optimizers of ``models``) or leaves
    (every other variable the user made). The gradient scaler of a ``"16-mixed"`` wrap is
    neither: every rank of the new world holds it alike (its registry part agrees on it,
    ``models.rank_grad_scaler.GradScaling``), a new rank too."""
    owners = {id(p): name for name in models for p in wrapped()[name].module.parameters()}
    optimizers: dict[str, list[str]] = {name: [] for name in models}
    problems = []
    for oname, optim in sorted(_optimizers().items()):
        model, problem = _owner(optim, owners)
        if problem:
            problems.append(f"optimizer {oname!r} {problem}")
        elif model is not None:
            optimizers[model].append(oname)
    carried = set(models) | {o for os_ in optimizers.values() for o in os_}
    if current_scaler() is not None:
        carried.add(SCALER)
    variables = sorted(
        k for k, v in user_ns().items()
        if not k.startswith("_") and k not in OWN_NAMES and k not in carried
        and not isinstance(v, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType))
    )
    carry = {m: tuple(o) for m, o in optimizers.items()}
    return RankSurvey(carry, tuple(problems), tuple(variables), 0 if problems else state_size(carry))


def recipe(oname: str, model: str) -> tuple[OptimizerRecipe, str | None]:
    """How to build optimizer ``oname`` (over wrapped ``model``) on a new rank, and the
    problem that would stop it (None), found by building it over stand-in parameters."""
    import cloudpickle
    import torch

    optim = user_ns()[oname]
    names = {id(p): fqn for fqn, p in wrapped()[model].module.named_parameters()}
    groups = tuple({k: v for k, v in g.items() if k != "params"} for g in optim.param_groups)
    fqns = tuple(tuple(names[id(p)] for p in g["params"]) for g in optim.param_groups)
    cls = type(optim)
    out = OptimizerRecipe(oname, model, ByValue(cloudpickle.dumps(cls), cls.__qualname__),
                          dict(optim.defaults), groups, fqns)
    try:
        _build_optimizer(out, {f: torch.nn.Parameter(torch.zeros(1)) for g in fqns for f in g})
    except Exception as exc:  # noqa: BLE001 - any failure becomes the reason a growth is refused
        return out, (f"optimizer {oname!r} ({cls.__qualname__}) cannot be built again on a new rank: "
                     f"{type(exc).__name__}: {exc}")
    return out, None


def recipes(optimizers: dict[str, tuple[str, ...]]) -> dict[str, tuple[tuple[OptimizerRecipe, str | None], ...]]:
    """``recipe`` of every optimizer of every wrapped model (``optimizers``), in one call."""
    return {model: tuple(recipe(o, model) for o in onames) for model, onames in optimizers.items()}


def state_size(optimizers: dict[str, tuple[str, ...]]) -> int:
    """Bytes this rank holds of each wrapped model (``optimizers``' keys: parameters and
    buffers) and of its optimizers' state: what ``stage`` will write."""
    import torch

    ns = user_ns()
    total = 0
    for name, onames in optimizers.items():
        module = wrapped()[name].module
        total += sum(local_tensor(t).nbytes for t in [*module.parameters(), *module.buffers()])
        for o in onames:
            total += sum(local_tensor(v).nbytes for st in ns[o].state.values() for v in st.values()
                         if isinstance(v, torch.Tensor))
    return total


def _build_optimizer(rec: OptimizerRecipe, params: dict[str, Any]) -> Any:
    """``rec``'s class over ``params`` (name -> parameter), its groups' settings restored."""
    cls = unship(rec.cls)
    try:
        accepted = _inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in rec.defaults.items() if k in accepted}
    except (TypeError, ValueError):
        kwargs = {}
    groups = [{**g, "params": [params[f] for f in fq]} for g, fq in zip(rec.groups, rec.fqns)]
    optim = cls(groups, **kwargs)
    for group, settings in zip(optim.param_groups, rec.groups):
        group.update(settings)
    return optim


# -- memory -------------------------------------------------------------------------

def watch_memory() -> None:
    """Start this process's peak resident set afresh (``memory_sample.reset_peak_resident``:
    the kernel keeps the peak; nothing samples it)."""
    reset_peak_resident()


def memory_peak() -> int:
    """The highest resident bytes this process reached since ``watch_memory``."""
    return peak_resident()


# -- staging --------------------------------------------------------------------------


def _state(model: Any, optims: list[Any]) -> dict[str, Any]:
    """``{"model": ..., "optim": ..., "optim_1": ...}``: the model's and each optimizer's
    sharded state dicts (with one optimizer this is fsdp_nb's own checkpoint layout, which
    ``sess.load`` reads: a failed resize leaves its staged folders loadable)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    sd: dict[str, Any] = {"model": get_model_state_dict(model)}
    for i, optim in enumerate(optims):
        sd["optim" if i == 0 else f"optim_{i}"] = get_optimizer_state_dict(model, optim)
    return sd


def stage(folder: str, optimizers: dict[str, tuple[str, ...]]) -> int:
    """Write each wrapped model (``optimizers``' keys) with its optimizers into
    ``folder/<model>``, then drop the models and detach the optimizers; bytes written by
    this rank. Every rank of the old world calls it together, once its own async saves
    (an autosave's) have finished, so their collectives end before these begin."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    drain()
    ns = user_ns()
    written = 0
    for name, onames in optimizers.items():
        sd = _state(wrapped()[name].module, [ns[o] for o in onames])
        written += state_bytes(sd)
        path = os.path.join(folder, name)
        writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=False)
        dcp.save(sd, storage_writer=writer, process_group=checkpoint_group())
        del sd
        for f in os.listdir(path):  # 0600 as well as in a 0700 folder: readable by this user only
            os.chmod(os.path.join(path, f), 0o600)
        os.chmod(path, 0o700)
    for onames in optimizers.values():
        for o in onames:
            optim = part(Detached).optimizers[o] = ns[o]
            optim.state.clear()
            for g in optim.param_groups:
                g["params"] = []
    forget_all(tuple(optimizers))
    return written


def leave() -> None:
    """A retiring rank: drop its wrapped models and detached optimizers, leave the group."""
    from ..engine.process_group import destroy

    for o in list(part(Detached).optimizers):
        user_ns().pop(o, None)
    part(Detached).optimizers.clear()
    forget_all(tuple(wrapped()))
    destroy()


def _templates(params: dict[str, Any], rec: OptimizerRecipe, root: str, md: Any) -> dict[str, Any] | None:
    """Where the staged state of optimizer ``rec`` (stored under ``root``) is read into on
    this rank, built from the folder's metadata: per parameter name, an empty tensor per
    state entry, shaped as the parameter's shard for an entry the parameter's shape
    (``exp_avg``), else whole (``step``). This stands in for DCP's template, which runs a
    step of the optimizer to create its state (as long as the staging, measured). None
    when an entry is not a tensor or names no parameter of ``rec``: the caller then takes
    DCP's way."""
    import torch

    wanted = {f for g in rec.fqns for f in g}
    on_device = any(g.get("capturable") or g.get("fused") for g in rec.groups)
    out: dict[str, dict[str, Any]] = {}
    prefix = f"{root}.state."
    for key, meta in md.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        fqn, _, entry = key[len(prefix):].rpartition(".")
        if fqn not in wanted or not hasattr(meta, "size"):
            return None
        p, size, dtype = params[fqn], tuple(meta.size), meta.properties.dtype
        if entry != "step" and size == tuple(p.shape):
            t = torch.empty_like(p, dtype=dtype)
        else:
            t = torch.empty(size, dtype=dtype, device=p.device if on_device else "cpu")
        out.setdefault(fqn, {})[entry] = t
    return out


def restore(name: str, folder: str, recipes: tuple[OptimizerRecipe, ...]) -> int:
    """Fill wrapped model ``name`` (just rebuilt on the new mesh) and its optimizers from
    ``folder/<name>``: optimizers this rank kept get the new parameters, the others are
    built from their ``recipes``; bytes this rank read. Every rank of the new world calls
    it together."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = wrapped()[name].module
    params = dict(model.named_parameters())
    ns = user_ns()
    path = os.path.join(folder, name)
    fs, p = url_to_fs(path)
    md = read_dcp_metadata(fs, p, path)
    sd: dict[str, Any] = {"model": get_model_state_dict(model)}
    fill: list[tuple[Any, str, dict[str, Any] | None]] = []
    for i, rec in enumerate(recipes):
        optim = part(Detached).optimizers.pop(rec.name, None)
        if optim is not None and rec.name in ns and ns[rec.name] is optim:
            for g, fqns in zip(optim.param_groups, rec.fqns):
                g["params"] = [params[f] for f in fqns]
        else:
            optim = ns[rec.name] = _build_optimizer(rec, params)
        root = "optim" if i == 0 else f"optim_{i}"
        templates = _templates(params, rec, root, md)
        sd[root] = {"state": templates} if templates is not None else get_optimizer_state_dict(model, optim)
        fill.append((optim, root, templates))
    dcp.load(sd, storage_reader=safe_reader(fs, p, {}, metadata=md), planner=load_planner(),
             process_group=checkpoint_group())
    set_model_state_dict(model, sd["model"])
    for optim, root, templates in fill:
        if templates is None:
            set_optimizer_state_dict(model, optim, sd[root])
            continue
        for fqn, entries in templates.items():
            optim.state[params[fqn]] = entries
    return state_bytes(sd)
