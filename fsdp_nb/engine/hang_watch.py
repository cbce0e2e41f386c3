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
one; read only when the notebook asks), the main thread's frame inside
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
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sysconfig
import threading
import time
from typing import Any

from ..torch_compat import (
    current_frames,
    default_group,
    flight_recorder,
    group_sequence_numbers,
    process_groups,
)
from .retired_groups import RETIRED
from .signing import Link, Refused, start_listener

__all__ = ["FREE", "MAX_FRAME_BYTES", "QUERY", "QUERY_NOW", "WINDOW", "collective", "issued", "library_dirs",
           "main_frame", "start", "state"]

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
_COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "gather",
    "scatter", "send", "recv", "broadcast_object_list", "monitored_barrier",
}
_TENSOR_ARGS = ("tensor", "input_tensor", "output_tensor", "tensor_list", "input", "output")
_WATCH: dict[str, Any] = {}
_SEEN: dict[tuple[str, int], float] = {}
_GROUP_MAKERS = frozenset({
    "init_process_group", "new_group", "_new_process_group_helper", "new_subgroups",
    "new_subgroups_by_enumeration", "split_group", "init_device_mesh", "_init_process_groups",
})
"""torch.distributed's functions that make a process group (the recorder's table grows)."""
_LAST: dict[str, Any] = {"at": None}
"""The main thread as the previous question found it (``_settled``)."""
_ISSUED: dict[tuple[str, str], tuple[int, float]] = {}
"""(group, backend) -> (its count of issued collectives, when that count was first seen)."""


@functools.lru_cache(maxsize=1)
def library_dirs() -> tuple[str, ...]:
    """Where library code lives: the standard library, site-packages and fsdp_nb itself
    (read once: 0.4 ms, most of a question before)."""
    paths = sysconfig.get_paths()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the fsdp_nb package
    return tuple({os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {here})


@functools.lru_cache(maxsize=4096)
def _is_user(filename: str, libs: tuple[str, ...]) -> bool:
    if filename.startswith("<frozen") or filename.startswith("<string>"):
        return False
    return not os.path.realpath(filename).startswith(libs)


def _where(filename: str, line: int) -> str:
    """``cell line N`` for code from a cell (IPython names them ``/tmp/ipykernel_<pid>/<n>.py``
    or ``<ipython-input-…>``), else ``file.py:N``."""
    base = os.path.basename(filename)
    if "ipykernel_" in filename or filename.startswith("<ipython-input") or filename.startswith("<cell"):
        return f"cell line {line}"
    return f"{base}:{line}"


def main_frame(frame: Any = None) -> dict[str, Any] | None:
    """The innermost frame of user code on the main thread (or of ``frame``): its
    function, where it is (``cell line 3``) and the line's source; None when none is."""
    import linecache

    if frame is None:
        frame = current_frames().get(threading.main_thread().ident or 0)
    libs = library_dirs()
    while frame is not None:
        code = frame.f_code
        if _is_user(code.co_filename, libs):
            line = frame.f_lineno or 0
            text = linecache.getline(code.co_filename, line).strip()
            return {"function": code.co_name, "where": _where(code.co_filename, line), "code": text}
        frame = frame.f_back
    return None


def _dtype(name: str) -> str:
    """The flight recorder's dtype name (``Float``, ``BFloat16``) as torch spells it."""
    table = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
             "Long": "int64", "Int": "int32", "Bool": "bool", "Byte": "uint8", "Char": "int8"}
    return table.get(name, name.lower())


def _group_names(config: dict[str, Any]) -> dict[str, tuple[str, list[int] | None]]:
    """pg name -> (description, ranks) from the flight recorder's ``pg_config``."""
    out: dict[str, tuple[str, list[int] | None]] = {}
    for name, cfg in (config or {}).items():
        ranks = cfg.get("ranks")
        try:
            ranks = json.loads(ranks) if isinstance(ranks, str) else ranks
        except ValueError:
            ranks = None
        out[str(name)] = (str(cfg.get("desc") or name), list(ranks) if isinstance(ranks, list) else None)
    return out


def _dump(collectives: bool) -> dict[str, Any] | None:
    """torch's flight recorder, read (``torch_compat.flight_recorder``): only once the
    main thread has settled (``_settled``)."""
    return flight_recorder(collectives)


