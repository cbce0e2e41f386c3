"""Where the step view, the profile, ``fsdp_nb.log`` and the memory readings meet the rank's
step and its lifecycle (issue 56), driven on CPU in this process, no engines: the parts
hear the step owner's events and start afresh when the group forms again.

The rank-side tests drive this process's own registry and step owner, as IPython or the
call server would on a rank (``owner().cell_started()`` and ``cell_ended``)."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fsdp_nb.engine.registry import World, part
from fsdp_nb.engine.step import owner
from fsdp_nb.steps import rank_step_profile as profiling
from fsdp_nb.steps import rank_step_timing as timing
from fsdp_nb.steps.step_trace import lanes, step_parts
from fsdp_nb.steps.steps_view import StepsView
from fsdp_nb.steps.wire_profile import ProfileSpec
from fsdp_nb.steps.wire_step_times import RankSteps

MAIN, GLOO = 100, 200
US = 1e-6


def _x(name, ts, dur, tid=MAIN, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": float(ts), "dur": float(dur), "tid": tid, "pid": 7, "cat": cat}


@pytest.fixture
def cell():
    """A cell on this process's rank: the owner's iteration an earlier test left is over,
    and every listener a test added is gone at its end."""
    listeners = list(owner().listeners)
    owner().cell_started()
    yield owner()
    owner().cell_ended(False)
    timing.stop()
    profiling.discard()
    assert owner().listeners == listeners


# -- the profile's split (bug 7) ---------------------------------------------------------------


def test_host_work_inside_a_collective_and_fsdps_copies_are_compute_on_a_cpu_rank():
    """FSDP's all-gather on a CPU rank: its copy-in runs inside ``FSDP::all_gather``, gloo's
    reduce-scatter copies its input inside ``c10d::_reduce_scatter_base_``, and the
    copy-out is a copy: all compute. Only the time blocked in the collective is
    communication (as a real gloo trace has them: ``aten::clone`` inside the reduce-scatter)."""
    events = [
        _x("FSDP::all_gather (0)", 0, 30, cat="user_annotation"),
        _x("fsdp::all_gather_copy_in", 1, 4),              # 1-5: copy into the buffer
        _x("aten::_foreach_copy_", 2, 3),
        _x("c10d::_allgather_base_", 6, 20),               # 6-26: the collective, blocking
        _x("FSDP::all_gather_copy_out (0)", 30, 6, cat="user_annotation"),
        _x("fsdp::split_with_sizes_copy", 31, 4),          # 31-35: copy out of the buffer
        _x("aten::addmm", 40, 10),                         # 40-50: the forward
        _x("c10d::_reduce_scatter_base_", 50, 20),         # 50-70: the reduce-scatter...
        _x("aten::clone", 51, 5),                          # ...copies its input first: 51-56
        _x("gloo:all_gather", 7, 18, tid=GLOO, cat="user_annotation"),  # gloo's thread works 7-25
    ]
    compute, comm = lanes(events, (0.0, 80.0), MAIN)
    assert compute == [(1, 5), (31, 35), (40, 50), (51, 56)]
    # the collectives' spans less the work inside them (the all-gather's annotation less its copy-in)
    assert comm == [(0, 1), (5, 30), (50, 51), (56, 70)]
    p = step_parts(0, events, [(0.0, 80.0)], MAIN)
    assert p.compute == pytest.approx(23 * US) and p.exposed == pytest.approx(41 * US)
    assert p.idle == pytest.approx(16 * US) and p.compute + p.exposed + p.idle == pytest.approx(p.step)


def test_on_a_gpu_rank_only_the_devices_collective_kernels_are_communication():
    """The host's spans of a collective (its ``c10d::`` op, FSDP's annotations, the copy-out)
    only launch work: a GPU rank's communication is NCCL's kernels, its compute the other
    kernels (the copies into and out of the buffers among them)."""
    events = [
        _x("FSDP::all_gather (0)", 0, 50, cat="user_annotation"),  # the host: launches only
        _x("c10d::_allgather_base_", 5, 40),
        _x("record_param_comms", 5, 40),
        _x("FSDP::all_gather_copy_out (0)", 50, 10, cat="user_annotation"),
        _x("void at::native::all_gather_copy_in_kernel", 10, 2, tid=7, cat="kernel"),  # 10-12
        _x("ncclDevKernel_AllGather_RING_LL", 12, 6, tid=9, cat="kernel"),              # 12-18
        _x("void at::native::split_with_sizes_copy_out_kernel", 18, 2, tid=7, cat="kernel"),  # 18-20
        _x("sm90_gemm", 20, 10, tid=7, cat="kernel"),                                   # 20-30
    ]
    compute, comm = lanes(events, (0.0, 40.0), MAIN)
    assert compute == [(10, 12), (18, 30)] and comm == [(12, 18)]
    p = step_parts(1, events, [(0.0, 40.0)], MAIN)
    assert p.device == "gpu" and p.exposed == pytest.approx(6 * US) and p.idle == pytest.approx(20 * US)


# -- the step view's sampler (bug 17d) ---------------------------------------------------------


def _torch_line(relative: str, text: str) -> tuple[str, int]:
    """A line of torch's own source: its file and number (the test is skipped on a torch
    whose source no longer has it)."""
    path = os.path.join(os.path.dirname(torch.__file__), "distributed", relative)
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip().startswith(text):
                return path, n
    pytest.skip(f"torch {torch.__version__} has no line {text!r} in {relative}")


@pytest.mark.parametrize("relative,text,kind", [
    ("fsdp/_fully_shard/_fsdp_collectives.py", "torch._foreach_copy_(", timing.COMPUTE),   # the copy-in
    ("fsdp/_fully_shard/_fsdp_collectives.py", "torch.split_with_sizes_copy(", timing.COMPUTE),  # the copy-out
    ("fsdp/_fully_shard/_fsdp_collectives.py", "torch._chunk_cat(", timing.COMPUTE),  # the reduce-scatter's copy-in
    ("distributed_c10d.py", "work.wait()", timing.COLLECTIVE),
    ("distributed_c10d.py", "work = group.allreduce(", timing.COLLECTIVE),
], ids=["copy-in", "copy-out", "chunk-cat", "wait", "allreduce"])
def test_the_sampler_counts_fsdps_copies_as_compute_and_a_collective_or_its_wait_as_communication(
        relative, text, kind):
    path, n = _torch_line(relative, text)
    lines: dict[tuple[str, int], int] = {}
    frame = SimpleNamespace(f_code=SimpleNamespace(co_filename=path), f_lineno=n)
    assert timing.frame_kind(frame, lines) == kind
    assert lines == {(path, n): kind}  # looked up once: the next look at that line reads no file
    elsewhere = SimpleNamespace(f_code=SimpleNamespace(co_filename=torch.nn.functional.__file__), f_lineno=1)
    assert timing.frame_kind(elsewhere, lines) == timing.COMPUTE


def test_a_line_is_communication_by_what_it_calls():
    assert timing.line_kind("all_gather_work = dist.all_gather_into_tensor(out, inp, group=g, async_op=True)") == 1
    assert timing.line_kind("torch.ops._c10d_functional.wait_tensor(t)") == timing.COLLECTIVE
    assert timing.line_kind("all_gather_input, all_gather_output = torch.ops.fsdp.all_gather_copy_in(") == 0
    assert timing.line_kind("reduce_scatter_input = torch.empty(size, dtype=dtype)") == timing.COMPUTE


# -- the step view's window and views (bugs 12, 17c) -------------------------------------------


def _steps(cell_, n: int) -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()


def test_a_new_group_starts_the_window_afresh_under_a_new_epoch(cell):
    timing.start(10, "a")
    _steps(cell, 3)
    before = timing.window()
    assert len(before.seconds) == 3 and before.epoch == part(timing.StepTiming).epoch
    part(timing.StepTiming).reformed(World(0, 1))  # one rank: nothing to agree with
    after = timing.window()
    assert after.seconds == [] and after.epoch == before.epoch + 1 and timing.count() == 0
    _steps(cell, 2)
    assert timing.window().index == [0, 1]  # numbered from the new group's start
    # the notebook's view takes only the newest epoch's samples: a rank not yet heard from
    # since the group formed again is left out, never mixed in
    old = RankSteps(rank=1, index=[7, 8], seconds=[9.0, 9.0], compute=[9.0] * 2, collective=[0.0] * 2,
                    other=[0.0] * 2, device="cpu", epoch=before.epoch)
    view = StepsView(ctx=None, window=10)  # type: ignore[arg-type]  # apply needs no session
    view.apply([timing.window(), old])
    assert sorted(view.ranks) == [0] and view.ranks[0].steps == 2 and view.stragglers == []


def test_stopping_one_view_leaves_the_others_measuring(cell):
    timing.start(5, "a")
    timing.start(8, "b")
    window = part(timing.StepTiming).window
    assert window is not None and window.keep == 8
    timing.stop("a")
    assert part(timing.StepTiming).window is window and window in owner().listeners
    _steps(cell, 2)
    assert len(timing.window().seconds) == 2
    timing.stop("b")
    assert part(timing.StepTiming).window is None and window not in owner().listeners
    window.sampler.join(10)
    assert not window.sampler.is_alive()


def test_a_pause_between_cells_is_no_steps(cell):
    """The owner hears a cell's (or a ``sess.run`` call's) start: the step after it counts
    from there, not from the last step before the pause."""
    timing.start(5, "a")
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    owner().cell_ended(False)
    window = part(timing.StepTiming).window
    assert window is not None
    window.last_end -= 60.0  # as if the user read for a minute before the next cell
    owner().cell_started()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert max(timing.window().seconds) < 60.0


# -- the profile (bugs 6, 7, 17g) ----------------------------------------------------------------


def _two_optimizers():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    return model, torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)


def test_a_profile_counts_iterations_and_stops_at_the_boundary_after_the_last(cell):
    """Two optimizers step in each iteration: two profiled steps are two iterations, both
    optimizers' steps in each, and nothing of the third iteration is in the trace."""
    model, a, b = _two_optimizers()
    profiling.arm(ProfileSpec(steps=2, token="two"))
    for _ in range(3):
        model(torch.ones(4, 8)).sum().backward()
        a.step()
        b.step()
    got = profiling.take("two")
    assert got.done and got.steps_run == 2 and len(got.windows) == 2
    stepped = [e for e in got.events if str(e.get("name", "")).startswith("Optimizer.step#")]
    assert len(stepped) == 4  # a and b in both iterations, the third's left out
    assert all(e["ts"] < got.windows[-1][1] for e in stepped)  # the last window ends after b's last step
    assert not torch.autograd._profiler_enabled()


