"""A rank's step measurement (``engine.step_timing``) driven directly on CPU, no engines:
which model counts the batch, what an eval forward or a second optimizer does, and that
``stop`` leaves no hook behind."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

from fsdp_nb.engine import step_timing


@pytest.fixture
def timing():
    hooks = dict(torch_module._global_forward_pre_hooks)
    step_timing.start(10)
    try:
        yield step_timing
    finally:
        step_timing.stop()
        assert dict(torch_module._global_forward_pre_hooks) == hooks  # the one-shot hook went too


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


def test_steps_with_no_model_are_each_a_step(timing):
    opt = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    for _ in range(3):
        opt.step()
    assert len(timing.window().seconds) == 3 and timing.count() == 3
