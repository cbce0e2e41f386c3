"""Saving the run from the ranks themselves, every N optimizer steps (``sess.autosave``).

A hook on the optimizer's ``step`` counts steps on every rank; they count alike, as every
rank steps in the same cell. After every N-th step the save is due. What the loop draws
before the next forward is taken right then, after the N-th step: each rank's random
state, and the state of each named object that is iterable (a ``StatefulDataLoader``, a
sampler; the loop takes the next batch before that forward). The rest is taken at the
next forward of the model (a forward pre-hook that runs before FSDP2's own, while the
parameters are still sharded): the iteration boundary, where the scheduler has stepped
and the scaler has updated. A run resumed from it goes on bit for bit.

Each save is an async save of ``checkpoint_save`` (``<root>/step-<N>``, ``keep_last``):
training waits for the copy, and first for the previous save's write when it has not
finished (``begin`` drains it). A failed save is logged on the rank and kept for
:func:`status`; training goes on.
"""

from __future__ import annotations

import copy
import logging
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..checkpoints import rank_async_saves as async_saves
from ..checkpoints.rank_async_saves import async_wait
from ..checkpoints.rank_run_state import capture, check_objects, per_rank, rng_state
from ..checkpoints.rank_save import named_objects, save
from ..checkpoints.wire_checkpoint import Outcome, SaveSpec
from ..engine.checkpoint_group import agree, rank_and_world
from ..engine.namespace import user_ns
from ..engine.step import StepListener, owner, training_step
from ..errors import UnsafeCheckpointError
from ..formats.metadata import base_metadata
from ..formats.run_state import RNG, decode, encode, run_meta, state_file
from .wire_autosave import AutosaveSpec, AutosaveState

__all__ = ["arm", "armed_spec", "disarm", "status"]

log = logging.getLogger("fsdp_nb")


@dataclass(eq=False)
class _Armed(StepListener):
    spec: AutosaveSpec
    step: int
    handles: list[Any] = field(default_factory=list)
    due: bool = False
    early: dict[str, Any] = field(default_factory=dict)
    """State of the iterable named objects, taken just after the step that made a save due."""
    saved: str | None = None
    token: str | None = None
    failed: str | None = None
    blocked_s: float = 0.0
    """Seconds training waited in this rank's autosave hooks (the save's call and the
    staging copy the next step waits for are what ``waited`` adds)."""
    waited_before: float = 0.0
    branch: int = 0
    """Loads since arming: a save after one gets a temporary folder of its own, never the one
    an abandoned save of the same step number left (every rank loads alike, so they agree)."""

    def loaded(self, extra: dict[str, Any] | None) -> None:
        """A load changed this rank's model and optimizer (``loaded``)."""
        loaded(extra)


_ARMED: _Armed | None = None


def _outside_graphs(hook: Callable[..., None]) -> Callable[..., None]:
    """``hook`` run eagerly even inside a compiled module's call (``compile=True`` with no
    unit compiles the whole model, its hooks included): a save is no graph."""
    import torch

    return torch.compiler.disable(hook)


def arm(spec: AutosaveSpec) -> Outcome:
    """Count ``spec.optimizer``'s steps on this rank and save after every ``spec.every``-th
    (replacing an earlier autosave). Every rank checks the names, then the ranks agree:
    all arm, or none does and each keeps what it had (the same failed outcome on each)."""
    global _ARMED
    async_saves.drain()  # an earlier autosave's collectives end before the agreement's
    mine = None
    try:
        model, optim = named_objects(spec.model, spec.optimizer)
        check_objects(spec.state)
        # a state_dict a load would refuse would fail every save: refused now, by name. Not a
        # loader's: a StatefulDataLoader's state_dict() can start an iterator, which moves it
        ns = user_ns()
        plain = [n for n in spec.state if not per_rank(ns[n])]
        decode(encode(capture(plain, False, None)), spec.root, state_file(rank_and_world()[0]))
    except (NameError, TypeError, UnsafeCheckpointError) as exc:
        mine = Outcome.failed(exc)
    bad = agree(mine)
    if bad is not None:
        return bad
    disarm()
    armed = _Armed(spec, spec.start_step, waited_before=async_saves.waited_s)
    # the hooks run outside a compiled forward (compile=True): a save is no graph
    armed.handles = [
        optim.register_step_post_hook(_outside_graphs(lambda *_: _stepped(armed))),
        model.register_forward_pre_hook(_outside_graphs(lambda *_: _boundary(armed)), prepend=True),
    ]
    # the staging gate on the model's forward is there before the first save, which starts
    # inside a forward whose hooks are already chosen (a buffer must not change mid-copy)
    async_saves.gate(model if any(True for _ in model.buffers()) else None, optim)
    _ARMED = armed
    owner().listen(armed)
    return Outcome()


