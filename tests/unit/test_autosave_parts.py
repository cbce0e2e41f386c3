"""Autosave's and the async saves' rank parts and their notebook half, with no engines: what
counts as a loader, what arming refuses, whose async job is whose, how the ranks agree
after the group formed again, and the façade's argument checks."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
from helpers import FakeDispatcher, fake_context

from fsdp_nb.autosave import rank_autosave
from fsdp_nb.autosave.autosave import SUSPENDED, Autosaving, autosave, describe, finish_cell, stop
from fsdp_nb.autosave.rank_autosave import Armed, Autosave, agreed
from fsdp_nb.autosave.rank_autosave_checks import left_out_optimizers, loader_lookalikes, refusal
from fsdp_nb.autosave.wire_autosave import AutosaveSpec, AutosaveState
from fsdp_nb.checkpoints.async_saves import AsyncCheckpoint
from fsdp_nb.checkpoints.rank_async_saves import AsyncSaves
from fsdp_nb.checkpoints.rank_run_state import is_torch_loader, loader_method
from fsdp_nb.checkpoints.wire_checkpoint import Outcome
from fsdp_nb.engine.namespace import user_ns
from fsdp_nb.engine.registry import World
from fsdp_nb.errors import CheckpointError
from fsdp_nb.formats.run_state import RNG


class NanoLoader:
    """nanoGPT's way: ``next()`` draws a batch."""

    def next(self):
        return 0

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class GetBatch(NanoLoader):
    next = None  # type: ignore[assignment]

    def get_batch(self):
        return 0


class Ema:
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _spec(**kw) -> AutosaveSpec:
    base = dict(root="ck", storage_options={}, every=2, model="m", optimizers=("opt",), run="r1")
    return AutosaveSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_a_loader_is_known_by_torchs_class_or_by_the_methods_that_draw_batches():
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(8))
    assert is_torch_loader(torch.utils.data.DataLoader(data)) and is_torch_loader(StatefulDataLoader(data))
    assert is_torch_loader(torch.utils.data.RandomSampler(data)) and not is_torch_loader(NanoLoader())
    assert loader_method(NanoLoader()) == "next" and loader_method(GetBatch()) == "get_batch"
    assert loader_method(iter(data)) == "__iter__"
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # an EMA kept in a ModuleList iterates too
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    assert [loader_method(o) for o in (model, opt, sched, Ema(), {"a": 1}, [1])] == [None] * 6


