"""How one copy in memory is staged off the device and travels between two ranks
(``sess.autosave(..., in_memory=True)``; the bookkeeping is ``rank_memory_copies``).

A copy is a :class:`Generation`: the shards in one flat ``uint8`` buffer and the rest as
weights-only bytes. :func:`stage` fills the buffer, on a GPU through a stream of the copy
thread's own on the shards' device, after the training stream's step. :func:`transfer`
moves generations on the copy group in three messages a pair, a header first:

- ``[step, shard bytes, rest bytes]``: the receiver checks the step is the one it waits
  for and the sizes are within its bound before it allocates anything;
- ``[-1, 0, 0]`` says "no copy this time" (the sender's own taking failed, or nothing
  can be copied yet), and neither side sends or waits for more: a failure on one rank
  never leaves its buddy waiting for messages that will not come;
- then the shards, then the rest, each under a tag of its step and kind: a message a
  failure left unreceived never pairs with a later copy's.

Every wait has a bound (:data:`WAIT_S`): a peer that stops answering fails the copy
instead of holding the thread, or training behind it, forever.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["HEADER_TAG", "NO_COPY", "WAIT_S", "Generation", "host_buffer", "stage", "transfer"]

log = logging.getLogger("fsdp_nb")

NO_COPY = -1
"""The step a header carries when the sender has no copy to send this time."""
WAIT_S = 600.0
"""Seconds one message of a copy may take before the copy is failed (a peer that stopped
answering); the copies then go on at the next step."""


@dataclass(eq=False)
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
    """Of this rank's own: its send to the buddy completed."""
    world: int = 0
    """The world size it was taken in: its shards fit that world's layout only."""

    def size(self) -> int:
        """Host bytes this generation holds."""
        return int(self.flat.numel()) + len(self.rest)


def host_buffer(old: Any, nbytes: int, pinned: bool) -> Any:
    """A ``uint8`` host buffer of at least ``nbytes``: ``old`` when it fits (not more than
    about twice as large, and pinned or not as asked), else a new one (pinned: page-locked,
    for a device-to-host copy that does not block)."""
    import torch

    if old is not None and nbytes <= old.numel() <= 2 * nbytes + 64 and bool(old.is_pinned()) == pinned:
        return old
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)


def stage(tensors: list[Any], leaves: list[Any], flat: Any, device: Any, event: Any) -> None:
    """Copy the shards ``tensors`` into ``flat`` at their ``leaves``' offsets. On a GPU
    (``device``, with ``event`` recorded on the training stream after the step that made
    them): on this thread's own stream of that device, after the event, non-blocking into
    pinned memory, then synchronised, so the copy has landed when this returns."""
    from ..formats.packed_state import stage as copy_leaves

    if device is None:
        copy_leaves(tensors, leaves, flat)
        return
    import torch

    torch.cuda.set_device(device)  # a new thread starts on device 0
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            copy_leaves(tensors, leaves, flat, non_blocking=True)
        stream.synchronize()


HEADER_TAG = 1
"""The tag of every header (a receiver does not know the step before it reads one)."""


def _tag(step: int, kind: int) -> int:
    """The tag of a copy's shards (``kind`` 2) or rest (3): its step in it."""
    return 4 * (step % (1 << 24)) + kind


def _wait(work: list[Any]) -> BaseException | None:
    """Wait for each of ``work`` (each within :data:`WAIT_S`); the first error, if any."""
    failed: BaseException | None = None
    for w in work:
        if w is None:
            continue
        try:
            w.wait(datetime.timedelta(seconds=WAIT_S))
        except Exception as exc:  # noqa: BLE001 - the caller names it; the other waits still run
            failed = failed or exc
    return failed


def transfer(group: Any, sends: list[tuple[int, Generation | None]], source: int | None, *,
             limit: int | None, expect: int | None = None, spare: Any = None,
             ) -> tuple[Generation | None, BaseException | None]:
    """Send each ``(rank, generation)`` of ``sends`` (None: a "no copy" header) and receive
    one from ``source`` (None: nothing), on ``group``.

    Args:
        group: the copy group (``engine.checkpoint_group.copy_group``).
        sends: the generations to send, with the rank each goes to.
        source: the rank to receive from, or None.
        expect: the step the received copy must be of (None: any); another is received,
            so the messages stay paired, then refused.
        spare: a buffer to receive the shards into when it is the right size.
        limit: the most bytes a received copy may announce; more is refused before
            anything is allocated (None only where nothing is received).

    Returns:
        (the received generation, None when nothing came or it was refused; the first
        error of the sends, or of the receive, None when all went well). Each send's
        generation is marked ``sent`` when its messages went out.
    """
    import torch
    import torch.distributed as dist

    if source is not None and limit is None:
        raise ValueError("transfer() receives from a peer only within a limit= of bytes")

    def isend(t: Any, dst: int, tag: int) -> Any:
        return dist.isend(t, dst, group=group, tag=tag) if t.numel() else None

    def header(g: Generation | None) -> Any:
        return torch.tensor([NO_COPY, 0, 0] if g is None else [g.step, g.nbytes, len(g.rest)], dtype=torch.int64)

    inbox = torch.zeros(3, dtype=torch.int64) if source is not None else None
    work = [isend(header(g), dst, HEADER_TAG) for dst, g in sends]
    got = _wait([dist.irecv(inbox, source, group=group, tag=HEADER_TAG)] if inbox is not None else [])
    failed = _wait(work)
    # a header that did not go out is followed by nothing: its receiver never asked for more
    payload = [(dst, g) for dst, g in sends if g is not None] if failed is None else []
    failed = failed or got
    step, nbytes, nrest = (int(x) for x in inbox) if inbox is not None and got is None else (NO_COPY, 0, 0)
    refused = None
    if step != NO_COPY and (min(nbytes, nrest) < 0 or (limit is not None and nbytes + nrest > limit)):
        refused = ValueError(f"rank {source} announced a copy of {nbytes} + {nrest} bytes, and a copy of its state "
                             f"holds at most {limit}: refused before anything was allocated")
        step = NO_COPY  # nothing allocated, nothing received: the sender's next messages fail it there
    flat = host_buffer(spare, nbytes, False) if step != NO_COPY else None
    rest = torch.empty(nrest, dtype=torch.uint8) if step != NO_COPY else None
    recv = [dist.irecv(flat[:nbytes], source, group=group, tag=_tag(step, 2))] if flat is not None and nbytes else []
    sent = _wait([isend(g.flat[:g.nbytes], dst, _tag(g.step, 2)) for dst, g in payload])
    got = _wait(recv)
    recv = [dist.irecv(rest, source, group=group, tag=_tag(step, 3))] if rest is not None and nrest and got is None else []
    sent = sent or _wait([isend(torch.frombuffer(bytearray(g.rest), dtype=torch.uint8), dst, _tag(g.step, 3))
                          for dst, g in payload])
    got = got or _wait(recv)
    if sent is None and failed is None:
        for _, g in payload:
            g.sent = True
    failed = failed or sent or got or refused
    if step == NO_COPY or flat is None or rest is None or got is not None:
        return None, failed
    if expect is not None and step != expect:
        return None, failed or ValueError(f"rank {source} sent its copy of step {step} where step {expect} was due: "
                                          "the ranks' copies are out of step; it is not kept")
    return Generation(step, flat, rest.numpy().tobytes(), nbytes, world=dist.get_world_size(group)), failed
