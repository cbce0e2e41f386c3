"""The hang diagnosis from what the ranks said, the folded stacks, and where it shows: no engines."""

from __future__ import annotations

import dataclasses
import re
import sys
from types import SimpleNamespace
from typing import Literal

import pytest
import torch
import torch.distributed as dist

from fsdp_nb.engine.retired_groups import RetiredGroups
from fsdp_nb.engine.stacks import fold_stacks
from fsdp_nb.errors import WireError
from fsdp_nb.frontends.magics import parse_px
from fsdp_nb.hangs.hang_report import hang_report, out_of_step
from fsdp_nb.hangs.hang_view import HangView
from fsdp_nb.hangs.rank_hang_watch import RankWatch, main_frame
from fsdp_nb.hangs.wire_hang_state import RankState, UserFrame
from fsdp_nb.recovery.status import RankStatus, SessionStatus, apply_event
from fsdp_nb.runtime.checks import check_hang_after
from fsdp_nb.runtime.dispatch import CallEvent
from fsdp_nb.wire.decode import decode, encode, loads

NOW = 1_000_000.0


def _state(collective=None, frame=None, issued=()):
    """A rank's answer as its watch thread sends it (JSON), decoded as the notebook decodes it."""
    return decode(RankState, {"rank": None, "pid": 1, "now": NOW, "collective": collective, "issued": list(issued),
                              "frame": frame})


def _frame(function, where, code=""):
    return {"function": function, "where": where, "code": code}


def _waits(op="all_reduce", seq=57, shapes=([1],), dtypes=("float32",), waited=38.0, frame=None, group="default_pg"):
    return _state({"op": op, "seq": seq, "desc": group, "group_ranks": None, "since": NOW - waited,
                   "shapes": [list(s) for s in shapes], "dtypes": list(dtypes)}, frame)


def _in(function="data_step", where="cell line 3", code="time.sleep(60)"):
    return _state(None, _frame(function, where, code))


def test_a_straggler_is_named_first_then_who_waits_and_for_how_long():
    r = hang_report({0: _waits(frame=_frame("train_step", "cell line 9")), 1: _in()})
    assert r.lines == (
        "rank 1 is not in it: in data_step (cell line 3): time.sleep(60)",
        "rank 0 waits in all_reduce #57 on the default group (float32[1]) for 38 s, from train_step (cell line 9)",
    )
    assert (r.waiting, r.missing, r.stalled, r.mismatch) == ((0,), (1,), (), False)
    assert r.triggered(30) and not r.triggered(60)


def test_a_rank_that_does_not_answer_is_named_stopped_or_stuck():
    r = hang_report({0: _waits(), 1: None, 2: None}, stopped={1})
    assert r.lines[:2] == ("rank 1 is not responding (process stopped)",
                           "rank 2 is not responding (no answer: stuck in C holding the GIL, or gone)")
    assert (r.stalled, r.stopped) == ((1, 2), (1,))


def test_ranks_in_different_collectives_or_shapes_are_a_mismatch():
    r = hang_report({0: _waits(seq=12), 1: _waits(op="broadcast", seq=12)})
    assert r.mismatch and r.lines[0] == (
        "mismatch on the default group (different collectives): rank 0 in all_reduce #12, rank 1 in broadcast #12")
    r = hang_report({0: _waits(seq=12, shapes=([4],)), 1: _waits(seq=12, shapes=([8],))})
    assert r.mismatch and r.lines[0] == ("mismatch on the default group (the same op with different shapes): "
                                         "rank 0 in all_reduce #12 (float32[4]), rank 1 in all_reduce #12 (float32[8])")
    assert not hang_report({0: _waits(seq=12), 1: _waits(seq=12)}).mismatch


def test_an_idle_rank_and_no_collective_at_all():
    r = hang_report({0: _waits(group="dp_shard"), 1: _in()}, running={0})
    assert r.lines[0].startswith("rank 1 is not in it: idle") and "on group dp_shard" in r.lines[1]
    quiet = hang_report({0: _in(), 1: _in()})
    assert quiet.lines == () and not quiet.triggered(0)


def _counts(seq, since_ago=5.0, frame=None, group="0", desc="default_pg", ranks=(0, 1), backend="nccl"):
    """A rank whose watch found no collective (NCCL, no flight recorder) but counts."""
    return _state(None, frame, [{"name": group, "desc": desc, "ranks": list(ranks), "backend": backend, "seq": seq,
                                 "since": NOW - since_ago}])


