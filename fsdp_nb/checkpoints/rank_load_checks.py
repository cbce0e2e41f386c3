"""What every load does around its reading: compare stored keys and shapes with the
model's (and optimizer's), agree the outcome on all ranks, and set what was read.

The comparisons work on stored keys: each loader spells the model's names the way its
checkpoint stores them (``layouts.Layout.model_key``, or as they are in safetensors).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..engine.checkpoint_group import agree
from ..errors import CheckpointError
from ..models.rank_hugging_face import tied_parameters
from .wire_checkpoint import Outcome

__all__ = ["agree_problem", "apply_read", "match", "optim_entries", "shape_problems", "shapes"]


def agree_problem(problem: str | None, cls: type[BaseException] = CheckpointError) -> Outcome | None:
    """All ranks learn every rank's problem; the same failure outcome (or None) on each."""
    return agree(Outcome.failed(problem, cls) if problem else None)


def shapes(sd: Mapping[str, Any], key: Callable[[str], str] = str) -> dict[str, tuple]:
    """``{key(name): shape}`` of every tensor of state dict ``sd``."""
    import torch

    return {key(k): tuple(v.shape) for k, v in sd.items() if isinstance(v, torch.Tensor)}


def optim_entries(osd: Mapping[str, Any], flat: bool = False) -> Iterator[tuple[str, str, Any]]:
    """(fqn, key, value) of every state entry of an optimizer state dict, nested
    (``{"state": {fqn: {key: v}}}``) or flat (``{"state.<fqn>.<key>": v}``)."""
    if not flat:
        for fqn, entries in osd.get("state", {}).items():
            for key, value in entries.items():
                yield fqn, key, value
        return
    for k, value in osd.items():
        if k.startswith("state."):
            fqn, key = k[len("state."):].rsplit(".", 1)
            yield fqn, key, value


def shape_problems(
    url: str, expected: dict[str, tuple], found: dict[str, tuple], what: str, strict: bool
) -> tuple[str | None, set[str]]:
    """(message or None, keys to load) comparing expected and stored shapes."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mism = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    usable = {k for k in set(expected) & set(found) if expected[k] == found[k]}
    if not strict and not mism:
        return None, usable
    if not (missing or unexpected or mism):
        return None, usable
    lines = [f"checkpoint {url!r} does not match the {what}:"]
    if missing:
        lines.append(f"  missing keys ({len(missing)}): {', '.join(missing[:20])}")
    if unexpected:
        lines.append(f"  unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}")
    for k in mism[:20]:
        lines.append(f"  shape mismatch {k}: checkpoint {list(found[k])}, model {list(expected[k])}")
    if strict and not mism:
        lines.append("  load with strict=False to load the keys both have.")
    return "\n".join(lines), usable


def match(url: str, strict: bool, expected: dict[str, tuple], found: dict[str, tuple],
          tied: dict[str, str], optim_expected: dict[str, tuple] | None,
          optim_found: dict[str, tuple] | None, no_optim: str) -> tuple[str | None, set[str]]:
    """(problem or None, stored model keys to load).

    Args:
        url: the checkpoint, for the message.
        strict: every key must match (else: the keys both have, same shapes).
        expected: the model's tensors as the checkpoint would store them, with shapes.
        found: the checkpoint's model tensors, with shapes.
        tied: stored key of a tied copy (``lm_head.weight``) → the key it shares; a copy
            the checkpoint leaves out, as ``save_pretrained`` does, is filled from it.
        optim_expected: the optimizer's state tensors as stored, or None (no optimizer).
        optim_found: the checkpoint's optimizer state tensors, or None when it has none.
        no_optim: why a checkpoint has no optimizer state, for the message.
    """
    expected = dict(expected)
    for dup, src in tied.items():
        if dup not in found and src in found:
            expected.pop(dup, None)
    problem, usable = shape_problems(url, expected, found, "model", strict)
    if problem is None and optim_expected is not None:
        if optim_found is None:
            problem = f"checkpoint {url!r} has no optimizer state ({no_optim})"
        else:
            problem, _ = shape_problems(url, optim_expected, optim_found, "optimizer", True)
    return problem, usable


def apply_read(model: Any, optim: Any, msd: dict | None, osd: dict | None, strict: bool, meta: dict,
               flat_optim: bool = False) -> Outcome:
    """Set what this rank read (every rank read all of it) into the optimizer and, unless
    it was read in place (``msd`` None), the model; the outcome carries the checkpoint's
    ``extra`` and world size. ``flat_optim``: ``osd`` is flat (torchtitan's)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(strict=strict, flatten_optimizer_state_dict=flat_optim)
    if msd is not None:
        for dup, src in tied_parameters(model).items():  # left out of the file: it shares src's tensor
            if dup not in msd and src in msd:
                msd[dup] = msd[src]
        set_model_state_dict(model, msd, options=opts)
    if optim is not None and osd is not None:  # the callers read one whenever there is an optimizer
        set_optimizer_state_dict(model, optim if isinstance(optim, list) else [optim], osd, options=opts)
    return Outcome(extra=meta.get("extra", {}), world_size=meta.get("world_size"))
