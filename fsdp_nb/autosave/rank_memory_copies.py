"""Each rank's state in host memory, its own copy and one on a buddy rank
(``sess.autosave(..., in_memory=True)``).

The armed autosave (``rank_autosave.Armed``) takes, at the end of every step, the loaders'
positions and the random state, and at the iteration's boundary hands them to
:meth:`MemoryCopies.take` with the model and its optimizers. ``take``:

1. waits for the last copy to finish, if it has not (bounded: ``rank_copy_transfer.WAIT_S``
   a message);
2. takes the state tree (``get_state_dict``: the model's and optimizers' shards) and
   splits it (``formats.packed_state``): the small parts are copied now, the shards are
   staged by the copy thread into a flat host buffer (``rank_copy_transfer.stage``). The
   next optimizer step waits for that staging (:meth:`MemoryCopies.optimizer_stepping`)
   before it changes a shard;
3. the same thread then sends the copy to this rank's buddy and receives its ward's
   (``rank_copy_transfer.transfer``). Where the taking fails on this rank, or nothing can
   be copied yet (an optimizer that never stepped), a "no copy" header still goes out, so
   the buddy is never left waiting.

A rank keeps, beside the copy being taken, the newest of its own that it sent whole to
its buddy; and the newest two whole copies of its ward. A copy cut short by a death is
never the only one. :meth:`MemoryCopies.restore` rolls every rank back to one generation
that the notebook found whole for every rank (``autosave.memory_copies``): a rank with its
own copy uses it, a rank without (a new engine) receives it from the rank that holds it.

A copy thread the group's re-forming cut off (its peer died, or the group formed again
around it) may still be running: each thread carries the epoch it started in, and what
it finds is kept only while that epoch lasts.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

from ..checkpoints.rank_run_state import restore as restore_objects
from ..engine.checkpoint_group import copy_group, gathered, rank_and_world
from ..engine.gates import waited
from ..engine.registry import Part, World, part
from ..engine.step import StepListener, owner, taking_state
from ..formats.packed_state import Leaf, fill, leaf_bytes, split
from ..formats.run_state import decode, encode
from ..memory.rank_memory_kinds import copy_bytes, note_copies
from .rank_copy_transfer import Generation, host_buffer, stage, transfer
from .wire_autosave import HeldCopies

__all__ = ["KEPT", "MemoryCopies", "apply", "arm_copies", "copies", "held", "restore"]

log = logging.getLogger("fsdp_nb")

KEPT = 2
"""Generations kept of each rank's state, on its own rank and on its buddy."""
_SLACK = 64 << 20
"""Bytes a copy may hold beyond twice the estimate of a rank's state (its rest: the
loaders' and schedulers' states, the random state)."""


