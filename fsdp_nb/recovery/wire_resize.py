"""What a resize carries between the notebook and the ranks (``fsdp_nb.recovery.rank_resize``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..wire.calls import ByValue

__all__ = ["OptimizerRecipe", "RankSurvey"]


@dataclass(frozen=True)
class OptimizerRecipe:
    """How to build an optimizer again on a rank that never had it: its class, its
    defaults and, per parameter group, its settings and the names of its parameters."""

    name: str
    """The engine global it is bound to (``optimizer``)."""
    model: str
    """The wrapped model whose parameters it steps."""
    cls: ByValue
    """Its class, pickled by value (a class defined in a ``%%px`` cell travels too)."""
    defaults: dict
    """``optimizer.defaults``."""
    groups: tuple[dict, ...]
    """Each parameter group's settings (``lr``, ``betas``...), without its parameters."""
    fqns: tuple[tuple[str, ...], ...]
    """Each group's parameters, by their names in the model (``named_parameters``)."""


@dataclass(frozen=True)
class RankSurvey:
    """What one rank holds that a resize must carry or leave behind."""

    optimizers: dict[str, tuple[str, ...]]
    """Wrapped model name -> the engine globals holding optimizers over its parameters."""
    problems: tuple[str, ...]
    """Optimizers a resize cannot carry (parameters of several models, or of none)."""
    variables: tuple[str, ...]
    """The other engine globals a user made (data, tensors, schedulers...): they stay
    on the ranks that survive and are not created on new ones."""
    state_bytes: int = 0
    """Bytes of the wrapped models and their optimizers' state on this rank: what a resize
    stages from it."""
