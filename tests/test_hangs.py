"""Hangs explained while they happen, on real engines: a straggler, a stopped rank, a
mismatch, a rank that fails while the others wait. Every fault is triggered by a marker
the engines or the watch itself write, never by a timer."""

from __future__ import annotations

import os
import re

import psutil
import pytest
import torch
from helpers import mark_code, on_marker, release_on_diagnosis, straggle

from fsdp_nb.errors import RankError, RankTimeoutError
from fsdp_nb.hangs import rank_hang_watch as hang_watch
from fsdp_nb.runtime.cluster import wait_until

BLOCKED = "t = torch.ones(1)\ndist.all_reduce(t)\n"


def _follow(s) -> list[tuple[str, str]]:
    """(phase, note) of every hang event the session's dispatcher reports from now on."""
    seen: list[tuple[str, str]] = []
    s.dispatcher.observers.append(lambda e: seen.append((e.phase, e.note)) if e.phase.startswith("hang") else None)
    return seen


def _line(code: str, text: str) -> int:
    """The cell line of ``code`` that holds ``text``."""
    return next(i for i, ln in enumerate(code.splitlines(), 1) if text in ln)


def test_a_straggler_is_explained_while_the_cell_waits_and_its_arrival_ends_the_cell(sess, tmp_path, capsys):
    go = tmp_path / "go"
    seen = _follow(sess)
    code = (
        "import os, time, torch\nimport torch.distributed as dist\n"
        "def data_step():\n"
        f"    while not os.path.exists({str(go)!r}): time.sleep(0.02)\n"  # one line: whichever a sample lands in
        "if rank == 1:\n    data_step()\n" + BLOCKED + "straggled = float(t)\n"
    )
    try:
        with release_on_diagnosis(sess, go):  # the first diagnosis lets the straggler go
            sess.execute(code, hang_after=1)
    finally:
        sess.dispatcher.observers.pop(-1)  # _follow's
    assert sess.pull("straggled") == [2.0, 2.0]  # the cell ended normally
    phases = [p for p, _ in seen]
    assert phases[0] == "hang" and phases[-1] == "hang-cleared"
    lines = seen[0][1].splitlines()
    assert lines[0] == (f"rank 1 is not in it: in data_step (cell line {_line(code, 'sleep')}): "
                        f"while not os.path.exists({str(go)!r}): time.sleep(0.02)")
    assert re.fullmatch(r"rank 0 waits in all_reduce #\d+ on the default group \(float32\[1\]\) for \d+ s, "
                        rf"from <module> \(cell line {_line(code, 'all_reduce')}\)", lines[1])
    err = capsys.readouterr().err  # not a notebook: the diagnosis went to stderr
    assert "fsdp_nb: execute has waited" in err and "the collective completed" in err


def test_mismatched_collectives_are_named_and_the_timeout_leads_with_them(sess):
    code = "import torch\nimport torch.distributed as dist\nt = torch.ones(4)\n" \
           "if rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, 0)\n"
    before = sess.all_reduce_check()
    sess.execute("mm_kept = 10 + rank")
    with pytest.raises(RankTimeoutError) as info:
        sess.execute(code, timeout=3, hang_after=1)
    err = info.value
    assert re.fullmatch(r"mismatch on the default group \(different collectives\): "
                        r"rank 0 in all_reduce #(\d+), rank 1 in broadcast #\1", err.diagnosis[0])
    assert str(err).startswith("execute did not finish within 3 s on rank(s) 0, 1:\n  mismatch on the default group")
    assert "framework frame" in str(err)  # the stacks follow, framework frames folded
    # recovered without a kill: both ranks' sockets closed by their watch threads, both
    # back in Python with their variables, in a new group
    assert sess.all_reduce_check() == before and sess.pull("mm_kept") == [10, 11]
    # the cut collectives stay "in flight" in the old groups' recorder status: no rank
    # reports them as where it waits now (a later straggler would be misnamed)
    assert wait_until(lambda: sess.run(lambda: hang_watch.watch().collective(now=True)) == [None, None], 5)


def test_a_rank_that_fails_while_the_other_waits_says_where_the_other_waited(sess):
    code = "import torch\nimport torch.distributed as dist\nif rank == 1:\n    raise ValueError('bad batch')\n" + BLOCKED
    with pytest.raises(RankError) as info:
        sess.execute(code)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "While the other ranks waited:" in notes
    assert re.search(r"rank 1 is not in it: idle .*\n\s*rank 0 waits in all_reduce #\d+ on the default group", notes)
    assert sess.all_reduce_check() == 1.0


def test_a_stopped_rank_is_named_and_the_waiting_rank_keeps_its_model_and_variables(session_factory, tmp_path):
    s = session_factory(2, private=True)
    try:
        s.execute(
            "import torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
            "torch.manual_seed(0)\nnet = torch.nn.Linear(4, 4)\nfully_shard(net)\nkept = 41 + rank\n"
        )
        before = s.run(lambda: net.weight.to_local().clone())  # noqa: F821 - engine global
        victim = psutil.Process(s.ranks[1].pid)
        marker = tmp_path / "looping"
        on_marker(marker, victim.suspend)
        code = "if rank == 1:\n    " + mark_code(marker) + "for _ in range(10 ** 9):\n    dist.all_reduce(torch.ones(1))\n"
        with pytest.raises(RankTimeoutError) as info:
            s.execute(code, timeout=5)
        err = info.value
        assert err.diagnosis[0] == "rank 1 is not responding (process stopped)"
        assert re.match(r"rank 0 waits in all_reduce #\d+ on the default group \(float32\[1\]\)", err.diagnosis[1])
        assert "replaced" in "\n".join(err.__notes__)
        # the stopped rank was killed and replaced; the waiting rank kept everything
        assert not victim.is_running() and s.ranks[1].pid != victim.pid and s.state == "ready"
        assert s.run(lambda: globals().get("kept")) == [41, None]
        after = s.run(lambda: globals()["net"].weight.to_local().clone() if "net" in globals() else None)
        assert torch.equal(after[0], before[0]) and after[1] is None
        assert s.all_reduce_check() == 1.0
    finally:
        s.shutdown()


