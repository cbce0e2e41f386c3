"""fsdp_nb: a Jupyter notebook driving PyTorch FSDP2 across ipyparallel engines.

``sess = fsdp_nb.Session()`` starts one engine per GPU (2 CPU engines on gloo
without GPUs), each a rank of one process group; ``%%px`` runs cells on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointError,
    CollectiveMismatchError,
    CorruptCheckpointError,
    DeadRankError,
    FsdpNbError,
    RankError,
    RankFailure,
    RankTimeoutError,
    ResizeError,
    SessionClosedError,
    SessionUnfinishedError,
    UnsafeCheckpointError,
)

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and editors see of the lazy names below
    from .autosave.autosave import Autosaving
    from .checkpoints.async_saves import AsyncCheckpoint
    from .checkpoints.consolidate import consolidate
    from .checkpoints.export import export_safetensors
    from .context import SessionContext
    from .debugging.rank_breakpoints import breakpoint
    from .formats.info import CheckpointInfo
    from .formats.inspect import inspect
    from .formats.listing import list_checkpoints
    from .formats.storage import set_storage_options
    from .lifetime.keepalive import sessions
    from .memory.memory_report import MemoryPlan
    from .memory.session_planning import plan
    from .models.sharded_model import ShardedModel
    from .models.wire_wrap_options import WrapOptions
    from .recovery.resize import ResizeReport
    from .recovery.restart_report import RestartReport
    from .runtime.rendezvous import RankInfo
    from .session import Session
    from .steps.rank_logged import log
    from .steps.step_profile import StepProfile
    from .steps.steps_view import StepsView
    from .steps.steps_widget import StepsWidget

# Names served lazily from the layers that define them: `import fsdp_nb` stays light,
# so a process that needs one small module (the session watchdog, an engine importing
# fsdp_nb.engine) does not pay for ipyparallel and IPython.
_LAZY = {
    "Session": "session",
    "SessionContext": "context",
    "RankInfo": "runtime.rendezvous",
    "ShardedModel": "models.sharded_model",
    "WrapOptions": "models.wire_wrap_options",
    "MemoryPlan": "memory.memory_report",
    "plan": "memory.session_planning",
    "AsyncCheckpoint": "checkpoints.async_saves",
    "Autosaving": "autosave.autosave",
    "StepProfile": "steps.step_profile",
    "StepsView": "steps.steps_view",
    "StepsWidget": "steps.steps_widget",
    "log": "steps.rank_logged",
    "RestartReport": "recovery.restart_report",
    "CheckpointInfo": "formats.info",
    "inspect": "formats.inspect",
    "list_checkpoints": "formats.listing",
    "set_storage_options": "formats.storage",
    "consolidate": "checkpoints.consolidate",
    "export_safetensors": "checkpoints.export",
    "sessions": "lifetime.keepalive",
    "ResizeReport": "recovery.resize",
    "breakpoint": "debugging.rank_breakpoints",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'fsdp_nb' has no attribute {name!r}")


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext fsdp_nb``: adds ``%fsdp`` (start / status / stop / list / attach /
    debug / resize), ``%px`` and ``%%px`` to IPython shell ``ip`` (IPython calls this)."""
    from .frontends.magics import register
    from .session import Session

    register(ip, Session)


__all__ = [
    "AsyncCheckpoint",
    "Autosaving",
    "CheckpointError",
    "CheckpointInfo",
    "CollectiveMismatchError",
    "CorruptCheckpointError",
    "DeadRankError",
    "FsdpNbError",
    "MemoryPlan",
    "RankError",
    "RankFailure",
    "RankInfo",
    "RankTimeoutError",
    "ResizeError",
    "ResizeReport",
    "RestartReport",
    "Session",
    "SessionClosedError",
    "SessionContext",
    "SessionUnfinishedError",
    "ShardedModel",
    "StepProfile",
    "StepsView",
    "StepsWidget",
    "UnsafeCheckpointError",
    "WrapOptions",
    "__version__",
    "breakpoint",
    "consolidate",
    "export_safetensors",
    "inspect",
    "list_checkpoints",
    "load_ipython_extension",
    "log",
    "plan",
    "sessions",
    "set_storage_options",
]
