"""The collective check, rank side: ranks compare each collective before they issue it.

The commonest distributed bug is ranks calling different collectives: one all-reduces a
``float32[3]`` while another all-reduces a ``float32[4]``, or all-gathers, or skips a
barrier. Issued, that hangs or corrupts. With the check armed for a cell (``arm``),
each of ``torch.distributed``'s collectives (``CHECKED``, also as FSDP2 calls them) first
writes what this rank calls (op, shapes, dtypes, the reduction and root, group, this
group's count of checked collectives, the cell and line) under a key of the session's store (the TCP store the
group formed on, not the training group), waits for every member's key of the same
count, and compares op, shapes, dtypes, reduction and root (``compared``: gather's and
scatter's list, which only the root passes, and all-to-all's sizes, which uneven splits
make differ, are left out). On any difference every member raises
``CollectiveMismatchError`` before issuing it, naming each rank's call: nothing hangs,
nothing is in flight, the session stays usable. A rank that finished the cell writes
"finished" for every group (``cell_ended``), so a collective another rank skipped is
named at once; one that is late past the check's limit is named then.

Groups the session uses in the background (``engine.checkpoint_group``: async saves,
memory copies) are not checked: their collectives run in threads of their own.

Cost: a store write, a wait and a read per collective (``docs/how-to/debugging.md``
gives the measured numbers); off by default.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import time
import weakref
from datetime import timedelta
from typing import Any

from ..engine.checkpoint_group import background_groups
from ..engine.registry import Part, part
from ..engine.stacks import in_library
from ..errors import CollectiveMismatchError
from ..torch_compat import default_group, default_store
from .rank_cell_places import caller_frame, cell_name, stopped_at

__all__ = ["CHECKED", "CollectiveCheck", "arm", "breakpoint_held", "cell_ended", "checked_call", "compared"]

CHECKED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
           "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "barrier", "all_to_all",
           "all_to_all_single", "reduce", "gather", "scatter", "monitored_barrier")
"""The ``torch.distributed`` functions checked (those this torch has), wrapped while a
checked cell runs."""
_PREFIX = "fsdp_nb/collectives"
log = logging.getLogger("fsdp_nb")


class CollectiveCheck(Part):
    """The check on this rank: armed or not, and each group's count."""

    def __init__(self) -> None:
        self.limit: float | None = None
        """Seconds to wait for the other members' calls (None: the check is off)."""
        self.counts: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        """Process group -> collectives checked on it so far."""
        self.posted: dict[str, list[str]] = {}
        """Group name -> this rank's keys on it not yet removed from the store (a group's
        keys are removed once every member is past them, which says nothing of another
        group's)."""
        self.patched: dict[str, Any] = {}
        """Function name -> torch's own, while the wrappers are in place."""
        self.inside = False
        """A checked call is running (a collective made of others is checked once)."""
        self.epoch = 0
        """The notebook's number of the checked cell (keys of one cell never meet another's)."""

    def reformed(self, world: Any) -> None:
        """A new group: nothing of the cell the re-form cut short stays armed."""
        self.counts = weakref.WeakKeyDictionary()
        self.posted = {}
        self.limit = None
        _unpatch(self)

    def closed(self) -> None:
        _unpatch(self)
        self.limit = None


def _modules() -> list[Any]:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    return [dist, c10d]


def _patch(check: CollectiveCheck) -> None:
    if check.patched:
        return
    mods = _modules()
    for name in CHECKED:
        fn = getattr(mods[1], name, None) or getattr(mods[0], name, None)
        if fn is None:
            continue
        check.patched[name] = fn
        wrapper = functools.wraps(fn)(functools.partial(checked_call, name, fn))
        for m in mods:
            if getattr(m, name, None) is fn:
                setattr(m, name, wrapper)


def _unpatch(check: CollectiveCheck) -> None:
    for m in _modules():
        for name, fn in check.patched.items():
            if getattr(getattr(m, name, None), "func", None) is checked_call:
                setattr(m, name, fn)
    check.patched = {}


def arm(limit: float | None, epoch: int = 0) -> None:
    """Check the next cell's collectives (``limit``: seconds to wait for the others; None:
    off); ``epoch``: the session's count of armed cells, the same on every rank it runs on.
    Each group's count starts again at 0, so a cell a mismatch cut short leaves no rank
    out of step with the next."""
    check = part(CollectiveCheck)
    _forget(check)
    check.limit, check.epoch, check.counts = limit, epoch, weakref.WeakKeyDictionary()
    if limit is not None:
        check.posted[""] = [_stopped_key(epoch)]  # the cell's count of stopped ranks goes with its keys
        _patch(check)


