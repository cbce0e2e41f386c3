"""Where the step view, the profile and the live feeds meet a failed cell, a second optimizer,
``sess.run``, another open view, a recovery and a restart (issue 56), on real gloo ranks.

The cases that leave the group as it was share the session's ``sess``; those that re-form
it or kill an engine share one 2-rank session of their own (``own``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest
import torch
from helpers import forget_models
from torch import nn

from fsdp_nb.errors import DeadRankError, RankError
from fsdp_nb.memory.memory_feed import MemoryFeed
from fsdp_nb.runtime.cluster import wait_until
from fsdp_nb.runtime.dispatch import CallEvent

TRAIN = """
sm_opt = torch.optim.SGD(sm_net[0].parameters(), lr=1e-3)
sm_opt2 = torch.optim.SGD(sm_net[1].parameters(), lr=1e-3)
sm_x = torch.randn(8, 32)

def sm_steps(n, both=False):
    for _ in range(n):
        sm_net(sm_x).sum().backward()
        sm_opt.step()
        if both:
            sm_opt2.step()
        sm_opt.zero_grad()
        sm_opt2.zero_grad()
"""


@pytest.fixture
def net(sess):
    """A small FSDP2 model on the shared session, two optimizers (one per layer), and a
    loop; no step view or profile left over from an earlier test."""
    from fsdp_nb.steps.steps_view import stop_measuring

    stop_measuring(sess.context)
    sess.wrap(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), name="sm_net", auto_wrap={nn.Linear})
    sess.execute(TRAIN)
    try:
        yield sess
    finally:
        stop_measuring(sess.context)
        forget_models(sess, "sm_net", optimizers=("sm_opt", "sm_opt2", "sm_x", "sm_steps"))


def _profiling() -> bool:
    import torch as t

    return t.autograd._profiler_enabled()


# -- the profile -----------------------------------------------------------------------------------


def test_a_failed_cell_stops_the_profile_so_a_later_eval_cell_is_not_profiled(net):
    """Bug 6: the profiler ran on after the failed cell, through an eval cell and on."""
    prof = net.profile(steps=5)
    assert net.run(_profiling) == [True, True]
    with pytest.raises(RankError, match="after one step"):
        net.execute("sm_steps(1)\nraise ValueError('after one step')")
    net.execute("with torch.no_grad():\n    sm_net(sm_x)")
    assert net.run(_profiling) == [False, False]
    with pytest.raises(RuntimeError, match="ended before they all ran"):
        _ = prof.trace


def test_a_profile_read_after_a_failed_cell_says_how_many_steps_each_rank_ran(net):
    """Bug 17g: it said "0 of 5" on ranks that had finished one."""
    prof = net.profile(steps=5)
    with pytest.raises(RankError, match="after one step"):
        net.execute("sm_steps(1)\nraise ValueError('after one step')")
    with pytest.raises(RuntimeError, match="rank 0: a cell failed after 1 of its 5 steps; "
                                           "rank 1: a cell failed after 1 of its 5 steps"):
        _ = prof.trace


def test_a_second_optimizer_is_inside_each_profiled_step(net):
    """Bug 7: two optimizers halved the steps a profile took; now a step is an iteration,
    both optimizers' steps in it, and the iteration after the last is left out."""
    prof = net.profile(steps=2)
    net.execute("sm_steps(3, both=True)")
    with open(prof.trace) as f:
        events = json.load(f)["traceEvents"]
    try:
        for r in (0, 1):
            marked = [e["name"] for e in events if e.get("pid") == r and e.get("cat") == "fsdp_nb"]
            stepped = [e for e in events if e.get("pid") == r and str(e.get("name", "")).startswith("Optimizer.step#")]
            assert marked == ["step 1", "step 2"] and len(stepped) == 4, (r, marked, [e["name"] for e in stepped])
    finally:
        shutil.rmtree(os.path.dirname(prof.trace))


# -- the step view -------------------------------------------------------------------------------


def test_stopping_one_step_view_leaves_another_measuring(net):
    """Bug 17c: ``StepsWidget.stop`` stopped every open view's measurement."""
    first, second = net.steps(window=5), net.steps(window=5)
    try:
        first.stop()
        net.execute("sm_steps(3)")
        second.refresh()
        assert sorted(second.ranks) == [0, 1] and all(p.steps == 3 for p in second.ranks.values())
    finally:
        second.stop()


def _one_step() -> None:
    sm_steps(1)  # type: ignore[name-defined]  # noqa: F821 - an engine global


def test_the_pause_between_two_runs_is_no_steps(net):
    """Bug 17f: a ``sess.run`` call is a cell on the ranks, so the step it runs counts from
    the call's start, not from the last step of the call before it (each step lies within
    its call, which the notebook timed around it)."""
    view = net.steps(window=2)
    try:
        walls = []
        for pause in (3.0, 0.0):
            t0 = time.perf_counter()
            net.run(_one_step)
            walls.append(time.perf_counter() - t0)
            time.sleep(pause)  # the user reads between the calls
        view.refresh()
        for r, p in view.ranks.items():
            assert p.steps == 2 and p.step * 2 <= sum(walls), (r, p, walls)
    finally:
        view.stop()


