"""The alternatives a memory plan weighs: what each changes, and what it costs in speed.

A what-if is a dict of changes to the planned step: ``world_size``, ``batch`` (a new
batch, or a number that scales the batch's first dimension) and the wrap options
that move memory (``activation_checkpointing``, ``mixed_precision``, ``cpu_offload``,
``sharding``, ``reshard_after_forward``, ``auto_wrap``). :func:`standard` gives the
usual ones for a plan (``what_if="auto"``). :func:`cost` names what a change costs,
with a rank that orders them from free to expensive, so the plan can say which is the
cheapest change that fits. Pure functions, no engines.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..models.wire_wrap_options import OPTION_NAMES, WrapOptions

__all__ = ["WHAT_IF_KEYS", "apply", "check_what_ifs", "cost", "label", "standard"]

WHAT_IF_KEYS = ("world_size", "batch", "activation_checkpointing", "mixed_precision", "cpu_offload",
                "sharding", "reshard_after_forward", "auto_wrap")
"""What a what-if may change."""


def check_what_ifs(what_if: Any, options: WrapOptions, world_size: int, batch: Any,
                   fixed_world: bool) -> list[dict[str, Any]]:
    """``what_if`` as a list of change dicts, each checked (its options build a valid
    ``WrapOptions``); ``"auto"``: :func:`standard`. ValueError / TypeError naming what
    is wrong and what is allowed, before anything is planned."""
    if what_if is None:
        return []
    if what_if == "auto":
        return standard(options, world_size, batch, fixed_world)
    if isinstance(what_if, dict):
        what_if = [what_if]
    if not isinstance(what_if, (list, tuple)) or not all(isinstance(w, dict) and w for w in what_if):
        raise TypeError(
            f"what_if must be 'auto', a dict of changes or a list of them (e.g. "
            f"[{{'activation_checkpointing': {{Block}}}}, {{'world_size': 8}}]), got {what_if!r}")
    for w in what_if:
        unknown = sorted(set(w) - set(WHAT_IF_KEYS))
        if unknown:
            raise ValueError(f"what_if {w!r} changes {', '.join(map(repr, unknown))}; "
                             f"allowed: {', '.join(WHAT_IF_KEYS)}")
        n = w.get("world_size", world_size)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"what_if world_size must be a positive int, got {n!r}")
        b = w.get("batch")
        if isinstance(b, (int, float)) and not isinstance(b, bool) and b <= 0:
            raise ValueError(f"what_if batch scale must be positive, got {b!r}")
        apply(options, w)  # a valid WrapOptions, or the option's own error
    return list(what_if)


def apply(options: WrapOptions, change: dict[str, Any]) -> WrapOptions:
    """``options`` with the wrap options of ``change`` applied."""
    kw = {k: v for k, v in change.items() if k in OPTION_NAMES}
    if "reshard_after_forward" in change:
        raf = change["reshard_after_forward"]
        if not isinstance(raf, bool):
            raise TypeError(f"reshard_after_forward must be True or False, got {raf!r}")
        kw["sharding"] = "full" if raf else "grad_op"
    return dataclasses.replace(options, **kw) if kw else options


def standard(options: WrapOptions, world_size: int, batch: Any, fixed_world: bool) -> list[dict[str, Any]]:
    """The usual alternatives to ``options``: bf16 compute, activation checkpointing on
    the auto-wrap blocks, resharding after forward, CPU offload, half the batch, and
    twice the ranks (for a plan without a session, whose world is not fixed)."""
    out: list[dict[str, Any]] = []
    if options.mixed_precision == "32-true":
        out.append({"mixed_precision": "bf16-mixed"})
    if options.activation_checkpointing is None and isinstance(options.auto_wrap, frozenset):
        out.append({"activation_checkpointing": options.auto_wrap})
    if options.sharding == "grad_op":
        out.append({"reshard_after_forward": True})
    if options.cpu_offload is False:
        out.append({"cpu_offload": True})
    if _first_dim(batch) > 1:
        out.append({"batch": 0.5})
    if not fixed_world:
        out.append({"world_size": world_size * 2})
    return out


def _first_dim(batch: Any) -> int:
    """The smallest first dimension among the batch's tensors (or their specs), however deep
    they sit in tuples, lists and dicts; 0 when none has one."""
    if isinstance(batch, dict):
        parts = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        parts = list(batch)
    else:
        shape = getattr(batch, "shape", ())
        return int(shape[0]) if shape else 0
    return min((d for d in map(_first_dim, parts) if d), default=0)


_COSTS: dict[str, tuple[int, str]] = {
    "bf16-mixed": (0, "none: bf16 compute (faster on GPUs with bf16; fp32 weights and gradient reduction kept)"),
    "16-mixed": (1, "numerics: fp16 compute needs loss scaling"),
    "bf16-true": (1, "numerics: parameters, gradients and optimizer state in bf16"),
    "32-true": (2, "speed: fp32 compute"),
    "grad_op": (0, "none: one all-gather fewer per unit (more memory between forward and backward)"),
    "full": (1, "communication: every unit is gathered again in the backward"),
    "auto_wrap": (1, "communication: more, smaller all-gathers"),
    "no_auto_wrap": (0, "none: one all-gather of the whole model (fewer, larger ones)"),
    "activation_checkpointing": (2, "recompute: the checkpointed blocks' forward runs again in the "
                                    "backward (about a third more compute)"),
    "no_activation_checkpointing": (0, "none: no forward runs again in the backward (faster)"),
    "batch": (3, "fewer samples per step: accumulate gradients over more steps for the same batch"),
    "larger_batch": (0, "none: more samples per step (faster per sample)"),
    "cpu_offload": (4, "transfers: parameters and gradients cross to the host every step and the "
                       "optimizer steps on the CPU"),
    "no_cpu_offload": (0, "none: parameters, gradients and optimizer state stay on the device (faster)"),
    "more_ranks": (5, "hardware: more GPUs"),
    "fewer_ranks": (0, "none: fewer GPUs"),
}


def _cost_key(k: str, v: Any, world_size: int) -> str:
    """Which of ``_COSTS`` change ``k=v`` is; a change not named there is its own key."""
    if k == "world_size":
        return "more_ranks" if v > world_size else "fewer_ranks"
    if k == "mixed_precision":
        return v if isinstance(v, str) else "bf16-mixed"
    if k in ("sharding", "reshard_after_forward"):
        return "full" if v in ("full", "hybrid", True) else "grad_op"
    if k == "cpu_offload":
        return "cpu_offload" if v else "no_cpu_offload"
    if k == "activation_checkpointing":
        return "activation_checkpointing" if v else "no_activation_checkpointing"
    if k == "auto_wrap" and v is None:
        return "no_auto_wrap"
    if k == "batch" and isinstance(v, (int, float)) and v > 1:
        return "larger_batch"
    return k


def cost(change: dict[str, Any], world_size: int) -> tuple[int, str]:
    """(rank, words) of what ``change`` costs in speed: rank 0 is free, higher is dearer;
    a change of several things costs its dearest, words for each. A change this table
    does not know (a new batch given as tensors is ``batch``) is named as it is, at rank 1."""
    parts = [_COSTS.get(key, (1, f"{key} changed: its speed cost is not known"))
             for key in (_cost_key(k, v, world_size) for k, v in change.items())]
    return max(r for r, _ in parts), "; ".join(w for _, w in parts)


def label(change: dict[str, Any]) -> str:
    """A short name of ``change``, e.g. ``activation_checkpointing={Block}, world_size=8``."""
    def short(v: Any) -> str:
        if isinstance(v, (set, frozenset)):
            return "{" + ", ".join(sorted(getattr(c, "__name__", repr(c)) for c in v)) + "}"
        if isinstance(v, float) and v < 1:
            return f"x{v:g}"
        return getattr(v, "__name__", None) or repr(v)

    return ", ".join(f"{k}={short(v)}" for k, v in change.items())
