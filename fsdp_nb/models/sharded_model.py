"""``ShardedModel``: the notebook's handle on a model ``sess.wrap`` sharded.

The module itself lives on the engines (engine global ``name``, registry
``fsdp_nb.models.rank_wrap.wrapped()[name] -> (module, mesh, options)``); this handle asks
them for what the notebook wants to see. Shipped to the engines (captured by a
function given to ``sess.run``) it turns into that rank's FSDP module.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from . import rank_shards as _es
from . import rank_weights as _weights
from . import rank_wrap as _ew
from .wire_shards import ShardTable

if TYPE_CHECKING:
    from ..context import SessionContext
    from ..memory.memory_report import MemoryPlan
    from .wire_wrap import WrapSummary
    from .wire_wrap_options import WrapOptions

__all__ = ["ShardedModel"]


class ShardedModel:
    """A model sharded over a session's ranks with FSDP2, bound as engine global ``name``.

    ``sess.wrap`` (and ``Session.attach``) make it, not user code: ``ctx`` is the session's
    context, ``options`` the ``WrapOptions`` and ``summary`` what the ranks reported."""

    def __init__(self, ctx: SessionContext, name: str, options: WrapOptions, summary: WrapSummary):
        self._ctx = ctx
        self.name = name
        """Engine global name of the FSDP module."""
        self.options = options
        """The ``WrapOptions`` it was wrapped with."""
        self.summary = summary
        """The engine's ``WrapSummary`` (units, mesh, dtypes)."""

    @property
    def num_params(self) -> int:
        """Parameters of the whole (unsharded) model."""
        return self.summary.num_params

    def state_dict(self) -> dict[str, Any]:
        """The full state dict on the notebook, CPU tensors, unwrapped FQNs.

        Gathered one tensor at a time to rank 0, so no rank holds a full copy.
        """
        d = self._ctx.dispatcher
        got = d.gather(d.apply(f"state_dict({self.name!r})", _weights.full_state_dict, args=(self.name,)))
        return got[0]

    def shards(self) -> ShardTable:
        """Per-parameter shard table: global shape, placements, each rank's piece."""
        d = self._ctx.dispatcher
        per_rank = d.gather(d.apply(f"shards({self.name!r})", _es.local_shards, args=(self.name,)))
        rows = [
            dataclasses.replace(
                first,
                local_shapes=tuple(r[i].local_shapes[0] for r in per_rank),
                local_offsets=tuple(r[i].local_offsets[0] for r in per_rank),
                local_bytes=tuple(r[i].local_bytes[0] for r in per_rank),
            )
            for i, first in enumerate(per_rank[0])
        ]
        return ShardTable(
            model=self.name,
            world_size=len(per_rank),
            mesh_shape=self.summary.mesh_shape,
            mesh_dims=self.summary.mesh_dims,
            params=tuple(rows),
        )

    def measure_memory(self, batch: Any, *, step: Any = None, optimizer: Any = None, steps: int = 2) -> MemoryPlan:
        """Run ``steps`` real training steps on the ranks under the tracker ``sess.plan``
        uses, and return what each rank held at its peak, by category (a ``MemoryPlan``
        with ``measured=True``), beside each process's peak resident growth (and CUDA's
        peak allocation). The model trains: its weights change.

        Args:
            batch: one rank's batch: a tensor, or a tuple / list / dict of tensors
                (shipped to every rank).
            step: ``fn(model, batch)`` (forward and backward; the optimizer steps after it)
                or ``fn(model, batch, optimizer)``; None: ``model(batch)``'s mean is the loss.
            optimizer: an optimizer class, a factory ``params -> optimizer`` (made for
                the measurement, dropped after it) or an engine global optimizer's name.
            steps: steps run; the peak is their highest.
        """
        self._ctx.check_open()
        measure = self._ctx.measure_memory
        if measure is None:
            raise RuntimeError("this model's session cannot measure memory (its context has no memory feature)")
        return measure(self._ctx, self.name, batch, step, optimizer, steps)

    def layout(self) -> Any:
        """The shard layout widget (``fsdp_nb.models.layout_widget``)."""
        view = self._ctx.layout_view
        if view is None:
            raise RuntimeError("this model's session has no widgets: call layout() on a model "
                               "of an fsdp_nb.Session")
        return view(self)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # shipped to an engine (e.g. captured by a function given to sess.run), a
        # handle becomes that rank's FSDP module
        return (_ew.resolve, (self.name,))

    def __repr__(self) -> str:
        s = self.summary
        opts = ", ".join(f"{k}={v}" for k, v in self.options.describe().items())
        mesh = "×".join(map(str, s.mesh_shape))
        return (
            f"<ShardedModel {self.name!r}: {s.model_class}, {self.num_params:,} params "
            f"({s.param_dtype}), mesh {mesh} {s.mesh_dims}, {len(s.units)} FSDP unit(s)"
            + (f", {opts}" if opts else "")
            + ">"
        )