def _forget(check: CollectiveCheck) -> None:
    """Remove this rank's keys of the cells before."""
    if check.posted:
        store = _store()
        for keys in check.posted.values():
            for key in keys:
                store.delete_key(key)
    check.posted = {}


@functools.lru_cache(maxsize=64)
def _signature(fn: Any) -> inspect.Signature:
    """``inspect.signature(fn)``, read once per collective."""
    return inspect.signature(fn)


def _group(kwargs: dict[str, Any], args: tuple[Any, ...], fn: Any) -> Any:

    try:
        group = _signature(fn).bind_partial(*args, **kwargs).arguments.get("group")
    except TypeError:
        group = kwargs.get("group")
    return group if group is not None else default_group()


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    import torch

    out: list[Any] = []
    for a in [*args, *kwargs.values()]:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _place() -> str:
    """The innermost frame of a cell (``cell [12] line 4``), else of the user's file."""
    frame = caller_frame(2)
    first = None
    while frame is not None:
        name = frame.f_code.co_filename
        if cell_name(name) is not None:
            return stopped_at(frame)
        if first is None and not in_library(name):
            first = frame
        frame = frame.f_back  # type: ignore[assignment]
    return stopped_at(first) if first is not None else "outside user code"


_ROOT_ONLY = frozenset({"gather", "scatter"})
"""Collectives whose list argument only the root passes: their ``tensor`` alone is compared."""
_SIZES_DIFFER = frozenset({"all_to_all", "all_to_all_single"})
"""Collectives whose tensors may differ in size across ranks (uneven splits): their count,
dimensions and dtypes are compared, not their sizes."""
_ROLES = ("op", "src", "dst", "group_src", "group_dst")
"""The arguments besides tensors that every member must pass alike (the reduction, the root)."""


def _role(value: Any) -> Any:
    """An argument as the ranks compare it: a number as is, a reduction by its name."""
    if isinstance(value, (bool, int, str)):
        return value
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else type(value).__name__


