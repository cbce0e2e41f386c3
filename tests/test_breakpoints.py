"""Debugging ranks while they run: breakpoints in cells, driven from the notebook, and the
collective check that names a mismatched collective before it hangs.

The shared session drives the console with ``input()`` answered in order (as the
post-mortem test does); a real kernel drives it through jupyter_client's stdin channel.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from fsdp_nb.debugging.cell_debug import CHECK_LIMIT_S
from fsdp_nb.errors import RankError

CELL = """import torch, torch.distributed as dist
x = torch.ones(3) * (rank + 1)
breakpoint()
y = x * 2
dist.all_reduce(y)
print('done', y.tolist())
"""


def _answer(monkeypatch, answers, before=None):
    """``input()`` answers ``answers`` in order (calling ``before()`` first); the prompts
    it was shown."""
    left, prompts = iter(answers), []

    def fake_input(prompt=""):
        prompts.append(prompt)
        if before is not None:
            before()
        return next(left)

    monkeypatch.setattr("builtins.input", fake_input)
    return prompts


def test_a_breakpoint_stops_the_chosen_rank_while_the_other_waits_in_its_collective(sess, monkeypatch, capsys):
    status = []  # sess.status() at the first prompt, while rank 1 stands
    prompts = _answer(monkeypatch, ["p x.shape", "n", "p y", "ll", "c"], before=lambda: status or status.append(sess.status()))
    events = []
    sess._ctx.dispatcher.observers.append(events.append)
    try:
        sess.execute(CELL, debug=[1])
    finally:
        sess._ctx.dispatcher.observers.remove(events.append)
    out = capsys.readouterr().out
    assert prompts == ["(Pdb rank 1) "] * 5
    assert "rank 1 stopped at a breakpoint in line 4 of the running cell" in out  # no notebook: no cell number
    assert "torch.Size([3])" in out  # rank 1's x, not rank 0's
    assert "tensor([4., 4., 4.])" in out  # after `n`: y = x * 2 on rank 1
    assert "  3  \tbreakpoint()" in out and "  5  ->\tdist.all_reduce(y)" in out  # the cell's lines
    assert "[ranks 0-1] done [6.0, 6.0, 6.0]" in out
    # the stop was told as a breakpoint, never as a hang
    assert any(e.phase == "breakpoint" and "rank 1 is at a breakpoint in line 4 of the running cell" in e.note for e in events)
    assert not [e for e in events if e.phase == "hang"]
    assert [r.state for r in status[0].ranks] == ["busy", "stopped"]  # rank 0 waits in its all_reduce
    assert status[0].ranks[1].activity == "at a breakpoint in line 4 of the running cell"
    assert sess.status().idle == [0, 1]
    # the choice ends with the cell: the same code elsewhere does not stop
    sess.execute("breakpoint()\nprint('went on')")
    assert "went on" in capsys.readouterr().out


def test_two_ranks_stopped_answer_one_command_merged_and_c_continues_both(sess, monkeypatch, capsys):
    prompts = _answer(monkeypatch, ["ranks 0-1 p x.sum().item()", "ranks 0-1 p 7", "rank 1", "p rank", "c"])
    sess.execute("import fsdp_nb\nfsdp_nb_bp = fsdp_nb.breakpoint")
    sess.execute(CELL.replace("breakpoint()", "fsdp_nb_bp(ranks=[0, 1])"), hang_after=0.5)
    out = capsys.readouterr().out
    assert prompts == ["(Pdb rank 0) "] * 3 + ["(Pdb rank 1) "] * 2
    assert "[rank 0]\n3.0\n[rank 1]\n6.0\n" in out  # each rank's own answer
    assert "(Pdb rank 0) ranks 0-1 p 7" not in out and "\n7\n" in out  # an answer alike: once, unlabelled
    assert out.count("[ranks 0-1] done") == 1
    assert "waits in" not in out  # a short hang_after: still no hang while stopped


def test_debug_commands_run_at_every_stop_and_a_trailing_c_asks_nothing(sess, monkeypatch, capsys):
    def no_input(prompt=""):
        raise AssertionError(f"asked {prompt!r}")

    monkeypatch.setattr("builtins.input", no_input)
    sess.execute("import fsdp_nb, torch, torch.distributed as dist\nfor i in range(3):\n"
                 "    loss = torch.tensor(1.0 / (i + 1))\n    fsdp_nb.breakpoint(ranks=1)\n    dist.all_reduce(loss)",
                 debug_commands="p i, round(loss.item(), 3);; c")
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("(0, ") or line.startswith("(1, ")
            or line.startswith("(2, ")] == ["(0, 1.0)", "(1, 0.5)", "(2, 0.333)"]  # rank 1's values, each stop
    assert out.count("(Pdb rank 1) c") == 3
    with pytest.raises(ValueError, match="debug_commands takes pdb command lines"):
        sess.execute("pass", debug_commands=["p x", ""])


def test_ctrl_c_at_the_prompt_leaves_the_debugger_and_interrupts_the_cell(sess, monkeypatch):
    """A real SIGINT, as interrupting the kernel sends, while the prompt waits: the gather
    loop's own handler only notes a Ctrl-C, so the prompt must have Python's back."""
    waited_out = []

    def interrupt(prompt=""):
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the prompt waits for the user; SIGINT must end the wait
            time.sleep(0.01)
        waited_out.append(prompt)  # the Ctrl-C did not reach the prompt
        return "c"

    monkeypatch.setattr("builtins.input", interrupt)
    with pytest.raises(KeyboardInterrupt):
        sess.execute(CELL.replace("dist.all_reduce(y)", "import time\nwhile True: time.sleep(0.05)"), debug=[1])
    assert waited_out == []
    assert sess.all_reduce_check() == 1.0  # the session is usable, no rank stopped
    assert sess.run(lambda: 1) == [1, 1]


def test_a_rank_that_stops_while_the_prompt_is_open_joins_it(sess, monkeypatch, capsys):
    """Rank 0 reaches its breakpoint after rank 1's prompt opened: the prompt takes it in
    (and holds it) rather than leaving it to its hold time."""
    said = []

    def answer(prompt=""):
        said.append(capsys.readouterr().out)
        if "rank 0 stopped at a breakpoint" not in "".join(said):
            assert len(said) < 500, "rank 0's stop never reached the prompt"
            return "p rank"
        return "ranks 0-1 p rank + 10" if "[rank 0]" not in said[-1] else "c"

    monkeypatch.setattr("builtins.input", answer)
    sess.execute("import time, torch, torch.distributed as dist\nif rank == 0:\n    time.sleep(1.0)\n"
                 "breakpoint()\ndist.all_reduce(torch.ones(1))", debug=[0, 1])
    out = "".join(said) + capsys.readouterr().out
    assert "rank 1 stopped at a breakpoint" in out and "rank 0 stopped at a breakpoint" in out
    assert "[rank 0]\n10\n[rank 1]\n11\n" in out


def test_a_rank_late_past_the_checks_limit_is_named_and_never_issues_it_alone(sess):
    """Rank 0 waits 0.5 s for rank 1's call and gives up; rank 1, arriving later, finds
    every call posted and alike, and must still not issue an all-reduce that rank 0 will
    never join: it raises too, and nothing hangs."""
    with pytest.raises(RankError) as info:
        sess.execute("import time, torch, torch.distributed as dist\nif rank == 1:\n    time.sleep(1.5)\n"
                     "dist.all_reduce(torch.ones(2))", check_collectives=0.5, timeout=60)
    text = str(info.value)
    assert "rank(s) 0, 1" in text, text
    assert "not every rank reached collective #0 of its group within 0.5 s" in text
    assert "rank 1: did not reach it" in text
    assert "another rank gave up waiting for it first" in text
    assert sess.all_reduce_check() == 1.0


def test_the_checks_limit_does_not_run_out_while_a_rank_stands_at_a_breakpoint(sess, monkeypatch):
    """A checked cell, rank 1 at its prompt 4 s, past the check's 3 s limit, then 1.6 s of
    work before its all-reduce: rank 0, waiting in the check, gives the whole limit again
    from when rank 1 went on, and the all-reduce runs."""
    def slow_user(prompt=""):
        time.sleep(4.0)  # the user reads the rank's state
        return "c"

    monkeypatch.setattr("builtins.input", slow_user)
    sess.execute("import time, torch, torch.distributed as dist\nt = torch.ones(2)\nbreakpoint()\n"
                 "if rank == 1:\n    time.sleep(1.6)\ndist.all_reduce(t)\nchecked_sum = t.tolist()",
                 debug=[1], check_collectives=3.0)
    assert sess.pull("checked_sum") == [[2.0, 2.0]] * 2


def test_a_rank_that_hears_nothing_from_the_notebook_goes_on_and_says_so(sess, capsys):
    def hold(seconds):
        from fsdp_nb.debugging.rank_breakpoints import Breakpoints
        from fsdp_nb.engine.registry import part

        part(Breakpoints).hold_s = seconds

    d = sess._ctx.dispatcher
    watch, d.watch = d.watch, None  # the notebook stops asking, as a closed tab or dead kernel would
    sess.run(hold, 1.0)
    try:
        sess.execute("import fsdp_nb\nfsdp_nb.breakpoint(ranks=[1])\nheld_on = rank")
    finally:
        d.watch = watch
        sess.run(hold, 60.0)
    assert sess.pull("held_on") == [0, 1]  # rank 1 went on and finished the cell
    captured = capsys.readouterr()
    assert "heard nothing from the notebook for 1 s at its breakpoint" in captured.out + captured.err


# -- the collective check ------------------------------------------------------------


@pytest.mark.parametrize("code, says", [
    ("t = torch.ones(3 if rank else 4)\ndist.all_reduce(t)\n",
     ["rank 0: all_reduce(float32[4]) at line 2 of the running cell", "rank 1: all_reduce(float32[3]) at line 2 of the running cell"]),
    ("t = torch.ones(3)\nif rank:\n    dist.all_gather_into_tensor(torch.empty(6), t)\nelse:\n    dist.all_reduce(t)\n",
     ["rank 0: all_reduce(float32[3]) at line 5 of the running cell",
      "rank 1: all_gather_into_tensor(float32[6], float32[3]) at line 3 of the running cell"]),
    ("if rank == 0:\n    dist.barrier()\n", ["rank 0: barrier() at line 2 of the running cell", "rank 1: finished the cell without it"]),
], ids=["shapes", "ops", "skipped barrier"])
def test_a_mismatched_collective_is_named_before_it_is_issued(sess, code, says):
    sess.execute("import torch, torch.distributed as dist")
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        sess.execute(code, check_collectives=True)
    took = time.monotonic() - started
    text = str(info.value)
    assert "CollectiveMismatchError" in text and "none was issued" in text
    for line in says:
        assert line in text, text
    assert took < 2.0 + sess.grace, took  # named at once, not after a hang's timeout
    # nothing hung, no rank killed: the session goes on, with the check and without it
    assert sess.all_reduce_check() == 1.0
    sess.execute("t = torch.ones(2)\ndist.all_reduce(t)\nassert t.tolist() == [2.0, 2.0]", check_collectives=True)


def test_the_session_wide_check_and_fsdp2s_own_collectives(sess):
    sess.check_collectives = True
    try:
        assert sess.check_collectives == CHECK_LIMIT_S
        sess.execute("""import torch
