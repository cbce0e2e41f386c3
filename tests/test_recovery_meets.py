"""Where restart, resize and the hang watch meet the other features, on real engines.

- fp16 meets resize and restart: the ranks that stay keep the run's scale, a rank that
  joins gets it, every rank's scaler reduces over the new group (no hang), and training
  goes on as a session that never resized (issue 56, bug 4);
- a failed cell cut into a step of the scaler, which the next one must not trip over;
- a restart whose ``setup`` fails on a rank leaves a session that says so, refuses calls
  until it is mended, and lets ``sess.restart`` mend it (bug 15);
- the checkpoint group's background collectives, an async save's commit ahead on one
  rank, are neither a hang nor a group out of step (bug 5);
- a call cut off by its ``timeout=`` is not said to have completed its collective (17h);
- the collective check and breakpoints on a resized and restarted group, beside autosave
  and an async save, and after a failed cell (issue 58).

Tests that resize, kill engines or restart share one private 2-rank session (``own``);
the timeout runs on the shared ``sess``, which its recovery re-forms as any timeout does.
Every fault is set up by a marker or a readiness check, never by a timer.
"""

from __future__ import annotations

import signal

import pytest
import torch
from helpers import forget_models, run_out
from torch import nn

import fsdp_nb
from fsdp_nb.errors import DeadRankError, RankError, RankTimeoutError
from fsdp_nb.runtime.cluster import wait_until

DEFS = '''
import time
import torch
import torch.distributed as dist

def mt_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g)

def mt_train(start, stop):
    """Steps ``start`` to ``stop`` on the same batch on every rank: the mean gradient is one
    rank's, whatever the world size. The loss is large: fp16 gradients overflow at the
    first scales, so the scaler skips steps and its scale moves."""
    losses = []
    for step in range(start, stop):
        x = mt_batch(step)
        loss = (mt_net(x) - x.flip(1)).square().mean() * 100.0
        scaler.scale(loss).backward()
        scaler.step(mt_opt)
        scaler.update()
        mt_opt.zero_grad()
        losses.append(loss.item())
    return losses
'''

SCALER = "rs_out = scaler.state_dict()"
"""Each rank's scaler state."""