def _call(op: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What this rank calls, as the members compare it (JSON): the op, its tensors' shapes
    and dtypes, the reduction and root, and where in the user's code it was called."""
    import torch

    try:
        bound = _signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        named = dict(bound.arguments)
    except (TypeError, ValueError):
        named = dict(kwargs)
    ts = [t for t in [named.get("tensor")] if isinstance(t, torch.Tensor)] if op in _ROOT_ONLY else _tensors(args, kwargs)
    return {"op": op, "shapes": [list(t.shape) for t in ts], "dtypes": [str(t.dtype).replace("torch.", "") for t in ts],
            "roles": {k: _role(named[k]) for k in _ROLES if named.get(k) is not None}, "at": _place()}


def compared(call: dict[str, Any]) -> tuple[Any, ...]:
    """The part of a call (``_call``'s) that must be the same on every member."""
    shapes = call.get("shapes") or []
    if call.get("op") in _SIZES_DIFFER:
        shapes = [len(s) for s in shapes]
    return call.get("op"), shapes, call.get("dtypes"), call.get("roles") or {}


def checked_call(op: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` once every member of its group calls the same (see the module)."""
    __tracebackhide__ = True  # a mismatch's traceback ends at the user's line
    check = part(CollectiveCheck)
    if check.limit is None or check.inside:
        return fn(*args, **kwargs)
    group = _group(kwargs, args, fn)
    if any(group is g for g in background_groups()):
        return fn(*args, **kwargs)
    check.inside = True  # the collectives torch calls inside this one are not checked again
    try:
        mismatch = _compare(check, group, _call(op, fn, args, kwargs))
        if mismatch is None:
            return fn(*args, **kwargs)
    finally:
        check.inside = False
    raise CollectiveMismatchError(mismatch)  # on every rank of the group; none issued the collective


def _key(epoch: int, group: Any, seq: int, rank: int | str) -> str:
    return f"{_PREFIX}/{epoch}/{group.group_name}/{seq}/{rank}"


def _post(check: CollectiveCheck, group: Any, call: dict[str, Any]) -> tuple[int, list[int]]:
    import torch.distributed as dist

    seq = check.counts.get(group, 0)
    check.counts[group] = seq + 1
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    key = _key(check.epoch, group, seq, me)
    _store().set(key, json.dumps({**call, "group": str(getattr(group, "group_desc", "") or group.group_name),
                                  "seq": seq}))
    check.posted.setdefault(group.group_name, []).extend([key, _key(check.epoch, group, seq, "decided")])
    return seq, ranks


def _store() -> Any:
    return default_store()


def _compare(check: CollectiveCheck, group: Any, call: dict[str, Any]) -> str | None:
    """Post this rank's ``call`` and wait for the group's; what differs, in words (None:
    every member calls the same and none gave up waiting).

    A member that waited past the limit and a member that saw every call agree through
    one key set once (``compare_set``): the first to decide ("go" or "gave up") decides
    for all, so a late rank never issues a collective the others gave up on. While a
    member of the checked cell stands at a breakpoint the limit does not run out: it
    starts again, whole, once no member is stopped."""
    import torch.distributed as dist

    seq, ranks = _post(check, group, call)
    store, me = _store(), dist.get_rank()
    keys = [_key(check.epoch, group, seq, r) for r in ranks]
    decided = _key(check.epoch, group, seq, "decided")
    deadline = time.monotonic() + (check.limit or 0.0)
    while True:
        try:
            store.wait(keys, timedelta(seconds=max(0.01, min(0.5, deadline - time.monotonic()))))
            break
        except (RuntimeError, dist.DistStoreError) as exc:  # not all there yet
            if "timeout" not in str(exc).lower() and "wait" not in str(exc).lower():
                raise
            if store.add(_stopped_key(check.epoch), 0) > 0:  # a rank at a breakpoint: its turn will come
                deadline = time.monotonic() + (check.limit or 0.0)  # the whole limit again once it goes on
            elif time.monotonic() >= deadline and store.compare_set(decided, "", "gave up") == b"gave up":
                late = [r for r, k in zip(ranks, keys) if not store.check([k])]
                return _lines(ranks, me, {r: None for r in late}, call, seq, f"within {check.limit:g} s")
    calls = {r: json.loads(v) for r, v in zip(ranks, store.multi_get(keys))}
    mine = compared(call)
    if any(compared(c) != mine for c in calls.values()):
        return _lines(ranks, me, calls, call, seq, "")
    if store.compare_set(decided, "", "go") != b"go":  # a member gave up waiting for this rank
        return _lines(ranks, me, calls, call, seq, "in time: another rank gave up waiting for it first")
    mine_keys = check.posted[group.group_name]
    done, check.posted[group.group_name] = mine_keys[:-2], mine_keys[-2:]  # every member is past the ones before
    for key in done:
        store.delete_key(key)
    return None


def _stopped_key(epoch: int) -> str:
    return f"{_PREFIX}/{epoch}/stopped"


def breakpoint_held(delta: int) -> None:
    """This rank stops at (+1) or leaves (-1) a breakpoint in a checked cell: the other
    ranks' limit stands still while it is stopped (``_compare``)."""
    check = part(CollectiveCheck)
    if check.limit is not None:
        try:
            _store().add(_stopped_key(check.epoch), delta)
        except (RuntimeError, ValueError) as exc:  # the store is gone (the group is being torn down)
            log.warning("fsdp_nb: could not tell the checked collectives of a breakpoint: %s", exc)


def _describe(c: dict[str, Any]) -> str:
    if c.get("op") == "finished":
        return f"finished the cell without it ({c.get('at')})"
    parts = [f"{d}{list(s)}" for s, d in zip(c.get("shapes") or [], c.get("dtypes") or [])]
    parts += [f"{k}={v}" for k, v in (c.get("roles") or {}).items() if (k, v) != ("op", "SUM")]
    return f"{c.get('op')}({', '.join(parts)}) at {c.get('at')}"


def _lines(ranks: list[int], me: int, calls: dict[int, dict[str, Any] | None], mine: dict[str, Any], seq: int,
           late: str) -> str:
    group = calls.get(me, mine) or mine
    head = (f"the ranks called different collectives on {group.get('group') or 'their group'} (checked "
            f"collective #{seq}); none was issued:" if not late else
            f"not every rank reached collective #{seq} of its group {late}; none was issued:")
    body = []
    for r in ranks:
        c = calls.get(r, {} if r not in calls else None)
        if r == me:
            c = mine
        body.append(f"  rank {r}: " + ("did not reach it" if c is None else _describe(c)))
    return "\n".join([head, *body])


def cell_ended() -> None:
    """The cell ended on this rank: write "finished" at each group's next count, so a rank
    still waiting for a collective this rank skipped learns it at once; disarm."""
    check = part(CollectiveCheck)
    if check.limit is None:
        return
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            default = default_group()
            for group in [default, *(g for g in list(check.counts.keys()) if g is not default)]:
                _post(check, group, {"op": "finished", "shapes": [], "dtypes": [], "at": "the cell ended"})
    finally:
        check.limit = None
        _unpatch(check)  # torch's own functions back until the next checked cell (torch.compile sees them)