def test_a_failed_cell_ends_a_profile_its_profiler_off_and_says_after_how_many_steps(cell):
    model, a, _ = _two_optimizers()
    profiling.arm(ProfileSpec(steps=5, token="five"))
    model(torch.ones(4, 8)).sum().backward()
    a.step()
    owner().cell_ended(True)  # the cell raised after one step
    assert not torch.autograd._profiler_enabled()
    owner().cell_started()
    with torch.no_grad():
        model(torch.ones(4, 8))  # an eval cell after it: not profiled
    got = profiling.take("five")
    assert not got.done and got.steps_run == 1 and got.ended == "a cell failed after 1 of its 5 steps"
    assert profiling.take("five") == got  # read again: the same answer, until the next profile


def test_the_group_forming_again_ends_a_profile_and_a_taken_trace_stays(cell):
    model, a, _ = _two_optimizers()
    profiling.arm(ProfileSpec(steps=3, token="three"))
    for _ in range(2):
        model(torch.ones(4, 8)).sum().backward()
        a.step()
    part(profiling.Profiling).reformed(World(0, 1))
    assert not torch.autograd._profiler_enabled()
    got = profiling.take("three")
    assert not got.done and re.search(r"formed again .* after 2 of its 3 steps", got.ended)
    profiling.arm(ProfileSpec(steps=1, token="one"))
    model(torch.ones(4, 8)).sum().backward()
    a.step()
    owner().cell_ended(False)  # the cell's end is the iteration's boundary: the trace is taken
    owner().cell_started()
    part(profiling.Profiling).reformed(World(0, 1))
    assert profiling.take("one").done  # steps that ran before the group formed again are kept


