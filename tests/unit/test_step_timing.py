"""A rank's step measurement (``steps.rank_step_timing``) driven directly on CPU, no engines:
which model counts the batch, what an eval forward or a second optimizer does, and that
``stop`` leaves the step owner's listeners as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_nb.engine.registry import part
from fsdp_nb.engine.step import owner
from fsdp_nb.steps import rank_step_timing as step_timing
from fsdp_nb.steps.rank_logged import Logged


@pytest.fixture
def timing():
    listeners = list(owner().listeners)
    owner().cell_started()  # as IPython tells the rank's owner: an iteration of an earlier test is over
    step_timing.start(10)
    try:
        yield step_timing
    finally:
        owner().cell_ended(False)
        step_timing.stop()
        # what the test left listening is only fsdp_nb.log's part, which listens for the run's life
        assert [x for x in owner().listeners if x not in listeners and not isinstance(x, Logged)] == []
        assert part(step_timing.StepTiming).window is None


class Lm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 8), nn.Linear(8, 32)

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_a_loops_own_model_counts_its_batch_and_an_eval_forward_does_not(timing):
    model, teacher = Lm(), nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        with torch.no_grad():
            teacher(torch.ones(32, 4))  # an eval forward first: it does not take the batch
        model(torch.zeros(4, 16, dtype=torch.long)).sum().backward()
        opt.step()
    got = timing.window()
    assert got.samples == [4, 4, 4] and got.tokens == [64, 64, 64]
    assert got.parameters == sum(p.numel() for p in model.parameters()) and len(got.seconds) == 3


def test_a_second_optimizers_step_joins_the_iteration(timing):
    model = nn.Linear(4, 4)
    a = torch.optim.SGD([model.weight], lr=0.1)
    b = torch.optim.SGD([model.bias], lr=0.1)
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        a.step()
        b.step()  # no forward since a's step: the same iteration
    got = timing.window()
    assert len(got.seconds) == 2 and got.samples == [2, 2]
    for i in range(2):
        assert got.compute[i] + got.collective[i] + got.other[i] == pytest.approx(got.seconds[i])


def test_steps_with_no_model_are_each_a_step_one_a_cell(timing):
    """With no forward between them, optimizer steps are one iteration (the step owner's
    rule: a second optimizer's step joins the first's); a cell's end ends it."""
    opt = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    for _ in range(3):
        owner().cell_started()
        opt.step()
        owner().cell_ended(False)
    assert len(timing.window().seconds) == 3 and timing.count() == 3


class FakeEvent:
    """A CUDA timing event as the device would leave it: recorded at device time ``at``
    (seconds), passed once ``done``."""

    def __init__(self, at, done=True):
        self.at, self.done = at, done

    def query(self):
        return self.done

    def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event's
        assert self.done and end.done, "elapsed_time of an event the device has not passed"
        return (end.at - self.at) * 1e3


def test_a_gpu_ranks_steps_are_read_from_its_events_never_waiting_for_the_device():
    from fsdp_nb.steps.rank_step_events import DeviceSteps

    clock = iter([0.0, 0.02, 0.10, 0.13, 0.21, 0.24, 0.30])  # end 0; then (forward, end) per step
    made = []

    def event():
        made.append(FakeEvent(next(clock)))
        return made[-1]

    dev = DeviceSteps(keep=5, event=event)
    dev.stepped(0)  # a step measured before: only its end counts
    for i in (1, 2, 3):
        dev.forward()
        dev.stepped(i)
    assert dev.newest_passed() == 3
    made[-1].done = False  # the device has not reached step 3's end yet: it is left out, not waited for
    assert dev.newest_passed() == 2
    got = dev.read()
    assert [g[0] for g in got] == [1, 2]
    assert got[0][1:] == pytest.approx((0.10, 0.02, 0.08)) and got[1][1:] == pytest.approx((0.11, 0.03, 0.08))
    cpu = DeviceSteps(keep=5, event=lambda: None)
    cpu.stepped(0)
    assert cpu.read() == [] and cpu.newest_passed() is None  # a CPU rank records nothing


def test_a_gpu_ranks_first_step_in_a_cell_counts_from_the_cells_start():
    from fsdp_nb.steps.rank_step_events import DeviceSteps

    # step 1 ends at 0.10; the user reads a minute; the next cell starts at 60.0
    clock = iter([0.0, 0.02, 0.10, 60.0, 60.01, 60.05, 60.06, 60.10])
    dev = DeviceSteps(keep=5, event=lambda: FakeEvent(next(clock)))
    dev.cell_started()
    dev.forward()
    dev.stepped(1)
    dev.cell_started()
    for i in (2, 3):
        dev.forward()
        dev.stepped(i)
    got = dev.read()
    assert [g[0] for g in got] == [1, 2, 3]  # a cell's first step, the session's first too, is measured
    assert got[1][1:] == pytest.approx((0.05, 0.01, 0.04))  # not the minute between the cells
    assert got[2][1:] == pytest.approx((0.05, 0.01, 0.04))  # the next: from step 2's end


def test_a_cells_start_reaches_a_gpu_ranks_events_and_a_second_optimizer_does_not_join_across_it(timing):
    from fsdp_nb.steps.rank_step_events import DeviceSteps

    clock = iter([-0.01, 0.0, 0.10, 60.0, 60.01, 60.03, 60.07])  # end, forward, end, cell, joined, forward, end
    window = part(timing.StepTiming).window
    assert window is not None
    dev = window.device = DeviceSteps(keep=5, event=lambda: FakeEvent(next(clock)))
    dev.stepped(0)
    dev.forward()
    dev.stepped(1)
    owner().cell_started()  # IPython's pre_execute (or a sess.run call's start), on the rank's main thread
    assert dev.since is not None and dev.since.at == 60.0
    dev.joined()  # a second optimizer's step, the cell's first act: step 1 stays as it was
    dev.forward()
    dev.stepped(2)
    got = dev.read()
    assert [g[0] for g in got] == [1, 2] and got[0][1] == pytest.approx(0.11)  # not the minute after it
    assert got[1][1:] == pytest.approx((0.07, 0.03, 0.04))  # from the cell's start


def test_the_view_of_gpu_ranks_uses_the_devices_times_and_leaves_the_model_part_whole():
    from fsdp_nb.steps.steps_view import StepsView
    from fsdp_nb.steps.wire_step_times import RankSteps

    def rank(r, model):  # host clocks say 1 ms steps (launches); the device says otherwise
        return RankSteps(rank=r, index=[0, 1, 2], seconds=[0.001] * 3, compute=[0.001] * 3, collective=[0.0] * 3,
                         other=[0.0] * 3, device="cuda", device_name="NVIDIA H100 80GB HBM3", samples=[4] * 3,
                         tokens=[4096] * 3, parameters=10**8, device_index=[1, 2], device_seconds=[model + 0.01] * 2,
                         device_other=[0.01] * 2, device_model=[model] * 2)

    view = StepsView(ctx=None, window=5)  # type: ignore[arg-type]
    view.apply([rank(0, 0.05), rank(1, 0.08)])
    assert view.device == "cuda" and view.ranks[1].step == pytest.approx(0.09) and view.ranks[1].steps == 2
    assert view.ranks[1].compute == pytest.approx(0.08) and view.ranks[1].other == pytest.approx(0.01)
    assert [(s.rank, s.part) for s in view.stragglers] == [(1, "compute")]
    text = view.to_text()
    assert "model ms" in text and "communication ms" not in text and "CUDA events" in text
    assert view.rates.tokens_per_s == pytest.approx(4096 / 0.06 + 4096 / 0.09) and view.rates.mfu is not None
