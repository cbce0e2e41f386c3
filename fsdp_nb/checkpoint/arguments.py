"""The notebook side of a save or load's arguments and answers.

``model_name`` and ``check_optimizer`` turn what the user passed into engine global
names before anything is sent; ``raise_outcomes`` turns the ranks' agreed
:class:`~fsdp_nb.wire.checkpoint.Outcome` into one error in the notebook.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from ..wire.checkpoint import Outcome

__all__ = ["check_optimizer", "model_name", "raise_outcomes"]


def raise_outcomes(outs: list[Outcome]) -> None:
    """Raise the first failed rank's error as its own class (they agree by construction)."""
    for out in outs:
        if not out.ok:
            cls = out.error if isinstance(out.error, type) and issubclass(out.error, Exception) else CheckpointError
            raise cls(out.message or "checkpoint operation failed")


def model_name(model: Any) -> str:
    """The engine global name of ``model`` (a ShardedModel or a str)."""
    if isinstance(model, str):
        if not model.isidentifier():
            raise ValueError(f"model name {model!r} is not a Python identifier")
        return model
    name = getattr(model, "name", None)
    if isinstance(name, str) and name:
        return name
    raise TypeError(
        f"model must be a ShardedModel (from sess.wrap) or the engine global name of an FSDP2 "
        f"module (str), got {type(model).__name__}"
    )


def check_optimizer(optimizer: Any) -> str | None:
    """``optimizer`` as an engine global name (str) or None; TypeError otherwise."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, str) or not optimizer.isidentifier():
        raise TypeError(
            f"optimizer must be the engine global name of a torch.optim.Optimizer (str), got {optimizer!r}"
        )
    return optimizer
