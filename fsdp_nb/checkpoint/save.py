"""``sess.save``: validate in the notebook, then run ``fsdp_nb.engine.checkpoint_io`` on every rank.

Every argument is checked, ``extra`` included, and the target's existence too,
before any rank writes a byte. ``async_save=True`` returns an ``AsyncCheckpoint``
as soon as every rank has staged its state (a CPU copy); the write and the commit
continue in the background on the engines.
"""

from __future__ import annotations

import uuid
import weakref
from typing import TYPE_CHECKING, Any

from .fullfile import full_suffix
from .info import CheckpointError, CheckpointInfo, CorruptCheckpointError
from .metadata import base_metadata, validate_extra
from .storage import options_for, url_to_fs

if TYPE_CHECKING:
    from ..session import Session

__all__ = ["AsyncCheckpoint", "model_name", "save"]

_ERRORS: dict[str, type[BaseException]] = {
    "FileExistsError": FileExistsError,
    "FileNotFoundError": FileNotFoundError,
    "NameError": NameError,
    "TypeError": TypeError,
    "ValueError": ValueError,
    "CheckpointError": CheckpointError,
    "CorruptCheckpointError": CorruptCheckpointError,
}

_PENDING: weakref.WeakKeyDictionary[Any, list[AsyncCheckpoint]] = weakref.WeakKeyDictionary()


def raise_outcomes(outs: list[dict[str, Any]]) -> None:
    """Raise the first failed rank's error as its own class (they agree by construction)."""
    for out in outs:
        if not out.get("ok", False):
            cls = _ERRORS.get(out.get("error", ""), CheckpointError)
            raise cls(out.get("message", "checkpoint operation failed"))


def model_name(model: Any) -> str:
    """The engine global name of ``model`` (a ShardedModel or a str)."""
    if isinstance(model, str):
        if not model.isidentifier():
            raise ValueError(f"model name {model!r} is not a Python identifier")
        return model
    name = getattr(model, "name", None)
    if isinstance(name, str) and name:
        return name
    raise TypeError(
        f"model must be a ShardedModel (from sess.wrap) or the engine global name of an FSDP2 "
        f"module (str), got {type(model).__name__}"
    )


def check_optimizer(optimizer: Any) -> str | None:
    if optimizer is None:
        return None
    if not isinstance(optimizer, str) or not optimizer.isidentifier():
        raise TypeError(
            f"optimizer must be the engine global name of a torch.optim.Optimizer (str), got {optimizer!r}"
        )
    return optimizer


def wait_pending(sess: Session) -> None:
    """Finish every async save of ``sess`` still running (commits them)."""
    for h in list(_PENDING.get(sess, [])):
        h.wait()


class AsyncCheckpoint:
    """A checkpoint being written in the background on the ranks.

    ``done()`` asks the ranks without blocking; ``wait()`` blocks until every rank
    finished and rank 0 committed, then returns the ``CheckpointInfo``. The next
    ``sess.save`` / ``sess.load`` waits for it too.
    """

    def __init__(self, sess: Session, path: str, token: str, blocked: float):
        self._sess = sess
        self.path = path
        """Where the checkpoint is being written."""
        self.token = token
        self.blocked_s = blocked
        """Seconds training was blocked (slowest rank's staging)."""
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self._finished = False

    def done(self) -> bool:
        """True when every rank finished writing (the commit happened or failed)."""
        if self._finished:
            return True
        from ..engine import checkpoint_io as cio

        d = self._sess.dispatcher
        return all(d.gather(d.apply("checkpoint async_done", cio.async_done, args=(self.token,))))

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until committed; returns its CheckpointInfo (raises if the save failed)."""
        if not self._finished:
            from ..engine import checkpoint_io as cio

            d = self._sess.dispatcher
            try:
                outs = d.gather(d.apply("checkpoint async_wait", cio.async_wait, args=(self.token,)), timeout)
                self._finished = True
                raise_outcomes(outs)
                self._info = next((o["info"] for o in outs if o.get("info") is not None), None)
            except BaseException as exc:
                if self._finished:
                    self._error = exc
                raise
            finally:
                if self._finished:
                    lst = _PENDING.get(self._sess, [])
                    if self in lst:
                        lst.remove(self)
        if self._error is not None:
            raise self._error
        assert self._info is not None
        return self._info

    def __repr__(self) -> str:
        state = "committed" if self._info else ("failed" if self._error else "in flight")
        return f"<AsyncCheckpoint {self.path!r}: {state}, training blocked {self.blocked_s:.3f} s>"


def save(
    sess: Session,
    path: str,
    model: Any,
    *,
    optimizer: str | None = None,
    extra: dict[str, Any] | None = None,
    sharded: bool = True,
    overwrite: bool = False,
    async_save: bool = False,
    keep_last: int | None = None,
) -> CheckpointInfo | AsyncCheckpoint:
    """Write a checkpoint of engine module ``model`` (and optimizer) at ``path``, atomically.

    ``sharded=True``: a folder, one DCP file per rank. ``sharded=False``: one file
    written by rank 0, ``.pt`` or ``.safetensors`` by the path's suffix. An existing
    path raises FileExistsError unless ``overwrite``. ``keep_last=k`` keeps the newest
    k checkpoints in the path's folder. Returns the CheckpointInfo, or with
    ``async_save=True`` an ``AsyncCheckpoint`` (``wait()`` / ``done()``).
    """
    from ..engine import checkpoint_io as cio

    name = model_name(model)
    optim = check_optimizer(optimizer)
    extra = validate_extra(extra)
    for flag, v in (("sharded", sharded), ("overwrite", overwrite), ("async_save", async_save)):
        if not isinstance(v, bool):
            raise TypeError(f"{flag} must be True or False, got {v!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    url_to_fs(path)  # a bad URL or a missing filesystem package fails here
    suffix = full_suffix(path)
    if not sharded and suffix is None:
        raise ValueError(
            f"a full checkpoint (sharded=False) is one file: {path!r} must end in .pt or .safetensors"
        )
    if sharded and suffix is not None:
        raise ValueError(
            f"a sharded checkpoint is a folder, but {path!r} ends in {suffix}; "
            "drop the suffix, or pass sharded=False for one file"
        )
    wait_pending(sess)
    spec = {
        "url": path,
        "so": options_for(path),
        "model": name,
        "optimizer": optim,
        "sharded": sharded,
        "async": async_save,
        "keep_last": keep_last,
        "token": uuid.uuid4().hex[:12],
        "meta": base_metadata(extra, "sharded" if sharded else "full"),
        "check_exists": not overwrite,
    }
    d = sess.dispatcher
    pre = d.gather(d.apply("checkpoint preflight", cio.preflight, args=(spec,)))
    raise_outcomes(pre)
    if pre[0].get("exists"):
        raise FileExistsError(
            f"a checkpoint already exists at {path!r}; pass overwrite=True to replace it "
            "(nothing was written)"
        )
    outs = d.gather(d.apply("checkpoint save", cio.save, args=(spec,)))
    raise_outcomes(outs)
    if async_save:
        h = AsyncCheckpoint(sess, path, spec["token"], max(o.get("blocked", 0.0) for o in outs))
        _PENDING.setdefault(sess, []).append(h)
        return h
    info = outs[0].get("info")
    if info is None:  # pragma: no cover - rank 0 always returns it
        raise CheckpointError(f"save of {path!r} returned no description from rank 0")
    return info
