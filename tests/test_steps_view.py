"""``sess.steps()`` on real gloo ranks: each rank's steps split into compute,
communication, waiting and other, adding up to the step it measured, and the rank that
holds the others back named with the part that grew."""

from __future__ import annotations

import pytest
from helpers import forget_models
from torch import nn

from fsdp_nb.runtime.cluster import wait_until

LOOP = """
import time
sv_opt = torch.optim.AdamW(sv_net.parameters(), lr=1e-3)
sv_x = torch.randn(128, 256)

def sv_loop(n, sleep_rank=None, heavy_rank=None):
    sv_net.extra = 32 if rank == heavy_rank else 0
    t0 = time.perf_counter()
    for _ in range(n):
        if rank == sleep_rank:
            time.sleep(0.06)  # a slow data step
        sv_net(sv_x).sum().backward()
        sv_opt.step()
        sv_opt.zero_grad()
    return (time.perf_counter() - t0) / n
"""


class Heavy(nn.Module):
    """Four FSDP units; ``extra`` adds compute (no collective) after each."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
        self.extra = 0

    def forward(self, x):
        import torch

        for layer in self.layers:
            x = torch.relu(layer(x))
            for _ in range(self.extra):
                x = x + 1e-3 * torch.tanh(x @ torch.ones(256, 256) / 256)
        return x


def _stop():
    from fsdp_nb.steps import rank_step_timing as step_timing

    step_timing.stop()


class _Views:
    """``sess.steps`` that closes every view it made (their feeds) at the test's end."""

    def __init__(self, sess):
        self.sess, self.made = sess, []

    def __getattr__(self, name):
        return getattr(self.sess, name)

    def steps(self, *args, **kwargs):
        view = self.sess.steps(*args, **kwargs)
        self.made.append(view)
        return view


@pytest.fixture
def stepped(sess):
    sess.run(_stop)  # steps an earlier test's view left measured are not this test's
    sess.wrap(Heavy, name="sv_net", auto_wrap={nn.Linear})
    sess.execute(LOOP)
    views = _Views(sess)
    try:
        yield views
    finally:
        for v in views.made:
            v.close()
        sess.run(_stop)
        sess.execute("from fsdp_nb.steps import rank_logged as _lg; _lg.clear()")
        forget_models(sess, "sv_net", optimizers=("sv_opt", "sv_x", "sv_loop"))


def test_the_parts_add_up_to_the_step_each_rank_measured(stepped):
    view = stepped.steps(window=24)
    assert "no optimizer step measured yet" in view.refresh().to_text()
    stepped.execute("sv_wall = sv_loop(24)")  # enough steps that a scheduling pause is not 5% of them
    walls = stepped.pull("sv_wall")
    view.refresh()
    assert sorted(view.ranks) == [0, 1] and view.device == "cpu"
    for r, p in view.ranks.items():
        assert p.steps == 24
        assert p.compute + p.communication + p.waiting + p.other == pytest.approx(p.step, rel=1e-9)
        assert p.step == pytest.approx(walls[r], rel=0.05)  # the loop's own clock, same steps
        assert p.compute > 0 and p.communication > 0


def _train_until_released(stepped, release, logs: str):
    """Start a cell that trains a step at a time, logging ``logs`` (``sv_n`` counts the
    steps), until ``release`` exists; the pending call. The ranks agree on when to stop
    (each looking alone may stop a step apart)."""
    return stepped.dispatcher.execute(
        "import os as _os, fsdp_nb\nsv_n = 0\n"
        "def sv_released():\n"
        f"    seen = torch.tensor([float(_os.path.exists({str(release)!r}))])\n"
        "    dist.all_reduce(seen, op=dist.ReduceOp.MAX)\n"
        "    return bool(seen.item())\n"
        "while not sv_released():\n"
        f"    sv_loop(1)\n    fsdp_nb.log({logs})\n    sv_n += 1")


