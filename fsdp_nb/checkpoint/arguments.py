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


def check_layout(layout: Any, path: str, sharded: bool, extra: dict[str, Any]) -> None:
    """Refuse a ``sess.save(layout=)`` its trainer could not resume from, before any work.

    ``"lightning"`` and ``"torchtitan"`` are DCP folders (``sharded=True``). torchtitan
    resumes from ``<folder>/step-<N>`` and loads each top-level entry of the folder as
    one of its states (``train_state``, ``lr_scheduler``, ``dataloader``): each ``extra``
    entry must be a dict, and none may be named ``optimizer``.
    """
    import posixpath
    import re

    from ..formats.layouts import WRITABLE

    if layout not in WRITABLE:
        raise ValueError(f"layout must be one of {', '.join(map(repr, WRITABLE))}, got {layout!r}")
    if layout == "fsdp_nb":
        return
    if not sharded:
        raise ValueError(f"layout={layout!r} is a sharded folder; sharded=False writes fsdp_nb's own full file")
    if layout != "torchtitan":
        return
    name = posixpath.basename(path.rstrip("/"))
    if not re.fullmatch(r"step-\d+", name):
        raise ValueError(
            f"torchtitan resumes from a folder named step-<N> (its checkpoint folder holds one per step); "
            f"{path!r} ends in {name!r}: name it like .../checkpoint/step-100"
        )
    for key, value in extra.items():
        if key == "optimizer" or not isinstance(value, dict):
            raise ValueError(
                f"with layout='torchtitan' each extra entry is one state of the trainer, a dict under "
                f"its own name (extra={{'train_state': {{'step': 100, 'ntokens_seen': 0}}}}); "
                f"extra[{key!r}] is {'a name torchtitan keeps for the optimizer' if key == 'optimizer' else type(value).__name__}"
            )