def _snapshot(frame: Any) -> tuple[Any, ...] | None:
    """Where the main thread is (its frame and instruction) and what each group has
    issued; None while it is making a process group."""
    f = frame
    while f is not None:
        if f.f_code.co_name in _GROUP_MAKERS:
            return None
        f = f.f_back
    counts = tuple((g["group"], g["backend"], g["seq"]) for g in issued())
    return (id(frame), getattr(frame, "f_code", None), getattr(frame, "f_lasti", -1), counts)


def _settled(frame: Any, now: bool) -> bool:
    """The main thread has not moved since the previous question (``now``: over the
    next 20 ms, for a question that cannot wait for another): same frame, same
    instruction, no group made, no collective issued. Only then may the recorder be read.
    Asked on the main thread itself (a call that runs ``collective``), it is settled."""
    if threading.current_thread() is threading.main_thread():
        return True
    here = _snapshot(frame)
    before, _LAST["at"] = _LAST["at"], here
    if now:
        time.sleep(0.02)
        before, here = here, _snapshot(current_frames().get(threading.main_thread().ident or 0))
    return here is not None and here == before


def _from_recorder() -> dict[str, Any] | None:
    """This rank's collective in flight per the flight recorder: {} when none is in
    flight, None when it records nothing here. Called only once settled (``_settled``).

    The groups' status alone costs microseconds; the records (milliseconds) are read
    only when a group has a collective in flight."""
    status = _dump(collectives=False)
    if status is None or not status.get("pg_status"):
        return None
    flying = {pg: int(st.get("last_enqueued_collective", -1)) for pg, st in status["pg_status"].items()
              if pg not in RETIRED
              and int(st.get("last_enqueued_collective", -1)) > int(st.get("last_completed_collective", -1))}
    if not flying:
        return {}
    dump = _dump(collectives=True)
    if dump is None:
        return None
    entries = dump.get("entries") or []
    groups = _group_names(dump.get("pg_config") or {})
    best: dict[str, Any] = {}
    for pg, enq in flying.items():
        # the newest record of that sequence number: a group formed again (recovery) may
        # be named anew in the status but not in the records, where older groups' remain
        same = [e for e in entries if int(e.get("collective_seq_id", -1)) == enq and not e.get("is_p2p")]
        named = [e for e in same if str((e.get("process_group") or ("",))[0]) == str(pg)]
        if not (named or same):
            continue
        e = (named or same)[-1]
        since = int(e.get("time_created_ns") or 0) / 1e9
        if best and since >= best["since"]:
            continue
        desc = str((tuple(e.get("process_group") or ()) + ("", ""))[1])
        desc, ranks = groups.get(str(pg), (desc or str(pg), None))
        best = {"op": str(e.get("profiling_name", "")).split(":", 1)[-1], "group": desc or "default_pg",
                "group_ranks": ranks, "seq": enq, "since": since,
                "shapes": [list(x) for x in e.get("input_sizes") or []],
                "dtypes": [_dtype(d) for d in e.get("input_dtypes") or []]}
    return best


def _from_frame(frame: Any) -> dict[str, Any]:
    """This rank's collective from where its main thread waits in ``torch.distributed``
    ({} when it is not in one): op, group and shapes from the call's own arguments."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in _COLLECTIVES and code.co_filename.endswith("distributed_c10d.py"):
            local = frame.f_locals
            group = local.get("group") or local.get("pg")
            try:
                import torch.distributed as dist

                pg = group or default_group()
                seq = max(group_sequence_numbers(pg).values(), default=-1)
                desc = getattr(pg, "group_desc", None) or "default_pg"
                ranks = dist.get_process_group_ranks(pg)
            except (RuntimeError, AttributeError, ValueError):
                seq, desc, ranks = -1, "default_pg", None
            shapes, dtypes = [], []
            for k in _TENSOR_ARGS:
                for t in (local.get(k) if isinstance(local.get(k), list) else [local.get(k)]):
                    if hasattr(t, "shape") and hasattr(t, "dtype"):
                        shapes.append(list(t.shape))
                        dtypes.append(str(t.dtype).replace("torch.", ""))
            key = (code.co_name, seq)
            if key not in _SEEN:  # first seen now: the wait is counted from here
                _SEEN.clear()
                _SEEN[key] = time.time()
            since = _SEEN[key]
            return {"op": code.co_name, "group": desc, "group_ranks": ranks, "seq": seq, "since": since,
                    "shapes": shapes, "dtypes": dtypes}
        frame = frame.f_back
    return {}


def collective(now: bool = False) -> dict[str, Any]:
    """The collective this rank waits in, or {}: ``op``, ``group`` (its description:
    ``default_pg``, a mesh dimension), ``group_ranks``, ``seq`` (the group's sequence
    number), ``since`` (Unix time it began), ``shapes`` and ``dtypes``.

    From the flight recorder once the main thread has settled (``_settled``; ``now``:
    checked over 20 ms instead of since the previous question), else from the main
    thread's frame in ``torch.distributed``."""
    frame = current_frames().get(threading.main_thread().ident or 0)
    found = _from_recorder() if _settled(frame, now) else None
    if not found:  # nothing recorded here, not settled, or a record the status does not name
        found = _from_frame(frame)
    return found


