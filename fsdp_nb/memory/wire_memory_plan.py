"""One rank's memory over a training step, planned or measured: plain data that crosses
from a planner process or an engine to the notebook.

``RankMemory`` holds the peak of the step by category, in bytes, and where the peak
fell. ``categories`` folds torch's ``FSDPMemTracker`` categories into the six a plan
shows. A planner process (``python -m fsdp_nb.memory.rank_memory_plan``) reads
:class:`PlanJob` s (cloudpickled, on its stdin) and prints one :class:`PlanAnswer` per
job as a JSON line, which the notebook decodes strictly (``fsdp_nb.wire.decode``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..models.wire_mesh_plan import MeshPlan
from ..wire.calls import ByValue

__all__ = [
    "CATEGORIES", "TRACKER_CATEGORIES", "BatchSpec", "PlanAnswer", "PlanJob", "RankMemory", "StepSpec", "TensorSpec",
    "categories",
]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "other")
"""The categories of a plan, in the order it shows them."""

TRACKER_CATEGORIES: Mapping[str, str] = MappingProxyType({
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Buffer": "parameters",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "All Gather": "communication",
    "Reduce Scatter": "communication",
    "Temp": "other",
})
"""torch's tracker category (``_FSDPRefType.value``) -> the plan's category."""


def categories(detail: dict[str, int]) -> dict[str, int]:
    """The tracker's bytes by its own categories (``detail``) folded into
    :data:`CATEGORIES`; a category torch adds later counts as ``other``."""
    out = dict.fromkeys(CATEGORIES, 0)
    for name, n in detail.items():
        out[TRACKER_CATEGORIES.get(name, "other")] += int(n)
    return out


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the batch, by shape and dtype only: what the planner makes a fake
    tensor of (the notebook's batch itself is not shipped)."""

    shape: tuple[int, ...]
    """Its shape."""
    dtype: str
    """Its dtype's name, e.g. ``"int64"``."""


BatchSpec = TensorSpec | list[Any] | tuple[Any, ...] | dict[str, Any]
"""A batch as shapes: a :class:`TensorSpec`, or a tuple / list / dict (str keys) of batch specs."""


@dataclass(frozen=True)
class StepSpec:
    """The training step a plan or a measurement runs, as shipped (plain data and
    by-value payloads)."""

    batch: BatchSpec
    """The batch, as shapes."""
    step: ByValue | None = None
    """``fn(model, batch)`` (forward and backward; the optimizer steps after it) or
    ``fn(model, batch, optimizer)`` (the whole step), shipped by value; None: the mean of
    ``model(batch)`` (``model(**batch)`` for a dict) is the loss."""
    optimizer: ByValue | str | None = None
    """An optimizer class (its defaults) or a factory ``params -> optimizer``, shipped by
    value; on engines also the name of an engine global optimizer; None: no optimizer."""
    steps: int = 2
    """Steps run; the peak is the highest of them (the first creates optimizer state)."""


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """One rank's peak memory over the step, by category, in bytes."""

    rank: int
    """The rank."""
    peak: int
    """The highest total the step reached (the sum of the categories at that moment)."""
    parameters: int
    """Parameters at the peak: this rank's shards, the unsharded ones gathered for the
    running unit, buffers."""
    gradients: int
    """Gradients at the peak, sharded and unsharded."""
    optimizer: int
    """Optimizer state at the peak."""
    activations: int
    """Activations saved for the backward, and the batch."""
    communication: int
    """All-gather and reduce-scatter buffers at the peak."""
    other: int
    """Temporaries of the running operators."""
    peak_unit: str
    """The FSDP unit running when the peak fell (``""``: the root; the optimizer step
    is ``"(optimizer step)"``)."""
    peak_phase: str
    """``"forward"``, ``"backward"`` or ``"optimizer"``."""
    detail: dict[str, int] = field(default_factory=dict)
    """The tracker's own categories at the peak, in bytes."""
    resident_growth: int | None = None
    """Measured only: how far the process's peak resident memory rose over the step,
    in bytes (a cross-check of the tracker, which counts tensors only)."""
    device_peak: int | None = None
    """Measured on CUDA only: ``torch.cuda.max_memory_allocated`` over the step (every
    tensor on the device, the model's shards included, as the plan's peak includes them)."""
    state: int = 0
    """This rank's shards (parameters, buffers) and optimizer state after the step: what
    one copy of the in-memory autosave holds (``sess.autosave(..., in_memory=True)``)."""

    def by_category(self) -> dict[str, int]:
        """Category -> bytes at the peak, in ``CATEGORIES`` order (parameters, gradients,
        optimizer, activations, communication, other)."""
        return {c: getattr(self, c) for c in CATEGORIES}


@dataclass(frozen=True, kw_only=True)
class PlanJob:
    """One scenario a planner process plans: a wrap of one model on a fake world."""

    kind: str
    """How the model is given: ``"class"``, ``"factory"`` or ``"instance"`` (``models.model_spec``)."""
    payload: ByValue
    """``(model, args, kwargs, WrapOptions)`` by value: what ``sess.wrap`` would build and shard."""
    plan: MeshPlan
    """The mesh every rank builds for it."""
    world_size: int
    """Ranks planned for."""
    device: str
    """Where the fake tensors live: ``"cpu"`` or ``"cuda"``."""
    step: StepSpec
    """The training step to run under the tracker."""


@dataclass(frozen=True, kw_only=True)
class PlanAnswer:
    """A planner process's answer to one :class:`PlanJob`: every rank's peak, or why not."""

    ranks: list[RankMemory] | None = None
    """Each rank's peak by category, in rank order (None: it failed)."""
    error: str | None = None
    """The model's or the step's error, as ``"TypeError: ..."`` (None: it was planned)."""
    traceback: str = ""
    """The planner's traceback of that error."""
