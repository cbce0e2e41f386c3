"""``sess.load``: load a sharded or full checkpoint onto the session's world size.

Resharding is DCP's: each rank reads the pieces of the stored chunks that overlap
its own shards, whatever the world size that wrote them. Files are verified and
keys/shapes checked on the ranks first; the model is written only after every
rank has read everything into fresh tensors, so a failure leaves it as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .contract import LoadSpec, check_optimizer, model_name, raise_outcomes
from .pending import wait_pending
from .storage import options_for, url_to_fs

if TYPE_CHECKING:
    from ..session import Session

__all__ = ["load"]


def load(
    sess: Session,
    path: str,
    model: Any,
    *,
    optimizer: str | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load ``path`` into engine module ``model`` (and optimizer); returns the saved ``extra``.

    Raises FileNotFoundError (nothing there), CheckpointError (incomplete, keys or
    shapes differ: listed), CorruptCheckpointError (a file is damaged: named).
    """
    from ..engine import checkpoint_load

    name = model_name(model)
    optim = check_optimizer(optimizer)
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    url_to_fs(path)
    wait_pending(sess)
    spec = LoadSpec(url=path, storage_options=options_for(path), model=name, optimizer=optim, strict=strict)
    d = sess.dispatcher
    outs = d.gather(d.apply("checkpoint load", checkpoint_load.load, args=(spec,)))
    raise_outcomes(outs)
    return outs[0].extra or {}
