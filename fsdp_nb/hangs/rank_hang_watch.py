"""Where this rank is while a call runs, for the notebook's hang watch: told by a thread.

A request through the engines' task queue waits behind the running cell, so ``start``
(called once per engine, with the health hooks) runs a daemon thread with a zmq
ROUTER socket on the address the notebook gives (loopback when the notebook is on
this host). Each request, signed with the cluster's key (``signing.Link``, the
thread's nonce in its key), gets one signed JSON reply: :func:`state`. A rank whose
main thread runs Python or waits in a collective (which releases the GIL) answers;
one that is stopped (SIGSTOP) or holds the GIL in C does not, and the notebook says
so. A request that is unsigned, forged, replayed or over ``MAX_FRAME_BYTES`` is
dropped before it is read further. The recovery may also ask it to shut the rank's
connections to its peers (``FREE``): a main thread blocked in a gloo collective whose
peers are blocked too (mismatched collectives) then returns, as when a peer leaves.

What a rank is in comes from three sources, cheapest first, none of which costs a
collective anything: each process group's count of issued collectives
(``issued``: a member that issued fewer than the others is missing from the next
one; read only when the notebook asks; the checkpoint group's are marked as its own,
since an async save commits there from a background thread), the main thread's frame inside
``torch.distributed`` (a synchronous collective names its op and tensors there), and
torch's flight recorder where the ranks run with it (``TORCH_FR_BUFFER_SIZE``): each
group's last enqueued and last completed collective, and, for one in flight, its op,
sizes, dtypes and start. fsdp_nb turns the recorder on for gloo only
(``process_group.init``): on NCCL each record costs the training step (a fifth of an
H200's throughput for a 368M model), so there it is the user's opt-in.

The recorder is read only once the main thread has settled (``_settled``). Its dump
walks the recorder's tables of groups without the lock that guards them
(``FlightRecorder::dump_json`` reads ``pg_name_to_ranks_`` and ``all_pg_status_``
unlocked) and without the GIL, while the main thread adds to them as it makes a group
and as a group issues its first collective. Settled means the main thread sat at the
same instruction since the previous question, making no group and issuing nothing: then
nothing adds to the tables while the watch reads them. A training loop never settles,
so it pays nothing for the recorder either.

What the watch remembers between questions (where the main thread was, when it first
saw a wait and each group's count) is a :class:`RankWatch`'s, one per engine
(:func:`watch`); a test makes its own, handing it the recorder, the main thread's frame
and the clock it reads.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from ..debugging import rank_breakpoints, rank_cell_debug
from ..engine.checkpoint_group import BACKGROUND, background_groups
from ..engine.registry import Part, World, part
from ..engine.retired_groups import RetiredGroups, retired
from ..engine.signing import Link, ListenerState, Refused, start_listener
from ..engine.stacks import in_library, is_cell_file
from ..torch_compat import (
    collective_call,
    default_group,
    flight_recorder,
    group_sequence_numbers,
    making_group,
    process_groups,
)
from ..wire.decode import encode
from .wire_hang_state import Collective, Freed, GroupCount, RankState, UserFrame, WatchError

__all__ = ["FREE", "MAX_FRAME_BYTES", "QUERY", "QUERY_NOW", "WINDOW", "RankWatch", "WatchListener", "watch",
           "main_frame", "start"]

log = logging.getLogger("fsdp_nb")

QUERY = b"state"
"""The payload of a request for this rank's state (what has been in flight since the
last such request, the watch's cheap question)."""
QUERY_NOW = b"state now"
"""The payload of a request for this rank's state, every collective in flight now
included (an error's one question)."""
FREE = b"free "
"""The head of a request to shut this rank's connections to its peers (JSON list of
``[ip, port]`` after it): a main thread blocked in a gloo collective then returns."""
MAX_FRAME_BYTES = 4096
"""The largest frame the thread takes (a signed request is under 100 bytes)."""
WINDOW = 64
"""How far out of order the questions (each on a socket of its own) and their answers may
arrive and still be taken once (``signing.Link``): a rank whose main thread holds the GIL
reads two queued questions in either order."""


def _where(filename: str, line: int) -> str:
    """``cell line N`` for code from a cell (IPython names them ``/tmp/ipykernel_<pid>/<n>.py``
    or ``<ipython-input-…>``), else ``file.py:N``."""
    base = os.path.basename(filename)
    if is_cell_file(filename):
        return f"cell line {line}"
    return f"{base}:{line}"


def _main_thread_frame() -> FrameType | None:
    """The main thread's innermost frame now."""
    return sys._current_frames().get(threading.main_thread().ident or 0)


