"""A training step's memory by category: planned in a process of its own under a fake
process group and fake tensors, or measured on the real ranks.

Both run the same step under torch's ``FSDPMemTracker`` (``torch_compat``), which
counts every tensor the step makes by what it is (parameters, gradients, optimizer
state, activations, communication buffers, temporaries), fake or real alike:

- :func:`plan_world` (the planner process, ``python -m fsdp_nb.memory.rank_memory_plan``):
  the process plays one rank of a fake ``N``-rank group; the model is built on the meta
  device and sharded exactly as ``sess.wrap`` shards it (``models.rank_wrap.shard``), then
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

import dataclasses
import inspect
import logging
import math
import os
import sys
from typing import Any, ClassVar

from ..engine.namespace import rank_device, unship, user_ns
from ..engine.step import StepListener, owner
from ..models.rank_wrap import construct, get, mesh_of, shard
from ..models.wire_mesh_plan import MeshPlan
from ..models.wire_wrap_options import WrapOptions
from ..torch_compat import tree_map_only
from ..torch_compat_planning import fake_process_group, fake_tensor_mode, fsdp_memory_tracker
from ..wire.decode import encode
from .rank_memory_kinds import copy_bytes
from .rank_memory_sample import peak_resident, reset_peak_resident
from .wire_memory_plan import PlanAnswer, PlanJob, RankMemory, StepSpec, TensorSpec, categories

__all__ = ["PeakPlace", "main", "measure", "plan_world", "rank_kinds", "run_step"]

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


class PeakPlace(StepListener):
    """Where a step's memory peak fell: the FSDP unit that ran and the phase. The tracker
    tells :meth:`on_peak` each time the peak rises; the rank's step owner tells it when
    the optimizer steps (order 80), which the tracker does not name.

    Args:
        units: the FQNs of the model's FSDP units (``""``: the root).
        optimizer: the step's optimizer (None: any optimizer's step is the optimizer phase).
    """

    order: ClassVar[int] = 80

    def __init__(self, units: set[str], optimizer: Any = None):
        self.units = units
        """The FQNs of the model's FSDP units (``""``: the root)."""
        self.optimizer = optimizer
        self.unit = ""
        """The unit running when the peak fell (``"(optimizer step)"`` in the optimizer)."""
        self.phase = "forward"
        """``"forward"``, ``"backward"`` or ``"optimizer"``."""
        self.in_optimizer = False
        """The optimizer's step is running now."""

    def on_peak(self, active: set[str], backward: bool) -> None:
        """The peak rose while the tracker's modules ``active`` ran (``backward``: in the backward)."""
        if self.in_optimizer:
            self.unit, self.phase = "(optimizer step)", "optimizer"
            return
        names = {n.split(".", 1)[1] if "." in n else "" for n in active if n != "Global"}
        inside = sorted((n for n in names if n in self.units), key=lambda n: n.count(".") + bool(n))
        self.unit, self.phase = (inside[-1] if inside else ""), ("backward" if backward else "forward")

    def _ours(self, optimizer: Any) -> bool:
        return self.optimizer is None or optimizer is self.optimizer

    def optimizer_stepping(self, optimizer: Any) -> None:
        if self._ours(optimizer):
            self.in_optimizer = True

    def step_ended(self, step: int, optimizer: Any) -> None:
        if self._ours(optimizer):
            self.in_optimizer = False

    def step_joined(self, step: int, optimizer: Any) -> None:
        if self._ours(optimizer):
            self.in_optimizer = False

    def cell_ended(self, failed: bool) -> None:
        self.in_optimizer = False  # a step that raised: no post-step event came


def run_step(model: Any, optimizer: Any, step: Any, batch: Any, steps: int, units: set[str],
             device_type: str) -> RankMemory:
    """Run ``steps`` training steps under the tracker; this rank's peak by category on
    its ``device_type`` (with CPU offload the host holds the rest).

    ``units``: the FQNs of the model's FSDP units (``""``: the root), for naming where
    the peak fell."""
    place = PeakPlace(units, optimizer)
    if optimizer is not None:
        owner().listen(place)
    whole = step is not None and _takes_optimizer(step)
    tracker = fsdp_memory_tracker(model, optimizer, place.on_peak)
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
        owner().unlisten(place)
    dev = next((d for d in peak if d.type == device_type), next(iter(peak), None))
    snap = dict(peak.get(dev, {})) if dev is not None else {}
    total = int(snap.pop("Total", 0))
    detail = {getattr(k, "value", str(k)): int(v) for k, v in snap.items()}
    state = copy_bytes(model, [optimizer] if optimizer is not None else [])
    return RankMemory(rank=_rank(), peak=total, **categories(detail), peak_unit=place.unit, peak_phase=place.phase,
                      detail=detail, state=state)


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