def test_without_the_recorder_the_issued_counts_name_who_waits_and_who_is_missing():
    # rank 0 issued collective 58, which rank 1 has not: rank 0 waits in it, rank 1 is missing
    r = hang_report({0: _counts(58, since_ago=7.0, frame=_frame("step", "cell line 4")),
                     1: _counts(57, frame=_frame("data_step", "cell line 2", "load()"))})
    assert r.lines == (
        "rank 1 is not in it: in data_step (cell line 2): load()",
        "rank 0 waits in collective #58 on the default group for 7 s, from step (cell line 4)",
    )
    assert (r.waiting, r.missing, r.mismatch) == ((0,), (1,), False) and r.triggered(5) and not r.triggered(8)
    # the CPU ran ahead (async NCCL): 3 issued past the laggard, still #58 is the one it waits in
    assert "collective #58 " in hang_report({0: _counts(60), 1: _counts(57)}).lines[1]


def test_equal_counts_or_a_silent_member_say_nothing_and_a_frame_wins_over_counts():
    assert hang_report({0: _counts(9), 1: _counts(9)}).lines == ()
    assert hang_report({0: _counts(9), 1: None}).waiting == ()  # nothing to compare rank 0 with
    # a subgroup: only its members are compared
    sub = hang_report({0: _counts(4, group="3", desc="dp", ranks=(0, 2)), 1: _counts(1, ranks=(0, 1, 2)),
                       2: _counts(3, group="3", desc="dp", ranks=(0, 2))})
    assert sub.waiting == (0,) and "on group dp" in sub.lines[-1] and sub.missing == (2,)
    # a rank whose frame names its collective keeps it; no mismatch with a count-told one
    framed = dataclasses.replace(_waits(seq=5), issued=_counts(5).issued)
    r = hang_report({0: framed, 1: _counts(4)})
    assert r.lines[-1].startswith("rank 0 waits in all_reduce #5") and not r.mismatch


def test_a_group_left_out_of_step_is_named_rank_by_rank():
    assert out_of_step({0: _counts(3), 1: _counts(3)}) == []
    assert out_of_step({0: _counts(3), 1: _counts(4)}) == [
        "rank 1 issued collective #4 on the default group, which rank(s) 0 never joined"]
    three = {0: _counts(2, ranks=(0, 1, 2)), 1: _counts(3, ranks=(0, 1, 2)), 2: _counts(3, ranks=(0, 1, 2))}
    assert out_of_step(three) == [
        "rank 1 issued collective #3 on the default group, which rank(s) 0 never joined",
        "rank 2 issued collective #3 on the default group, which rank(s) 0 never joined"]
    assert out_of_step({0: _counts(3), 1: None}) == []  # a silent member: nothing to compare


class _Recorder:
    """torch's flight recorder as the watch reads it: the groups' status, and the records of
    collectives in flight; counts its reads."""

    def __init__(self, status, record):
        self.status, self.record, self.reads = status, record, []

    def __call__(self, collectives):
        self.reads.append(collectives)
        return {**self.status, "entries": [self.record]} if collectives else self.status


def _watch(recorder, frame=None, main=False, retired=None):
    return RankWatch(recorder=recorder, left=retired or RetiredGroups(recorder),
                     main_thread_frame=lambda: frame, on_main_thread=lambda: main, pause=lambda s: None)


def test_a_left_groups_collective_in_flight_is_not_named_once_retired():
    """The flight recorder keeps a destroyed group's status; a collective cut short stays
    "in flight" there. Once the groups are retired (before a destroy), it is not named."""
    recorder = _Recorder({"pg_status": {"0": {"last_enqueued_collective": "13", "last_completed_collective": "12"}}},
                         {"collective_seq_id": 13, "pg_id": 0, "process_group": ["0", "default_pg"],
                          "profiling_name": "gloo:all_reduce", "time_created_ns": 1_000 * 10**9,
                          "input_sizes": [[144]], "input_dtypes": ["Float"]})
    retired = RetiredGroups(recorder)
    watch = _watch(recorder, main=True, retired=retired)
    found = watch.collective(now=True)
    assert found is not None and (found.op, found.seq, found.shapes, found.dtypes) == (
        "all_reduce", 13, ((144,),), ("float32",))
    retired.retire()
    assert watch.collective(now=True) is None and retired.keys == {"0"}
    # a group formed after it, under a new key, is read as before
    recorder.status["pg_status"]["1"] = {"last_enqueued_collective": "2", "last_completed_collective": "1"}
    recorder.record.update(collective_seq_id=2, pg_id=1, process_group=["0", "default_pg"], input_sizes=[[1]])
    assert watch.collective(now=True).seq == 2


