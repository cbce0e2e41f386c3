"""Each rank's state in host memory, its own copy and one on a buddy rank
(``sess.autosave(..., in_memory=True)``).

The armed autosave (``rank_autosave.Armed``) takes, at the end of every step, the loaders'
positions and the random state, and at the iteration's boundary hands them to
:meth:`MemoryCopies.take` with the model and its optimizers. ``take``:

1. waits for the last copy to finish, if it has not (the only wait training has, besides
   the one below);
2. takes the state tree (``get_state_dict``: the model's and optimizers' shards) and the
   ``state=`` objects, splitting it (``formats.packed_state``): the small parts are copied
   now, the shards are staged by the copy thread into a flat host buffer (pinned, through
   a stream of its own, on a GPU). The next optimizer step waits for that staging
   (:meth:`optimizer_stepping`) before it changes a shard;
3. the same thread then sends the copy to this rank's buddy and receives its ward's, on the
   copy group (``engine.checkpoint_group.copy_group``), one message each for the header,
   the shards and the rest.

Two generations are kept of this rank's own state and of its ward's: a copy cut short by
a death is never the only one. A rank keeps, beside the copy being taken, the newest of
its own that its buddy holds whole (``Generation.sent``), however many copies failed
since; a ward's copy is kept once all of it arrived.
:meth:`MemoryCopies.restore` rolls every rank back to one generation that the notebook
found complete for every rank (``autosave.memory_copies``): a rank with its own copy uses
it, a rank without (a new engine) receives it from the rank that holds it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from ..checkpoints.rank_run_state import restore as restore_objects
from ..engine.checkpoint_group import copy_group, rank_and_world
from ..engine.registry import Part, World, part
from ..engine.step import StepListener, owner, taking_state
from ..formats.packed_state import Leaf, fill, leaf_bytes, split, stage
from ..formats.run_state import decode, encode
from ..memory.rank_memory_kinds import note_copies
from .wire_autosave import HeldCopies

__all__ = ["Generation", "MemoryCopies", "arm_copies", "copies", "held", "restore"]

log = logging.getLogger("fsdp_nb")

KEPT = 2
"""Generations kept of each rank's state, on its own rank and on its buddy."""


@dataclass
class Generation:
    """One rank's state at one step, packed (``formats.packed_state``)."""

    step: int
    """The autosave's step count it was taken at."""
    flat: Any
    """The shards, one ``uint8`` tensor (pinned on a GPU rank)."""
    rest: bytes
    """Everything else, as ``formats.run_state.encode`` bytes: ``{"state", "rng", "tree",
    "leaves"}``."""
    nbytes: int
    """How much of ``flat`` the shards fill."""
    sent: bool = False
    """Of this rank's own: the buddy holds it whole (the exchange completed)."""
    world: int = 0
    """The world size it was taken in: its shards fit that world's layout only."""

    def size(self) -> int:
        """Host bytes this generation holds."""
        return int(self.flat.numel()) + len(self.rest)