# -- fsdp_nb.log, the memory readings, the measurement's peak ----------------------------------------


def test_logged_values_start_afresh_with_the_group():
    from fsdp_nb.steps import rank_logged as logged

    logged.clear()
    logged.log(loss=1.0)
    part(logged.Logged).reformed(World(0, 1))
    assert logged.latest() == {}


def test_the_memory_readings_hear_steps_and_cells_from_the_owner(cell):
    from fsdp_nb.memory.rank_memory_kinds import KindReadings

    reads = []
    readings = KindReadings(read=lambda: reads.append(1) or (len(reads), 0, 0), every=0.0)
    readings.install()
    try:
        _steps(cell, 2)
        owner().cell_ended(False)
        assert len(reads) == 4  # the install's, two steps', the cell's end
    finally:
        readings.uninstall()
        owner().cell_started()


def test_the_measured_peak_names_the_optimizer_step_from_the_owners_events(cell):
    from fsdp_nb.memory.rank_memory_plan import PeakPlace

    model, a, b = _two_optimizers()
    place = PeakPlace({""}, a)
    seen = []
    a.register_step_pre_hook(lambda *_: seen.append(("a", place.in_optimizer)))  # the test's own, to look
    owner().listen(place)
    try:
        model(torch.ones(4, 8)).sum().backward()
        a.step()
        b.step()
        place.on_peak(set(), backward=False)
    finally:
        owner().unlisten(place)
    assert seen == [("a", True)] and not place.in_optimizer and place.phase == "forward"


def test_a_call_server_request_says_whether_it_is_a_cell():
    from fsdp_nb.engine import call_channel

    assert call_channel._request((len, ("ab",), True)) == (len, ("ab",), True)
    with pytest.raises(TypeError, match="another version of fsdp_nb"):
        call_channel._request((len, ("ab",)))


def test_only_the_users_own_call_is_sent_as_a_cell():
    """``sess.run`` sends its call as a cell; push, pull and the session's own calls do not."""
    import types

    from fsdp_nb.runtime import calls

    class Sent:
        def __init__(self) -> None:
            self.cells: list[bool] = []

        def apply(self, what, fn, args_by_rank=None, *, ranks=None, args=(), fast=False, cell=False):
            self.cells.append(cell)
            return types.SimpleNamespace(merged=True)

        def gather(self, pending, timeout=None, hang_after=None):
            return [None]

    d = Sent()
    calls.run(d, len, ("ab",), {}, None)  # type: ignore[arg-type]
    calls.push(d, {"x": 1})  # type: ignore[arg-type]
    calls.pull(d, "x")  # type: ignore[arg-type]
    assert d.cells == [True, False, False]
