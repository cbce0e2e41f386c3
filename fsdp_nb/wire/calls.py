"""What a call carries to the engines and what they publish back while it runs."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PROGRESS_KEY", "ByValue"]

PROGRESS_KEY = "fsdp_nb.progress"
"""The key under which a rank publishes ``{"done": bytes, "total": bytes}`` of a save or
load (ipyparallel's data channel; the notebook sums them into one bar)."""


@dataclass(frozen=True)
class ByValue:
    """An object pickled with cloudpickle; ipyparallel carries the bytes untouched."""

    payload: bytes
    """cloudpickle bytes of the object."""
    what: str
    """A short description, for error messages."""
    rebind: bool = False
    """A notebook (by-value) function: let it also see the engine's globals."""
