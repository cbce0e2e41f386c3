"""The step view's numbers written to TensorBoard (read back from its event files) and to
a W&B-like run, with no engines; ``tests/test_steps_view.py`` writes them from a real
training cell."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_nb.steps.step_metrics import StepMetrics, writer_for
from fsdp_nb.steps.wire_step_times import RankSteps


def steps(rank: int, index: list[int], loss: list[float], total: int, epoch: int = 0) -> RankSteps:
    n = len(index)
    return RankSteps(rank=rank, index=index, seconds=[0.5] * n, compute=[0.2] * n, collective=[0.1] * n,
                     other=[0.2] * n, device="cpu", samples=[8] * n, logged={"loss": loss},
                     logged_total={"loss": total}, epoch=epoch)


class Run:
    """A W&B run's calls, kept."""

    def __init__(self):
        self.logged, self.defined = [], []

    def log(self, values):
        self.logged.append(values)

    def define_metric(self, name, step_metric=None):
        self.defined.append((name, step_metric))


def test_each_step_and_logged_value_is_written_once_when_every_rank_has_it():
    run = Run()
    m = StepMetrics(writer_for(run))
    # rank 1 is a step behind: step 2 waits for it
    assert m.take([steps(0, [0, 1, 2], [3.0, 2.0, 1.0], 3), steps(1, [0, 1], [5.0, 4.0], 2)]) == 4
    assert [v["fsdp_nb/step"] for v in run.logged if "fsdp_nb/step" in v] == [0, 1]
    assert [(v["fsdp_nb/logged"], v["loss"]) for v in run.logged if "loss" in v] == [(0, 4.0), (1, 3.0)]
    assert run.logged[0]["throughput/samples_per_s"] == 32.0 and run.logged[0]["step_ms/rank1"] == 500.0
    run.logged.clear()
    # the same batch again writes nothing; the newest step and value, once rank 1 has them
    assert m.take([steps(0, [0, 1, 2], [3.0, 2.0, 1.0], 3), steps(1, [0, 1], [5.0, 4.0], 2)]) == 0
    assert m.take([steps(0, [1, 2], [2.0, 1.0], 3), steps(1, [1, 2], [4.0, 3.0], 3)]) == 2
    assert [(v.get("fsdp_nb/step"), v.get("fsdp_nb/logged"), v.get("loss")) for v in run.logged] == \
        [(2, None, None), (None, 2, 2.0)]
    assert ("step_ms/*", "fsdp_nb/step") in run.defined and run.defined.count(("loss", "fsdp_nb/logged")) == 1


def test_a_restart_goes_on_from_the_steps_written():
    run = Run()
    m = StepMetrics(writer_for(run))
    m.take([steps(0, [0, 1], [2.0, 1.0], 2)])
    run.logged.clear()
    m.take([steps(0, [0], [0.5], 1, epoch=1)])  # a new group: the rank counts from 0 again
    assert [(v.get("fsdp_nb/step"), v.get("fsdp_nb/logged")) for v in run.logged] == [(2, None), (None, 2)]


def test_anything_else_is_refused_by_name():
    with pytest.raises(TypeError, match="SummaryWriter .*or a W&B run"):
        writer_for(object())


def test_tensorboard_reads_back_what_was_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    m = StepMetrics(writer_for(writer))
    m.take([steps(0, [0, 1], [2.0, 1.0], 2), steps(1, [0, 1], [4.0, 3.0], 2)])
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 3.0), (1, 2.0)]
    assert [e.value for e in events.Scalars("step_ms/rank0")] == [500.0, 500.0]
    assert [e.value for e in events.Scalars("throughput/samples_per_s")] == [32.0, 32.0]


def test_steps_that_left_the_window_unwritten_are_counted_and_said_once(caplog):
    run = Run()
    m = StepMetrics(writer_for(run))
    m.take([steps(0, [5, 6], [1.0, 1.0], 2)])  # the first write starts where the rank is: nothing missed
    assert [v["fsdp_nb/step"] for v in run.logged if "fsdp_nb/step" in v] == [5, 6] and m.missed == 0
    with caplog.at_level("WARNING", logger="fsdp_nb"):
        m.take([steps(0, [10, 11], [1.0, 1.0], 4)])
        m.take([steps(0, [14], [1.0], 5)])
    assert m.missed == 3 + 2
    assert [r.getMessage() for r in caplog.records] == [
        "log_to: steps 7 to 9 ended between two updates and were not written; "
        "a larger sess.steps(window=...) keeps them"]


