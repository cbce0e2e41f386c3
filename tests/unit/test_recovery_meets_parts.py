"""Where restart, resize and the hang watch meet the other features: their pure parts, no
engines. The scaler's rank part runs in this process as on a rank (this process's
registry and step owner, a one-rank gloo group where torch's scaler reduces); the ranks'
agreement it makes over the checkpoint group is handed the other ranks' offers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import fake_context

from fsdp_nb.engine.namespace import user_ns
from fsdp_nb.engine.registry import World, part
from fsdp_nb.engine.step import owner
from fsdp_nb.errors import (
    DeadRankError,
    RankError,
    RankFailure,
    RankTimeoutError,
    SessionUnfinishedError,
)
from fsdp_nb.hangs.hang_report import ahead, hang_report, out_of_step, saving
from fsdp_nb.hangs.hang_view import HangView
from fsdp_nb.hangs.hang_watch import HangWatch, Watching, how_it_ended
from fsdp_nb.hangs.rank_hang_watch import _recorded
from fsdp_nb.hangs.wire_hang_state import RankState
from fsdp_nb.models import rank_grad_scaler as gs
from fsdp_nb.recovery import restart as restart_module
from fsdp_nb.recovery.restart_report import stopped_at
from fsdp_nb.runtime.lifecycle import Lifecycle
from fsdp_nb.wire.decode import decode

NOW = 1_000_000.0


# -- the gradient scaler: one state on every rank -------------------------------------


@pytest.fixture
def ns():
    """This process's namespace as a rank's: no ``scaler`` before, none left after."""
    space = user_ns()
    kept = space.pop(gs.SCALER, None)
    yield space
    space.pop(gs.SCALER, None)
    if kept is not None:
        space[gs.SCALER] = kept


def _offer(stayed: bool, scale: float, skipped: int = 0) -> gs.Offer:
    state = {**gs.CountingScaler(device="cpu").state_dict(), "scale": scale, "skipped": skipped, "growth_interval": 7}
    return gs.Offer(stayed, state, "cpu")


def _agree(monkeypatch, world: World, others: dict[int, gs.Offer | None]) -> list[Any]:
    """``GradScaling.reformed`` on this process as rank ``world.rank``, the other ranks'
    offers as given; what this rank offered."""
    offered: list[Any] = []

    def gather(offer):
        offered.append(offer)
        return [offer if r == world.rank else others.get(r) for r in range(world.size)]

    monkeypatch.setattr(gs, "gathered", gather)
    part(gs.GradScaling).reformed(world)
    return offered


def _unscaled(scaler: gs.CountingScaler) -> torch.optim.Optimizer:
    """An optimizer whose gradients ``scaler`` has unscaled: a step begun, not updated."""
    lin = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler.scale(lin(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    return opt


def test_the_state_every_rank_takes_is_the_lowest_rank_that_stayed():
    a, b = _offer(True, 8.0), _offer(False, 65536.0)
    assert gs.choose([b, a, _offer(True, 4.0)]) == 1  # a rank that joined does not set the scale
    assert gs.choose([None, b, b]) == 1  # every rank with one is new: the lowest
    assert gs.choose([None, None]) is None  # no rank has a scaler


def test_a_rank_that_joined_gets_exactly_the_scaler_of_the_ranks_that_stayed(monkeypatch, ns):
    offered = _agree(monkeypatch, World(rank=2, size=3, joined=(2,)), {0: _offer(True, 1024.0, 5),
                                                                       1: _offer(True, 1024.0, 5)})
    assert offered == [None]
    made = ns[gs.SCALER]
    assert isinstance(made, gs.CountingScaler) and made.process_group is None
    assert made.state_dict() == _offer(True, 1024.0, 5).state
    assert part(gs.GradScaling).steps in owner().listeners


def test_where_no_rank_has_a_scaler_nothing_is_made(monkeypatch, ns):
    assert _agree(monkeypatch, World(rank=1, size=2, joined=(1,)), {0: None}) == [None]
    assert gs.SCALER not in ns


def test_a_rank_that_stayed_drops_a_step_cut_short_and_points_at_the_new_group(monkeypatch, ns, group):
    mine = ns[gs.SCALER] = gs.CountingScaler(device="cpu")
    mine.process_group = group  # as one made before this change kept it: the group it was made in
    opt = _unscaled(mine)
    assert mine.begun
    offered = _agree(monkeypatch, World(rank=1, size=2), {0: _offer(True, 16.0, 3)})
    assert offered[0].stayed and offered[0].state["scale"] == 65536.0
    assert mine.process_group is None and not mine.begun
    assert mine.state_dict() == _offer(True, 16.0, 3).state  # rank 0's, the lowest that stayed
    mine.unscale_(opt)  # an iteration's start again: torch's scaler does not refuse it


def test_a_failed_cell_drops_the_step_it_cut_short(ns, group):
    scaler = ns[gs.SCALER] = gs.CountingScaler(device="cpu")
    opt = _unscaled(scaler)
    steps = part(gs.GradScaling).steps
    steps.cell_ended(False)  # a cell that ended well leaves a step to its loop
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    steps.cell_ended(True)  # a failed cell that cut no step short (a typo after unscale_) leaves it too
    assert scaler.begun and not scaler.stepped
    steps.cut_short()  # one that did (here, or on another rank)
    assert not scaler.begun and scaler.get_scale() == 65536.0
    scaler.unscale_(opt)
    scaler.step(opt)
    steps.cell_ended(True)  # a typo between step and update: the update runs
    assert not scaler.begun and not scaler.stepped and scaler.skipped == 0
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def test_a_wrap_makes_one_scaler_and_leaves_another_name_alone(ns, caplog):
    gs.install("cpu")
    made = ns[gs.SCALER]
    gs.install("cpu")
    assert ns[gs.SCALER] is made and gs.current() is made
    ns[gs.SCALER] = "mine"
    gs.install("cpu")
    assert ns[gs.SCALER] == "mine" and gs.current() is None and "makes no gradient scaler" in caplog.text


def test_the_resize_survey_counts_the_scaler_as_every_ranks(monkeypatch, ns):
    from fsdp_nb.recovery.rank_resize import survey

    monkeypatch.setitem(ns, "steps", 3)
    ns[gs.SCALER] = gs.CountingScaler(device="cpu")
    assert "scaler" not in survey(()).variables and "steps" in survey(()).variables
    ns[gs.SCALER] = 0.5  # a value of the user's under the name: theirs, left on the ranks that have it
    assert "scaler" in survey(()).variables


# -- the hang watch and the checkpoint group ------------------------------------------


def _state(collective=None, issued=()):
    return decode(RankState, {"rank": None, "pid": 1, "now": NOW, "collective": collective, "issued": list(issued),
                              "frame": None})


def _count(seq, checkpoint=False, name="0", desc="default_pg"):
    if checkpoint:
        name, desc = "1", "checkpoint"
    return {"name": name, "desc": desc, "ranks": [0, 1], "backend": "gloo", "seq": seq, "since": NOW - 30,
            "checkpoint": checkpoint}


def test_a_commit_ahead_on_the_checkpoint_group_is_no_hang_and_no_group_out_of_step():
    states = {0: _state(issued=[_count(9), _count(3, checkpoint=True)]),
              1: _state(issued=[_count(9), _count(2, checkpoint=True)])}
    assert ahead(states) == {} and out_of_step(states) == []
    report = hang_report(states)
    assert report.lines == () and not report.waiting and not report.triggered(1.0)
    assert saving(states) == ["rank 0 is 1 collective(s) ahead on the checkpoint group, waiting for rank(s) 1: a save "
                              "or load in the background (an async save still writing), not the training's"]
    # under a wait of the training's, the save is named for what it is, last
    states[0] = _state(issued=[_count(10), _count(3, checkpoint=True)])
    report = hang_report(states)
    assert report.waiting == (0,) and report.missing == (1,)
    assert report.lines[1].startswith("rank 0 waits in collective #10 on the default group")
    assert report.lines[-1].startswith("rank 0 is 1 collective(s) ahead on the checkpoint group")


def test_the_recorder_leaves_out_a_collective_in_flight_on_the_checkpoint_group():
    def dump(desc):
        return {"pg_config": {"9": {"desc": desc, "ranks": "[0, 1]"}},
                "entries": [{"collective_seq_id": 3, "pg_id": 9, "process_group": ["9", desc],
                             "profiling_name": "gloo:all_gather",
                             "time_created_ns": int(NOW * 1e9), "input_sizes": [[1]], "input_dtypes": ["Long"]}]}

    assert _recorded(dump("checkpoint"), {"9": 3}) is None  # an async save's commit, in its thread
    found = _recorded(dump("default_pg"), {"9": 3})
    assert found is not None and (found.op, found.desc, found.seq) == ("all_gather", "default_pg", 3)


# -- a call's end, as the watch says it -------------------------------------------------


class _Cluster:
    world_size = 2

    def stopped_ranks(self, ranks):
        return []


def test_a_diagnosis_whose_call_was_cut_off_by_its_timeout_does_not_say_completed(capsys):
    told: list[tuple[str, str]] = []
    view = HangView()
    w = Watching(HangWatch(_Cluster()), "execute", started=0.0, hang_after=1.0,  # type: ignore[arg-type]
                 notify=lambda what, phase, *a, note="": told.append((phase, note)), view=view)
    w.shown = hang_report({0: _state({"op": "all_reduce", "seq": 5, "desc": "default_pg", "group_ranks": None,
                                      "since": NOW - 9, "shapes": [[1]], "dtypes": ["float32"]}), 1: _state()})
    view("execute", w.shown)
    w.end(RankTimeoutError("execute", 8, [0, 1]))
    assert told == [("hang-cleared", "the call was cut off by its timeout=: the collective did not complete")]
    err = capsys.readouterr().err
    assert "fsdp_nb: execute: the call was cut off by its timeout=: the collective did not complete" in err
    assert "the collective completed" not in err
    w.end(None)  # taken down once
    assert len(told) == 1


def test_how_a_diagnosed_wait_ended_in_words():
    stopped = RankError("execute", [RankFailure(1, "ValueError", "bad", ""), RankFailure(0, "RuntimeError", "x", "")],
                        2, collateral=[0])
    assert how_it_ended(None) == "the collective completed"
    assert how_it_ended(KeyboardInterrupt()) == "the call was interrupted (Ctrl-C): the collective did not complete"
    assert how_it_ended(DeadRankError([1])) == "a rank died: the collective did not complete"
    assert how_it_ended(stopped) == ("the call failed on rank(s) 1 and the others were stopped: the collective did "
                                     "not complete")
    returned = RankError("execute", [RankFailure(1, "ValueError", "bad", "")], 2)
    assert how_it_ended(returned) == "the call ended with RankError on rank(s) 1"


# -- a restart that stops part way ----------------------------------------------------


def _setup_failed() -> RankError:
    return RankError("setup f", [RankFailure(1, "NameError", "name 'LR' is not defined", "")], 2)


def test_where_a_restart_stopped_and_how_to_mend_it():
    said = stopped_at("setup", _setup_failed())
    assert said.startswith("sess.restart() stopped at its step 'setup' (setup on rank 1: NameError: name 'LR' is "
                           "not defined); the ranks may lack what setup makes. Call sess.restart(setup=...) again")
    assert stopped_at("re-form the group", TimeoutError("no answer\nmore")) == (
        "sess.restart() stopped at its step 're-form the group' (re-form the group: TimeoutError: no answer); call "
        "sess.restart() again (with the same restore= and setup=) to finish it")


def test_an_unfinished_session_refuses_calls_and_leaves_by_a_restart_or_a_shutdown():
    life = Lifecycle()
    life.to("ready")
    life.check_usable("execute")
    life.to("unfinished", "why")
    with pytest.raises(SessionUnfinishedError, match="^execute was not sent: why$"):
        life.check_usable("execute")
    life.to("degraded")
    assert life.why == "" and life.state == "degraded"
    life.check_usable("execute")
    life.to("unfinished", "again")
    life.to("closed")
    with pytest.raises(RuntimeError, match="cannot go from 'closed'"):
        life.to("unfinished", "no")


def test_a_failed_restart_step_leaves_the_session_unfinished_until_a_restart_runs_to_its_end(monkeypatch):
    ctx = fake_context()
    ctx.recovering.lifecycle = ctx.lifecycle
    ctx.lifecycle.to("ready")
    runs: list[str] = []

    def fails_at_setup(ctx, restore, drop, setup, progress, rebuilt_before):
        runs.append("setup fails")
        progress.at("rebuild the wrapped models")
        progress.at("setup")
        raise _setup_failed()

    monkeypatch.setattr(restart_module, "_restart", fails_at_setup)
    with pytest.raises(RankError) as info:
        restart_module.restart(ctx)
    assert ctx.state == "unfinished" and "setup on rank 1: NameError" in ctx.lifecycle.why
    assert "The session is left unfinished: sess.restart() stopped at its step 'setup'" in info.value.__notes__[0]
    with pytest.raises(SessionUnfinishedError, match=r"^pull was not sent: sess.restart\(\) stopped at its step"):
        ctx.recovering.apply("pull", len)

    def refused(ctx, restore, drop, setup, progress, rebuilt_before):  # by its checks, before any change
        runs.append("refused")
        assert ctx.state == "degraded"  # its own calls (a restore's load) would go through
        raise ValueError("restore= names no checkpoint")

    monkeypatch.setattr(restart_module, "_restart", refused)
    why = ctx.lifecycle.why
    with pytest.raises(ValueError):
        restart_module.restart(ctx)
    assert ctx.state == "unfinished" and ctx.lifecycle.why == why

    def mends(ctx, restore, drop, setup, progress, rebuilt_before):
        runs.append("mends")
        progress.at("setup")
        ctx.lifecycle.to("ready")
        return "report"

    monkeypatch.setattr(restart_module, "_restart", mends)
    assert restart_module.restart(ctx) == "report"  # type: ignore[comparison-overlap]
    assert ctx.state == "ready" and ctx.lifecycle.why == "" and runs == ["setup fails", "refused", "mends"]