from torch.distributed.fsdp import fully_shard
cc_net = fully_shard(torch.nn.Linear(4, 4))
cc_net(torch.ones(2, 4)).sum().backward()
from fsdp_nb.debugging.rank_collective_check import CollectiveCheck
from fsdp_nb.engine.registry import part
cc_counted = sum(part(CollectiveCheck).counts.values())
""")
        counted = sess.pull("cc_counted")
        assert all(n >= 2 for n in counted)  # FSDP2's all-gather and reduce-scatter were checked
        count = "sum(part(CollectiveCheck).counts.values())"
        sess.execute(f"cc_before = {count}\nimport torch.distributed as dist\ndist.all_reduce(torch.ones(1))\n"
                     f"cc_counted = {count} - cc_before", check_collectives=False)  # this cell alone unchecked
        assert sess.pull("cc_counted") == [0, 0]
    finally:
        sess.check_collectives = False
        sess.execute("del cc_net")
    with pytest.raises(ValueError, match="check_collectives must be True, False or seconds"):
        sess.check_collectives = "yes"
    with pytest.raises(ValueError, match="debug= takes ranks"):
        sess.execute("pass", debug=[5])


def test_a_breakpoint_in_a_px_cell_through_a_real_kernel(kernel):
    """The prompt travels as the kernel's own input request (jupyter_client's stdin
    channel), as JupyterLab, Notebook and VS Code show it."""
    kernel.run("import fsdp_nb\nsess = fsdp_nb.Session(2, backend='gloo')", timeout=180)
    out = kernel.run("%%px --debug 1\n" + CELL, answers=["p x.shape", "n", "ll", "c"])
    assert out.count("(Pdb rank 1) ") == 4, out
    # the notebook's number of the cell, in the stop and in pdb's own `> ...` line
    number = re.search(r"rank 1 stopped at a breakpoint in cell \[(\d+)\] line 4", out)
    assert number and f"> cell [{number[1]}](4)<module>()" in out, out
    assert "torch.Size([3])" in out and "  5  ->\tdist.all_reduce(y)" in out
    assert "[ranks 0-1] done [6.0, 6.0, 6.0]" in out and "waits in" not in out
    out = kernel.run("%%px\nfsdp_nb.breakpoint(ranks=[0, 1])\nz = rank\ndist.all_reduce(torch.ones(1))",
                     answers=["ranks 0-1 p rank + 10", "c"])
    assert "[rank 0]\n10\n[rank 1]\n11\n" in out, out
    assert "(Pdb rank 0) " in out