def _in_thread(fn: Any, *args: Any) -> Future:
    """Run ``fn(*args)`` in a daemon thread of its own: a copy stuck on a dead group never
    keeps the engine from exiting. Its future holds the outcome."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            done.set_exception(exc)

    threading.Thread(target=run, name="fsdp_nb-copies", daemon=True).start()
    return done


class MemoryCopies(Part, StepListener):
    """This rank's copies in memory (the registry's part) and the gate that holds an
    optimizer step until the latest copy of the shards is staged (a step listener, order
    35: after autosave, which hands it the copy, before the step view)."""

    order = 35

    def __init__(self) -> None:
        self.own: list[Generation] = []
        """This rank's generations, oldest first: the newest it sent whole, and the one
        being taken."""
        self.held: dict[int, list[Generation]] = {}
        """Ward rank -> its whole generations held here, oldest first."""
        self.buddy: int | None = None
        """The rank this rank's copies go to."""
        self.ward: int | None = None
        """The rank whose copies come here."""
        self.lock = threading.Lock()
        """Guards ``own`` and ``held`` between the training thread and the copy thread."""
        self.staged: Future | None = None
        """The latest copy's staging of the shards: an optimizer step waits for it."""
        self.exchange: Future | None = None
        """The latest copy's thread: staging, then the send and the receive."""
        self.epoch = 0
        """Formations of the group since this part was made: a copy thread's findings are
        kept only in the epoch it started in."""
        self.waited_s = 0.0
        """Seconds training waited here: for a copy to stage, or the last one to finish."""
        self.failed: str | None = None
        """Why the last copy did not complete, if it did not."""
        self.limit: int | None = None
        """The most bytes a ward's copy may announce (from the sizes the ranks agreed on
        when the autosave was armed)."""

    # -- the map --------------------------------------------------------------------

    def assign(self, buddies: tuple[int, ...]) -> None:
        """Take the buddy map (``buddies[r]`` keeps rank r's copies), once the copy in
        flight is over; forget what was held for a rank that is no longer this rank's ward."""
        self.wait_exchange()
        rank, _ = rank_and_world()
        self.buddy = buddies[rank]
        wards = [r for r, b in enumerate(buddies) if b == rank and r != rank]
        self.ward = wards[0] if wards else None
        with self.lock:
            self.held = {r: g for r, g in self.held.items() if r == self.ward}

    def forget(self, after: int | None = None) -> None:
        """Drop every generation (``after``: only those of a later step)."""
        self.wait_exchange()
        with self.lock:
            self.own = [g for g in self.own if after is not None and g.step <= after]
            self.held = {r: [g for g in gs if after is not None and g.step <= after] for r, gs in self.held.items()}
        self.tell_memory()

    def tell_memory(self) -> None:
        """Tell the memory readings what the copies hold now (main thread)."""
        note_copies(self.report().bytes)

    def report(self) -> HeldCopies:
        """What this rank holds, for the notebook to choose a generation."""
        with self.lock:
            return HeldCopies(own=tuple(g.step for g in self.own if g.sent),
                              held={r: tuple(g.step for g in gs) for r, gs in self.held.items() if gs},
                              bytes=sum(g.size() for g in self.own) + sum(g.size() for gs in self.held.values()
                                                                          for g in gs),
                              failed=self.failed)

    # -- the gate ---------------------------------------------------------------------

    def optimizer_stepping(self, optimizer: Any) -> None:
        """An optimizer is about to change its shards: first the latest copy's staging
        must have taken them."""
        self._wait(self.staged)

    def wait_exchange(self) -> None:
        """Block until the copy in flight is over (whole or failed)."""
        self._wait(self.exchange)

    def _wait(self, f: Future | None) -> None:
        self.waited_s += waited(f)

    # -- taking a copy -------------------------------------------------------------------

    def take(self, step: int, model: Any, optims: list[Any], extra: dict[str, Any] | BaseException) -> None:
        """Copy this rank's state at ``step``: ``model`` and ``optims`` (their shards staged
        by the copy thread), and ``extra`` (``{"state": {name: state_dict}, "rng": ...}``,
        taken by the caller; an exception: the caller's taking failed); then send it to the
        buddy and receive the ward's. A taking that fails is logged and sent as "no copy":
        training goes on."""
        self.wait_exchange()
        self.tell_memory()
        group = copy_group()  # made when the autosave was armed or the group formed: a lookup
        sending = self.buddy is not None and self.buddy != rank_and_world()[0]
        job: tuple[Any, ...] | None = None
        if isinstance(extra, BaseException):
            self.failed = f"the copy of step {step}: {type(extra).__name__}: {extra}"
            log.warning("autosave in memory: %s", self.failed)
        elif any(not o.state for o in optims):
            self.failed = f"step {step}: an optimizer has no state yet (it never stepped): nothing to copy"
            log.info("autosave in memory: %s", self.failed)  # expected before the first step: not a warning
        else:
            try:
                job = self._taken(step, model, optims, extra)
            except Exception as exc:  # noqa: BLE001 - this step is not copied; the buddy is told so
                self.failed = f"the copy of step {step}: {type(exc).__name__}: {exc}"
                log.warning("autosave in memory: %s", self.failed)
        staged: Future = Future()
        if job is None:
            staged.set_result(None)
        self.staged = staged
        self.exchange = _in_thread(self._copy, self.epoch, step, job, staged, group,
                                   self.buddy if sending else None, self.ward if sending else None)

    def _taken(self, step: int, model: Any, optims: list[Any], extra: dict[str, Any]) -> tuple[Any, ...]:
        """What the copy thread needs: the shards, where each goes, the buffer, the rest's
        body, the device and its event (None on CPU)."""
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict

        with taking_state():
            msd, osd = get_state_dict(model, optims)
        rest, tensors, leaves = split({"model": msd, "optim": osd}, staged=("optim",))  # its step counts too
        device = next((t.device for t in tensors if t.is_cuda), None)
        event = None
        if device is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        with self.lock:  # kept: the newest generation the buddy holds whole; another's buffer is reused
            keep = [g for g in self.own if g.sent][-1:]
            spare = [g for g in self.own if all(g is not k for k in keep)]
            self.own = keep
        flat = host_buffer(spare[0].flat if spare else None, leaf_bytes(leaves), device is not None)
        body = {**extra, "tree": rest, "leaves": [leaf.as_tuple() for leaf in leaves]}
        return tensors, leaves, flat, body, device, event

    def _copy(self, epoch: int, step: int, job: tuple[Any, ...] | None, staged: Future, group: Any,
              buddy: int | None, ward: int | None) -> None:
        """The copy thread: stage ``job`` (None: nothing to send), keep it, send it to
        ``buddy`` and receive ``ward``'s, keeping what came while ``epoch`` lasts."""
        gen = None
        try:
            if job is not None:
                tensors, leaves, flat, body, device, event = job
                try:
                    stage(tensors, leaves, flat, device, event)
                finally:
                    staged.set_result(None)  # failed or not: the step may go on, this copy is not kept
                gen = Generation(step, flat, encode(body), leaf_bytes(leaves), world=rank_and_world()[1])
                with self.lock:
                    if epoch == self.epoch:
                        self.own = [*self.own[-(KEPT - 1):], gen]
        except Exception as exc:  # noqa: BLE001 - the buddy still gets a "no copy" header below
            gen = None
            self._failed(epoch, f"the copy of step {step}: {type(exc).__name__}: {exc}")
        if buddy is None and ward is None:
            return
        got, failed = transfer(group, [(buddy, gen)] if buddy is not None else [], ward, expect=step,
                               spare=self._spare(epoch, ward), limit=self.limit)
        with self.lock:
            if got is not None and ward is not None and epoch == self.epoch:
                self.held[ward] = [*self.held.get(ward, [])[-(KEPT - 1):], got]
        if failed is not None:
            self._failed(epoch, f"the copy of step {step} between this rank and rank {buddy} / {ward}: "
                                f"{type(failed).__name__}: {failed}")
        elif gen is not None and epoch == self.epoch:
            self.failed = None

    def _failed(self, epoch: int, why: str) -> None:
        if epoch == self.epoch:
            self.failed = why
        log.warning("autosave in memory: %s", why)

    def _spare(self, epoch: int, ward: int | None) -> Any:
        """The buffer of the ward's oldest generation, taken out to receive the next into
        (None: a new one), when both generations are held; never for a thread of an epoch
        that ended (its generations belong to the new group, a restore may need them)."""
        with self.lock:
            gens = self.held.get(ward, []) if ward is not None and epoch == self.epoch else []
            if len(gens) >= KEPT:
                return gens.pop(0).flat
        return None

    # -- restoring -------------------------------------------------------------------

    def restore(self, step: int, sources: dict[int, int], model: Any, optims: list[Any],
                names: tuple[str, ...]) -> str:
        """Roll this rank back to generation ``step``: its own copy, or the one rank
        ``sources[rank]`` holds for it (sent here now; this rank sends what it holds for
        others in ``sources``). Then the model, its optimizers, ``names`` and the random
        state are set from it. Called on every rank at once; the ranks first agree that
        each holds what it must send or keep, so none waits for a copy that will not come,
        and again once each copy arrived and was checked against the live shards, so every
        rank writes or none does. Where it came from, in words."""
        self.wait_exchange()
        group = copy_group()
        rank, _ = rank_and_world()
        with self.lock:
            sends = [(ward, _find(self.held.get(ward, []), step)) for ward, holder in sources.items()
                     if holder == rank]
            mine = _find(self.own, step)
        lacking = [f"rank {rank} holds no copy of rank {w}'s step {step}" for w, g in sends if g is None]
        if rank not in sources and mine is None:
            lacking.append(f"rank {rank} holds no copy of its own step {step}")
        said = [line for lines in gathered(lacking) for line in lines]
        if said:
            raise RuntimeError(f"the restore of step {step} from memory cannot be done: {'; '.join(said)}")
        got, failed = transfer(group, [(w, g) for w, g in sends if g is not None], sources.get(rank), expect=step,
                               limit=_bound(copy_bytes(model, optims)))  # this rank's own state, rebuilt
        if got is not None:
            got.sent = True  # the rank that sent it holds it: its buddy
        gen = got if rank in sources else mine
        where = f"rank {rank}'s copy of step {step}"
        problem = None
        if failed is not None or gen is None:
            problem = f"the copy of step {step} did not arrive whole on rank {rank}: {failed}"
        else:
            try:
                _checked(gen, model, optims, where)
            except Exception as exc:  # noqa: BLE001 - every rank hears it, and none writes
                problem = f"{type(exc).__name__}: {exc}"
        said = [p for p in gathered(problem) if p]  # every rank writes, or none does
        if said:
            raise RuntimeError(f"the restore of step {step} from memory cannot be done, and no rank's state was "
                               f"changed: {'; '.join(said)}")
        assert gen is not None  # agreed above
        apply(gen, model, optims, names, where)
        with self.lock:  # the copies of later steps belong to a run that is gone
            self.own = [g for g in self.own if g.step < step and g is not gen][-(KEPT - 1):] + [gen]
            self.held = {r: [g for g in gs if g.step <= step] for r, gs in self.held.items()}
        owner().loaded({"step": step, "memory": True})
        self.tell_memory()
        return "its own copy" if got is None else f"rank {sources[rank]}'s copy"

    def loaded(self, extra: dict[str, Any] | None) -> None:
        """A load replaced the state: the copies are of another run (a restore from memory
        keeps its own, :meth:`restore`)."""
        if not (extra or {}).get("memory"):
            self.forget()

    # -- the lifecycle -------------------------------------------------------------------

    def reformed(self, world: World) -> None:
        """A new group: the copies of a world of this size stay (a restore needs them), those
        of another size go (a resize: their shards fit the old layout). A copy the old
        group was sending is abandoned: its thread fails on the old group's sockets, or
        times out, and what it finds is not kept (a new epoch)."""
        if self.exchange is not None and not self.exchange.done():
            log.warning("autosave in memory: the copy in flight was cut off by the new group; the last whole "
                        "generation stays")
        with self.lock:
            self.epoch += 1
            self.own = [g for g in self.own if g.world == world.size]
            self.held = {r: [g for g in gs if g.world == world.size] for r, gs in self.held.items()}
        self.exchange = self.staged = None

    def closed(self) -> None:
        self.reformed(World(0, 1))
        with self.lock:
            self.own, self.held = [], {}