def test_steps_a_restarts_first_update_missed_are_said_too(caplog):
    """After a restart the ranks count from 0 again; an update that first comes after the
    window lost the new epoch's first steps says so (the numbers go on from before)."""
    run = Run()
    m = StepMetrics(writer_for(run))
    m.take([steps(0, [0, 1], [1.0, 1.0], 2)])
    with caplog.at_level("WARNING", logger="fsdp_nb"):
        m.take([steps(0, [3, 4], [1.0, 1.0], 2, epoch=1)])
    assert [v["fsdp_nb/step"] for v in run.logged if "fsdp_nb/step" in v] == [0, 1, 5, 6] and m.missed == 3
    assert [r.getMessage() for r in caplog.records] == [
        "log_to: steps 2 to 4 ended between two updates and were not written; "
        "a larger sess.steps(window=...) keeps them"]


def test_a_step_a_second_optimizer_may_still_join_waits_for_a_later_message():
    """A rank's newest step is written only once it is final: two optimizers step in one
    iteration, and a message read between them would have written the step short."""
    run = Run()
    m = StepMetrics(writer_for(run))
    early = [dataclasses.replace(steps(r, [0, 1], [1.0, 1.0], 2), open_step=1) for r in (0, 1)]
    m.take(early)
    assert [v["fsdp_nb/step"] for v in run.logged if "fsdp_nb/step" in v] == [0]
    joined = [dataclasses.replace(steps(r, [0, 1], [1.0, 1.0], 2), seconds=[0.5, 0.7]) for r in (0, 1)]
    m.take(joined)  # the boundary passed: step 1 is final, with the second optimizer's time in it
    rows = [v for v in run.logged if "fsdp_nb/step" in v]
    assert [v["fsdp_nb/step"] for v in rows] == [0, 1] and rows[1]["step_ms/rank0"] == pytest.approx(700.0)


def test_mfu_is_written_for_token_batches_on_a_known_gpu():
    run = Run()
    m = StepMetrics(writer_for(run))
    g = [RankSteps(rank=r, index=[0], seconds=[0.5], compute=[0.5], collective=[0.0], other=[0.0], device="cuda",
                   device_name="NVIDIA H100 80GB HBM3", samples=[4], tokens=[4096], parameters=10**9)
         for r in (0, 1)]
    m.take(g)
    (row,) = run.logged
    assert row["throughput/tokens_per_s"] == 2 * 4096 / 0.5
    assert row["throughput/mfu"] == pytest.approx(6e9 * 2 * 4096 / 0.5 / (989e12 * 2))
    m.take([steps(0, [1], [1.0], 2)])  # a CPU rank: no MFU
    assert "throughput/mfu" not in run.logged[-1]


def test_a_target_that_fails_is_dropped_with_a_warning_and_the_view_goes_on(caplog):
    from fsdp_nb.steps.steps_view import StepsView

    class Full:
        def add_scalar(self, tag, value, step):
            raise OSError("No space left on device")

    view = StepsView(ctx=None, window=4).log_to(Full())
    with caplog.at_level("WARNING", logger="fsdp_nb"):
        view.apply([steps(0, [0, 1], [1.0, 1.0], 2)])
    assert view._metrics == [] and view.updated == 1 and view.ranks[0].steps == 2
    assert "writing to Full failed (OSError: No space left on device)" in caplog.text
    with pytest.raises(TypeError, match="SummaryWriter"):
        view.log_to("runs/")  # a folder is not a writer: refused before anything is written


def test_a_target_given_later_begins_after_what_the_view_had_shown():
    run = Run()
    m = StepMetrics(writer_for(run))
    m.start_after([steps(0, [0, 1, 2], [3.0, 2.0, 1.0], 3), steps(1, [0, 1], [5.0, 4.0], 2)])
    m.take([steps(0, [1, 2, 3], [2.0, 1.0, 0.5], 4), steps(1, [1, 2, 3], [4.0, 3.0, 2.5], 4)])
    # rank 1 had passed step 1 and logged 2 values: step 2 on, value 2 on
    assert [(v.get("fsdp_nb/step"), v.get("fsdp_nb/logged")) for v in run.logged] == [
        (2, None), (3, None), (None, 2), (None, 3)]
    later = Run()
    m = StepMetrics(writer_for(later))
    m.start_after([steps(0, [0, 1], [1.0, 1.0], 2)])
    m.take([steps(0, [7, 8], [1.0, 1.0], 9)])  # steps 2-6 left the window before the first update
    assert [v["fsdp_nb/step"] for v in later.logged if "fsdp_nb/step" in v] == [7, 8] and m.missed == 0