def test_without_the_flight_recorder_the_waiting_collective_is_read_from_the_stack(session_factory, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # the engines record nothing (fsdp_nb keeps a user's value)
    s = session_factory(2, private=True, standby=False)
    go = tmp_path / "go"
    code = ("import os, time, torch\nimport torch.distributed as dist\n"
            + straggle(go) + BLOCKED)
    # as an NCCL rank waits: the collective issued, then a wait outside torch.distributed,
    # so neither the stack nor a recorder names it: the groups' issued counts do
    go_async = tmp_path / "go-async"
    like_nccl = ("import os, time, torch\nimport torch.distributed as dist\n"
                 + straggle(go_async) +
                 "w = dist.all_reduce(torch.ones(1), async_op=True)\nwhile not w.is_completed():\n"
                 "    time.sleep(0.01)\n")
    try:
        with release_on_diagnosis(s, go) as seen:
            s.execute(code, hang_after=1)
        assert s.run(lambda: os.environ["TORCH_FR_BUFFER_SIZE"]) == ["0", "0"]
        with release_on_diagnosis(s, go_async) as counted:
            s.execute(like_nccl, hang_after=1)
    finally:
        s.shutdown()
    lines = seen[0].splitlines()
    assert lines[0] == f"rank 1 is not in it: in <module> (cell line 3): {straggle(go).strip()}"
    assert re.match(r"rank 0 waits in all_reduce #\d+ on the default group \(float32\[1\]\) for \d+ s", lines[1])
    lines = counted[0].splitlines()
    assert lines[0] == f"rank 1 is not in it: in <module> (cell line 3): {straggle(go_async).strip()}"
    assert re.match(r"rank 0 waits in collective #\d+ on the default group for \d+ s, from <module> "
                    rf"\(cell line {_line(like_nccl, 'sleep(0.01)')}\)", lines[1]), lines


def test_a_failure_that_leaves_a_collective_unjoined_reforms_the_group(session_factory):
    """Rank 1 issues a collective rank 0 never joins, then fails, while rank 0 has
    returned: nobody waits, yet the group is out of step, and its next collective would
    pair rank 0's with rank 1's (gloo aborts rank 0 on the size: the engine dies). The
    failure re-forms the group; the old group's flight-recorder status, which keeps the
    cut collective "in flight" for good, no longer says where rank 1 waits."""
    s = session_factory(2, private=True, standby=False)
    try:
        s.execute("import torch\nimport torch.distributed as dist\nkept = 5 + rank")
        with pytest.raises(RankError) as info:
            s.execute("if rank == 1:\n    cut = dist.all_reduce(torch.ones(144), async_op=True)\n"
                      "    raise ValueError('after an async collective')\n")
        notes = "\n".join(info.value.__notes__)
        assert ("The failure left the group out of step: rank 1 issued collective #1 on the default "
                "group, which rank(s) 0 never joined.") in notes
        assert "joined a new process group; variables, models and optimizers are kept" in notes
        assert s.all_reduce_check() == 1.0 and s.pull("kept") == [5, 6] and s.state == "ready"
        assert s.run(lambda: os.environ["TORCH_FR_BUFFER_SIZE"]) == ["256", "256"]  # the recorder is on
        assert wait_until(lambda: s.run(lambda: hang_watch.watch().collective(now=True)) == [None, None], 5)
        # a failure that leaves the group in step re-forms nothing
        with pytest.raises(RankError) as info:
            s.execute("if rank == 1:\n    raise ValueError('no collective')\n")
        assert not any("out of step" in n for n in getattr(info.value, "__notes__", []))
    finally:
        s.shutdown()


def test_ctrl_c_during_a_hang_leads_with_where_each_rank_was(sess, tmp_path, capsys):
    import _thread

    marker = tmp_path / "sleeping"
    on_marker(marker, _thread.interrupt_main)
    sess.execute("hang_kept = 7 + rank")
    code = ("import time, torch\nimport torch.distributed as dist\n"
            "if rank == 1:\n    " + mark_code(marker) + "    time.sleep(30)\n" + BLOCKED)
    with pytest.raises(KeyboardInterrupt):
        sess.execute(code)
    out = capsys.readouterr().out
    head = out[out.index("fsdp_nb: interrupted execute:"):].splitlines()
    assert head[1].startswith("  rank 1 is not in it: in <module> (cell line ")  # at its sleep, or its marker
    assert re.match(r"  rank 0 waits in all_reduce #\d+ on the default group \(float32\[1\]\)", head[2])
    assert sess.pull("hang_kept") == [7, 8] and sess.all_reduce_check() == 1.0