def main_frame(frame: FrameType | None) -> UserFrame | None:
    """The innermost frame of user code at or under ``frame`` (a thread's stack, innermost
    first): its function, where it is (``cell line 3``) and the line's source; None when
    none is."""
    import linecache

    while frame is not None:
        code = frame.f_code
        if not in_library(code.co_filename):
            line = frame.f_lineno or 0
            return UserFrame(function=code.co_name, where=_where(code.co_filename, line),
                             code=linecache.getline(code.co_filename, line).strip())
        frame = frame.f_back
    return None


def _dtype(name: str) -> str:
    """The flight recorder's dtype name (``Float``, ``BFloat16``) as torch spells it."""
    table = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
             "Long": "int64", "Int": "int32", "Bool": "bool", "Byte": "uint8", "Char": "int8"}
    return table.get(name, name.lower())


def _group_names(config: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """pg name -> (description, ranks) from the flight recorder's ``pg_config``."""
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for name, cfg in (config or {}).items():
        ranks = cfg.get("ranks")
        try:
            ranks = json.loads(ranks) if isinstance(ranks, str) else ranks
        except ValueError:
            ranks = None
        out[str(name)] = (str(cfg.get("desc") or name), tuple(ranks) if isinstance(ranks, list) else None)
    return out


def _in_flight(status: dict[str, Any], retired: set[str]) -> dict[str, int]:
    """Status key (a record's ``pg_id``) -> the sequence number of its collective in
    flight, from the recorder's groups' status, the groups this rank has left
    (``retired``) left out."""
    out = {}
    for pg, st in (status.get("pg_status") or {}).items():
        enqueued = int(st.get("last_enqueued_collective", -1))
        if pg not in retired and enqueued > int(st.get("last_completed_collective", -1)):
            out[pg] = enqueued
    return out


def _recorded(dump: dict[str, Any], flying: dict[str, int]) -> Collective | None:
    """The oldest of the ``flying`` collectives that the recorder's ``dump`` has a live
    record of (None: none). One on the checkpoint group is left out: an async save's, in
    its background thread, not one the main thread waits in (that one its frame shows).

    A record is matched to its group by ``pg_id``, the key of the groups' status (a count
    of the groups this process made), not by its group name, which a group formed again
    takes anew (``"0"`` again for the default group). And a group's status alone does not
    say a collective is in flight: gloo's worker threads each write the last completed
    number as theirs ends, so one that finishes after a newer collective can leave an
    older number there. A record is marked ``retired`` when its collective ends, so only
    records not marked count."""
    live = [e for e in dump.get("entries") or [] if not e.get("is_p2p") and not e.get("retired")]
    groups = _group_names(dump.get("pg_config") or {})
    best: Collective | None = None
    for pg, enq in flying.items():
        mine = [e for e in live if str(e.get("pg_id")) == str(pg) and int(e.get("collective_seq_id", -1)) == enq]
        if not mine:
            continue
        e = mine[-1]
        name, desc = (str(x) for x in (tuple(e.get("process_group") or ()) + ("", ""))[:2])
        known, ranks = groups.get(name, ("", None))  # pg_config is keyed by the name, as the records are
        desc = desc or known or str(pg)
        if desc in BACKGROUND:  # the recorder's own key for a group, not torch's group name
            continue
        since = int(e.get("time_created_ns") or 0) / 1e9
        if best is not None and since >= best.since:
            continue
        best = Collective(op=str(e.get("profiling_name", "")).split(":", 1)[-1], desc=desc or "default_pg",
                          group_ranks=ranks, seq=enq, since=since,
                          shapes=tuple(tuple(x) for x in e.get("input_sizes") or []),
                          dtypes=tuple(_dtype(d) for d in e.get("input_dtypes") or []))
    return best


class RankWatch(Part):
    """What this rank's watch thread reads when the notebook asks, and what it remembers
    between two questions.

    Args:
        recorder: reads torch's flight recorder (``torch_compat.flight_recorder``):
            ``recorder(collectives)`` -> its JSON dump, or None where it records nothing.
        left: the groups this rank has left, whose status the recorder keeps (default:
            this engine's, ``retired_groups.retired()``).
        main_thread_frame: the main thread's innermost frame now.
        on_main_thread: whether the caller is the main thread (a call that runs the
            question itself needs no waiting for it to settle).
        clock: Unix time now.
        pause: sleeps that many seconds (a question that cannot wait checks over 20 ms).
    """

    def __init__(self, *, recorder: Callable[[bool], dict[str, Any] | None] = flight_recorder,
                 left: RetiredGroups | None = None,
                 main_thread_frame: Callable[[], FrameType | None] = _main_thread_frame,
                 on_main_thread: Callable[[], bool] = lambda: threading.current_thread() is threading.main_thread(),
                 clock: Callable[[], float] = time.time, pause: Callable[[float], None] = time.sleep):
        self.recorder, self.retired = recorder, left if left is not None else retired()
        self.main_thread_frame, self.on_main_thread = main_thread_frame, on_main_thread
        self.clock, self.pause = clock, pause
        self.last: tuple[Any, ...] | None = None
        """The main thread as the previous question found it (``_settled``)."""
        self.waits: dict[tuple[str, int], float] = {}
        """(op, sequence number) -> when a wait seen in ``torch.distributed`` was first seen."""
        self.counts: dict[tuple[str, str], tuple[int, float]] = {}
        """(group name, backend) -> (its count of issued collectives, when that count was first seen)."""
        self.lock = threading.Lock()
        """Held by each question: the watch thread and a call on the main thread may ask at once."""

    def reformed(self, world: World) -> None:
        """A new group: torch reuses its groups' names, so what was seen of the old ones
        (their counts and waits, and when) is forgotten, or a count from before would date
        a wait from before the group formed."""
        with self.lock:
            self.last, self.waits, self.counts = None, {}, {}

    def state(self, rank: int | None = None, now: bool = True) -> RankState:
        """This rank, now: its collective in flight (:meth:`collective`; ``now=False``:
        only one in flight since the previous question), each group's issued collectives
        (:meth:`issued`), the innermost user frame of its main thread (:func:`main_frame`),
        its pid, rank and the time."""
        if rank is None:
            try:
                import torch.distributed as dist

                rank = dist.get_rank() if dist.is_initialized() else None
            except (RuntimeError, ValueError):
                rank = None
        with self.lock:
            issued = self._issued()  # read once: the settling check compares these counts too
            return RankState(rank=rank, pid=os.getpid(), now=self.clock(), collective=self._collective(now, issued),
                             issued=issued, frame=main_frame(self.main_thread_frame()),
                             stopped=part(rank_breakpoints.Breakpoints).where)

    def collective(self, now: bool = False) -> Collective | None:
        """The collective this rank waits in, or None.

        From the flight recorder once the main thread has settled (``now``: checked over
        20 ms instead of since the previous question), else from the main thread's frame
        in ``torch.distributed``."""
        with self.lock:
            return self._collective(now, None)

    def issued(self) -> tuple[GroupCount, ...]:
        """Each process group's count of issued collectives on this rank, per backend, with
        when this count was first seen here. Microseconds per group, paid only when the
        notebook asks: unlike the flight recorder, nothing is done per collective."""
        with self.lock:
            return self._issued()

    def _collective(self, now: bool, issued: tuple[GroupCount, ...] | None) -> Collective | None:
        frame = self.main_thread_frame()
        found = self._from_recorder() if self._settled(frame, now, issued) else None
        if found is None:  # nothing recorded here, not settled, or a record the status does not name
            found = self._from_frame(frame)
        return found

    def _issued(self) -> tuple[GroupCount, ...]:
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return ()
            groups = process_groups()
        except (RuntimeError, AttributeError, ImportError):
            return ()
        at, out, seen = self.clock(), [], set()
        saving = background_groups()
        for pg in groups:
            try:
                name = str(pg.group_name)
                desc = str(getattr(pg, "group_desc", None) or name)
                ranks = tuple(dist.get_process_group_ranks(pg))
                counts = group_sequence_numbers(pg)
            except (RuntimeError, AttributeError, ValueError):
                continue
            for backend, seq in counts.items():
                key = (name, backend)
                seen.add(key)
                if self.counts.get(key, (None,))[0] != seq:
                    self.counts[key] = (seq, at)
                out.append(GroupCount(name=name, desc=desc, ranks=ranks, backend=backend, seq=seq,
                                      since=self.counts[key][1], checkpoint=any(pg is g for g in saving)))
        for key in set(self.counts) - seen:  # groups destroyed since
            del self.counts[key]
        return tuple(out)

    def _snapshot(self, frame: FrameType | None, issued: tuple[GroupCount, ...] | None = None,
                  ) -> tuple[Any, ...] | None:
        """Where the main thread is (its frame and instruction) and what each group has
        issued (``issued``: as just read, else read now); None while it is making a
        process group."""
        if making_group(frame):
            return None
        counts = tuple((g.name, g.backend, g.seq) for g in (self._issued() if issued is None else issued))
        return (id(frame), getattr(frame, "f_code", None), getattr(frame, "f_lasti", -1), counts)

    def _settled(self, frame: FrameType | None, now: bool, issued: tuple[GroupCount, ...] | None) -> bool:
        """The main thread has not moved since the previous question (``now``: over the
        next 20 ms, for a question that cannot wait for another): same frame, same
        instruction, no group made, no collective issued. Only then may the recorder be
        read. Asked on the main thread itself (a call that runs ``collective``), it is settled."""
        if self.on_main_thread():
            return True
        here = self._snapshot(frame, issued)
        before, self.last = self.last, here
        if now:
            self.pause(0.02)
            before, here = here, self._snapshot(self.main_thread_frame())
        return here is not None and here == before

    def _from_recorder(self) -> Collective | None:
        """This rank's collective in flight per the flight recorder; None when none is in
        flight or it records nothing here. Called only once settled (``_settled``).

        The groups' status alone costs microseconds; the records (milliseconds) are read
        only when a group has a collective in flight."""
        status = self.recorder(False)
        flying = _in_flight(status or {}, self.retired.keys)
        if not flying:
            return None
        dump = self.recorder(True)
        return None if dump is None else _recorded(dump, flying)

    def _from_frame(self, frame: FrameType | None) -> Collective | None:
        """This rank's collective from where its main thread waits in ``torch.distributed``
        (None when it is not in one): op, group and shapes from the call's own arguments."""
        call = collective_call(frame)
        if call is None:
            return None
        op, group, tensors = call
        try:
            import torch.distributed as dist

            pg = group or default_group()
            seq = max(group_sequence_numbers(pg).values(), default=-1)
            desc = getattr(pg, "group_desc", None) or "default_pg"
            ranks: tuple[int, ...] | None = tuple(dist.get_process_group_ranks(pg))
        except (RuntimeError, AttributeError, ValueError):
            seq, desc, ranks = -1, "default_pg", None
        key = (op, seq)
        if key not in self.waits:  # first seen now: the wait is counted from here
            self.waits.clear()
            self.waits[key] = self.clock()
        return Collective(op=op, desc=desc, group_ranks=ranks, seq=seq, since=self.waits[key],
                          shapes=tuple(tuple(t.shape) for t in tensors),
                          dtypes=tuple(str(t.dtype).replace("torch.", "") for t in tensors))


def watch() -> RankWatch:
    """This engine's watch: what its thread answers the notebook with (the registry's part)."""
    return part(RankWatch)


class WatchListener(ListenerState):
    """The watch thread's socket: its endpoint, nonce and link (``signing.start_listener``)."""


def _answer(payload: bytes) -> bytes:
    """The JSON reply to a checked request: this rank's state (a ``RankState``), or
    (``FREE``) how many connections to the given peers were shut (a ``Freed``); a
    ``WatchError`` when that failed."""
    try:
        if payload in (QUERY, QUERY_NOW):
            return encode(watch().state(now=payload == QUERY_NOW))
        if rank_breakpoints.is_request(payload):
            return rank_breakpoints.answer(payload)
        from ..engine.health import close_connections_to

        peers = [(str(ip), int(port)) for ip, port in json.loads(payload[len(FREE):])]
        log.warning("fsdp_nb: closing this rank's connections to its peers (asked by the notebook's recovery)")
        return encode(Freed(closed=close_connections_to(peers)))
    except Exception as exc:  # noqa: BLE001 - the thread must keep answering; the notebook is told why
        return encode(WatchError(error=f"{type(exc).__name__}: {exc}"))


def _handle(sock: Any, link: Link, endpoint: str, frames: list[Any]) -> None:
    """One message to the thread (``signing.start_listener`` runs the loop): a checked
    request gets its signed answer; anything else is dropped and counted, unanswered."""
    try:
        if len(frames) != 2:
            raise Refused(f"{len(frames)} frames where a request has 2")
        payload = link.unpack(frames[1].bytes)
        if payload not in (QUERY, QUERY_NOW) and not payload.startswith(FREE) and not rank_breakpoints.is_request(payload):
            raise Refused("a signed message that is not a request of the hang watch")
    except Refused as why:
        link.refused(why, endpoint)
        return
    sock.send_multipart([frames[0].bytes, link.pack(_answer(payload))])


def start(addr: str) -> tuple[str, bytes]:
    """Start (once per engine) the thread that tells where this rank is.

    Args:
        addr: the address to bind: loopback when the notebook runs on this host, else
            the engine's address on the interface that routes to the controller.

    Returns its zmq endpoint and nonce (for the notebook's ``signing.Link``). The same
    thread serves the rank's breakpoints (``fsdp_nb.debugging.rank_breakpoints``), whose
    hooks are installed here.
    """
    rank_cell_debug.install()
    return start_listener(part(WatchListener).state, addr, "hang-watch", "ROUTER", MAX_FRAME_BYTES, _handle, "fsdp_nb-hang-watch",
                          WINDOW)
