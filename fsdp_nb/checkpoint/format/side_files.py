"""Files other trainers keep beside their DCP shards, read weights-only.

Lightning Fabric's ModelParallel strategy writes the model and optimizer with DCP and
everything else ``fabric.save`` was given (a step, a learning rate) with ``torch.save``
into ``meta.pt``. ``sess.load`` returns that as the checkpoint's ``extra``; ``inspect``
shows it.
"""

from __future__ import annotations

import posixpath
from typing import Any

from .pickles import load_pt

__all__ = ["SIDE_FILE", "side_extra"]

SIDE_FILE = "meta.pt"
"""Lightning Fabric's file of the state that is not a model or an optimizer."""


def side_extra(fs: Any, p: str, url: str, weights_only: bool = True) -> dict[str, Any] | None:
    """The other state of folder ``p`` (``meta.pt`` as a dict), or None when it has none.

    Args:
        fs: the fsspec filesystem ``p`` is on.
        p: the checkpoint folder.
        url: the checkpoint as the user named it, for errors.
        weights_only: through torch's weights-only unpickler; one that could run code is
            refused (``UnsafeCheckpointError``). False trusts it.
    """
    path = posixpath.join(p, SIDE_FILE)
    if not fs.exists(path):
        return None
    side = load_pt(fs, path, url, weights_only)
    return dict(side) if isinstance(side, dict) else {SIDE_FILE: side}
