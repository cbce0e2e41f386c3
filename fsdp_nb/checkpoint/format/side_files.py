"""Where other trainers keep their DCP shards and the state beside them, read weights-only.

Lightning Fabric's ModelParallel strategy writes the model and optimizer with DCP and
everything else ``fabric.save`` was given (a step, a learning rate) with ``torch.save``
into ``meta.pt`` in the same folder. OLMo-core keeps its shards in ``model_and_optim/``
and the trainer's state in ``train/rank0.pt``. ``sess.load`` returns that state as the
checkpoint's ``extra``; ``inspect`` shows it.
"""

from __future__ import annotations

import posixpath
from typing import Any

from .pickles import load_pt

__all__ = ["OLMO_CORE_SHARDS", "OLMO_CORE_STATE", "SIDE_FILE", "data_folder", "side_extra"]

SIDE_FILE = "meta.pt"
"""Lightning Fabric's file of the state that is not a model or an optimizer."""
OLMO_CORE_SHARDS = "model_and_optim"
"""The subfolder of an OLMo-core step folder that holds the DCP shards."""
OLMO_CORE_STATE = "train/rank0.pt"
"""The trainer state of an OLMo-core step folder (rank 0's)."""


def data_folder(fs: Any, p: str) -> tuple[str, str]:
    """(the folder holding checkpoint ``p``'s DCP shards, the file of its other state):
    ``p`` itself and ``meta.pt`` in it, or for an OLMo-core step folder
    ``model_and_optim/`` and ``train/rank0.pt``."""
    sub = posixpath.join(p, OLMO_CORE_SHARDS)
    if not fs.exists(posixpath.join(p, ".metadata")) and fs.exists(posixpath.join(sub, ".metadata")):
        return sub, posixpath.join(p, OLMO_CORE_STATE)
    return p, posixpath.join(p, SIDE_FILE)


def side_extra(fs: Any, path: str, url: str, weights_only: bool = True) -> dict[str, Any] | None:
    """The other state in file ``path`` (``data_folder``'s second answer) as a dict, or
    None when there is no such file.

    Args:
        fs: the fsspec filesystem ``path`` is on.
        path: the side file.
        url: the checkpoint as the user named it, for errors.
        weights_only: through torch's weights-only unpickler; one that could run code is
            refused (``UnsafeCheckpointError``). False trusts it.
    """
    if not fs.exists(path):
        return None
    side = load_pt(fs, path, url, weights_only)
    return dict(side) if isinstance(side, dict) else {SIDE_FILE: side}
