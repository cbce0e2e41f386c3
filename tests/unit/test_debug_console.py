"""The notebook's ``(Pdb rank N)`` console and the debugging options, with no engines:
ranks played by a fake that answers the console's requests as a stopped rank's watch
thread does (``fsdp_nb.debugging.rank_breakpoints.answer``)."""

from __future__ import annotations

import pytest

from fsdp_nb.debugging import rank_breakpoints as bp
from fsdp_nb.debugging.breakpoints import console, parse_ranks
from fsdp_nb.debugging.cell_debug import check_collectives_option, check_debug, check_debug_commands
from fsdp_nb.debugging.wire_breakpoints import DebugState
from fsdp_nb.frontends.magics import parse_px
from fsdp_nb.recovery.status import RankStatus, SessionStatus, apply_event
from fsdp_nb.runtime.cluster import wait_until
from fsdp_nb.runtime.dispatch import CallEvent


class FakeRanks:
    """Ranks stopped at ``where``: ``p NAME`` answers the rank's value, ``c`` lets it run."""

    def __init__(self, stopped: dict[int, str], values: dict[int, dict[str, str]]):
        self.where: dict[int, str | None] = dict(stopped)
        self.values, self.reads = values, {r: 1 for r in stopped}
        self.out = {r: f"-> line of rank {r}\n" for r in stopped}
        self.sent: list[tuple[int, str]] = []
        self.released = False

    def __call__(self, requests: dict[int, bytes]) -> dict[int, DebugState | None]:
        answers: dict[int, DebugState | None] = {}
        for r, payload in requests.items():
            if r not in self.where:
                answers[r] = DebugState(where=None, waiting=False)
                continue
            if payload.startswith(bp.SEND):
                command = payload[len(bp.SEND):].decode()
                self.sent.append((r, command))
                if command == "c":
                    self.where[r] = None
                else:
                    self.out[r] += self.values[r].get(command.removeprefix("p "), "*** NameError") + "\n"
                    self.reads[r] += 1
            elif payload == bp.RELEASE:
                self.released = True
                self.where[r] = None
            where = self.where[r]
            output = self.out[r] if payload == bp.POLL else ""
            if payload == bp.POLL:
                self.out[r] = ""
            answers[r] = DebugState(where=where, waiting=where is not None, reads=self.reads[r], output=output)
        return answers


def _run(ranks: FakeRanks, lines: list[str], script=()):
    shown: list[str] = []
    prompts: list[str] = []
    left = iter(lines)

    def read(prompt):
        prompts.append(prompt)
        return next(left)

    console(ranks, {r: w for r, w in ranks.where.items() if w}, 4, read=read, show=shown.append, script=script)
    return "".join(shown), prompts


def test_one_rank_answers_and_c_lets_it_go():
    ranks = FakeRanks({1: "cell [3] line 4"}, {1: {"x.shape": "torch.Size([3])"}})
    out, prompts = _run(ranks, ["p x.shape", "c"])
    assert prompts == ["(Pdb rank 1) "] * 2
    assert "fsdp_nb: rank 1 stopped at a breakpoint in cell [3] line 4" in out
    assert "torch.Size([3])" in out and ranks.where[1] is None


def test_ranks_are_asked_together_answers_merged_and_rank_switches():
    ranks = FakeRanks({0: "cell [3] line 4", 2: "cell [3] line 4"},
                      {0: {"loss": "0.5", "k": "7"}, 2: {"loss": "0.25", "k": "7"}})
    out, prompts = _run(ranks, ["ranks 0-3 p loss", "ranks 0,2 p k", "rank 2", "p loss", "rank 1", "c"])
    assert "[rank 0]\n0.5\n[rank 2]\n0.25\n" in out  # each rank its own answer
    assert "[ranks 0,2]\n7\n" in out and out.count("\n7\n") == 1  # an answer alike: once
    assert "ranks 1,3 not stopped; asking ranks 0,2" in out
    assert "rank 1 is not stopped (stopped: ranks 0,2)" in out
    assert prompts[:3] == ["(Pdb rank 0) "] * 3 and prompts[3:5] == ["(Pdb rank 2) "] * 2
    assert (2, "p loss") in ranks.sent and (0, "p loss") in ranks.sent
    assert set(ranks.where.values()) == {None}  # `c` let every stopped rank go


def test_a_script_runs_at_the_stop_as_if_typed_and_asks_nothing_when_it_continues():
    ranks = FakeRanks({1: "cell [3] line 4"}, {1: {"loss.item()": "0.125"}})
    out, prompts = _run(ranks, [], script=("p loss.item()", "c"))
    assert prompts == []  # nothing asked of the user
    assert "(Pdb rank 1) p loss.item()\n0.125\n(Pdb rank 1) c\n" in out
    # a script that does not continue leaves the prompt to the user
    ranks = FakeRanks({1: "cell [3] line 4"}, {1: {"loss.item()": "0.125"}})
    out, prompts = _run(ranks, ["c"], script=("p loss.item()",))
    assert prompts == ["(Pdb rank 1) "] and "0.125" in out


def test_ctrl_c_at_the_prompt_releases_every_rank():
    ranks = FakeRanks({1: "cell [3] line 4"}, {1: {}})

    def interrupted(prompt):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        console(ranks, {1: "cell [3] line 4"}, 4, read=interrupted, show=lambda text: None)
    assert ranks.released