class MemoryCopies(Part, StepListener):
    """This rank's copies in memory (the registry's part) and the gate that holds an
    optimizer step until the latest copy of the shards is staged (a step listener, order
    35: after autosave, which hands it the copy, before the step view)."""

    order = 35

    def __init__(self) -> None:
        self.own: list[Generation] = []
        """This rank's complete generations, oldest first."""
        self.held: dict[int, list[Generation]] = {}
        """Ward rank -> its complete generations held here, oldest first."""
        self.buddy: int | None = None
        """The rank this rank's copies go to."""
        self.ward: int | None = None
        """The rank whose copies come here."""
        self.lock = threading.Lock()
        self.executor: ThreadPoolExecutor | None = None
        self.staged: Future | None = None
        self.exchange: Future | None = None
        self.waited_s = 0.0
        """Seconds training waited here: for a copy to stage, or the last one to finish."""
        self.copy_s = 0.0
        """Seconds the copy thread spent, staging and sending, in total."""
        self.failed: str | None = None
        """Why the last copy did not complete, if it did not."""

    # -- the map --------------------------------------------------------------------

    def assign(self, buddies: tuple[int, ...]) -> None:
        """Take the buddy map (``buddies[r]`` keeps rank r's copies); forget what was held
        for a rank that is no longer this rank's ward."""
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
            keep = (lambda g: g.step <= after) if after is not None else (lambda g: False)
            self.own = [g for g in self.own if keep(g)]
            self.held = {r: [g for g in gs if keep(g)] for r, gs in self.held.items()}
        self.tell_memory()

    def tell_memory(self) -> None:
        """Tell the memory readings what the copies hold now (main thread)."""
        note_copies(self.report().bytes)

    def report(self) -> HeldCopies:
        """What this rank holds, for the notebook to choose a generation."""
        with self.lock:
            return HeldCopies(own=tuple(g.step for g in self.own),
                              held={r: tuple(g.step for g in gs) for r, gs in self.held.items() if gs},
                              bytes=sum(g.size() for g in self.own) + sum(g.size() for gs in self.held.values()
                                                                          for g in gs),
                              waited_s=self.waited_s, copy_s=self.copy_s, failed=self.failed)

    # -- the gate ---------------------------------------------------------------------

    def optimizer_stepping(self, optimizer: Any) -> None:
        f = self.staged
        if f is not None and not f.done():
            t0 = time.perf_counter()
            wait_futures([f])
            self.waited_s += time.perf_counter() - t0

    def wait_exchange(self) -> None:
        """Block until the copy in flight is complete (or failed)."""
        f = self.exchange
        if f is not None and not f.done():
            t0 = time.perf_counter()
            wait_futures([f])
            self.waited_s += time.perf_counter() - t0

    # -- taking a copy -------------------------------------------------------------------

    def take(self, step: int, model: Any, optims: list[Any], extra: dict[str, Any]) -> None:
        """Copy this rank's state at ``step``: ``model`` and ``optims`` (their shards staged
        by the copy thread), and ``extra`` (``{"state": {name: state_dict}, "rng": ...}``,
        taken by the caller); then send it to the buddy and receive the ward's."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait_exchange()
        self.tell_memory()
        group = copy_group()  # every rank at this boundary: made here on the first, a collective
        with taking_state():
            msd, osd = get_state_dict(model, optims)
        rest, tensors, leaves = split({"model": msd, "optim": osd})
        cuda = any(t.is_cuda for t in tensors)
        event = _recorded_event() if cuda else None
        with self.lock:  # kept: the newest generation the buddy holds whole; the rest's buffer is reused
            sent = [g for g in self.own if g.sent]
            keep = sent[-1:]
            spare = [g for g in self.own if g not in keep]
            self.own = keep
        flat = _buffer(spare[0].flat if spare else None, leaf_bytes(leaves), cuda)
        staged: Future = Future()
        self.staged = staged
        body = {**extra, "tree": rest, "leaves": [leaf.as_tuple() for leaf in leaves]}
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="fsdp_nb-copies")
        self.exchange = self.executor.submit(self._copy, step, tensors, leaves, flat, body, staged, event, group)

    def _copy(self, step: int, tensors: list[Any], leaves: list[Leaf], flat: Any, body: dict[str, Any],
              staged: Future, event: Any, group: Any) -> None:
        t0 = time.perf_counter()
        try:
            _stage(tensors, leaves, flat, event)
            staged.set_result(None)
            gen = Generation(step, flat, encode(body), leaf_bytes(leaves), world=rank_and_world()[1])
            with self.lock:
                self.own = [*self.own[-(KEPT - 1):], gen]
            if self.buddy is not None and self.buddy != rank_and_world()[0]:
                got = transfer(group, [(self.buddy, gen)], self.ward, self._spare(self.ward))
                if got is not None and self.ward is not None:
                    with self.lock:
                        self.held[self.ward] = [*self.held.get(self.ward, [])[-(KEPT - 1):], got]
            gen.sent = True
            self.failed = None
        except BaseException as exc:  # noqa: BLE001 - kept for the report; the copy before it stays whole
            if not staged.done():
                staged.set_exception(exc)
            self.failed = f"the copy of step {step}: {type(exc).__name__}: {exc}"
            log.warning("autosave in memory: %s", self.failed)
        finally:
            self.copy_s += time.perf_counter() - t0

    def _spare(self, ward: int | None) -> Any:
        """The buffer of the ward's oldest generation, taken out to receive the next into
        (None: a new one), when both generations are held."""
        with self.lock:
            gens = self.held.get(ward, []) if ward is not None else []
            if len(gens) >= KEPT:
                return gens.pop(0).flat
        return None

    # -- restoring -------------------------------------------------------------------

    def restore(self, step: int, sources: dict[int, int], model: Any, optims: list[Any],
                names: tuple[str, ...]) -> str:
        """Roll this rank back to generation ``step``: its own copy, or the one rank
        ``sources[rank]`` holds for it (sent here now; this rank sends what it holds for
        others in ``sources``). Then the model, its optimizers, ``names`` and the random
        state are set from it. Called on every rank at once. Where it came from, in words."""
        self.wait_exchange()
        group = copy_group()
        rank, _ = rank_and_world()
        with self.lock:
            sends = [(ward, _find(self.held.get(ward, []), step)) for ward, holder in sources.items()
                     if holder == rank]
            mine = _find(self.own, step)
        missing = [ward for ward, gen in sends if gen is None]
        if missing:
            raise RuntimeError(f"rank {rank} was to send rank {missing[0]}'s copy of step {step}, and holds none")
        got = transfer(group, [(w, g) for w, g in sends if g is not None], sources.get(rank), None)
        if got is not None:
            got.sent = True  # the rank that sent it holds it: its buddy
        gen = got or mine
        if gen is None:
            raise RuntimeError(f"rank {rank} holds no copy of step {step} and none was sent")
        _apply(gen, model, optims, names, f"rank {rank}'s copy of step {step}")
        with self.lock:  # the copies of later steps belong to a run that is gone
            self.own = [g for g in self.own if g.step < step] + [gen]
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
        of another size go (a resize: their shards fit the old layout); a copy the old group
        was sending is abandoned, its thread left to fail on the old group's sockets."""
        if self.exchange is not None and not self.exchange.done():
            log.warning("autosave in memory: the copy in flight was cut off by the new group; the last whole "
                        "generation stays")
            self.executor = None
        self.exchange = self.staged = None
        with self.lock:
            self.own = [g for g in self.own if g.world == world.size]
            self.held = {r: [g for g in gs if g.world == world.size] for r, gs in self.held.items()}

    def closed(self) -> None:
        self.reformed(World(0, 1))
        with self.lock:
            self.own, self.held = [], {}


