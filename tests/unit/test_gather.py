"""The gather loop's branches, against fake replies and a fake cluster: no engines."""

from __future__ import annotations

import pytest
from helpers import FakeCluster, FakeReply, pending_of

from fsdp_nb.errors import DeadRankError, RankError, RankTimeoutError
from fsdp_nb.runtime.dispatch import Dispatcher, FailurePolicy


def _dispatcher(n: int = 2, policy: FailurePolicy | None = None) -> tuple[Dispatcher, FakeCluster]:
    cluster = FakeCluster(n)
    d = Dispatcher(cluster, policy)  # type: ignore[arg-type]
    d.echo = False
    return d, cluster


class Recorder(FailurePolicy):
    """A policy that records its calls (then does what the base policy does)."""

    grace = 0.05

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def on_partial_failure(self, pending, failures, running):
        self.calls.append(("partial", list(running)))
        super().on_partial_failure(pending, failures, running)

    def on_interrupt(self, pending, running):
        self.calls.append(("interrupt", list(running)))

    def on_dead(self, pending, dead):
        self.calls.append(("dead", list(dead)))
        super().on_dead(pending, dead)


def test_results_come_back_in_rank_order():
    d, _ = _dispatcher(3)
    p = pending_of({2: FakeReply("c"), 0: FakeReply("a"), 1: FakeReply("b")})
    assert d.gather(p) == ["a", "b", "c"]


def test_the_first_rank_to_fail_comes_first():
    d, _ = _dispatcher()
    p = pending_of({0: FakeReply(error=ValueError("echo"), completed=20.0),
                    1: FakeReply(error=KeyError("cause"), completed=10.0)})
    with pytest.raises(RankError) as err:
        d.gather(p)
    assert err.value.ranks == [1, 0] and err.value.first.ename == "KeyError"
    assert d.last_error is err.value


def test_a_failure_while_others_run_goes_to_the_policy_after_its_grace():
    policy = Recorder()
    d, _ = _dispatcher(policy=policy)
    p = pending_of({0: FakeReply(error=ValueError("boom")), 1: FakeReply(done=False)})
    with pytest.raises(RankError, match="boom"):
        d.gather(p)
    assert policy.calls == [("partial", [1])]


def test_a_rank_that_dies_while_running_is_a_dead_rank_error():
    policy = Recorder()
    d, cluster = _dispatcher(policy=policy)
    d.liveness_every = 0.0
    cluster.dead = {1}
    p = pending_of({0: FakeReply(1), 1: FakeReply(done=False)})
    with pytest.raises(DeadRankError, match=r"rank\(s\) 1 died"):
        d.gather(p)
    assert policy.calls == [("dead", [1])]


def test_a_death_the_controller_reported_first_is_still_a_death():
    policy = Recorder()
    d, cluster = _dispatcher(policy=policy)
    cluster.dead = {0}
    p = pending_of({0: FakeReply(error=RuntimeError("engine gone")), 1: FakeReply(2)})
    with pytest.raises(DeadRankError):
        d.gather(p)
    assert policy.calls == [("dead", [0])]


def test_a_timeout_names_the_ranks_still_running():
    d, _ = _dispatcher(3)
    p = pending_of({0: FakeReply(1), 1: FakeReply(done=False), 2: FakeReply(done=False)})
    with pytest.raises(RankTimeoutError) as err:
        d.gather(p, timeout=0.05)
    assert err.value.pending == [1, 2] and "within 0.05 s" in str(err.value)


def test_ctrl_c_while_sending_is_raised_at_the_first_check_and_told_to_the_policy():
    policy = Recorder()
    d, _ = _dispatcher(policy=policy)
    events = []
    d.observers.append(events.append)
    p = pending_of({0: FakeReply(done=False), 1: FakeReply(1)})
    p.interrupted = True
    with pytest.raises(KeyboardInterrupt):
        d.gather(p)
    assert policy.calls == [("interrupt", [0])]
    assert [(e.phase, e.ranks) for e in events] == [("interrupted", (0,))]


def test_observers_see_running_then_done_and_a_broken_one_is_skipped():
    d, _ = _dispatcher()
    events = []

    def broken(event):
        raise RuntimeError("a widget that fails")

    d.observers += [broken, events.append]
    slow = FakeReply(done=False)
    p = pending_of({0: FakeReply(1), 1: slow}, what="run(f)", waiter=lambda rs, t: slow.finish(2))
    assert d.gather(p) == [1, 2]
    assert [(e.what, e.phase, e.ranks) for e in events] == [
        ("run(f)", "running", (1,)), ("run(f)", "running", ()), ("run(f)", "done", ())]


def test_on_poll_runs_while_ranks_still_work():
    d, _ = _dispatcher()
    slow, polled = FakeReply(done=False), []
    p = pending_of({0: FakeReply(1), 1: slow}, waiter=lambda rs, t: slow.finish(2))
    p.on_poll = lambda: polled.append(slow.done)
    d.gather(p)
    assert polled == [True]


def test_a_send_that_fails_on_a_dead_rank_names_the_death_and_starts_a_replacement():
    d, cluster = _dispatcher()
    cluster.dead = {1}
    with pytest.raises(DeadRankError, match="was not sent"):
        with d._sending("run(f)", [0, 1]):
            raise KeyError(1)
    assert cluster.asked == [("start_replacements", [1])]


def test_a_failed_send_with_every_rank_alive_raises_as_it_is():
    d, _ = _dispatcher()
    with pytest.raises(KeyError):
        with d._sending("run(f)", [0, 1]):
            raise KeyError(5)
