"""The notebook side of ``sess.plan`` / ``fsdp_nb.plan``: will this model, with these
options and this batch, fit on N ranks? Answered before anything is allocated.

1. Everything is checked here, before any work: the model spec and its arguments,
   the wrap options (``WrapOptions``), the batch (tensors, or a tuple / list / dict of
   them: only their shapes and dtypes travel), the step, the optimizer, the what-ifs,
   the world size and device.
2. The base plan and every what-if go to one planner process of their own
   (``python -m fsdp_nb.memory.rank_memory_plan``), which plays a rank of a fake process
   group, builds the model of fake tensors, shards it as ``sess.wrap`` would and runs
   the step under torch's ``FSDPMemTracker``. A process of its own, not the notebook and
   not an engine: the fake group must be its default group (an engine's is the real
   one, and the notebook has none to spare), nothing the planning allocates stays in
   the notebook, and Ctrl-C or a crash ends only it.
3. The answer is a :class:`~fsdp_nb.memory.memory_report.MemoryPlan`: per-rank peak by
   category, where it falls, whether it fits, the what-ifs ranked by speed cost.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from ..errors import FsdpNbError, WireError
from ..models.model_spec import check_call, meta_clone, model_kind
from ..models.wire_mesh_plan import plan_mesh
from ..models.wire_wrap_options import OPTION_NAMES, WrapOptions, make_options, no_split_default
from ..runtime.shipping import by_value, register_local_modules
from ..wire.calls import ByValue
from ..wire.decode import loads
from .memory_report import MemoryPlan, WhatIf
from .rank_memory_sample import device_budget
from .what_if import apply, check_what_ifs, cost, label
from .wire_memory_plan import PlanAnswer, PlanJob, StepSpec, TensorSpec

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["PlanError", "measure", "plan", "session_budget", "step_spec"]

log = logging.getLogger("fsdp_nb")

DEVICES = ("cpu", "cuda")
"""Devices a plan is made for."""


class PlanError(FsdpNbError, RuntimeError):
    """The planner could not run the step (the model's or the step's own error, named)."""


def _batch_spec(batch: Any, where: str = "batch") -> Any:
    """``batch`` with each tensor replaced by its :class:`TensorSpec`."""
    import torch

    if isinstance(batch, torch.Tensor):
        return TensorSpec(tuple(batch.shape), str(batch.dtype).removeprefix("torch."))
    if isinstance(batch, dict) and batch and all(isinstance(k, str) for k in batch):
        return {k: _batch_spec(v, f"{where}[{k!r}]") for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and batch:
        return type(batch)(_batch_spec(v, f"{where}[{i}]") for i, v in enumerate(batch))
    raise TypeError(f"{where} must be a tensor, or a tuple / list / dict (str keys) of tensors: one "
                    f"rank's batch, e.g. torch.randint(0, vocab, (8, 1024)); got {type(batch).__name__}")


def _scaled(batch: Any, scale: float) -> Any:
    """A batch spec with every first dimension scaled (at least 1)."""
    if isinstance(batch, TensorSpec):
        if not batch.shape:
            return batch
        return TensorSpec((max(1, int(batch.shape[0] * scale)), *batch.shape[1:]), batch.dtype)
    if isinstance(batch, dict):
        return {k: _scaled(v, scale) for k, v in batch.items()}
    return type(batch)(_scaled(v, scale) for v in batch)


def step_spec(batch: Any, step: Any, optimizer: Any, steps: int, *, engine_names: bool = False) -> StepSpec:
    """The step, checked and shipped: ``batch`` as shapes, ``step`` and ``optimizer`` by
    value (``engine_names``: an optimizer may also be an engine global's name)."""
    import torch

    if step is not None:
        if not callable(step):
            raise TypeError(f"step must be fn(model, batch) or fn(model, batch, optimizer), got {step!r}")
        try:
            n = len(inspect.signature(step).parameters)
        except (TypeError, ValueError):
            n = 2
        if n not in (2, 3):
            raise TypeError(f"step must take (model, batch) or (model, batch, optimizer); "
                            f"{getattr(step, '__qualname__', step)} takes {n} parameter(s)")
    ok = optimizer is None or (engine_names and isinstance(optimizer, str)) or (
        isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)) or (
        callable(optimizer) and not isinstance(optimizer, type))
    if not ok:
        raise TypeError(f"optimizer must be an optimizer class (e.g. torch.optim.AdamW), a factory "
                        f"params -> optimizer{', an engine global name' if engine_names else ''} or None; "
                        f"got {optimizer!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    register_local_modules((step, optimizer))
    return StepSpec(batch, None if step is None else by_value(step),
                    optimizer if optimizer is None or isinstance(optimizer, str) else by_value(optimizer), steps)


def session_budget(ctx: SessionContext) -> tuple[str, int | None]:
    """(device type, the smallest bytes any rank may hold) of the session's ranks, by the
    rule every budget follows (``fsdp_nb.memory.rank_memory_sample.device_budget``)."""
    from . import rank_memory_sample as _ems

    d = ctx.dispatcher
    got = d.gather(d.apply("device budget", _ems.rank_budget))
    known = [b for _, b in got if b is not None]
    return got[0][0], min(known) if known else None


def _run_planner(jobs: list[PlanJob], timeout: float) -> list[PlanAnswer]:
    """Run ``jobs`` in one planner process; its answer to each, decoded strictly (a
    :class:`~fsdp_nb.errors.WireError` names a field that does not match). Its temporary
    folder is one of its own, removed after it (torch leaves an inductor cache there)."""
    import cloudpickle

    try:  # Ctrl-C or the timeout kill the planner process (subprocess.run does)
        with tempfile.TemporaryDirectory(prefix="fsdp_nb_planner_") as scratch:
            proc = subprocess.run([sys.executable, "-m", "fsdp_nb.memory.rank_memory_plan"], input=cloudpickle.dumps(jobs),
                                  capture_output=True, timeout=timeout, check=False,
                                  env=dict(os.environ, TMPDIR=scratch))
    except subprocess.TimeoutExpired:
        raise PlanError(f"planning {len(jobs)} step(s) took longer than timeout={timeout:g} s and was "
                        "stopped; pass a larger timeout=, or fewer what_if alternatives") from None
    tail = "\n".join(proc.stderr.decode(errors="replace").strip().splitlines()[-12:])
    try:
        lines = [loads(PlanAnswer, x) for x in proc.stdout.decode().splitlines()]
    except WireError as why:
        raise PlanError(f"the planner process answered what this notebook cannot read ({why}):\n{tail}") from None
    if proc.returncode != 0 or len(lines) != len(jobs):
        raise PlanError(f"the planner process ended with exit code {proc.returncode} after {len(lines)} of "
                        f"{len(jobs)} plan(s):\n{tail}")
    return lines


def plan(
    model: Any, args: tuple, *, ctx: SessionContext | None = None, batch: Any, step: Any = None,
    optimizer: Any = None, what_if: Any = None, budget: int | None = None, world_size: int | None = None,
    device: str | None = None, steps: int = 2, timeout: float = 600.0, **options: Any,
) -> MemoryPlan:
    """Plan ``model``'s training step on ``world_size`` ranks (the session's, with
    ``ctx``); see ``Session.plan`` for the parameters."""
    t0 = time.perf_counter()
    kind = model_kind(model)
    if kind == "string":
        raise TypeError("plan needs the model's class, factory or an instance (a name of an engine "
                        "global is already built: measure it with sess.models[name].measure_memory)")
    if ctx is not None:
        if world_size is not None or device is not None:
            raise TypeError("sess.plan plans for the session's own ranks and devices; "
                            "world_size= and device= are for fsdp_nb.plan without a session")
        world, hosts = ctx.world_size, [r.host for r in ctx.ranks]
        device = "cuda" if ctx.backend == "nccl" else "cpu"
    else:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int (the ranks to plan for), got {world_size!r}")
        device = device or "cpu"
        if device not in DEVICES:
            raise ValueError(f"device={device!r} is not allowed; allowed: {', '.join(DEVICES)}")
        world, hosts = world_size, ["localhost"] * world_size
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"budget must be a positive number of bytes per rank, got {budget!r}")
    kwargs = {k: v for k, v in options.items() if k not in OPTION_NAMES}
    opts = make_options(**{k: v for k, v in options.items() if k in OPTION_NAMES})
    if "auto_wrap" not in options and (split := no_split_default(model)):
        opts = dataclasses.replace(opts, auto_wrap=split)
    if kind == "instance" and (args or kwargs):
        raise TypeError(f"unknown wrap option(s) {', '.join(map(repr, sorted(kwargs)))} or arguments "
                        f"given with a module instance; allowed: {', '.join(OPTION_NAMES)}")
    if kind in ("class", "factory"):
        check_call(model, args, kwargs)
    batch_spec = _batch_spec(batch)
    spec = step_spec(batch_spec, step, optimizer, steps)
    changes = check_what_ifs(what_if, opts, world, batch_spec, fixed_world=ctx is not None)
    register_local_modules((model, args, kwargs, opts))
    payload = by_value(((meta_clone(model) if kind == "instance" else model), tuple(args), kwargs, opts))
    planned_on, notes = _device_notes(device)
    backend = "nccl" if planned_on == "cuda" else "gloo"  # the mesh's device type: where the fake tensors live
    jobs = [_job(kind, payload, opts, world, backend, hosts, planned_on, spec)]
    for change in changes:
        o = apply(opts, change)
        n = change.get("world_size", world)
        b = change.get("batch")
        s = spec if b is None else dataclasses.replace(
            spec, batch=_scaled(batch_spec, b) if isinstance(b, (int, float)) else _batch_spec(b, "what_if batch"))
        p = by_value((meta_clone(model) if kind == "instance" else model, tuple(args), kwargs, o))
        jobs.append(_job(kind, p, o, n, backend, hosts[:1] * n if n != world else hosts, planned_on, s))
    given = budget
    if budget is None:
        # here (no session): this machine's first GPU, or its RAM shared by the ranks; None for
        # CUDA where this process sees no GPU (the plan then says to pass budget=)
        budget = session_budget(ctx)[1] if ctx is not None else device_budget(device, world)
    answers = _run_planner(jobs, timeout)
    base = answers[0]
    if base.ranks is None:
        raise PlanError(f"planning the step failed: {base.error}\n{_user_lines(base.traceback)}")
    ranks = base.ranks
    weighed = []
    for change, ans in zip(changes, answers[1:]):
        rank, words = cost(change, world)
        if ans.ranks is None:
            weighed.append(WhatIf(change, label(change), None, None, rank, words, ans.error))
            continue
        peak = max(r.peak for r in ans.ranks)
        n = change.get("world_size", world)  # without a session, n ranks share this machine as a plan's do
        limit = budget if given is not None or ctx is not None or n == world else device_budget(device, n)
        weighed.append(WhatIf(change, label(change), peak, None if limit is None else peak <= limit, rank, words))
    weighed.sort(key=lambda w: (not w.fits, w.cost_rank, w.peak if w.peak is not None else 1 << 62))
    return MemoryPlan(ranks, world, device, budget, opts.describe(), weighed, notes,
                      seconds=time.perf_counter() - t0)


