"""Checks of ``Session()`` and ``Session.connect()`` arguments, before any process starts.

Each raises a ``ValueError`` naming what was wrong and what is allowed; nothing has
been started when it does. ``validate`` also decides what a local session can decide
up front: the backend (local engines share this machine's GPUs) and the rank count.
"""

from __future__ import annotations

import glob
import sys
from collections.abc import Sequence

from ..engine.probe import _cuda_count
from .launch_settings import launcher_names

__all__ = [
    "BACKENDS", "GPU_DEVICE_NODES", "check_grace", "check_n_backend", "check_output", "check_ranks",
    "check_standby", "local_gpu_count", "validate",
]

BACKENDS = ("gloo", "nccl")
"""Process-group backends a session can form."""

GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")
"""Device files a host with a CUDA (or ROCm, or WSL) GPU has."""


def local_gpu_count() -> int:
    """GPUs torch sees on this host. Without a GPU device file, 0 without importing
    torch: the import takes seconds that a CPU session's engines can use instead."""
    if "torch" not in sys.modules and not any(glob.glob(p) for p in GPU_DEVICE_NODES):
        return 0
    return _cuda_count()


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
    gpus = local_gpu_count() if launcher == "local" and backend != "gloo" else None
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


def check_standby(standby: object) -> None:
    if not isinstance(standby, bool):
        raise ValueError(f"standby must be True or False, got {standby!r}")


def check_grace(grace: float) -> None:
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise ValueError(f"grace must be a number of seconds >= 0, got {grace!r}")


def check_hang_after(seconds: float | None, what: str = "hang_after") -> float | None:
    """``hang_after`` as seconds > 0 (None where allowed); ValueError naming what is allowed."""
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not 0 < seconds < float("inf")):
        raise ValueError(f"{what} must be a number of seconds > 0 (None: the default), got {seconds!r}")
    return None if seconds is None else float(seconds)


def check_ranks(ranks: Sequence[int] | None, world_size: int) -> list[int]:
    """``ranks=`` of a call: distinct ranks of this session, sorted (None: every rank)."""
    allowed = f"ranks 0..{world_size - 1}"
    if ranks is None:
        return list(range(world_size))
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"ranks must be a list of ints ({allowed}) or None, got {ranks!r}")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size]
    if bad or not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(
            f"ranks={list(ranks)!r} is not a non-empty list of distinct ranks; this session "
            f"has {allowed}"
        )
    return sorted(ranks)


def check_output(output: str | None, ranks: Sequence[int]) -> tuple[int, ...] | None:
    """``output=`` of a call: ``"all"`` and ``"each"`` stream every rank's output
    (``"each"`` unmerged), ``"rank<k>"`` only rank k's (one of ``ranks``), ``"none"``
    (None too) no rank's: errors still raise. Returns the echoed ranks (None: all)."""
    if output in ("all", "each"):
        return None
    if output is None or output == "none":
        return ()
    allowed = ", ".join(["'all'", "'each'", "'none'", *(f"'rank{r}'" for r in ranks)])
    if isinstance(output, str) and output.startswith("rank") and output[4:].isdigit():
        rank = int(output[4:])
        if rank in ranks:
            return (rank,)
    raise ValueError(f"output={output!r} is not one of the running ranks' outputs; allowed: {allowed}")