def test_q_is_not_sent_and_a_kernel_that_cannot_ask_lets_every_rank_go():
    ranks = FakeRanks({1: "cell [3] line 4"}, {1: {}})
    out, _ = _run(ranks, ["q", "ranks 1 q", "c"])
    assert out.count("'q' would end a rank's cell") == 2 and (1, "q") not in ranks.sent and (1, "c") in ranks.sent

    ranks = FakeRanks({1: "cell [3] line 4"}, {1: {}})
    shown: list[str] = []

    def cannot_ask(prompt):
        raise NotImplementedError("raw_input was called, but this frontend does not support input requests")

    console(ranks, {1: "cell [3] line 4"}, 2, read=cannot_ask, show=shown.append)
    assert ranks.released and "cannot read a debugger command" in "".join(shown)


def test_a_prompt_left_unanswered_lets_the_stopped_ranks_go(monkeypatch):
    monkeypatch.setattr(bp, "HOLD_EVERY_S", 0.05)
    ranks = FakeRanks({1: "cell [3] line 4"}, {1: {}})

    def away(prompt):  # the user is gone: the prompt is answered only once the holder let go
        assert wait_until(lambda: ranks.released, 30, 0.01), "the holder never let the rank go"
        return "c"

    console(ranks, {1: "cell [3] line 4"}, 2, read=away, show=lambda text: None, idle_s=0.2)
    assert ranks.where[1] is None


def test_options_are_read_or_refused_naming_what_is_allowed():
    assert parse_ranks("0-2,5", 8) == [0, 1, 2, 5]
    with pytest.raises(ValueError, match="not in this session"):
        parse_ranks("7", 4)
    with pytest.raises(ValueError, match="written 0-3, 0,2 or 1"):
        parse_ranks("a", 4)
    assert check_debug(1, 2) == [1] and check_debug(None, 2) == [] and check_debug([1, 0, 1], 2) == [0, 1]
    for bad in (2, "1", [True], 1.0):
        with pytest.raises(ValueError, match="debug= takes ranks"):
            check_debug(bad, 2)
    assert check_debug_commands("p loss.item();; c") == ("p loss.item()", "c")
    assert check_debug_commands(["n", "c"]) == ("n", "c") and check_debug_commands(None) == ()
    for bad in ("p x;;", ["n", 3], b"c"):
        with pytest.raises(ValueError, match="debug_commands takes pdb command lines"):
            check_debug_commands(bad)
    assert check_collectives_option(True) == 60.0 and check_collectives_option(2) == 2.0
    assert check_collectives_option(False) is None
    with pytest.raises(ValueError, match="True, False or seconds"):
        check_collectives_option(0)
    args = parse_px("--debug 1,3 --check-collectives --debug-commands 'p x;; c'")
    assert (args.debug, args.check_collectives, args.debug_commands) == ([1, 3], True, "p x;; c")
    assert parse_px("--debug 0-2,5").debug == [0, 1, 2, 5]
    assert parse_px("--no-check-collectives").check_collectives is False and parse_px("").check_collectives is None
    with pytest.raises(ValueError, match="together"):
        parse_px("--check-collectives --no-check-collectives")


def test_the_status_shows_a_rank_at_a_breakpoint_as_stopped_until_it_runs_on():
    rows = tuple(RankStatus(r, r, "h", 100 + r, "cpu", "busy") for r in range(2))
    status = SessionStatus("ready", "gloo", rows)
    status = apply_event(status, CallEvent("execute", "breakpoint", (1,), note="rank 1 is at a breakpoint in cell [3] line 4"))
    assert [r.state for r in status.ranks] == ["busy", "stopped"]
    assert status.ranks[1].activity == "at a breakpoint in cell [3] line 4"
    status = apply_event(status, CallEvent("execute", "running", (0, 1)))
    assert [r.state for r in status.ranks] == ["busy", "busy"]


def test_the_check_compares_what_must_agree_and_leaves_out_what_may_differ():
    import torch
    import torch.distributed as dist

    from fsdp_nb.debugging.rank_collective_check import _call, compared

    t = torch.ones(4)

    def call(name, fn, *args, **kwargs):
        return compared(_call(name, fn, args, kwargs))

    # gather: the root passes the list, the others none; only the tensor is compared
    assert call("gather", dist.gather, t, [torch.ones(4), torch.ones(4)], 0) == call("gather", dist.gather, t, None, 0)
    assert call("gather", dist.gather, t, None, 0) != call("gather", dist.gather, t, None, 1)  # another root
    # all-to-all with uneven splits: the sizes differ, the dimensions and dtypes do not
    assert call("all_to_all_single", dist.all_to_all_single, torch.ones(3), torch.ones(5)) == \
        call("all_to_all_single", dist.all_to_all_single, torch.ones(6), torch.ones(2))
    assert call("all_to_all_single", dist.all_to_all_single, torch.ones(3), torch.ones(5)) != \
        call("all_to_all_single", dist.all_to_all_single, torch.ones(3, 1), torch.ones(5))
    # the reduction, written or left to its default
    assert call("all_reduce", dist.all_reduce, t) == call("all_reduce", dist.all_reduce, t, op=dist.ReduceOp.SUM)
    assert call("all_reduce", dist.all_reduce, t) != call("all_reduce", dist.all_reduce, t, op=dist.ReduceOp.MAX)
    assert call("broadcast", dist.broadcast, t, 0) != call("broadcast", dist.broadcast, t, src=1)
    assert call("all_reduce", dist.all_reduce, t) != call("all_reduce", dist.all_reduce, torch.ones(4, dtype=torch.int64))
