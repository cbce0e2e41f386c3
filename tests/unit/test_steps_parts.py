"""The step view's split and its stragglers (``steps.steps_view``), from synthetic
per-rank steps: no engines."""

from __future__ import annotations

import pytest

from fsdp_nb.steps.steps_view import StepsView
from fsdp_nb.steps.wire_step_times import RankSteps


def _rank(r, n, compute, collective, other, start=0):
    step = [c + k + o for c, k, o in zip(compute, collective, other)]
    return RankSteps(rank=r, index=list(range(start, start + n)), seconds=step, compute=list(compute),
                     collective=list(collective), other=list(other), device="cpu")


def test_waiting_is_collective_time_beyond_the_rank_that_waited_least_and_the_parts_add_up():
    n = 4
    ranks = [_rank(0, n, [0.01] * n, [0.03] * n, [0.0] * n),  # waits for rank 1's data step
             _rank(1, n, [0.01] * n, [0.01] * n, [0.02] * n)]
    view = StepsView(ctx=None, window=n)  # type: ignore[arg-type]  # apply needs no session
    view.apply(ranks)
    p0, p1 = view.ranks[0], view.ranks[1]
    assert p0.communication == p1.communication == pytest.approx(0.01)
    assert p0.waiting == pytest.approx(0.02) and p1.waiting == pytest.approx(0.0)
    for p in (p0, p1):
        assert p.compute + p.communication + p.waiting + p.other == pytest.approx(p.step)
    s = view.stragglers
    # own work: rank 0's 40 ms step less its 20 ms waiting, rank 1's 40 ms; median 30 ms
    assert [(x.rank, x.part) for x in s] == [(1, "other")] and s[0].slower == pytest.approx(0.04 / 0.03 - 1)


def test_since_is_the_first_of_the_newest_steps_that_stayed_slow():
    fast, slow = 0.0, 0.02
    other1 = [fast] * 5 + [slow] * 5  # rank 1 slows down from its sixth kept step (number 105)
    ranks = [_rank(0, 10, [0.01] * 10, [0.01 + o for o in other1], [0.0] * 10, start=100),
             _rank(1, 10, [0.01] * 10, [0.01] * 10, other1, start=100)]
    view = StepsView(ctx=None, window=10)  # type: ignore[arg-type]
    view.apply(ranks)
    assert [(x.rank, x.part, x.since) for x in view.stragglers] == [(1, "other", 105)]
    assert "rank 1:" in str(view.stragglers[0]) and "since step 105" in str(view.stragglers[0])


def test_alike_ranks_have_no_straggler_and_one_rank_none_either():
    ranks = [_rank(r, 3, [0.01] * 3, [0.01] * 3, [0.001] * 3) for r in range(4)]
    view = StepsView(ctx=None, window=3)  # type: ignore[arg-type]
    view.apply(ranks)
    assert view.stragglers == [] and "no straggler" in view.to_text()
    view.apply(ranks[:1])
    assert view.stragglers == []