def _find(gens: list[Generation], step: int) -> Generation | None:
    return next((g for g in gens if g.step == step), None)


def _checked(gen: Generation, model: Any, optims: list[Any], where: str) -> tuple[dict[str, Any], list[Leaf], Any]:
    """``gen``'s rest (read weights-only), its leaves, and the live state tree, once every
    shard was checked against the live ones (a ValueError naming the first that does not
    fit); nothing is written."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    body = decode(gen.rest, "memory", where)
    leaves = [Leaf.parse(leaf) for leaf in body["leaves"]]
    with taking_state():
        msd, osd = get_state_dict(model, optims)
    live = {"model": msd, "optim": osd}
    fill(live, body["tree"], gen.flat, leaves, where, write=False)
    return body, leaves, live


def apply(gen: Generation, model: Any, optims: list[Any], names: tuple[str, ...], where: str) -> None:
    """Set ``model``, ``optims``, the engine globals ``names`` and the random state from
    ``gen``; its rest is read weights-only, and every shard is checked against the live
    ones before any is written, so a copy that does not fit changes nothing."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    body, leaves, live = _checked(gen, model, optims, where)
    with taking_state():
        tree = fill(live, body["tree"], gen.flat, leaves, where)
        set_state_dict(model, optims, model_state_dict=tree["model"], optim_state_dict=tree["optim"])
    restore_objects(body.get("state", {}), names, body.get("rng"))