def loaded(extra: dict[str, Any] | None) -> None:
    """A load changed this rank's model and optimizer: a save that was due would keep the
    loaded state under the old step, so it is dropped, and the count goes on from the
    loaded checkpoint's step (``extra["step"]``) where it has one."""
    a = _ARMED
    if a is None:
        return
    a.due, a.early = False, {}
    a.branch += 1
    step = (extra or {}).get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        a.step = step


def disarm() -> int | None:
    """Stop saving on this rank; the step count it had reached (None: none was armed)."""
    global _ARMED
    armed, _ARMED = _ARMED, None
    if armed is None:
        return None
    owner().unlisten(armed)
    for h in armed.handles:
        h.remove()
    if armed.due:  # step N ran, and the forward that would have saved it never came
        log.warning("autosave stopped with the save of step %d due and not written (it is written at the next "
                    "forward); the last one written is %s", armed.step, armed.saved or "none")
    return armed.step


def armed_spec() -> AutosaveSpec | None:
    """The autosave armed on this rank, counting on from where it is (None: none is): what
    a kernel that attaches to these engines takes back as its session's autosave."""
    import dataclasses

    a = _ARMED
    return None if a is None else dataclasses.replace(a.spec, start_step=a.step)


def status() -> AutosaveState | None:
    """Where this rank's autosave is (None: none is armed)."""
    a = _ARMED
    if a is None:
        return None
    return AutosaveState(step=a.step, saved=a.saved, failed=a.failed,
                         blocked_s=a.blocked_s + async_saves.waited_s - a.waited_before)


def _stepped(armed: _Armed) -> None:
    if not training_step():  # a save's or load's own step (an optimizer without state)
        return
    armed.step += 1
    if armed.step % armed.spec.every == 0:
        armed.due = True
        # what the loop draws next (the next batch, random draws before the forward) must
        # come again on a resume: the loaders' positions and the random state, taken now.
        # A failure is kept for the save, whose ranks agree on it
        ns = user_ns()
        try:
            armed.early = {n: copy.deepcopy(ns[n].state_dict()) for n in armed.spec.state if per_rank(ns[n])}
            armed.early[RNG] = rng_state()
        except Exception as exc:  # noqa: BLE001 - reported by the save at the boundary, agreed by every rank
            armed.early = {RNG: exc}


def _boundary(armed: _Armed) -> None:
    if not armed.due:
        return
    armed.due = False
    t0 = time.perf_counter()
    try:
        _save(armed)
    finally:
        armed.blocked_s += time.perf_counter() - t0


def _save(armed: _Armed) -> None:
    spec = armed.spec
    if armed.token is not None:  # the last save's outcome, before the next one starts
        out = async_wait(armed.token)
        if not out.ok:
            armed.failed = out.message
            log.warning("autosave: %s", out.message)
    url = posixpath.join(spec.root.rstrip("/"), f"step-{armed.step}")
    meta = {**base_metadata({"step": armed.step}, "sharded"), **spec.meta, **run_meta(spec.state)}
    save_spec = SaveSpec(
        url=url, storage_options=spec.storage_options, model=spec.model, optimizer=spec.optimizer,
        state=spec.state, rng=True, sharded=True, async_save=True, keep_last=spec.keep_last,
        token=f"{spec.run}b{armed.branch}s{armed.step}", meta=meta, check_exists=False, layout="fsdp_nb",
    )
    out = save(save_spec, taken=armed.early)
    armed.early = {}
    if out.ok:
        armed.saved, armed.token = url, save_spec.token
    else:
        armed.failed, armed.token = out.message, None
        log.warning("autosave at step %d: %s", armed.step, out.message)
