"""fsdp_nb: a Jupyter notebook driving PyTorch FSDP2 across ipyparallel engines.

``sess = fsdp_nb.Session()`` starts one engine per GPU (2 CPU engines on gloo
without GPUs), each a rank of one process group; ``%%px`` runs cells on every rank.
"""

from __future__ import annotations

from .errors import DeadRankError, RankError, RankFailure, RankTimeoutError, SessionClosedError
from .magics import load_ipython_extension
from .rendezvous import RankInfo
from .session import Session

__version__ = "0.1.0"

__all__ = [
    "DeadRankError",
    "RankError",
    "RankFailure",
    "RankInfo",
    "RankTimeoutError",
    "Session",
    "SessionClosedError",
    "__version__",
    "load_ipython_extension",
]