def _bound(state_bytes: int) -> int:
    """The most bytes a copy of a rank whose state is ``state_bytes`` may announce."""
    return 2 * state_bytes + _SLACK


def arm_copies(buddies: tuple[int, ...], start_step: int, largest: int) -> None:
    """Copy into memory from now on, with ``buddies`` as the buddy map; generations of a
    step after ``start_step`` (a count that went back: a restart's restore, a new
    autosave) are dropped, the copy group is made (every rank arms at once), and the gate
    hears every optimizer step. ``largest``: the largest rank's state as the ranks agreed
    on it (``copy_bytes``), which bounds what a ward's copy may announce."""
    c = copies()
    c.assign(buddies)
    c.limit = _bound(largest)
    c.forget(after=start_step)
    copy_group()
    owner().listen(c)


def copies() -> MemoryCopies:
    """This rank's copies in memory (the registry's part)."""
    return part(MemoryCopies)


def held() -> HeldCopies:
    """What this rank holds (``MemoryCopies.report``)."""
    return copies().report()


def restore(step: int, sources: dict[int, int], model: str, optimizers: tuple[str, ...],
            names: tuple[str, ...]) -> str:
    """Roll this rank back to generation ``step`` (``MemoryCopies.restore``), into the
    engine globals ``model``, ``optimizers`` and ``names``."""
    from ..checkpoints.rank_save import named_objects

    m = named_objects(model, None)[0]
    optims = [named_objects(model, o)[1] for o in optimizers]
    return copies().restore(step, sources, m, optims, names)
