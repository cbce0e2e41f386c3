"""How checkpoint keys are spelled: ``model.<fqn>`` and ``optim.state.<fqn>.<key>``.

DCP flattens ``{"model": ..., "optim": {"state": {fqn: {key: tensor}}}}`` this way, and
fsdp_nb's full files use the same spelling, so loading, inspecting and converting
agree on one layout. Optimizer state keys (``exp_avg``, ``step``) never contain a dot;
parameter FQNs do, so a flat key splits at its last dot.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = [
    "MODEL", "OPTIM_PREFIXES", "OPTIM_STATE", "flat_optim_state", "is_bare", "is_model_key", "optim_key",
    "optim_root", "split_optim_key",
]

MODEL = "model."
"""Prefix of model tensors."""
OPTIM_STATE = "optim.state."
"""Prefix of optimizer state entries."""
OPTIM_PREFIXES = ("optim.", "optimizer.")
"""Top-level keys of a plain DCP save that hold optimizer state, not the model's."""


def is_bare(keys: Iterable[str], expected: Iterable[str] | None = None) -> bool:
    """True for a plain ``dcp.save`` of the model's own state dict (torchtitan's layout)
    rather than one nesting it under ``model.`` (fsdp_nb, ``get_state_dict`` users).

    Without ``expected``: no key under ``model.``. With the model's own names
    (``expected``), the spelling more of them are stored under: a Hugging Face model's
    own names often start with ``model.`` too."""
    keys = set(keys)
    if expected is None:
        return not any(k.startswith(MODEL) for k in keys)
    expected = list(expected)
    as_is = sum(k in keys for k in expected)
    nested = sum(MODEL + k in keys for k in expected)
    return as_is > nested if as_is or nested else is_bare(keys)


def optim_root(keys: Iterable[str]) -> str:
    """Where a DCP folder keeps its optimizer: ``"optim"`` (fsdp_nb), or ``"optimizer"``
    (Lightning Fabric's and torchtitan's key) when only that one holds optimizer state."""
    keys = list(keys)
    if any(k.startswith("optimizer.state.") for k in keys) and not any(k.startswith(OPTIM_STATE) for k in keys):
        return "optimizer"
    return "optim"


def is_model_key(key: str, bare: bool) -> bool:
    """Whether stored ``key`` is a model tensor, in a bare save (``is_bare``) or a nested one."""
    return not key.startswith(OPTIM_PREFIXES) if bare else key.startswith(MODEL)


def optim_key(fqn: str, key: str) -> str:
    """``optim.state.<fqn>.<key>``."""
    return f"{OPTIM_STATE}{fqn}.{key}"


def split_optim_key(flat: str) -> tuple[str, str]:
    """(fqn, key) of an ``optim.state.<fqn>.<key>`` string."""
    fqn, key = flat[len(OPTIM_STATE):].rsplit(".", 1)
    return fqn, key


def flat_optim_state(state: Mapping[str, Mapping[str, Any]]) -> Iterator[tuple[str, str, str, Any]]:
    """(flat key, fqn, key, value) for every entry of an optimizer state dict's ``state``."""
    for fqn, entries in state.items():
        for key, value in entries.items():
            yield optim_key(fqn, key), fqn, key, value