def test_the_view_is_fed_while_a_cell_trains_with_throughput_and_logged_curves(stepped, tmp_path):
    """Nothing in the loop but ``fsdp_nb.log``: the widget moves on while the cell still
    runs (the cell waits for a file the test writes only once the widget showed 4 steps)."""
    view = stepped.steps(window=4, interval=0.2)
    release = tmp_path / "release"
    d = stepped.dispatcher
    pending = _train_until_released(stepped, release, "loss=torch.tensor(float(sv_n)), lr=1e-3 * rank")
    try:
        assert wait_until(lambda: all(p.steps == 4 for p in view.ranks.values()) and len(view.ranks) == 2, 60)
        assert wait_until(lambda: len(view.curves.get("loss", ())) >= 4, 30)
        assert view.renders >= 1 and "loss: " in view.to_text()
    finally:
        release.touch()
        d.gather(pending, timeout=120)
    stepped.execute("del sv_released")
    n = stepped.pull("sv_n")
    loss = view.curves["loss"]
    assert loss == sorted(loss) and loss[-1] <= n[0] - 1  # the ranks' mean, in order, as they logged it
    assert view.curves["lr"][-1] == pytest.approx(0.5e-3)  # the mean of rank 0's 0 and rank 1's 1e-3
    # 128 samples (sv_x's leading dimension) a step on each rank
    assert view.rates.samples_per_s == pytest.approx(
        sum(128 / p.step for p in view.ranks.values()), rel=0.25) and view.rates.mfu is None
    assert "samples/s" in view.to_text()


def test_a_rank_slow_in_its_data_step_is_named_with_other_and_the_others_wait(stepped):
    view = stepped.steps(window=10)
    stepped.execute("sv_loop(10, sleep_rank=1)")
    view.refresh()
    assert [(s.rank, s.part) for s in view.stragglers] == [(1, "other")]
    assert view.ranks[1].other - view.ranks[0].other > 0.02 and view.ranks[0].waiting > view.ranks[1].waiting
    assert "straggler: rank 1:" in view.to_text() and "in other (data loading" in view.to_text()


def test_a_rank_given_more_compute_is_named_with_compute(stepped):
    view = stepped.steps(window=10)
    stepped.execute("sv_loop(10, heavy_rank=1)")
    view.refresh()
    assert [(s.rank, s.part) for s in view.stragglers] == [(1, "compute")]
    assert view.ranks[1].compute > view.ranks[0].compute and view.ranks[0].waiting > view.ranks[1].waiting
    with pytest.raises(ValueError, match="window must be an int from 1 to 1000"):
        stepped.steps(window=0)