def test_the_view_shows_each_ranks_newest_message_when_an_older_one_comes_after():
    """A live update that the feed's thread hands over after a refresh may carry a message
    older than the refresh's: the view does not go back to it."""
    from fsdp_nb.steps.steps_view import StepsView

    view = StepsView(ctx=None, window=50)
    view.apply([steps(0, list(range(40)), [1.0] * 40, 40), steps(1, list(range(40)), [1.0] * 40, 40)])
    view.apply([steps(0, list(range(20)), [1.0] * 20, 20), steps(1, list(range(41)), [1.0] * 41, 41)])
    assert {r: p.steps for r, p in view.ranks.items()} == {0: 40, 1: 41}
    view.apply([steps(0, [0], [1.0], 1, epoch=1)])  # a restart: the new epoch's steps, however few
    assert {r: p.steps for r, p in view.ranks.items()} == {0: 1}


def test_nothing_is_written_until_every_rank_of_the_world_has_sent_a_step():
    """A rank absent from an update, or one whose window is still empty (a sampler's first
    message, a GPU whose events are not read yet), has passed no step: writing the others'
    would lose its numbers for good."""
    run = Run()
    m = StepMetrics(writer_for(run))
    assert m.take([steps(0, [0, 1, 2], [1.0, 1.0, 1.0], 3)], world=2) == 0
    # rank 1 has sent, with no step yet: no step is written; a name only rank 0 logs so far is
    assert m.take([steps(0, [0, 1, 2], [1.0, 1.0, 1.0], 3), steps(1, [], [], 0)], world=2) == 3
    assert [v for v in run.logged if "fsdp_nb/step" in v] == []
    m.take([steps(0, [0, 1, 2], [1.0, 1.0, 1.0], 3), steps(1, [0, 1], [1.0, 1.0], 2)], world=2)
    assert [v["fsdp_nb/step"] for v in run.logged if "fsdp_nb/step" in v] == [0, 1]
    assert all("step_ms/rank1" in v for v in run.logged if "fsdp_nb/step" in v)


def test_a_logger_or_a_log_method_alone_is_refused_by_name():
    import logging

    with pytest.raises(TypeError, match="not a logging.Logger"):
        writer_for(logging.getLogger("fsdp_nb"))

    class Logs:
        def log(self, values):
            pass

    with pytest.raises(TypeError, match="define_metric"):
        writer_for(Logs())


class _Window:
    """A step view's window whose rows the training thread changes while they are read."""

    def __init__(self, owner, changes_while_read: int):
        self.owner, self.left = owner, changes_while_read
        self.rows = [(0, 0.5, 0.2, 0.1, 0.2, 8, 0), (1, 0.5, 0.2, 0.1, 0.2, 8, 0)]
        self.device = type("NoDevice", (), {"read": staticmethod(lambda: [])})()

    @property
    def steps(self):
        if self.left:  # a step joined or a boundary came as this thread read
            self.left -= 1
            self.owner.changes += 1
        return self.rows


def test_a_window_is_read_as_one_state_and_its_newest_step_open_while_it_may_grow():
    from fsdp_nb.engine.step import StepOwner
    from fsdp_nb.steps import rank_step_timing

    owner = StepOwner()
    owner.pending, owner.forwarded = True, True  # the newest step ended at an optimizer step
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rank_step_timing, "owner", lambda: owner)
        rows, _, open_step = rank_step_timing._steps_now(_Window(owner, 1))  # read again once
        assert [r[0] for r in rows] == [0, 1] and open_step == 1
        owner.pending = False  # its boundary came: final
        assert rank_step_timing._steps_now(_Window(owner, 0))[2] == -1
        # a loop that changes it at every read: the newest is taken as open, never as final
        assert rank_step_timing._steps_now(_Window(owner, 99))[2] == 1
        owner.pending, owner.forwarded = True, False  # a step with no forward: the next is its own
        assert rank_step_timing._steps_now(_Window(owner, 0))[2] == -1