class Mlp(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.a = nn.Linear(dim, 64)
        self.b = nn.Linear(64, dim)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.fixture(scope="module")
def own(session_factory):
    """A 2-rank session of this module's own: it is resized, loses an engine, restarts."""
    s = session_factory(2, private=True, grace=1.0)
    assert wait_until(s.cluster.standby.waiting, 120)
    s.execute(DEFS)
    s.wrap(Mlp, name="mt_net", mixed_precision="16-mixed")
    s.execute("mt_opt = torch.optim.SGD(mt_net.parameters(), lr=0.01)\nscaler.set_growth_interval(2)")
    yield s
    s.shutdown()


def _train(s, start: int, stop: int) -> list[float]:
    """Train steps ``start``..``stop`` on every rank; rank 0's losses, once every rank's
    are the same. A short hang watch and a timeout: a step that hangs fails the test
    within a minute rather than hanging the suite."""
    s.execute(f"rs_out = mt_train({start}, {stop})", timeout=120, hang_after=5)
    losses = s.pull("rs_out")
    assert all(x == losses[0] for x in losses), losses
    return losses[0]


def _scalers(s) -> list[dict]:
    return run_out(s, SCALER)


def test_fp16_resized_up_and_down_keeps_one_scale_and_trains_as_if_never_resized(own, sess, tmp_path):
    s = own
    ckpt = str(tmp_path / "start")
    s.save(ckpt, "mt_net", optimizer="mt_opt", state=["scaler"])
    losses = _train(s, 0, 4)
    before = _scalers(s)
    assert before[0] == before[1] and before[0]["skipped"] > 0, before  # the scale came down from 2**16
    assert before[0]["scale"] != 65536.0

    report = s.resize(3)
    assert "scaler" not in report.variables, report  # every rank has one (17i)
    assert _scalers(s) == [before[0]] * 3  # the rank that joined holds the run's scale, not a fresh one
    losses += _train(s, 4, 8)  # no rank waits in an all-reduce the others never make
    grown = _scalers(s)
    assert grown == [grown[0]] * 3

    s.resize(2)
    assert _scalers(s) == [grown[0]] * 2
    losses += _train(s, 8, 10)
    # a restart once the world shrank: the meshes of the 3-rank world (torch's caches keep
    # them) are no group to re-form, and each rank keeps the run's scale
    here = _scalers(s)
    s.restart()
    assert _scalers(s) == here
    losses += _train(s, 10, 12)
    after = _scalers(s)
    assert after == [after[0]] * 2

    # the same 12 steps on a session that never resized, from the same start, give the same
    # losses and scale: every rank's fp16 gradient is the same, and a sum of 2 or 3 of them in
    # the fp32 reduction, divided by the world size, is that gradient exactly
    sess.execute(DEFS)
    sess.wrap(Mlp, name="mt_net", mixed_precision="16-mixed")
    try:
        sess.execute("mt_opt = torch.optim.SGD(mt_net.parameters(), lr=0.01)")
        sess.load(ckpt, "mt_net", optimizer="mt_opt", state=["scaler"])
        assert run_out(sess, "rs_out = scaler.get_scale()") == [65536.0] * 2
        sess.execute("scaler.set_growth_interval(2)")
        reference = _train(sess, 0, 12)
        assert losses == reference
        assert _scalers(sess) == after
    finally:
        forget_models(sess, "mt_net", optimizers=("mt_opt", "scaler"))


def test_a_cell_that_fails_inside_a_scaled_step_does_not_stop_the_next(own):
    """A cell that fails after ``unscale_`` and before ``update`` (a clip that raises, a
    Ctrl-C) leaves torch's scaler mid-step: its next ``unscale_`` would refuse ("already
    been called on this optimizer since the last update"). The failed cell drops that step."""
    s = own
    with pytest.raises(RankError):
        s.execute("loss = (mt_net(mt_batch(0)) - 1).square().mean()\nscaler.scale(loss).backward()\n"
                  "scaler.unscale_(mt_opt)\nraise ValueError('the clip found a NaN')\n")
    s.execute("mt_opt.zero_grad()")
    assert all(x == x for x in _train(s, 12, 14))
    state = _scalers(s)
    assert state == [state[0]] * 2


def test_the_check_and_breakpoints_on_a_resized_restarted_group_beside_autosave_and_an_async_save(own, tmp_path,
                                                                                                   monkeypatch, capsys):
    """The debugging tools where they meet the rest (issue 58), on the group a restart
    re-formed (in this module's order, after the resizes above too), with two state
    objects beside the model (its optimizer's and the scaler's), an in-memory and disk
    autosave every step and the user's async save in flight:

    - a checked training cell raises no false mismatch: FSDP2's all-gathers and
      reduce-scatters, the scaler's all-reduce and the check's own count go through; the
      checkpoint group's collectives (the async save's, autosave's) are not checked;
    - a breakpoint mid-step stops rank 1; the step's autosave waits for it and goes on;
    - a mismatch on that group is named, the session goes on, and autosave with it;
    - a failed cell ends its debugging choice: the next cell's ``breakpoint()`` does nothing.
    """
    s = own
    s.restart()
    s.autosave(str(tmp_path / "auto"), every=1, model="mt_net", optimizer="mt_opt", state=["scaler"], in_memory=True)
    try:
        mine = s.save(str(tmp_path / "mine"), "mt_net", optimizer="mt_opt", async_save=True)
        s.execute("from fsdp_nb.debugging.rank_collective_check import CollectiveCheck\n"
                  "from fsdp_nb.engine.registry import part\nrs_out = mt_train(14, 17)\n"
                  "rs_checked = sum(part(CollectiveCheck).counts.values())",
                  check_collectives=True, timeout=120, hang_after=5)
        assert all(n >= 3 * 4 for n in s.pull("rs_checked"))  # 3 steps of FSDP2's and the scaler's
        mine.wait(60)

        prompts: list[str] = []
        left = iter(["p step", "c"])
        monkeypatch.setattr("builtins.input", lambda prompt="": prompts.append(prompt) or next(left))
        steps_before = s.autosave().ranks[1].step
        s.execute("for step in range(17, 19):\n    rs_out = mt_train(step, step + 1)\n"
                  "    if step == 17:\n        breakpoint()", debug=[1], timeout=120, hang_after=1)
        out = capsys.readouterr().out
        assert prompts == ["(Pdb rank 1) "] * 2 and "\n17\n" in out and "waits in" not in out
        assert s.autosave().ranks[1].step == steps_before + 2  # the step at the stop was saved, and the next

        with pytest.raises(RankError, match="CollectiveMismatchError"):
            s.execute("dist.all_reduce(torch.ones(2 + rank))", check_collectives=True)
        _train(s, 19, 20)
        assert s.autosave().ranks[0].step == steps_before + 3

        with pytest.raises(RankError, match="the cell failed"):
            s.execute("raise ValueError('the cell failed')", debug=[0, 1])
        s.execute("breakpoint()\nrs_out = 'went on'")  # not armed: no prompt (input would raise StopIteration)
        assert s.pull("rs_out") == ["went on"] * 2
    finally:
        s.stop_autosave()


def _setup_without_the_constant():
    """What the training cell needs, made with a value a cell made on the ranks: restart
    does not replay it on a new engine."""
    globals()["mt_opt"] = torch.optim.SGD(mt_net.parameters(), lr=MT_LR)  # noqa: F821 - engine globals


def _setup():
    globals()["mt_opt"] = torch.optim.SGD(mt_net.parameters(), lr=0.01)  # noqa: F821 - engine global


def test_a_restart_whose_setup_fails_refuses_calls_until_a_restart_mends_it(own, tmp_path):
    s = own
    _train(s, 0, 2)
    s.execute("MT_LR = 0.01\nscaler.update(8.0)")
    ckpt = str(tmp_path / "eight")
    s.save(ckpt, "mt_net", optimizer="mt_opt", state=["scaler"])
    s.execute("scaler.update(16.0)")  # the run moves on from the checkpoint
    s.cluster.signal([1], signal.SIGKILL)  # by the session's verified handle
    with pytest.raises(DeadRankError):
        s.all_reduce_check()

    with pytest.raises(RankError) as info:
        s.restart(setup=_setup_without_the_constant)
    notes = "\n".join(getattr(info.value, "__notes__", [])) + str(info.value)
    assert ("stopped at its step 'setup' (setup on rank 1: NameError: name 'MT_LR' is not defined)"
            in notes), notes
    assert s.state == "unfinished"
    assert "setup on rank 1: NameError" in s.status().why
    for call in (lambda: s.execute("x = 1"), lambda: s.run(lambda: 1), lambda: s.pull("mt_opt"),
                 lambda: s.save(str(tmp_path / "no"), "mt_net")):
        with pytest.raises(fsdp_nb.FsdpNbError, match=r"setup on rank 1: NameError.*sess\.restart\(setup=\.\.\.\)"):
            call()
    with pytest.raises(ValueError, match="unfinished"):
        s.resize(3)

    report = s.restart(setup=_setup)  # mends it: the session is ready, every rank holds the optimizer
    assert s.state == "ready" and report.setup and not s.status().why
    assert s.run(lambda: type(mt_opt).__name__) == ["SGD", "SGD"]  # noqa: F821 - engine global
    # the rank that stayed kept the run's scale (16, not the checkpoint's 8); the new rank has it
    assert [x["scale"] for x in _scalers(s)] == [16.0, 16.0]
    _train(s, 14, 16)

    s.restart(restore=ckpt, setup=_setup)  # a saved scaler comes back after the ranks agreed
    assert [x["scale"] for x in _scalers(s)] == [8.0, 8.0]


COMMIT_AHEAD = '''
import threading
from fsdp_nb.engine.checkpoint_group import checkpoint_group

mt_parts = [None, None]
def mt_commit_fn():
    dist.all_gather_object(mt_parts, rank, group=checkpoint_group())
mt_commit = threading.Thread(target=mt_commit_fn, daemon=True)
mt_commit.start()
'''
"""What an async save's commit does on a rank whose files were written first, in the
save's background thread: gather every rank's files on the checkpoint group, where the
other ranks, still writing, have not come yet."""


def _one_rank_ahead(s) -> bool:
    """Whether the watch reads some group's count of issued collectives higher on rank 0
    than on rank 1."""
    states = s.context.health.watch.states([0, 1])
    counts = [{(g.name, g.backend): g.seq for g in st.issued} for st in (states[0], states[1])]
    return any(seq > counts[1].get(key, seq) for key, seq in counts[0].items())


def test_an_async_commit_ahead_on_the_checkpoint_group_is_neither_a_hang_nor_out_of_step(own):
    s = own
    s.execute("from fsdp_nb.engine.checkpoint_group import checkpoint_group\nmt_made = checkpoint_group() is not None")
    s.execute(COMMIT_AHEAD, ranks=[0])
    assert wait_until(lambda: _one_rank_ahead(s), 30)
    try:
        # the watch does not say rank 0 waits, nor that rank 1 is missing from a collective
        report = s.context.health.watch.report([0, 1])
        assert not report.waiting and not report.missing, report.lines
        # a training cell with a collective and a short hang_after shows no diagnosis
        seen: list[str] = []
        s.dispatcher.observers.append(lambda e: seen.append(e.phase) if e.phase.startswith("hang") else None)
        try:
            s.execute("t = torch.ones(1)\ndist.all_reduce(t)\ntime.sleep(2)\n", hang_after=0.5)
        finally:
            s.dispatcher.observers.pop(-1)
        assert seen == []
        # a failure meanwhile does not re-form the group under the save as "out of step"
        with pytest.raises(RankError) as info:
            s.execute("if rank == 1:\n    raise ValueError('bad batch')\n")
        assert not any("out of step" in n for n in getattr(info.value, "__notes__", [])), info.value.__notes__
        assert s.run(lambda: globals().get("mt_commit") is not None and mt_commit.is_alive()) == [True, False]  # noqa: F821
        # rank 1's files are written: it joins, and the commit completes on both
        s.execute("mt_parts = [None, None]\ndist.all_gather_object(mt_parts, rank, group=checkpoint_group())",
                  ranks=[1], timeout=60)
        assert wait_until(lambda: s.run(lambda: mt_commit.is_alive() if rank == 0 else False) == [False, False], 30)  # noqa: F821
        assert s.run(lambda: mt_parts) == [[0, 1], [0, 1]]  # noqa: F821
    finally:
        s.execute("for _n in ('mt_parts', 'mt_commit', 'mt_commit_fn', 'mt_made'): globals().pop(_n, None)")


def test_a_call_cut_off_by_its_timeout_does_not_say_its_collective_completed(sess, capsys):
    seen: list[tuple[str, str]] = []
    sess.dispatcher.observers.append(lambda e: seen.append((e.phase, e.note)) if e.phase.startswith("hang") else None)
    code = ("import time, torch\nimport torch.distributed as dist\nif rank == 1:\n    time.sleep(60)\n"
            "t = torch.ones(1)\ndist.all_reduce(t)\n")
    try:
        with pytest.raises(RankTimeoutError):
            sess.execute(code, timeout=8, hang_after=0.5)
    finally:
        sess.dispatcher.observers.pop(-1)
    assert seen and seen[0][0] == "hang", seen  # shown while it waited
    assert seen[-1] == ("hang-cleared", "the call was cut off by its timeout=: the collective did not complete")
    err = capsys.readouterr().err
    assert "execute: the call was cut off by its timeout=: the collective did not complete" in err
    assert "the collective completed" not in err
    assert sess.all_reduce_check() == 1.0
