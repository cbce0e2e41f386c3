"""Hugging Face models on a rank: initialised as transformers does, described as its
``config.json`` describes them.

Nothing here imports transformers: a model is recognised by what ``PreTrainedModel``
has (``_init_weights`` and a ``config``), so ranks without transformers never pay for it.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["hf_init_weights", "hugging_face_meta", "initialize_weights", "is_hugging_face", "tied_parameters"]


def is_hugging_face(model: Any) -> bool:
    """A transformers ``PreTrainedModel`` (its initialiser and its config)."""
    return callable(getattr(model, "_init_weights", None)) and hasattr(getattr(model, "config", None), "to_json_string")


def hf_init_weights(model: Any, module: Any) -> None:
    """A Hugging Face model's own initialisation of one of its ``module`` s (its
    ``_init_weights``, transformers' name for it)."""
    model._init_weights(module)


def initialize_weights(model: Any) -> None:
    """Initialise a ``PreTrainedModel`` built on meta as transformers does: its
    ``_init_weights`` on every module (``initialize_weights``, which also recomputes
    buffers such as rotary frequencies), on this rank's shards. Flags left by the meta
    build would make it skip modules, so they are cleared first."""
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            t.__dict__.pop("_is_hf_initialized", None)
    initialize = getattr(model, "initialize_weights", None)
    if callable(initialize):
        initialize()
    else:  # transformers 4: the same, one module at a time
        model.apply(lambda m: hf_init_weights(model, m))


def tied_parameters(model: Any) -> dict[str, str]:
    """Each parameter name that is another's tensor (tied embeddings) -> the name it
    repeats, the first registered: what transformers leaves out of a saved file."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def hugging_face_meta(model: Any) -> dict[str, Any]:
    """What a checkpoint keeps of a Hugging Face model so an export is loadable by
    ``from_pretrained``: ``hf_config`` (``config.json``, with the model's class as its
    architecture), ``hf_generation_config`` (``generation_config.json``, when the model
    generates) and ``tied`` (``tied_parameters``). Empty for any other model."""
    if not is_hugging_face(model):
        return {}
    from torch.distributed.fsdp import FSDPModule

    config = json.loads(model.config.to_json_string(use_diff=False))
    # fully_shard made the model's class a subclass of FSDPModule: name the model's own
    config["architectures"] = [next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__]
    meta: dict[str, Any] = {"hf_config": config, "tied": tied_parameters(model)}
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        meta["hf_generation_config"] = json.loads(generation.to_json_string(use_diff=True))
    return meta
