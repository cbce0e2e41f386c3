"""Checks of ``Session()`` and ``Session.connect()`` arguments, before any process starts.

Each raises a ``ValueError`` naming what was wrong and what is allowed; nothing has
been started when it does. ``validate`` also decides what a local session can decide
up front: the backend (local engines share this machine's GPUs) and the rank count.
"""

from __future__ import annotations

from .cluster import launcher_names
from .engine.probe import _cuda_count

__all__ = ["BACKENDS", "check_grace", "check_n_backend", "validate"]

BACKENDS = ("gloo", "nccl")
"""Process-group backends a session can form."""


def check_n_backend(n: int | None, backend: str | None) -> None:
    """The checks ``Session()`` and ``Session.connect()`` share."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be a positive int (number of ranks) or None, got {n!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)} or None")


def validate(n: int | None, backend: str | None, launcher: str) -> tuple[int, str | None]:
    """Check arguments before any process starts; return (n, backend).

    Local engines share this machine's GPUs, so the backend is decided here; engines
    a launcher starts elsewhere (mpi, slurm...) are probed first (backend None:
    ``rendezvous.choose_backend``), since the notebook's host may have no GPU.
    """
    check_n_backend(n, backend)
    names = launcher_names()
    if launcher not in names:
        raise ValueError(f"unknown launcher {launcher!r}; allowed: {', '.join(names)}")
    gpus = _cuda_count() if launcher == "local" else None
    if backend is None and gpus is not None:
        backend = "nccl" if gpus else "gloo"
    if n is None:
        n = gpus if (backend == "nccl" and gpus) else 2
    if backend == "nccl" and gpus is not None and n > gpus:
        raise ValueError(
            f"n={n} ranks with backend 'nccl' needs {n} GPUs, but this machine has {gpus}; "
            f"use n <= {gpus}, or backend='gloo' for CPU ranks"
        )
    return n, backend


def check_grace(grace: float) -> None:
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise ValueError(f"grace must be a number of seconds >= 0, got {grace!r}")
