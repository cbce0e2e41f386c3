"""Saving the run from the ranks themselves, every N optimizer steps (``sess.autosave``).

The rank's step owner (``fsdp_nb.engine.step``) tells the armed autosave (:class:`Armed`,
a listener of order 30) where the loop is. An iteration in which one of the autosave's
optimizers stepped is counted; the ranks count alike. After every N-th the save is due,
taken in two parts: at the step's end (before the loop draws its next batch) each rank's
random state and each loader's position (``loaders=``, and a torch ``DataLoader`` or
``Sampler`` named in ``state=``), so a resume draws that batch again; at the iteration's
boundary (the next training or eval forward, the scheduler and scaler stepped) the model,
its optimizers and the other ``state=`` objects, and the save is written. With
``in_memory`` every step is taken so, into memory (``rank_memory_copies``).

A cell's end is a boundary too, but a rank cannot know in its own post-execute hook that
every other rank's cell succeeded. So the notebook, after a user call, asks every rank
(:func:`finish_cell`) whether a save or copy is due, and has every rank take it
(:func:`write_due`) where all have it at one step; after a failed call each drops it.

Each save is an async save (``<root>/step-<N>``, ``keep_last``), a job of the autosave's
own (``rank_async_saves``): training waits for its copy, and first for the previous
save's write. A failed save is logged and kept for :func:`status`; training goes on.
When the group forms again the ranks agree on the count and on a save due
(:meth:`Autosave.reformed`), so no rank is left alone in a save's collectives.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..checkpoints import rank_async_saves as async_saves
from ..checkpoints.rank_run_state import capture, rng_state
from ..checkpoints.rank_save import save
from ..checkpoints.wire_checkpoint import Outcome, SaveSpec
from ..engine.checkpoint_group import agree, copy_group, gathered
from ..engine.namespace import user_ns
from ..engine.registry import Part, World, part
from ..engine.step import StepListener, owner
from ..errors import UnsafeCheckpointError
from ..formats.metadata import base_metadata
from ..formats.run_state import RNG, run_meta
from .rank_autosave_checks import agreed, checked, copies_refusal
from .rank_memory_copies import arm_copies, copies
from .wire_autosave import AutosaveSpec, AutosaveState

__all__ = [
    "Armed", "Autosave", "agreed", "arm", "armed_spec", "copy_now", "disarm", "drop_due", "finish_cell", "status",
    "write_due",
]

log = logging.getLogger("fsdp_nb")


@dataclass(eq=False)
class Armed(StepListener):
    """An autosave armed on this rank: what it counts, what it took, what it wrote."""

    order: ClassVar[int] = 30
    spec: AutosaveSpec
    loaders: tuple[str, ...]
    """Engine globals taken at the step's end: ``spec.loaders`` and each torch loader or
    sampler ``spec.state`` names."""
    state: tuple[str, ...]
    """The other ``spec.state`` objects, taken at the boundary."""
    step: int
    due: bool = False
    counted: int = -1
    """The owner's iteration last counted (one count per iteration, however many of the
    autosave's optimizers step in it)."""
    early: dict[str, Any] = field(default_factory=dict)
    """The loaders' states and the random state, taken at the end of the step that made a
    save due (an exception there: the taking failed, reported by the save)."""
    saved: str | None = None
    """The last save committed."""
    writing: str | None = None
    """The save in flight (its job not collected yet)."""
    token: str | None = None
    """That save's job."""
    failed: str | None = None
    blocked_s: float = 0.0
    """Seconds training waited in this rank's autosave (the save's call; the staging
    copy the next step waits for is what ``waited`` adds)."""
    waited_before: float = 0.0
    """The async saves' wait count when this autosave was armed (``AsyncSaves.waited_s``)."""
    copies_waited_before: float = 0.0
    """The copies' wait count when it was armed (``MemoryCopies.waited_s``)."""
    branch: int = 0
    """Loads since arming: a save after one gets a temporary folder of its own, never the one
    an abandoned save of the same step number left (every rank loads alike, so they agree)."""
    copy_early: dict[str, Any] | None = None
    """With ``spec.in_memory``: the loaders' states and the random state taken at the end of
    the last step, for the copy in memory its boundary takes (None: no copy pending)."""

    # -- what the step owner tells -----------------------------------------------------

    def step_ended(self, step: int, optimizer: Any) -> None:
        self._stepped(step, optimizer)

    def step_joined(self, step: int, optimizer: Any) -> None:
        self._stepped(step, optimizer)

    def boundary(self, step: int, at: str) -> None:
        if at != "cell end":  # a cell's end: the notebook calls finish_cell once every rank's cell ended well
            self.write_due()
            self.copy_due()

    def cell_started(self) -> None:
        # a save still due from an earlier cell: the notebook did not find every rank had it
        # due at the cell's end (or could not ask): no rank writes it on its own
        self.drop("it fell due at the end of an earlier call, and the ranks did not all agree to write it")

    def eval_forward(self, module: Any) -> None:
        self.write_due()
        self.copy_due()

    def cell_ended(self, failed: bool) -> None:
        if failed:
            self.drop("the cell failed on this rank")

    def loaded(self, extra: dict[str, Any] | None) -> None:
        """A load changed this rank's model and optimizer: a save that was due would keep
        the loaded state under the old step, so it is dropped, and the count goes on from
        the loaded checkpoint's step (``extra["step"]``). ``sess.load`` refuses, in the
        notebook, a checkpoint without one while an autosave is armed."""
        self.due, self.early, self.copy_early = False, {}, None
        self.branch += 1
        step = (extra or {}).get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            self.step = step
        else:
            log.warning("autosave: the checkpoint loaded keeps no step (extra['step']); the count stays at %d",
                        self.step)

    # -- counting and saving ---------------------------------------------------------

    def _stepped(self, step: int, optimizer: Any) -> None:
        if step == self.counted or not self._mine(optimizer):
            return
        self.counted = step
        self.step += 1
        due = self.spec.root is not None and not self.step % self.spec.every
        if not (due or self.spec.in_memory):
            return
        self.due = due
        # what the loop draws next (the next batch, random draws before the forward) must
        # come again on a resume: the loaders' positions and the random state, taken now
        early = self.early_state()
        if due:
            self.early = early
        if self.spec.in_memory:
            self.copy_early = early

    def _mine(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` ends an iteration for this autosave: the last of its
        optimizers, as the loop steps them (``optimizer=`` lists them in that order). With
        one optimizer, or several that step together (no training forward between them),
        that is every iteration; in a loop that steps one, runs a forward, then steps the
        next (a GAN's discriminator, then its generator), a save never falls between them."""
        return user_ns().get(self.spec.optimizers[-1]) is optimizer

    def drop(self, why: str) -> None:
        """Drop a save that is due and a copy pending, saying why (every rank drops them alike)."""
        if self.due:
            log.warning("autosave: the save of step %d is dropped, not written: %s; the last save written is %s",
                        self.step, why, self.saved or "none")
        self.due, self.early, self.copy_early = False, {}, None

    def early_state(self) -> dict[str, Any]:
        """The loaders' states and the random state now; a failure is kept in it, for the
        save (whose ranks agree on it) or the copy (which sends "no copy") to report."""
        ns = user_ns()
        try:
            return {**{n: copy.deepcopy(ns[n].state_dict()) for n in self.loaders}, RNG: rng_state()}
        except Exception as exc:  # noqa: BLE001 - reported where the state is used, as said
            return {RNG: exc}

    def copy_whole(self) -> None:
        """Take the pending copy and wait until the buddy holds it (a cell's end, a resize)."""
        self.copy_due()
        copies().wait_exchange()
        copies().tell_memory()

    def copy_due(self) -> None:
        """Copy the state of the step that ended into memory, this rank's and its buddy's
        (``rank_memory_copies``), if a copy is pending (at an iteration boundary)."""
        if self.copy_early is None:
            return
        early, self.copy_early = self.copy_early, None
        t0, waited = time.perf_counter(), copies().waited_s
        try:
            ns = user_ns()
            try:
                taken: dict[str, Any] | BaseException = capture((*self.loaders, *self.state), True, early)
            except Exception as exc:  # noqa: BLE001 - this step is not copied, and the buddy is told so
                taken = exc
            model = ns[self.spec.model]
            copies().take(self.step, model, [ns[o] for o in self.spec.optimizers], taken)
        finally:  # the wait for the last copy inside is the copies' own count (state_now adds it)
            self.blocked_s += time.perf_counter() - t0 - (copies().waited_s - waited)

    def write_due(self) -> None:
        """Write the save that is due, if one is (at an iteration boundary)."""
        if not self.due:
            return
        self.due = False
        t0 = time.perf_counter()
        try:
            self._save()
        finally:
            self.blocked_s += time.perf_counter() - t0

    def collect(self, wait: bool) -> None:
        """The outcome of the save in flight, once done (``wait``: block until it is)."""
        if self.token is None or not (wait or async_saves.async_done(self.token)):
            return
        out = async_saves.async_wait(self.token)
        if out.ok:
            self.saved = self.writing
        else:
            self.failed = out.message
            log.warning("autosave: %s", out.message)
        self.writing = self.token = None

    def _save(self) -> None:
        spec = self.spec
        self.collect(wait=True)  # the last save's outcome, before the next one starts
        url = posixpath.join((spec.root or "").rstrip("/"), f"step-{self.step}")
        kept = (*self.loaders, *self.state)
        meta = {**base_metadata({"step": self.step}, "sharded"), **spec.meta, **run_meta(kept)}
        save_spec = SaveSpec(
            url=url, storage_options=spec.storage_options, model=spec.model, optimizer=spec.optimizers[0],
            optimizers=spec.optimizers if len(spec.optimizers) > 1 else (), state=kept, rng=True, sharded=True,
            async_save=True, keep_last=spec.keep_last, token=f"{spec.run}b{self.branch}s{self.step}", meta=meta,
            check_exists=False, layout="fsdp_nb",
        )
        out = save(save_spec, taken=self.early)
        self.early = {}
        if out.ok:
            self.writing, self.token = url, save_spec.token
        else:
            self.failed = out.message
            log.warning("autosave at step %d: %s", self.step, out.message)

    def state_now(self) -> AutosaveState:
        """Where it is: the count, the last committed save, the one in flight."""
        self.collect(wait=False)
        waited = part(async_saves.AsyncSaves).waited_s - self.waited_before
        if self.spec.in_memory:
            waited += copies().waited_s - self.copies_waited_before
        return AutosaveState(step=self.step, saved=self.saved, writing=self.writing, failed=self.failed,
                             blocked_s=self.blocked_s + waited, due=self.due,
                             copies=copies().report() if self.spec.in_memory else None)


class Autosave(Part):
    """This rank's autosave, when one is armed (the registry's part). Its lifecycle runs
    after the checkpoint group's (order 60), whose group it agrees over."""

    order = 60

    def __init__(self) -> None:
        self.armed: Armed | None = None

    def arm(self, armed: Armed) -> None:
        """Arm ``armed`` in place of an earlier autosave."""
        self.disarm()
        self.armed = armed
        owner().listen(armed)

    def disarm(self) -> Armed | None:
        """Stop the armed autosave (None: none was); its save in flight still finishes."""
        armed, self.armed = self.armed, None
        if armed is None:
            return None
        owner().unlisten(armed)
        armed.collect(wait=False)
        if armed.token is not None:  # still writing: nobody will collect it now
            async_saves.orphan(armed.token)
        armed.drop("the autosave stopped")
        if armed.spec.in_memory:
            owner().unlisten(copies())
        return armed

    def reformed(self, world: World) -> None:
        """The group formed again: the ranks agree on the autosave (over the checkpoint
        group, so none is left alone in a later save's collectives; :func:`agreed`)."""
        a = self.armed
        held = gathered(None if a is None else (a.spec.run, a.step, a.due, a.branch))
        if a is None:
            return
        a.collect(wait=False)  # a save of the old group: collected if it ended; if not, abandoned below
        if a.token is not None and async_saves.abandoned(a.token):
            a.failed = f"the save of {a.writing} was cut off when the group formed again"
            log.warning("autosave: %s", a.failed)
            a.writing = a.token = None
        same, step, due, branch = agreed(held)
        if not same:
            log.warning("autosave: the ranks hold different autosaves after the group formed again: stopped on "
                        "every rank (a restart arms the session's autosave again)")
            self.disarm()
            return
        if step != a.step:
            log.warning("autosave: the ranks had counted %s steps when the group formed again (a failure cut a step "
                        "short on some): counting on from %d on every rank", sorted({h[1] for h in held}), step)
        if not due:
            a.drop("the group formed again and not every rank had it due at the same step")
        a.copy_early = None  # a copy pairs with the buddy's: none is taken at a boundary the ranks did not agree on
        if a.spec.in_memory:
            copy_group()  # the new world's, made by every rank here, not in a later forward
        a.step, a.branch = step, branch

    def closed(self) -> None:
        self.disarm()


def _autosave() -> Autosave:
    return part(Autosave)


def arm(spec: AutosaveSpec) -> Outcome:
    """Count the iterations in which ``spec.optimizers`` step on this rank and save after
    every ``spec.every``-th (replacing an earlier autosave). Every rank checks the names
    (and refuses an object it cannot place, by name), then the ranks agree: all arm, or
    none does and each keeps what it had (the same failed outcome on each)."""
    async_saves.drain()  # an earlier autosave's collectives end before the agreement's
    mine: Outcome | None = None
    model: Any = None
    optims: list[Any] = []
    loaders: tuple[str, ...] = ()
    try:
        model, optims, loaders = checked(spec)
    except (NameError, TypeError, ValueError, UnsafeCheckpointError) as exc:
        mine = Outcome.failed(exc)
    largest = 0
    if spec.in_memory:  # a collective: every rank, whatever it found above
        room, largest = copies_refusal(spec, model, optims)
        mine = mine or (Outcome.failed(room) if room else None)
    bad = agree(mine)
    if bad is not None:
        return bad
    saves = part(async_saves.AsyncSaves)
    owner().listen(saves)  # the staging gate hears every step from the first save on
    owner().watch(model)  # its forwards are the iteration's boundary
    _autosave().arm(Armed(spec, loaders, tuple(n for n in spec.state if n not in loaders), spec.start_step,
                          waited_before=saves.waited_s, copies_waited_before=copies().waited_s))
    if spec.in_memory:
        arm_copies(spec.buddies, spec.start_step, largest)
    else:
        copies().forget()
    return Outcome()


def disarm(forget: bool = False) -> int | None:
    """Stop saving on this rank; the step count it had reached (None: none was armed).
    ``forget``: also free the copies in memory (``sess.stop_autosave``; a suspended
    autosave keeps them for the next restore)."""
    armed = _autosave().disarm()
    if forget:
        copies().forget()
    return None if armed is None else armed.step


def finish_cell(ok: bool) -> tuple[int, bool, bool] | None:
    """A user call ended on every rank, ``ok``: it succeeded on each (called by the
    notebook on every rank at once). After a failed call a save that is due is dropped.
    Returns (this rank's count, whether a save is due here, whether a copy in memory is
    pending here; None: no autosave armed). No
    collective: a save still writing in the background runs its own on the checkpoint
    group, and gloo pairs collectives by the order they are issued in. The notebook then
    calls :func:`write_due` on every rank where every rank had it due at one step, else
    :func:`drop_due`, and :func:`count_from` where the counts differ (a failure on one
    rank inside an optimizer's step, with no collective after it, leaves them apart)."""
    a = _autosave().armed
    if a is None:
        return None
    if not ok:
        a.drop("the cell failed on some rank")
    return a.step, a.due, a.copy_early is not None


def count_from(step: int) -> None:
    """Count on from ``step`` on this rank (the ranks' counts differed after a call: the
    notebook gives every rank the highest), with no save due."""
    a = _autosave().armed
    if a is not None:
        if a.step != step:
            log.warning("autosave: this rank had counted %d steps and another more: counting on from %d",
                        a.step, step)
        a.drop("the ranks' counts differed")
        a.step = step


def write_due(step: int, save: bool = True, copy: bool = False) -> None:
    """At the cell's end, the iteration's boundary: write the save due at ``step``
    (``save``) and take the copy in memory pending there (``copy``), where every rank
    has them at that step, the notebook found. The copy is waited for, so the state
    after a cell's last step is held by the buddy when the cell returns."""
    a = _autosave().armed
    if a is None or a.step != step:
        return
    if save and a.due:
        a.write_due()
    if copy and a.copy_early is not None:
        a.copy_whole()


def copy_now() -> None:
    """Copy this rank's state into memory now, at the step it has counted, and wait until
    its buddy holds it (between cells: after a resize, the new world's first copies)."""
    a = _autosave().armed
    if a is None or not a.spec.in_memory:
        return
    a.copy_early = a.early_state()
    a.copy_whole()


def drop_due(why: str) -> None:
    """Drop a save that is due and a pending copy, saying ``why`` (the ranks did not all
    have them due)."""
    a = _autosave().armed
    if a is not None:
        a.drop(why)


def armed_spec() -> AutosaveSpec | None:
    """The autosave armed on this rank, counting on from where it is (None: none is): what
    a kernel that attaches to these engines takes back as its session's autosave."""
    a = _autosave().armed
    return None if a is None else dataclasses.replace(a.spec, start_step=a.step)


def status() -> AutosaveState | None:
    """Where this rank's autosave is (None: none is armed)."""
    a = _autosave().armed
    return None if a is None else a.state_now()
