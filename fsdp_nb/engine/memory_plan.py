"""A training step's memory by category: planned in a process of its own under a fake
process group and fake tensors, or measured on the real ranks.

Both run the same step under torch's ``FSDPMemTracker`` (``torch_compat``), which
counts every tensor the step makes by what it is (parameters, gradients, optimizer
state, activations, communication buffers, temporaries), fake or real alike:

- :func:`plan_world` (the planner process, ``python -m fsdp_nb.engine.memory_plan``):
  the process plays one rank of a fake ``N``-rank group; the model is built on the meta
  device and sharded exactly as ``sess.wrap`` shards it (``engine.wrap.shard``), then
  made of fake tensors, so no weight exists anywhere. Ranks whose shards have the same
  shapes have the same plan: one rank of each kind is run.
- :func:`measure` (on every engine): the same step over the wrapped model's real
  tensors, with the process's peak resident memory (and CUDA's peak allocation) beside
  the tracker's count.

The planner process reads its job (cloudpickled by the notebook, through its stdin: a
pipe only its parent holds) and writes plain JSON to stdout, so the notebook
unpickles nothing from it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import sys
from typing import Any

from ..torch_compat import fake_process_group, fake_tensor_mode, fsdp_memory_tracker
from ..wire.memory_plan import RankMemory, StepSpec, TensorSpec, categories
from .namespace import unship, user_ns
from .wrap import construct, get, mesh_of, shard

__all__ = ["device_budget", "main", "measure", "plan_world", "rank_kinds", "run_step"]

log = logging.getLogger("fsdp_nb")


# -- the step under the tracker ----------------------------------------------------------


def _loss(out: Any) -> Any:
    """The loss of a step given as a batch alone: the output's mean (a Hugging Face
    output's ``loss`` when it has one, else its first tensor)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out.float().mean()
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is not None:
        return loss
    first = next(v for v in (out.values() if isinstance(out, dict) else out) if isinstance(v, torch.Tensor))
    return first.float().mean()


def _optimizer(optimizer: Any, model: Any) -> Any:
    """The optimizer a step spec asks for: a class, a factory, an engine global's name."""
    if optimizer is None:
        return None
    if isinstance(optimizer, str):
        return user_ns()[optimizer]
    return optimizer(model.parameters())  # a class (its defaults) or a factory


def _takes_optimizer(fn: Any) -> bool:
    try:
        return len(inspect.signature(fn).parameters) >= 3
    except (TypeError, ValueError):
        return False


def run_step(model: Any, optimizer: Any, step: Any, batch: Any, steps: int, units: set[str],
             device_type: str) -> RankMemory:
    """Run ``steps`` training steps under the tracker; this rank's peak by category on
    its ``device_type`` (with CPU offload the host holds the rest).

    ``units``: the FQNs of the model's FSDP units (``""``: the root), for naming where
    the peak fell."""

    where = {"unit": "", "phase": "forward"}
    in_optimizer = [False]

    def on_peak(active: set[str], backward: bool) -> None:
        if in_optimizer[0]:
            where.update(unit="(optimizer step)", phase="optimizer")
            return
        names = {n.split(".", 1)[1] if "." in n else "" for n in active if n != "Global"}
        inside = sorted((n for n in names if n in units), key=lambda n: n.count(".") + bool(n))
        where.update(unit=inside[-1] if inside else "", phase="backward" if backward else "forward")

    hooks = []
    if optimizer is not None:
        hooks = [optimizer.register_step_pre_hook(lambda *_: in_optimizer.__setitem__(0, True)),
                 optimizer.register_step_post_hook(lambda *_: in_optimizer.__setitem__(0, False))]
    whole = step is not None and _takes_optimizer(step)
    tracker = fsdp_memory_tracker(model, optimizer, on_peak)
    try:
        with tracker:
            for _ in range(steps):
                if step is None:
                    out = model(**batch) if isinstance(batch, dict) else model(batch)
                    _loss(out).backward()
                    del out
                elif whole:
                    step(model, batch, optimizer)
                else:
                    step(model, batch)
                if optimizer is not None and not whole:
                    optimizer.step()
                    optimizer.zero_grad()
                tracker.reset_mod_stats()  # per-module stats hold one step; the peak is kept
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        for h in hooks:
            h.remove()
    dev = next((d for d in peak if d.type == device_type), next(iter(peak), None))
    snap = dict(peak.get(dev, {})) if dev is not None else {}
    total = int(snap.pop("Total", 0))
    detail = {getattr(k, "value", str(k)): int(v) for k, v in snap.items()}
    rank = _rank()
    return RankMemory(rank, total, **categories(detail), peak_unit=where["unit"],
                      peak_phase=where["phase"], detail=detail)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


# -- planned: a fake world ---------------------------------------------------------------