def test_a_collective_whose_record_is_retired_or_of_a_group_left_is_not_named():
    """gloo's worker threads each write a group's last completed number as theirs ends: a
    later one finishing first leaves the status saying an ended collective is in flight.
    Its record says it ended (``retired``). And a group formed again takes its old name in
    the records (``"0"`` again), where the old group's record of a collective cut short is
    never retired: records go with the status by ``pg_id``, a key never reused."""
    old = {"collective_seq_id": 7, "pg_id": 0, "process_group": ["0", "default_pg"],
           "profiling_name": "gloo:all_gather", "time_created_ns": 5_000 * 10**9, "input_sizes": [[36]],
           "input_dtypes": ["Float"], "retired": True}
    recorder = _Recorder({"pg_status": {"0": {"last_enqueued_collective": "7", "last_completed_collective": "6"}}},
                         old)
    retired = RetiredGroups(recorder)
    watch = _watch(recorder, main=True, retired=retired)
    assert watch.collective(now=True) is None  # the status is stale: the record ended
    old["retired"] = False
    assert watch.collective(now=True).op == "all_gather"  # a live record: in flight
    retired.retire()  # cut short there; the groups form again: the new default group is "1" in the status
    recorder.status["pg_status"]["1"] = {"last_enqueued_collective": "7", "last_completed_collective": "6"}
    assert watch.collective(now=True) is None  # the old group's #7, never retired, is not the new one's
    new = {**old, "pg_id": 1, "profiling_name": "gloo:all_reduce", "input_sizes": [[1]]}
    recorder.record = new  # the new group's own #7, under the old name
    found = watch.collective(now=True)
    assert found is not None and (found.op, found.seq, found.shapes) == ("all_reduce", 7, ((1,),))


def test_stacks_are_folded_to_the_users_frames():
    dump = (
        'Current thread 0x01 (most recent call first):\n'
        '  File "/lib/site/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "/lib/site/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
        '  File "/tmp/ipykernel_7/123.py", line 4 in data_step\n'
        '  File "/lib/site/ipykernel/kernelbase.py", line 1 in run\n'
        '  File "/lib/std/asyncio/events.py", line 2 in run\n'
        '\nThread 0x02 (most recent call first):\n  File "/lib/std/threading.py", line 1 in wait\n'
    )
    folded = fold_stacks(dump, libs=("/lib/site", "/lib/std"))
    assert folded.splitlines() == [
        "Current thread 0x01 (most recent call first):",
        "  … 2 framework frames (torch)",
        '  File "/tmp/ipykernel_7/123.py", line 4 in data_step',
        "  … 2 framework frames (asyncio, ipykernel)",
        "  … 1 other thread (framework)",
    ]


def test_the_main_threads_user_frame_is_this_test():
    here = main_frame(sys._getframe())  # noqa: SLF001 - this test's own frame
    assert here is not None and here.function == "test_the_main_threads_user_frame_is_this_test"
    assert here.where.startswith("test_hang_report.py:") and here.code.startswith("here = main_frame(")
    assert main_frame(None) is None


def test_hang_after_is_checked_and_read_from_px():
    assert parse_px("--hang-after 5").hang_after == 5.0 and parse_px("").hang_after is None
    with pytest.raises(ValueError, match="hang-after"):
        parse_px("--hang-after 0")
    for bad in (0, -1, float("inf"), True, "30"):
        with pytest.raises(ValueError, match="hang_after must be a number of seconds > 0"):
            check_hang_after(bad)
    assert check_hang_after(None) is None and check_hang_after(2) == 2.0


def test_in_a_script_the_diagnosis_goes_to_stderr_when_it_says_something_new(capsys):
    view = HangView()
    view("execute", hang_report({0: _waits(waited=31), 1: _in()}))
    view("execute", hang_report({0: _waits(waited=33), 1: _in()}))  # only the seconds changed
    view("execute", None)
    err = capsys.readouterr().err
    assert err.count("fsdp_nb: execute has waited") == 1 and "rank 1 is not in it" in err
    assert re.search(r"execute: the collective completed \(it had waited 33 s\)", err)