def issued() -> list[dict[str, Any]]:
    """Each process group's count of issued collectives on this rank, per backend:
    ``group`` (its name, the same on every member), ``desc`` (``default_pg``, a mesh
    dimension), ``ranks``, ``backend``, ``seq`` and ``since`` (when this count was first
    seen here, Unix time). Microseconds per group, paid only when the notebook asks:
    unlike the flight recorder, nothing is done per collective."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return []
        groups = process_groups()
    except (RuntimeError, AttributeError, ImportError):
        return []
    now, out, seen = time.time(), [], set()
    for pg in groups:
        try:
            name = str(pg.group_name)
            desc = str(getattr(pg, "group_desc", None) or name)
            ranks = list(dist.get_process_group_ranks(pg))
            counts = group_sequence_numbers(pg)
        except (RuntimeError, AttributeError, ValueError):
            continue
        for backend, seq in counts.items():
            key = (name, backend)
            seen.add(key)
            if _ISSUED.get(key, (None,))[0] != seq:
                _ISSUED[key] = (seq, now)
            out.append({"group": name, "desc": desc, "ranks": ranks, "backend": backend, "seq": seq,
                        "since": _ISSUED[key][1]})
    for key in set(_ISSUED) - seen:  # groups destroyed since
        del _ISSUED[key]
    return out


def state(rank: int | None = None, now: bool = True) -> dict[str, Any]:
    """This rank, now: its collective in flight (``collective``; ``now=False``: only one
    in flight since the previous question), each group's issued collectives
    (``issued``), the innermost user frame of its main thread
    (``main_frame``), its pid, rank and the time."""
    if rank is None:
        try:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else None
        except (RuntimeError, ValueError):
            rank = None
    return {"rank": rank, "pid": os.getpid(), "now": time.time(), "collective": collective(now),
            "issued": issued(), "frame": main_frame()}


def _answer(payload: bytes) -> bytes:
    """The JSON reply to a checked request: this rank's state, or (``FREE``) how many
    connections to the given peers were shut."""
    try:
        if payload in (QUERY, QUERY_NOW):
            return json.dumps(state(now=payload == QUERY_NOW), default=str).encode()
        from .health import close_connections_to

        peers = [(str(ip), int(port)) for ip, port in json.loads(payload[len(FREE):])]
        log.warning("fsdp_nb: closing this rank's connections to its peers (asked by the notebook's recovery)")
        return json.dumps({"closed": close_connections_to(peers)}).encode()
    except Exception as exc:  # noqa: BLE001 - the thread must keep answering; the notebook is told why
        return json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()


def _handle(sock: Any, link: Link, endpoint: str, frames: list[Any]) -> None:
    """One message to the thread (``signing.start_listener`` runs the loop): a checked
    request gets its signed answer; anything else is dropped and counted, unanswered."""
    try:
        if len(frames) != 2:
            raise Refused(f"{len(frames)} frames where a request has 2")
        payload = link.unpack(frames[1].bytes)
        if payload not in (QUERY, QUERY_NOW) and not payload.startswith(FREE):
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

    Returns its zmq endpoint and nonce (for the notebook's ``signing.Link``).
    """
    return start_listener(_WATCH, addr, "hang-watch", "ROUTER", MAX_FRAME_BYTES, _handle, "fsdp_nb-hang-watch",
                          WINDOW)
