"""How checkpoint keys are spelled: ``model.<fqn>`` and ``optim.state.<fqn>.<key>``.

DCP flattens ``{"model": ..., "optim": {"state": {fqn: {key: tensor}}}}`` this way, and
fsdp_nb's full files use the same spelling, so loading, inspecting and converting
agree on one layout. Optimizer state keys (``exp_avg``, ``step``) never contain a dot;
parameter FQNs do, so a flat key splits at its last dot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["MODEL", "OPTIM_STATE", "flat_optim_state", "nest_keys", "optim_key", "rekey_optim", "split_optim_key"]

MODEL = "model."
"""Prefix of model tensors."""
OPTIM_STATE = "optim.state."
"""Prefix of optimizer state entries."""


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


def rekey_optim(osd: dict[str, Any], flat: bool, rename: Callable[[str], str]) -> dict[str, Any]:
    """Optimizer state dict ``osd`` with every parameter name ``fqn`` as ``rename(fqn)``:
    nested (``state`` and each group's ``params``) or flat (``state.<fqn>.<key>``,
    ``param_groups.<fqn>.<key>``). Tensors are not copied."""
    if flat:
        out: dict[str, Any] = {}
        for k, v in osd.items():
            head, _, rest = k.partition(".")
            fqn, _, key = rest.rpartition(".")
            out[f"{head}.{rename(fqn)}.{key}" if head in ("state", "param_groups") and fqn else k] = v
        return out
    return {
        **osd,
        "state": {rename(fqn): entries for fqn, entries in osd.get("state", {}).items()},
        "param_groups": [{**g, "params": [rename(p) for p in g.get("params", [])]}
                         for g in osd.get("param_groups", [])],
    }


def nest_keys(flat: Mapping[str, Any], paths: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The nested dict DCP flattened into ``flat`` (``train_state.step`` →
    ``{"train_state": {"step": …}}``), by each key's path in ``paths`` (a DCP metadata's
    ``planner_data``) where it has one, else by the key's first dot."""
    out: dict[str, Any] = {}
    for k, v in flat.items():
        path = (paths or {}).get(k)
        parts = [str(x) for x in path] if isinstance(path, (tuple, list)) and path else k.split(".", 1)
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = v
    return out