def test_the_status_widget_keeps_one_line_per_diagnosis():
    st = SessionStatus("ready", "gloo", ranks=(RankStatus(0, 0, "h", 1, "cpu", "busy"),
                                                RankStatus(1, 1, "h", 2, "cpu", "busy")))
    note = hang_report({0: _waits(), 1: _in()}).text
    for _ in range(3):
        st = apply_event(st, CallEvent("execute", "hang", (1,), note=note))
    assert len(st.events) == 1 and "rank 1 is not in it" in st.events[0]
    assert st.ranks[0].activity.startswith("rank 0 waits in all_reduce #57")
    st = apply_event(st, CallEvent("execute", "hang-cleared", note="the collective completed"))
    assert len(st.events) == 1 and "hang-cleared" in st.events[0]


def _code(name, filename):
    return SimpleNamespace(co_name=name, co_filename=filename)


def new_group():
    """A user's function that happens to share a name with torch's: making no group."""


def test_the_recorder_is_read_only_once_the_main_thread_has_settled(group):
    """torch's recorder dump walks its table of groups unlocked, and the main thread adds
    to it as it makes a group or issues a group's first collective: another thread reads
    it only when the main thread sat still, making no group and issuing nothing. Real
    collectives on a one-rank gloo group move the counts; the main thread's frame is the
    watch's to read, handed to it."""
    recorder = _Recorder({"pg_status": {"0": {"last_enqueued_collective": "7", "last_completed_collective": "6"}}},
                         {"collective_seq_id": 7, "pg_id": 0, "process_group": ["0", "default_pg"],
                          "profiling_name": "gloo:all_gather", "time_created_ns": 1_000 * 10**9,
                          "input_sizes": [[8]], "input_dtypes": ["Float"]})
    here = SimpleNamespace(f_code=_code("train", __file__), f_lasti=40, f_back=None)
    watch = _watch(recorder, frame=here)
    assert watch.collective() is None and recorder.reads == []  # the first question has nothing to compare
    second = watch.collective()
    assert second is not None and (second.op, second.seq) == ("all_gather", 7) and recorder.reads == [False, True]
    recorder.reads.clear()
    assert _watch(recorder, frame=here).collective(now=True).seq == 7  # now: still over the pause is enough
    # the main thread moved on to the next instruction between two questions
    watch.collective()
    here.f_lasti = 42
    assert watch.collective() is None
    # it is making a group (inside torch's new_group): the recorder is left alone, even when still
    making = SimpleNamespace(f_code=_code("new_group", dist.distributed_c10d.__file__), f_lasti=1, f_back=None)
    inside = SimpleNamespace(f_code=_code("_store_based_barrier", dist.distributed_c10d.__file__), f_lasti=5,
                             f_back=making)
    recorder.reads.clear()
    watch.main_thread_frame = lambda: inside
    assert [watch.collective(), watch.collective(), watch.collective(now=True)] == [None] * 3
    assert recorder.reads == []
    # a user's function of the same name makes no group: read as soon as it sat still
    watch.main_thread_frame = lambda: SimpleNamespace(f_code=new_group.__code__, f_lasti=3, f_back=None)
    watch.collective()
    assert watch.collective().seq == 7
    # issuing collectives (its counts move) is not settled either, even at the same instruction
    watch.main_thread_frame = lambda: here
    watch.collective()
    recorder.reads.clear()
    for _ in range(3):
        dist.all_reduce(torch.ones(1))
        assert watch.collective() is None
    assert recorder.reads == []
    # on the main thread itself (a call running it) the recorder is read at once
    assert _watch(recorder, frame=here, main=True).collective().seq == 7


def test_a_rank_state_crosses_as_json_and_a_renamed_field_fails_loudly():
    state = RankState(rank=1, pid=2, now=NOW, collective=None, issued=(), frame=UserFrame(function="f", where="cell line 1", code="x"))
    assert loads(RankState, encode(state)) == state
    raw = encode(state).replace(b'"frame"', b'"user_frame"')
    with pytest.raises(WireError, match=r"RankState: unknown field\(s\) user_frame; missing field\(s\) frame"):
        loads(RankState, raw)
    with pytest.raises(WireError, match=r"RankState.issued\[0\]: missing field\(s\) since"):
        _state(issued=[{"name": "0", "desc": "default_pg", "ranks": [0], "backend": "gloo", "seq": 1}])
    with pytest.raises(WireError, match="RankState.collective.seq: expected an int, got '5'"):
        _waits(seq="5")


