"""The state other trainers keep beside their shards, read weights-only.

Lightning (Fabric and Trainer) ``torch.save``\\ s everything that is not a model or an
optimizer (a step, the loops' state) into ``meta.pt`` beside its DCP shards; OLMo-core
keeps the trainer's state in ``train/rank0.pt``; Accelerate its schedulers in
``scheduler.bin`` and registered objects in ``custom_checkpoint_<i>.pkl``. ``sess.load``
returns that state as the checkpoint's ``extra``; ``inspect`` shows it. Which files a
checkpoint has is its layout's (``layouts.find_layout``).
"""

from __future__ import annotations

import posixpath
from typing import Any

from .layouts import Layout
from .pickles import load_pt

__all__ = ["side_extra"]


def side_extra(fs: Any, layout: Layout, url: str, weights_only: bool = True) -> dict[str, Any] | None:
    """The other state in ``layout``'s side files as one dict, or None when it has none.

    A file holding a dict (``meta.pt``, ``train/rank0.pt``) gives its entries; any other
    file gives one entry named for the file (``scheduler``, ``custom_checkpoint_0``).

    Args:
        fs: the fsspec filesystem the files are on.
        layout: the checkpoint's layout, whose ``side_files`` are read.
        url: the checkpoint as the user named it, for errors.
        weights_only: through torch's weights-only unpickler; a file that could run code
            is refused (``UnsafeCheckpointError``). False trusts them.
    """
    if not layout.side_files:
        return None
    out: dict[str, Any] = {}
    for path in layout.side_files:
        value = load_pt(fs, path, url, weights_only)
        if isinstance(value, dict) and layout.name != "accelerate":
            out.update(value)
        else:
            out[posixpath.basename(path).rsplit(".", 1)[0]] = value
    return out