def _shard_rows(plan: MeshPlan, rank: int) -> tuple[int, int]:
    """(shards along FSDP's dimension, this rank's index among them)."""
    size = plan.shape[-1] if len(plan.fsdp_dims) == 2 else plan.shape[plan.dim_names.index(plan.fsdp_dims[0])]
    if len(plan.fsdp_dims) == 2:
        return size, rank % size
    if plan.tp_dim is not None:
        return size, rank // plan.shape[plan.dim_names.index(plan.tp_dim)]
    return size, rank


def rank_kinds(dim0s: list[int], plan: MeshPlan, world_size: int) -> dict[int, list[int]]:
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


def plan_world(job: PlanJob) -> list[RankMemory]:
    """Plan one scenario: every rank's :class:`RankMemory`, in rank order."""
    import torch
    import torch.distributed as dist

    kind, world, plan, spec = job.kind, job.world_size, job.plan, job.step
    spec_model, args, kwargs, options = unship(job.payload)
    step, optimizer = unship(spec.step), unship(spec.optimizer)
    with torch.device("meta"):
        probe = construct(kind, spec_model, args, kwargs)
    kinds = rank_kinds([p.shape[0] if p.dim() else 1 for p in probe.parameters()], plan, world)
    del probe
    out: dict[int, RankMemory] = {}
    for first, ranks in kinds.items():
        fake_process_group(first, world)
        try:
            mem = _plan_rank(kind, spec_model, args, kwargs, options, plan, job.device, spec, step, optimizer)
        finally:
            dist.destroy_process_group()
        for r in ranks:
            out[r] = dataclasses.replace(mem, rank=r)
    return [out[r] for r in range(world)]


def _plan_rank(kind: str, spec_model: Any, args: tuple, kwargs: dict, options: WrapOptions, plan: MeshPlan,
               device: str, spec: StepSpec, step: Any, optimizer: Any) -> RankMemory:
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
    """The planner process: a cloudpickled list of :class:`PlanJob` s on stdin, one
    :class:`PlanAnswer` per job on stdout as a JSON line. Stdout carries nothing else:
    what the user's model and step print (Python's and C's) goes to stderr."""
    import warnings

    import cloudpickle

    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    jobs: list[PlanJob] = cloudpickle.loads(sys.stdin.buffer.read())
    for job in jobs:
        try:
            answer = PlanAnswer(ranks=plan_world(job))
        except Exception as exc:  # noqa: BLE001 - each scenario's failure is reported, the others still run
            import traceback

            answer = PlanAnswer(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        answers.write(encode(answer) + b"\n")
        answers.flush()


# -- measured: the real ranks ------------------------------------------------------------


def measure(name: str, spec: StepSpec, batch: Any) -> RankMemory:
    """Run the step on the wrapped model ``name`` with its real tensors, under the same
    tracker as a plan; with the process's peak resident memory growth (and CUDA's peak
    allocation) beside it. The model trains: its weights change."""
    import gc

    import torch

    w = get(name)
    model, device = w.module, torch.device(rank_device())
    batch = tree_map_only(torch.Tensor, lambda t: t.to(device), unship(batch))  # nested too
    optimizer = _optimizer(unship(spec.optimizer), model)
    units = {fqn for fqn, m in model.named_modules() if hasattr(m, "unshard")}
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)  # the peak restarts at what is allocated now
    reset_peak_resident()
    before = peak_resident()
    mem = run_step(model, optimizer, unship(spec.step), batch, spec.steps, units, device.type)
    growth = peak_resident() - before
    device_peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    del optimizer  # a fresh one goes; an engine global's stays bound
    gc.collect()
    return dataclasses.replace(mem, resident_growth=growth, device_peak=device_peak)


if __name__ == "__main__":
    main()