def _find(gens: list[Generation], step: int) -> Generation | None:
    return next((g for g in gens if g.step == step), None)


def _recorded_event() -> Any:
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


def _buffer(old: Any, nbytes: int, pinned: bool) -> Any:
    import torch

    if old is not None and old.numel() >= nbytes and old.numel() <= 2 * nbytes + 64:
        return old
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)


def _stage(tensors: list[Any], leaves: list[Leaf], flat: Any, event: Any) -> None:
    """The shards into ``flat``: on a GPU through a stream of the copy thread's own, after
    the training stream's work up to ``event`` (the step that made them), non-blocking
    into pinned memory, then synchronised."""
    if event is None:
        stage(tensors, leaves, flat)
        return
    import torch

    stream = torch.cuda.Stream()
    stream.wait_event(event)
    with torch.cuda.stream(stream):
        stage(tensors, leaves, flat, non_blocking=True)
    stream.synchronize()


def transfer(group: Any, sends: list[tuple[int, Generation]], source: int | None, spare: Any) -> Generation | None:
    """Send each ``(rank, generation)`` of ``sends`` and receive one from ``source`` (None:
    nothing), on ``group``, in three messages a pair: a header (step and sizes), the
    shards, the rest. ``spare``: a buffer to receive the shards into when it is the right
    size. The received generation (None when ``source`` is None)."""
    import torch
    import torch.distributed as dist

    def exchange(out: list[tuple[int, Any]], into: Any) -> None:
        work = [dist.isend(t, dst, group=group) for dst, t in out if t.numel()]
        if into is not None and into.numel():
            work.append(dist.irecv(into, source, group=group))
        for w in work:
            if w is not None:
                w.wait()

    rests = [(dst, torch.frombuffer(bytearray(g.rest), dtype=torch.uint8)) for dst, g in sends]
    header = torch.zeros(3, dtype=torch.int64) if source is not None else None
    exchange([(dst, torch.tensor([g.step, g.nbytes, len(g.rest)], dtype=torch.int64)) for dst, g in sends], header)
    flat = rest = None
    if header is not None:
        step, nbytes, nrest = (int(x) for x in header)
        flat = _buffer(spare, nbytes, False)
        rest = torch.empty(nrest, dtype=torch.uint8)
    exchange([(dst, g.flat[:g.nbytes]) for dst, g in sends], None if flat is None else flat[:nbytes])
    exchange(rests, rest)
    if header is None or flat is None or rest is None:
        return None
    return Generation(step, flat, rest.numpy().tobytes(), nbytes, world=dist.get_world_size(group))


def _apply(gen: Generation, model: Any, optims: list[Any], names: tuple[str, ...], where: str) -> None:
    """Set ``model``, ``optims``, the engine globals ``names`` and the random state from
    ``gen``; its rest is read weights-only."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    body = decode(gen.rest, "memory", where)
    leaves = [Leaf(*leaf) for leaf in body["leaves"]]
    with taking_state():
        msd, osd = get_state_dict(model, optims)
        tree = fill({"model": msd, "optim": osd}, body["tree"], gen.flat, leaves, where)
        set_state_dict(model, optims, model_state_dict=tree["model"], optim_state_dict=tree["optim"])
    restore_objects(body.get("state", {}), names, body.get("rng"))


def arm_copies(buddies: tuple[int, ...], start_step: int) -> None:
    """Copy into memory from now on, with ``buddies`` as the buddy map; generations of a
    step after ``start_step`` (a count that went back: a restart's restore, a new
    autosave) are dropped, and the gate hears every optimizer step."""
    c = copies()
    c.assign(buddies)
    c.forget(after=start_step)
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
