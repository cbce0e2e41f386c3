"""``sess.plan``: the façade's memory planning, checked and delegated.

Mixed into :class:`fsdp_nb.Session`; hands the session context to
``fsdp_nb.memory.memory_plan``, imported at the first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..context import SessionContext
    from .memory_report import MemoryPlan

__all__ = ["PLAN_ARGS", "SessionPlanning", "plan"]

PLAN_ARGS = """model: what ``sess.wrap`` takes: a Module class, a factory, a module
                instance (its shapes only) or a Hugging Face class with its config.
            *args: arguments of the class or factory.
            batch: one rank's batch: a tensor, or a tuple / list / dict of tensors (only
                their shapes and dtypes are used).
            step: ``fn(model, batch)`` runs the forward and backward (the optimizer steps
                after it) or ``fn(model, batch, optimizer)`` the whole step; None: the
                mean of ``model(batch)`` (``model(**batch)`` for a dict) is the loss.
            optimizer: an optimizer class (its defaults) or a factory ``params -> optimizer``.
            what_if: alternatives to weigh: a dict of changes or a list of them (keys
                ``world_size``, ``batch`` (a batch or a scale of its first dimension),
                ``activation_checkpointing``, ``mixed_precision``, ``cpu_offload``,
                ``sharding``, ``reshard_after_forward``, ``auto_wrap``), or ``"auto"`` for
                the usual ones.
            budget: bytes one rank may hold (default: what a rank may hold by fsdp_nb's
                one rule: a GPU's memory, or on CPU the host's RAM shared by the ranks on
                it, no more than an address-space limit; with a session, the least of its
                ranks'; without one, this machine's, for each what-if's number of ranks).
            steps: training steps run (the peak is their highest; the first makes the
                optimizer's state).
            timeout: seconds the planner may take.
            **options: wrap options (``fsdp_nb.WrapOptions``) and keyword arguments of the
                class or factory."""


class SessionPlanning:
    """The memory planning method of a ``Session``."""

    _ctx: SessionContext

    def plan(self, model: Any, *args: Any, batch: Any, step: Any = None, optimizer: Any = None,
             what_if: Any = None, budget: int | None = None, steps: int = 2, timeout: float = 600.0,
             **options: Any) -> MemoryPlan:
        """Each rank's peak memory over a training step of ``model`` wrapped with
        ``options`` on this session's ranks, planned before anything is allocated: a fake
        process group and fake tensors in a process of its own, the step under torch's
        ``FSDPMemTracker``. Returns a ``MemoryPlan``: the peak by category per rank, where
        it falls, whether it fits what a rank may hold, the what-ifs ranked.

        Args:
            {PLAN_ARGS}
        """
        from .memory_plan import plan

        self._ctx.check_open()
        self._ctx.last_plan = plan(model, args, ctx=self._ctx, batch=batch, step=step, optimizer=optimizer,
                                   what_if=what_if, budget=budget, steps=steps, timeout=timeout, **options)
        return self._ctx.last_plan

    if plan.__doc__:
        plan.__doc__ = plan.__doc__.replace("{PLAN_ARGS}", PLAN_ARGS)


def plan(model: Any, *args: Any, world_size: int, device: str = "cpu", batch: Any, step: Any = None,
         optimizer: Any = None, what_if: Any = None, budget: int | None = None, steps: int = 2,
         timeout: float = 600.0, **options: Any) -> MemoryPlan:
    """Each rank's peak memory over a training step of ``model`` wrapped with ``options``
    on ``world_size`` ranks of ``device``, with no session: planned under a fake process
    group and fake tensors in a process of its own, nothing allocated. Returns a
    ``MemoryPlan`` (see ``Session.plan``).

    Args:
        world_size: the ranks to plan for.
        device: ``"cuda"`` or ``"cpu"`` (a CPU build of torch plans CUDA with CPU fake
            tensors: the sizes are the same; CUDA's own overheads are named beside the plan).
        {PLAN_ARGS}
    """
    from .memory_plan import plan as _plan

    return _plan(model, args, batch=batch, step=step, optimizer=optimizer, what_if=what_if, budget=budget,
                 world_size=world_size, device=device, steps=steps, timeout=timeout, **options)


if plan.__doc__:
    plan.__doc__ = plan.__doc__.replace("{PLAN_ARGS}", PLAN_ARGS.replace("\n    ", "\n"))