def _job(kind: str, payload: ByValue, opts: WrapOptions, world: int, backend: str, hosts: list[str],
         device: str, spec: StepSpec) -> PlanJob:
    return PlanJob(kind=kind, payload=payload, plan=plan_mesh(world, backend, hosts, opts), world_size=world,
                   device=device, step=spec)


def _device_notes(device: str) -> tuple[str, list[str]]:
    """(the device the planner makes fake tensors on, what the plan leaves out)."""
    import torch

    if device != "cuda":
        return "cpu", ["CPU: the peak counts tensors; the process's own memory (Python, torch's "
                       "libraries, about 0.3-0.5 GiB per rank) comes on top"]
    notes = ["CUDA's own overheads are not in the plan: the CUDA context (about 0.5 GiB per GPU), "
             "NCCL's buffers, and the caching allocator's rounding and fragmentation (compare "
             "torch.cuda.max_memory_reserved with max_memory_allocated)"]
    if torch.cuda.is_available():
        return "cuda", notes
    return "cpu", [*notes, "planned with CPU fake tensors: this process's torch has no usable CUDA; "
                           "tensor sizes are the same"]


def _user_lines(tb: str) -> str:
    """The last lines of the planner's traceback: where the model or step failed."""
    return "\n".join(tb.strip().splitlines()[-6:])


def measure(ctx: SessionContext, name: str, batch: Any, step: Any, optimizer: Any, steps: int) -> MemoryPlan:
    """The step measured on the real ranks: ``ShardedModel.measure_memory``."""
    from . import rank_memory_plan as _emp

    t0 = time.perf_counter()
    spec = step_spec(_batch_spec(batch), step, optimizer, steps, engine_names=True)
    device, budget = session_budget(ctx)
    d = ctx.dispatcher
    ranks = d.gather(d.apply(f"measure memory of {name!r}", _emp.measure, args=(name, spec, by_value(batch))))
    wrapped = ctx.models.get(name)
    notes = ["measured: the tracker counts the step's tensors; resident_growth is how far each "
             "process's peak resident memory rose over the step"]
    return MemoryPlan(ranks, ctx.world_size, device, budget, wrapped.options.describe() if wrapped else {},
                      [], notes, measured=True, seconds=time.perf_counter() - t0)