# -- the memory feed ------------------------------------------------------------------------------


def test_a_feed_started_again_while_its_old_receiver_is_busy_keeps_receiving(sess):
    """Bug 17a: the feed's zmq context was the feed's, not its receiver thread's, and so
    was its stop flag: a receiver still drawing when ``close`` gave up on it went on
    receiving beside the one started after it (its samplers never told to end), and once
    it did end it terminated the context the new one used."""
    feed = MemoryFeed(sess.context, interval=0.1)
    busy, release = threading.Event(), threading.Event()

    def slow_view(f):
        if not busy.is_set():
            busy.set()
            release.wait(30)

    feed.add_listener(slow_view)
    feed.start()
    try:
        assert busy.wait(30)
        old = [t for t in threading.enumerate() if t.name.startswith(f"fsdp_nb-memory-feed-{feed.token[:8]}")]
        # what a resize or restart makes the feed do: close (the old receiver is still in the
        # listener: close gives up on it after 5 s) and subscribe again, to new samplers
        feed._follow(CallEvent("resize", "recovered"))
        release.set()
        assert len(old) == 1 and wait_until(lambda: not old[0].is_alive(), 30), "the old receiver goes on"
        after = feed.updates
        assert wait_until(lambda: feed.updates >= after + 3, 30), "no samples after the old receiver ended"
        assert feed.running
    finally:
        release.set()
        feed.close()


# -- a recovery and a restart, on a session of their own ----------------------------------------------


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _setup():
    global own_opt
    own_opt = torch.optim.SGD(own_net.parameters(), lr=1e-3)  # noqa: F821 - an engine global


def _train(n: int) -> None:
    import torch as t

    for _ in range(n):
        own_net(t.ones(4, 16)).sum().backward()  # type: ignore[name-defined]  # noqa: F821 - an engine global
        own_opt.step()  # type: ignore[name-defined]  # noqa: F821
        own_opt.zero_grad()  # type: ignore[name-defined]  # noqa: F821


@pytest.fixture(scope="module")
def own(session_factory):
    """A 2-rank session of its own, with a model that restart can rebuild."""
    s = session_factory(2, private=True, grace=1.0)
    s.wrap(Small, name="own_net")
    s.execute("own_opt = torch.optim.SGD(own_net.parameters(), lr=1e-3)")
    yield s
    s.shutdown()


def test_a_profile_across_a_ranks_failure_ends_and_says_so(own):
    """Bug 17g: a profile spanning a rank's failure counted the recovery as exposed
    communication and idle time; its capture now ends, and reading it says so."""
    prof = own.profile(steps=4)
    own.run(_train, 1)
    with pytest.raises(RankError, match="boom"):
        own.execute("if rank == 1:\n    raise ValueError('boom')\ndist.all_reduce(torch.ones(1))")
    own.run(_train, 4)
    assert own.run(_profiling) == [False, False]
    with pytest.raises(RuntimeError, match=r"ended before they all ran \(rank 0: .* after 1 of its 4 steps"):
        _ = prof.trace


def test_a_profile_across_a_restart_ends_and_says_so(own):
    prof = own.profile(steps=3)
    own.run(_train, 1)
    own.restart()  # a healthy session: the group forms again, every rank's state kept
    own.run(_train, 3)
    with pytest.raises(RuntimeError, match=r"rank 0: the group formed again .* after 1 of its 3 steps"):
        _ = prof.trace


def test_after_a_restart_every_ranks_window_starts_afresh_and_the_feeds_follow(own, tmp_path):
    """Bug 12: the survivor's window held steps from both sides of the restart, the new
    rank's only after it, and the view named the survivor a straggler. Bug 17b: the
    memory feed followed a resize but not a restart: the new rank sent nothing. The
    numbers ``log_to`` writes go on from the steps before the restart (the ranks count
    from 0 again)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    view = own.steps(window=30).log_to(writer)
    memory = own.memory(interval=0.2)
    try:
        own.run(_train, 6)
        view.refresh()  # what the live feed had not sent yet: written before the rank dies
        own.cluster.signal([1], signal.SIGKILL)  # by the session's verified handle
        with pytest.raises(DeadRankError):
            own.all_reduce_check()
        own.restart(setup=_setup)
        restarted = time.time()
        own.run(_train, 4)
        view.refresh()
        assert sorted(view.ranks) == [0, 1] and [p.steps for p in view.ranks.values()] == [4, 4]
        # the live view's feed follows the restart too, and each rank sends its window afresh
        assert wait_until(lambda: [s and len(s.seconds) for s in view.feed.latest()] == [4, 4], 30)
        assert wait_until(lambda: all(s is not None and s.t > restarted for s in memory.feed.latest()), 30)
    finally:
        memory.close()
        view.stop()
        writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("step_ms/rank1")] == list(range(10))  # 6 before, 4 after