def _fake_batch(batch: Any, device: Any) -> Any:
    """Fake tensors of the shipped batch's shapes and dtypes (inside the fake mode)."""
    import torch

    if isinstance(batch, TensorSpec):
        return torch.empty(batch.shape, dtype=getattr(torch, batch.dtype), device=device)
    if isinstance(batch, dict):
        return {k: _fake_batch(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_fake_batch(v, device) for v in batch)
    return batch


def _shard_rows(plan: Any, rank: int) -> tuple[int, int]:
    """(shards along FSDP's dimension, this rank's index among them)."""
    size = plan.shape[-1] if len(plan.fsdp_dims) == 2 else plan.shape[plan.dim_names.index(plan.fsdp_dims[0])]
    if len(plan.fsdp_dims) == 2:
        return size, rank % size
    if plan.tp_dim is not None:
        return size, rank // plan.shape[plan.dim_names.index(plan.tp_dim)]
    return size, rank


def rank_kinds(dim0s: list[int], plan: Any, world_size: int) -> dict[int, list[int]]:
    """Ranks grouped by the shapes of their shards (FSDP2 gives rank i rows
    ``[i*ceil(d/S), (i+1)*ceil(d/S))`` of a dimension of ``d`` rows over ``S`` shards):
    first rank of each group -> the group. With tensor parallelism every rank is its own."""
    if plan.tp_dim is not None:
        return {r: [r] for r in range(world_size)}
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(world_size):
        size, i = _shard_rows(plan, r)
        sig = tuple(max(0, min(math.ceil(d / size), d - i * math.ceil(d / size))) for d in dim0s)
        groups.setdefault(sig, []).append(r)
    return {g[0]: g for g in groups.values()}


def plan_world(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Plan one scenario: ``job`` has ``kind``, ``payload`` (the wrap's shipped spec),
    ``plan`` (its ``MeshPlan``), ``world_size``, ``device`` and ``step`` (a
    :class:`StepSpec`). Returns every rank's :class:`RankMemory` as a dict."""
    import torch
    import torch.distributed as dist

    kind, world, plan, spec = job["kind"], job["world_size"], job["plan"], job["step"]
    spec_model, args, kwargs, options = unship(job["payload"])
    step, optimizer = unship(spec.step), unship(spec.optimizer)
    with torch.device("meta"):
        probe = construct(kind, spec_model, args, kwargs)
    kinds = rank_kinds([p.shape[0] if p.dim() else 1 for p in probe.parameters()], plan, world)
    del probe
    out: dict[int, dict[str, Any]] = {}
    for first, ranks in kinds.items():
        fake_process_group(first, world)
        try:
            mem = _plan_rank(kind, spec_model, args, kwargs, options, plan, job["device"], spec, step, optimizer)
        finally:
            dist.destroy_process_group()
        for r in ranks:
            out[r] = {**mem.__dict__, "rank": r}
    return [out[r] for r in range(world)]


def _plan_rank(kind: str, spec_model: Any, args: tuple, kwargs: dict, options: Any, plan: Any, device: str,
               spec: StepSpec, step: Any, optimizer: Any) -> RankMemory:
    import torch

    model = construct(kind, spec_model, args, kwargs)
    mesh = mesh_of(plan)  # outside the fake mode: the mesh reads its rank map's values
    model, units, _, offload = shard(model, options, plan, mesh)  # on the meta device
    with fake_tensor_mode():
        model.to_empty(device="cpu" if offload else device)
        opt = _optimizer(optimizer, model)
        batch = _fake_batch(spec.batch, torch.device(device))
        names = {fqn for fqn, _ in units} | {""}
        return run_step(model, opt, step, batch, spec.steps, names, torch.device(device).type)


def main() -> None:
    """The planner process: a cloudpickled list of jobs on stdin, one JSON line per
    job on stdout (``{"ranks": [...]}`` or ``{"error": ...}``)."""
    import warnings

    import cloudpickle

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    jobs = cloudpickle.loads(sys.stdin.buffer.read())
    for job in jobs:
        line: dict[str, Any]
        try:
            line = {"ranks": plan_world(job)}
        except Exception as exc:  # noqa: BLE001 - each scenario's failure is reported, the others still run
            import traceback

            line = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


# -- measured: the real ranks ------------------------------------------------------------


def _peak_resident() -> int | None:
    """This process's peak resident memory (``VmHWM``), in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_resident() -> None:
    """Start the peak resident memory afresh: first hand the allocator's free pages back
    (glibc's ``malloc_trim``; a process that freed memory keeps it resident, and the
    step would reuse it unseen), then ``5`` to ``clear_refs`` (Linux)."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(name: str, spec: StepSpec, batch: Any) -> RankMemory:
    """Run the step on the wrapped model ``name`` with its real tensors, under the same
    tracker as a plan; with the process's peak resident memory growth (and CUDA's peak
    allocation) beside it. The model trains: its weights change."""
    import gc

    import torch

    w = get(name)
    model, device = w.module, torch.device(user_ns().get("device", "cpu"))
    batch = unship(batch)
    if isinstance(batch, dict):
        batch = {k: v.to(device) for k, v in batch.items()}
    elif isinstance(batch, (list, tuple)):
        batch = type(batch)(v.to(device) for v in batch)
    else:
        batch = batch.to(device)
    optimizer = _optimizer(unship(spec.optimizer), model)
    units = {fqn for fqn, m in model.named_modules() if hasattr(m, "unshard")}
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)  # the peak restarts at what is allocated now
    _reset_peak_resident()
    before = _peak_resident()
    mem = run_step(model, optimizer, unship(spec.step), batch, spec.steps, units, device.type)
    after = _peak_resident()
    growth = None if before is None or after is None else after - before
    device_peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    del optimizer  # a fresh one goes; an engine global's stays bound
    gc.collect()
    return RankMemory(**{**mem.__dict__, "resident_growth": growth, "device_peak": device_peak})


def device_budget(local_world_size: int) -> tuple[str, int]:
    """(device type, bytes one rank may use): the GPU's total memory, or on CPU the
    host's RAM shared by the ranks on this host."""
    import psutil
    import torch

    dev = torch.device(user_ns().get("device", "cpu"))
    if dev.type == "cuda":
        return "cuda", int(torch.cuda.get_device_properties(dev).total_memory)
    return "cpu", int(psutil.virtual_memory().total) // max(1, local_world_size)


if __name__ == "__main__":
    main()
