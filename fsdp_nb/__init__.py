"""fsdp_nb: a Jupyter notebook driving PyTorch FSDP2 across ipyparallel engines.

``sess = fsdp_nb.Session()`` starts one engine per GPU (2 CPU engines on gloo
without GPUs), each a rank of one process group; ``%%px`` runs cells on every rank.
"""

from __future__ import annotations

from .errors import DeadRankError, RankError, RankFailure, RankTimeoutError, SessionClosedError

__version__ = "0.1.0"

# Names served lazily from the layers that define them: `import fsdp_nb` stays light,
# so a process that needs one small module (the session watchdog, an engine importing
# fsdp_nb.engine) does not pay for ipyparallel and IPython.
_LAZY = {
    "Session": "session",
    "RankInfo": "rendezvous",
    "load_ipython_extension": "magics",
    "ShardedModel": "sharded_model",
    "WrapOptions": "wrap_options",
    "CheckpointInfo": "checkpoint",
    "CheckpointError": "checkpoint",
    "CorruptCheckpointError": "checkpoint",
    "UnsafeCheckpointError": "checkpoint",
    "inspect": "checkpoint",
    "consolidate": "checkpoint",
    "export_safetensors": "checkpoint",
    "list_checkpoints": "checkpoint",
    "sessions": "keepalive",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'fsdp_nb' has no attribute {name!r}")

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CorruptCheckpointError",
    "DeadRankError",
    "RankError",
    "RankFailure",
    "RankInfo",
    "RankTimeoutError",
    "Session",
    "SessionClosedError",
    "ShardedModel",
    "UnsafeCheckpointError",
    "WrapOptions",
    "__version__",
    "consolidate",
    "export_safetensors",
    "inspect",
    "list_checkpoints",
    "load_ipython_extension",
    "sessions",
]