def test_arming_refuses_a_loader_lookalike_in_state_and_an_optimizer_it_leaves_out(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    emb, rest = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    for name, obj in {"batches": NanoLoader(), "dl": torch.utils.data.DataLoader(range(4)), "ema": Ema(),
                      "emb": emb, "rest": rest, "alias": rest, "other": other, "_": emb}.items():
        monkeypatch.setitem(user_ns(), name, obj)
    assert loader_lookalikes(("batches", "dl", "ema")) == [("batches", "next")]  # a torch loader is placed as one
    spec = _spec(optimizers=("rest",), state=("batches",))
    # an alias of a named optimizer, another model's optimizer and IPython's _ are not left out
    assert left_out_optimizers(model, [rest], spec) == ["emb"]
    err = refusal(spec, [("batches", "next")], [])
    assert isinstance(err, TypeError)
    assert "'batches' (a NanoLoader with next())" in str(err) and "loaders=[...]" in str(err)
    assert str(err).endswith("Nothing changed: the autosave that was running, if any, goes on")
    err = refusal(spec, [], ["emb"])
    assert isinstance(err, ValueError) and "optimizer=['rest', 'emb']" in str(err) and "Nothing changed" in str(err)
    assert refusal(spec, [], []) is None


def _armed(monkeypatch, **kw) -> Armed:
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    monkeypatch.setitem(user_ns(), "opt", opt)
    monkeypatch.setitem(user_ns(), "loader", NanoLoader())
    a = Armed(_spec(**kw), ("loader",), (), 0)
    writes: list[int] = []
    monkeypatch.setattr(a, "_save", lambda: writes.append(a.step))
    a.writes = writes  # type: ignore[attr-defined]
    return a


def test_an_iteration_counts_once_and_a_due_save_waits_for_the_boundary_or_the_cells_end(monkeypatch):
    a = _armed(monkeypatch)
    opt, other = user_ns()["opt"], torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    a.step_ended(0, other)  # another model's optimizer: not counted
    a.step_joined(0, opt)
    a.step_joined(0, opt)  # the same iteration again: counted once
    assert (a.step, a.due) == (1, False)
    a.step_ended(1, opt)
    assert a.due and set(a.early) == {"loader", RNG}  # taken at the step's end
    a.boundary(1, "cell end")  # the notebook's finish_cell writes it, once every rank's cell ended well
    assert a.due and a.writes == []  # type: ignore[attr-defined]
    a.cell_started()  # no notebook said so before the next cell: no rank writes it on its own
    assert not a.due and a.writes == []  # type: ignore[attr-defined]
    a.step_ended(2, opt)
    a.step_ended(3, opt)
    a.cell_ended(failed=True)  # a failed cell drops it
    assert (a.step, a.due, a.early) == (4, False, {})
    a.step_ended(4, opt)
    a.step_ended(5, opt)
    a.boundary(5, "forward")
    assert a.writes == [6]  # type: ignore[attr-defined]
    a.step_ended(6, opt)
    a.step_ended(7, opt)
    a.loaded({"step": 3})  # a load: the due save is dropped, the count is the checkpoint's
    assert (a.step, a.due, a.branch) == (3, False, 1)


def test_a_due_save_is_written_at_a_cells_end_only_where_every_rank_has_it_due(monkeypatch):
    a = _armed(monkeypatch)
    part = Autosave()
    part.armed = a
    monkeypatch.setattr(rank_autosave, "_autosave", lambda: part)
    a.due, a.step = True, 2
    assert rank_autosave.finish_cell(True) == (2, True, False) and a.due  # no collective: the notebook decides
    rank_autosave.write_due(3)  # not the step this rank has due: nothing
    assert a.due and a.writes == []  # type: ignore[attr-defined]
    rank_autosave.write_due(2)
    assert not a.due and a.writes == [2]  # type: ignore[attr-defined]
    a.due = True
    assert rank_autosave.finish_cell(False) == (2, False, False) and not a.due  # a failed call drops it
    rank_autosave.count_from(5)  # the ranks' counts differed: every rank counts on from the highest
    assert (a.step, a.due) == (5, False)
    ctx = fake_context()
    ctx.lifecycle.to("ready")
    ctx.autosave = _spec()
    # (each rank's (count, save due, copy in memory pending), the call went well, what the notebook sends next)
    for said, ok, then in (([(4, False, False)] * 2, True, ()), ([(4, True, False)] * 2, True, ("write_due",)),
                           ([(4, True, False), (4, False, False)], True, ("drop_due",)),
                           ([(4, False, False), (3, False, False)], False, ("count_from",)),
                           ([(4, True, False)] * 2, False, ()),
                           ([(4, False, True)] * 2, True, ("write_due",)),  # the cell's last step, copied
                           ([(4, True, True), (4, True, False)], True, ("write_due", "drop_due")),
                           ([(4, False, True)] * 2, False, ())):  # a failed call: no copy of a step it cut short
        ctx.recovering = FakeDispatcher({"finish_cell": said, "write_due": [None, None], "drop_due": [None, None],
                                         "count_from": [None, None]})
        finish_cell(ctx, ok)
        assert [fn for _, fn, _ in ctx.recovering.sent] == ["finish_cell", *then], said


def test_after_the_group_formed_again_the_ranks_agree_on_the_autosave(monkeypatch):
    assert agreed([("r", 4, True, 0), ("r", 4, True, 1)]) == (True, 4, True, 1)
    assert agreed([("r", 4, True, 0), ("r", 4, False, 0)]) == (True, 4, False, 0)  # not due everywhere: dropped
    assert agreed([("r", 5, False, 0), ("r", 4, False, 0)]) == (True, 5, False, 0)  # a step cut short on one
    assert agreed([("r", 4, True, 0), None])[0] is False  # a rank that joined holds none: all stop
    assert agreed([("r", 4, True, 0), ("s", 4, True, 0)])[0] is False
    a = _armed(monkeypatch)
    part = Autosave()
    part.armed = a
    a.due = True
    part.reformed(World(0, 1))  # one rank agrees with itself
    assert part.armed is a and a.due


def _job(outcome: Outcome | None = None) -> tuple[Future, threading.Event]:
    go = threading.Event()

    def run() -> Outcome:
        go.wait(10)
        return outcome or Outcome()

    return run, go  # type: ignore[return-value]


def test_an_async_job_is_its_owners_and_a_drain_leaves_it_to_them():
    saves = AsyncSaves()
    try:
        mine, go = _job(Outcome(removed=["old"]))
        saves.submit("user", mine)  # type: ignore[arg-type]
        go.set()
        saves.drain()  # waits, collects nothing
        assert saves.jobs["user"].future.done()
        assert saves.wait("user").removed == ["old"]
        out = saves.wait("user")  # collected already: an error that says so
        assert not out.ok and out.error is LookupError and "knows no async save 'user'" in out.message
        stopped, go = _job(Outcome.failed("disk full"))
        saves.submit("auto", stopped)  # type: ignore[arg-type]
        saves.orphan("auto")  # its autosave stopped: dropped once done
        go.set()
        saves.drain()
        assert "auto" not in saves.jobs
    finally:
        saves.closed()


def test_a_save_stuck_in_the_old_group_does_not_hold_the_new_groups_saves(monkeypatch):
    """A save whose thread stays blocked in a collective of the old group (a peer left it
    mid-ring) is abandoned at the re-form, and the next save runs on a thread of its own
    instead of queueing behind it (training would wait behind that save's staging)."""
    from fsdp_nb.checkpoints import rank_async_saves

    monkeypatch.setattr(rank_async_saves, "REFORM_WAIT_S", 0.2)
    saves = AsyncSaves()
    stuck, release = _job()
    try:
        saves.submit("old", stuck)  # type: ignore[arg-type]
        saves.reformed(World(0, 2))
        assert saves.jobs["old"].abandoned and not saves.jobs["old"].future.done()
        after, go = _job(Outcome(removed=["new"]))
        saves.submit("new", after)  # type: ignore[arg-type]
        go.set()
        assert saves.wait("new").removed == ["new"]  # ran while the old one is still blocked
        assert not saves.jobs["old"].future.done()
    finally:
        release.set()
        saves.closed()


def test_a_handle_whose_ranks_do_not_know_its_save_says_it_is_lost(tmp_path):
    ctx = fake_context()
    ctx.lifecycle.to("ready")
    lost = Outcome.failed("this rank knows no async save 'tok'", LookupError)
    ctx.recovering = FakeDispatcher({"async_wait": [Outcome(), lost]})
    h = AsyncCheckpoint(ctx, str(tmp_path / "gone"), "tok", 0.0)
    with pytest.raises(CheckpointError, match=r"is lost: rank\(s\) 1 do not know it.*is not there"):
        h.wait()
    ctx.recovering = FakeDispatcher({"async_wait": [Outcome.failed("disk full"), lost]})
    with pytest.raises(CheckpointError, match="disk full"):  # a real failure first
        AsyncCheckpoint(ctx, str(tmp_path / "gone"), "tok", 0.0).wait()
    # a rank's failure in its own words (a peer died under the save) is named by the save's path
    ctx.recovering = FakeDispatcher({"async_wait": [Outcome.failed("Connection closed by peer"), Outcome()]})
    with pytest.raises(CheckpointError, match=r"the async save to '.*gone': Connection closed by peer"):
        AsyncCheckpoint(ctx, str(tmp_path / "gone"), "tok", 0.0).wait()


def test_autosave_arguments_are_checked_before_any_rank_is_asked():
    ctx = fake_context()
    ctx.lifecycle.to("ready")
    with pytest.raises(ValueError, match="'sched' is named in both loaders= and state="):
        autosave(ctx, "ck", every=2, model="m", optimizer="opt", state=["sched"], loaders=["sched"])
    with pytest.raises(TypeError, match="loaders must be a list of engine global names"):
        autosave(ctx, "ck", every=2, model="m", optimizer="opt", loaders="loader")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="names an optimizer twice"):
        autosave(ctx, "ck", every=2, model="m", optimizer=["a", "a"])
    with pytest.raises(TypeError, match="or a list of them"):
        autosave(ctx, "ck", every=2, model="m", optimizer=None)  # type: ignore[arg-type]


def test_a_suspended_autosave_says_so_and_stop_forgets_it():
    ctx = fake_context()
    ctx.lifecycle.to("ready")
    spec = _spec(loaders=("batches",))
    ctx.suspended_autosave = ctx.last_autosave = spec
    on = describe(ctx)
    assert on is not None and on.suspended and on.ranks == () and on.loaders == ("batches",)
    assert repr(on).endswith(f"; {SUSPENDED}>")
    stop(ctx)  # no rank holds it: nothing is sent
    assert describe(ctx) is None and ctx.suspended_autosave is None and ctx.after_call == []
    finish_cell(ctx, True)  # off: nothing is sent


def test_the_autosaves_repr_names_the_last_committed_save_and_the_one_in_flight():
    on = Autosaving("ck", 2, "m", ("emb", "rest"), ("sched",), None,
                    (AutosaveState(step=5, saved="ck/step-2", writing="ck/step-4", failed=None),), ("batches",))
    assert repr(on) == ("<autosave of m, emb, rest, batches, sched, each rank's random state to ck every 2 "
                        "optimizer steps; at step 5, last save ck/step-2, writing ck/step-4>")