class Wide(nn.Module):
    """Four wide FSDP units and a small batch: their all-gathers outweigh their compute."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(4))

    def forward(self, x):
        import torch

        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_resharding_after_forward_moves_communication_as_fsdp2_says(sess, tmp_path):
    """``sharding="full"`` reshards each unit after its forward, so the backward gathers
    it again: 12 collectives a step (4 all-gathers in the forward, 4 in the backward, 4
    reduce-scatters) against ``"grad_op"``'s 8 (``reshard_after_forward=False``): the
    view's communication grows by about half (more than a tenth). The two models take
    turns step by step in one cell, so both meet the same load (another process busy on
    the 2 cores, a parallel test run); each step's communication is read back from the
    view's TensorBoard file, and the medians are compared."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    for sharding in ("grad_op", "full"):
        sess.wrap(Wide, name=f"sv_{sharding}", auto_wrap={nn.Linear}, sharding=sharding)
    sess.execute("sv_wx = torch.randn(2, 1024)\n"
                 "sv_wopts = {s: torch.optim.SGD(globals()[f'sv_{s}'].parameters(), lr=1e-3) for s in ('grad_op', 'full')}")
    writer = SummaryWriter(str(tmp_path / "tb"))
    view = sess.steps(window=200).log_to(writer)
    try:
        sess.execute("for sv_i in range(60):\n"  # step k is grad_op's when k is even: logged beside it
                     "    sv_s = ('grad_op', 'full')[sv_i % 2]\n"
                     "    globals()[f'sv_{sv_s}'](sv_wx).sum().backward(); sv_wopts[sv_s].step()\n"
                     "    sv_wopts[sv_s].zero_grad(); fsdp_nb.log(sv_full=float(sv_i % 2))")
        view.refresh()
        writer.flush()
    finally:
        view.stop()  # the feed, and the measurement on every rank
        writer.close()
        forget_models(sess, "sv_grad_op", "sv_full", optimizers=("sv_wopts", "sv_wx"))
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    comm = {e.step: e.value for e in events.Scalars("communication_ms/rank0")}
    full = [e.value for e in events.Scalars("sv_full")]
    assert sorted(comm) == list(range(60)) and len(full) == 60, (sorted(comm), len(full))
    by = {kind: sorted(comm[k] for k in range(4, 60) if full[k] == kind) for kind in (0.0, 1.0)}  # after warm-up
    medians = {kind: xs[len(xs) // 2] for kind, xs in by.items()}
    assert medians[1.0] > medians[0.0] * 1.1, (medians, by)


def _wandb_history(run_dir):
    """The rows a W&B offline run logged, and whether its exit record is written yet, read
    from its ``run-*.wandb`` file (LevelDB's log format, which W&B writes: a 7-byte header,
    then 32 KiB blocks of records, each with a 7-byte header of checksum, length and kind;
    FULL and LAST end a record). A record not yet written whole ends the read."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, chunk, rows, ended = path.read_bytes(), 7, b"", [], False
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):
            break
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
            ended |= record.WhichOneof("record_type") == "exit"
            chunk = b""
    return rows, ended


def test_log_to_writes_loss_step_time_and_throughput_to_tensorboard_and_wandb_while_the_cell_trains(
        stepped, tmp_path):
    """The cell trains until the test has read 4 steps' times and losses back from the
    TensorBoard event file: they were written live. Then every step and loss is there once,
    numbered in order, in TensorBoard's file and in a W&B offline run alike."""
    wandb = pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    run = wandb.init(mode="offline", dir=str(tmp_path), project="fsdp_nb-test", settings=wandb.Settings(silent=True))
    # a window that holds every step ending between two updates (0.2 s): none is missed
    view = stepped.steps(window=500, interval=0.2).log_to(writer).log_to(run).log_to(writer)  # the same writer: once
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})

    def written(tag):
        events.Reload()
        return events.Scalars(tag) if tag in events.Tags()["scalars"] else []

    release = tmp_path / "release"
    d = stepped.dispatcher
    pending = _train_until_released(stepped, release, "loss=torch.tensor(float(sv_n))")
    try:
        assert wait_until(lambda: len(written("step_ms/rank1")) >= 4 and len(written("loss")) >= 4, 60)
    finally:
        release.touch()
        d.gather(pending, timeout=120)
    stepped.execute("del sv_released")
    (n, _) = stepped.pull("sv_n")
    view.refresh()  # what the last live update missed
    writer.close()
    run.finish()

    loss = written("loss")
    assert [(e.step, e.value) for e in loss] == [(k, float(k)) for k in range(n)]  # each once, at its number
    times = {r: written(f"step_ms/rank{r}") for r in (0, 1)}
    assert [e.step for e in times[0]] == [e.step for e in times[1]] == list(range(n))
    assert all(e.value > 0 for r in (0, 1) for e in times[r])
    for r in (0, 1):  # the parts add up to the step
        parts = [written(f"{p}_ms/rank{r}") for p in ("compute", "communication", "other")]
        assert all(sum(p[i].value for p in parts) == pytest.approx(times[r][i].value, rel=1e-4) for i in range(n))
    # 128 samples a step on each rank (sv_x's leading dimension), the ranks' rates summed
    rate = written("throughput/samples_per_s")
    assert [e.step for e in rate] == list(range(n))
    assert all(e.value == pytest.approx(sum(128e3 / times[r][i].value for r in (0, 1)), rel=1e-4)
               for i, e in enumerate(rate))

    # W&B's own process writes the file: its exit record says the run is all there
    assert wait_until(lambda: _wandb_history(tmp_path)[1], 60)
    rows, _ = _wandb_history(tmp_path)
    assert [(r["fsdp_nb/logged"], r["loss"]) for r in rows if "loss" in r] == [(k, float(k)) for k in range(n)]
    wb_times = [(r["fsdp_nb/step"], r["step_ms/rank0"]) for r in rows if "step_ms/rank0" in r]
    assert wb_times == [(e.step, pytest.approx(e.value, rel=1e-6)) for e in times[0]]