def test_a_rank_whose_watch_failed_is_named_so_not_as_silent(caplog):
    """A rank's thread that raised while telling where it is answers a WatchError: the
    report says so (it is not stopped nor stuck), and the notebook logs it once."""
    from fsdp_nb.hangs.hang_watch import HangWatch
    from fsdp_nb.hangs.wire_hang_state import WatchError

    r = hang_report({0: _waits(), 1: WatchError(error="RuntimeError: no group")})
    assert r.lines[0] == "rank 1 is not in it, as far as it can tell: its watch failed (RuntimeError: no group)"
    assert r.stalled == () and r.missing == (1,)
    watch = HangWatch(cluster=None)  # type: ignore[arg-type]  # decoding needs no engines
    for raw in (b"{not json", b'{"rank": 1}', encode(WatchError(error="x"))):
        assert watch._decode(1, raw, RankState) is None
    assert watch._decode(1, encode(WatchError(error="x")), RankState, WatchError) == WatchError(error="x")
    assert watch._decode(0, b"[]", RankState) is None
    said = [rec.getMessage() for rec in caplog.records if "hang watch" in rec.getMessage()]
    assert len(said) == 2 and all("cannot read" in s for s in said)  # once per rank


@dataclasses.dataclass(frozen=True)
class _Kinds:
    mode: Literal["a", "b"]
    sizes: tuple[int, ...]
    pair: tuple[str, float]
    names: dict[str, list[int]]


@dataclasses.dataclass(frozen=True)
class _NotJson:
    raw: bytes


def test_decoding_checks_every_kind_of_field_and_refuses_a_type_json_cannot_carry():
    from fsdp_nb.errors import WireError

    got = decode(_Kinds, {"mode": "b", "sizes": [1, 2], "pair": ["x", 3], "names": {"k": [1]}})
    assert got == _Kinds("b", (1, 2), ("x", 3.0), {"k": [1]}) and isinstance(got.pair[1], float)
    for bad, match in (({"mode": "c"}, "'c' is not one of 'a', 'b'"), ({"sizes": [1, True]}, r"sizes\[1\]: expected an int"),
                       ({"pair": ["x"]}, "expected 2 items, got 1"), ({"names": {"k": 1}}, "expected a list")):
        with pytest.raises(WireError, match=match):
            decode(_Kinds, {"mode": "a", "sizes": [], "pair": ["x", 1.0], "names": {}} | bad)
    with pytest.raises(TypeError, match="cannot come from JSON"):
        decode(_NotJson, {"raw": "x"})



class _Cluster:
    world_size = 3

    def stopped_ranks(self, ranks):
        return []


def _watching(silent):
    """A real ``Watching`` over a ``HangWatch`` whose ranks answer as scripted: ranks 0
    and 2 wait in a collective, rank 1 (busy, on a loaded host) misses the quick 0.1 s
    question and answers within ``answer_s``, the ranks in ``silent`` never answer."""
    from fsdp_nb.hangs.hang_watch import HangWatch, Watching

    class Scripted(HangWatch):
        def states(self, ranks, now=True):
            self.asked.append((tuple(ranks), now))
            got = {0: _waits(), 1: _in() if now else None, 2: _waits()}
            return {r: None if r in silent else got.get(r) for r in ranks}

    watch = Scripted(_Cluster())  # type: ignore[arg-type]
    watch.asked = []
    shown = []
    w = Watching(watch, "run", started=0.0, hang_after=1.0, notify=lambda *a, **k: None,
                 view=lambda what, report, ended="": shown.append(report))
    w.every = float("inf")  # an unchanged diagnosis is never shown again: a pause on a loaded host changes nothing
    return w, watch.asked, shown


def test_a_rank_slow_to_answer_the_quick_question_is_asked_again_before_it_is_called_silent():
    w, asked, shown = _watching(silent=())
    w.poll([0, 1, 2])
    assert asked == [((0, 1, 2), False), ((1,), True)]  # only the rank that missed it, with answer_s
    assert shown[-1].lines[0] == "rank 1 is not in it: in data_step (cell line 3): time.sleep(60)"
    assert shown[-1].stalled == ()


def test_a_silent_rank_is_waited_for_once_not_at_every_question():
    w, asked, shown = _watching(silent={2})
    w.poll([0, 1, 2])
    assert asked == [((0, 1, 2), False), ((1, 2), True)] and shown[-1].stalled == (2,)
    assert "rank 2 is not responding (no answer" in shown[-1].text
    w.next = 0.0  # the next tick: rank 1 misses the quick question again, rank 2 stays silent
    w.poll([0, 1, 2])
    assert asked[2:] == [((0, 1, 2), False), ((1,), True)]  # rank 2, shown silent, is not waited for again
    assert len(shown) == 1  # the same diagnosis: not redrawn
