"""The step owner (``fsdp_nb.engine.step``) driven on CPU with real modules and optimizers,
no engines: what a listener hears, in which order, for the loops people write."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_nb.engine.registry import World
from fsdp_nb.engine.step import StepListener, StepOwner


class Heard(StepListener):
    """Writes down every event, as ``name`` or ``name:arg``."""

    def __init__(self, order: int = 50) -> None:
        self.order = order  # type: ignore[misc]
        self.events: list[str] = []

    def cell_started(self) -> None:
        self.events.append("cell")

    def step_began(self, step: int) -> None:
        self.events.append(f"began:{step}")

    def eval_forward(self, module: Any) -> None:
        self.events.append("eval")

    def step_ended(self, step: int, optimizer: Any) -> None:
        self.events.append(f"ended:{step}")

    def step_joined(self, step: int, optimizer: Any) -> None:
        self.events.append(f"joined:{step}")

    def boundary(self, step: int, at: str) -> None:
        self.events.append(f"boundary:{step}:{at}")

    def cell_ended(self, failed: bool) -> None:
        self.events.append("failed" if failed else "done")

    def watched(self, module: Any) -> None:
        self.events.append("watched")

    def cut_short(self) -> None:
        self.events.append("cut short")


def _owner(*listeners: StepListener) -> tuple[StepOwner, nn.Module]:
    steps = StepOwner()
    for x in listeners:
        steps.listen(x)
    model = nn.Linear(4, 1)
    steps.watch(model)
    return steps, model


def _step(model: nn.Module, *optims: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 4)).sum().backward()
    for o in optims:
        o.step()
        o.zero_grad()


def test_an_iteration_with_two_optimizers_and_an_eval_in_its_order():
    heard = Heard()
    steps, model = _owner(heard)
    try:
        a = torch.optim.SGD([model.weight], lr=0.1)
        b = torch.optim.SGD([model.bias], lr=0.1)
        steps.cell_started()
        _step(model, a, b)  # two optimizers, no forward between them: one iteration
        with torch.no_grad():
            model(torch.ones(1, 4))  # an evaluation after it: its boundary, no step
        _step(model, a, b)
        steps.cell_ended(False)
        assert heard.events == ["watched", "cell", "began:0", "ended:0", "joined:0", "boundary:0:eval", "eval",
                                "began:1", "ended:1", "joined:1", "boundary:1:cell end", "done"]
        assert (steps.optimizer_steps(a), steps.optimizer_steps(b), steps.steps) == (2, 2, 2)
    finally:
        steps.closed()


def test_a_failed_cell_tells_no_boundary_and_the_next_forward_begins_afresh():
    heard = Heard()
    steps, model = _owner(heard)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps.cell_started()
        _step(model, opt)
        steps.cell_ended(True)  # it raised after the step: the iteration did not end cleanly
        steps.cell_started()
        model(torch.ones(2, 4))
        assert heard.events[-4:] == ["ended:0", "failed", "cell", "began:1"]
    finally:
        steps.closed()


def test_a_step_the_scaler_skipped_still_ends_its_iteration():
    """An fp16 step whose gradients hold inf: the optimizer's step never runs, the scaler
    says so, and the next forward begins the next iteration (it used to merge the two)."""
    heard = Heard()
    steps, model = _owner(heard)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps.cell_started()
        model(torch.ones(2, 4)).sum().backward()
        steps.skipped(opt)  # what CountingScaler.step says when the step did not run
        _step(model, opt)
        assert heard.events[2:] == ["began:0", "ended:0", "boundary:0:forward", "began:1", "ended:1"]
        assert steps.optimizer_steps(opt) == 1 and steps.steps == 2
    finally:
        steps.closed()


def test_a_loop_whose_forwards_are_not_seen_makes_each_step_its_own():
    heard = Heard()
    steps = StepOwner()
    steps.listen(heard)
    watched = nn.Linear(1, 1)
    steps.watch(watched)  # a wrapped model alive, so the one-shot hook is off: the loop's own model goes unseen
    try:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps.cell_started()
        _step(model, opt)
        _step(model, opt)
        assert heard.events[2:] == ["began:0", "ended:0", "boundary:0:step", "began:1", "ended:1"]
    finally:
        steps.closed()


def test_listeners_are_told_in_their_order_and_a_listen_replaces_the_list():
    late, early = Heard(order=80), Heard(order=10)
    steps, model = _owner(late)
    try:
        told: list[str] = []
        late.step_began = lambda step: told.append("late")  # type: ignore[method-assign]
        early.step_began = lambda step: told.append("early")  # type: ignore[method-assign]
        before = steps.listeners
        steps.listen(early)
        assert before == [late]  # a step being told iterates the list it read, never one being sorted
        model(torch.ones(1, 4))
        assert told == ["early", "late"]
        steps.unlisten(early)
        assert steps.listeners == [late]
    finally:
        steps.closed()


def test_taking_state_hides_a_saves_own_steps_and_a_closed_owner_starts_again():
    heard = Heard()
    steps, model = _owner(heard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with steps.taking_state():
        _step(model, opt)  # torch's get_state_dict steps an optimizer with no state: no training step
    assert heard.events == ["watched"] and steps.optimizer_steps(opt) == 0
    steps.reformed(World(0, 1))
    steps.closed()  # the rank left: no hook remains, and the owner forgets the models it watched
    assert not steps.listeners and not steps.hooks and not len(steps.watched) and not steps.installed
    _step(model, opt)
    assert heard.events == ["watched"]


def test_the_notebook_learns_what_the_last_cell_did_and_a_step_it_cut_short_is_dropped(monkeypatch):
    """After a cell failed on some rank, ``cell_failed`` says how many optimizer steps the
    last cell took here (a load, or a group formed with a new rank, counts from there),
    whether it ended inside a step it trained in, failing or not, and whether it failed
    here; it changes nothing. ``drop_cut_short`` then drops that step and tells the
    listeners."""
    from fsdp_nb.engine import step as step_module

    drops: list[int] = []
    monkeypatch.setattr(step_module, "drop_unsynced_gradients", lambda module: drops.append(1) or 0)
    heard = Heard()
    steps, model = _owner(heard)
    try:
        opt, second = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
        steps.cell_started()
        _step(model, opt)
        _step(model, opt, second)  # one iteration, two optimizer steps: a rank that took one differs
        steps.cell_ended(False)
        assert steps.cell_failed() == (3, False, False) == steps.cell_failed() and drops == []
        steps.cell_started()
        _step(model)  # a micro-batch, no optimizer step: the cell ends inside the step
        steps.cell_ended(False)
        assert steps.cell_failed() == (0, True, False) and drops == []
        steps.drop_cut_short()
        assert drops == [1] and heard.events[-1] == "cut short" and steps.cell_failed() == (0, False, False)
        steps.cell_started()
        _step(model)
        steps.cell_ended(True)  # failed inside the step: dropped here at once, the listeners told first
        assert drops == [1, 1] and steps.cell_failed() == (0, True, True)
        assert heard.events[-2:] == ["cut short", "failed"]
        steps.cell_started()
        steps.cell_ended(True)  # a typo: no training forward, nothing cut short
        assert steps.cell_failed() == (0, False, True) and heard.events[-2:] == ["cell", "failed"]
        steps.cell_started()
        _step(model, opt)
        steps.cell_ended(True)
        steps.reformed(World(0, 2))  # a recovery's new group: the count goes on, for its note
        assert steps.cell_failed() == (1, False, True)
        steps.reformed(World(0, 2, joined=(1,)))  # a rank joined, whose count is 0: every count starts again
        assert steps.cell_failed() == (0, False, True)
        _step(model, opt)
        steps.loaded({"step": 5})
        assert steps.cell_failed() == (0, False, True) and drops == [1, 1]
    finally:
        steps.closed()
