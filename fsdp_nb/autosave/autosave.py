"""``sess.autosave``: the ranks save the run themselves, every N optimizer steps.

Checked here before any rank is asked; then every rank arms its hooks
(``fsdp_nb.autosave.rank_autosave``) and the spec is kept on the session context, so that
``restart`` re-arms it on the rebuilt objects, going on from the restored step, and
``restart(restore="latest")`` knows where to look (:func:`latest`).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..checkpoints.arguments import check_optimizer, check_state, model_name, raise_outcomes
from ..checkpoints.async_saves import wait_pending
from ..errors import CheckpointError
from ..formats.listing import list_checkpoints
from ..formats.metadata import base_metadata
from ..formats.storage import options_for, url_to_fs
from .wire_autosave import AutosaveSpec, AutosaveState

if TYPE_CHECKING:
    from ..context import SessionContext

__all__ = ["Autosaving", "arm", "autosave", "describe", "latest", "stop"]

log = logging.getLogger("fsdp_nb")


@dataclass(frozen=True)
class Autosaving:
    """What ``sess.autosave`` set going (its repr says it in one line)."""

    root: str
    """The folder of ``step-<N>`` checkpoints."""
    every: int
    """Optimizer steps between saves."""
    model: str
    """The model saved."""
    optimizer: str
    """Its optimizer, whose steps are counted."""
    state: tuple[str, ...]
    """Engine globals kept per rank with each rank's random state."""
    keep_last: int | None
    """How many checkpoints are kept under ``root`` (None: all)."""
    ranks: tuple[AutosaveState | None, ...] = ()
    """Each rank's step count and last save when asked (``sess.autosave()``), by rank;
    None for a rank whose engine is dead."""

    def __repr__(self) -> str:
        kept = f", keeping the last {self.keep_last}" if self.keep_last else ""
        named = ", ".join([self.model, self.optimizer, *self.state, "each rank's random state"])
        where = ""
        if self.ranks and self.ranks[0] is not None:
            r0 = self.ranks[0]
            where = f"; at step {r0.step}, last save {r0.saved or 'none yet'}"
            failed = [r.failed for r in self.ranks if r is not None and r.failed]
            if failed:
                where += f"; a save FAILED: {failed[0]}"
        return f"<autosave of {named} to {self.root} every {self.every} optimizer steps{kept}{where}>"


def _positive(name: str, value: Any, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if none_ok else ''}, got {value!r}")


def autosave(ctx: SessionContext, root: str, *, every: int, model: Any, optimizer: str,
             state: list[str] | tuple[str, ...] | None = None, keep_last: int | None = None) -> Autosaving:
    """Arm the ranks to save ``model``, ``optimizer`` and ``state`` under ``root`` after
    every ``every``-th optimizer step (``Session.autosave``); each argument is checked
    before any rank is asked, and each rank checks the names before any hook is set."""
    if not isinstance(root, str) or not root:
        raise TypeError(f"root must be a folder path or fsspec URL (str), got {root!r}")
    _positive("every", every)
    _positive("keep_last", keep_last, none_ok=True)
    name = model_name(model)
    optim = check_optimizer(optimizer)
    if optim is None:
        raise TypeError("autosave counts the optimizer's steps: pass optimizer='<its engine global name>'")
    names = check_state(state)
    url_to_fs(root)
    wait_pending(ctx)
    meta = {k: v for k, v in base_metadata({}, "sharded").items() if k in ("format", "kind", "versions")}
    spec = AutosaveSpec(root=root, storage_options=options_for(root), every=every, model=name, optimizer=optim,
                        state=names, keep_last=keep_last, run=uuid.uuid4().hex[:8], meta=meta)
    arm(ctx, spec)
    return Autosaving(root, every, name, optim, names, keep_last)


def arm(ctx: SessionContext, spec: AutosaveSpec) -> None:
    """Arm ``spec`` on every rank (each checks its names first), and keep it on ``ctx``."""
    from . import rank_autosave as engine_autosave

    d = ctx.dispatcher
    raise_outcomes(d.gather(d.apply("arm autosave", engine_autosave.arm, args=(spec,))))
    ctx.autosave = ctx.last_autosave = spec


def stop(ctx: SessionContext) -> None:
    """Disarm every rank's autosave (its saves still being written finish)."""
    from . import rank_autosave as engine_autosave

    d = ctx.dispatcher
    d.gather(d.apply("stop autosave", engine_autosave.disarm))
    ctx.autosave = None


def describe(ctx: SessionContext) -> Autosaving | None:
    """The session's autosave with each rank's step count and last save (None: off)."""
    from . import rank_autosave as engine_autosave

    spec = ctx.autosave
    if spec is None:
        return None
    d = ctx.dispatcher
    dead = set(ctx.cluster.dead_ranks())  # a degraded session: what the live ranks say
    live = [r for r in range(ctx.world_size) if r not in dead]
    said = dict(zip(live, d.gather(d.apply("autosave status", engine_autosave.status, ranks=live))))
    ranks = tuple(said.get(r) for r in range(ctx.world_size))
    return Autosaving(spec.root, spec.every, spec.model, spec.optimizer, spec.state, spec.keep_last, ranks)


def latest(ctx: SessionContext) -> str:
    """The newest valid checkpoint under the autosave's root (``restart(restore="latest")``),
    the running one's or the last one's (a restart that rebuilt the models stops it);
    CheckpointError saying why there is none."""
    spec = ctx.autosave or ctx.last_autosave  # a stopped autosave's checkpoints are still there
    if spec is None:
        raise CheckpointError(
            "restore='latest' means the newest checkpoint sess.autosave(...) wrote, but this session has had no "
            "autosave; pass the path of a checkpoint instead"
        )
    found = [i for i in list_checkpoints(spec.root, storage_options=spec.storage_options) if i.valid]
    if not found:
        raise CheckpointError(f"restore='latest': no complete checkpoint under {spec.root!r} yet")
    # the newest written, not the highest step: after a run went back to an earlier step,
    # the steps it abandoned are older than what it saved since
    return max(found, key=lambda i: i.created or 0.0).path
