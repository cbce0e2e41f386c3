"""Every feature against every lifecycle event: the feature goes on with nothing lost, or
it is refused by name before anything changes.

Features: autosave, the user's async save, the fp16 gradient scaler, the live step view
and the metrics it writes to TensorBoard (``log_to``), a profile, the hang watch, the
memory feed, merged output, run-state capture. Events: a
second optimizer, a failed cell, Ctrl-C, SIGKILL + restart, resize up, resize down, a
kernel restart + attach.

The events run once each, in three scenes that share what they can: one private session
meets a second optimizer, then a failed cell, then Ctrl-C; another is killed and
restarted, grown to 3 ranks, shrunk back to 2; a real kernel keeps its session alive
across a restart. Each scene arms every feature before its events (an autosave, an async
save of the user's own, a ``"16-mixed"`` model and its scaler, a step view, a profile,
a memory feed) and records, after each event, what each feature showed: the parametrized
test of each (feature, event) cell reads its record. The run trains a loader of the
user's own class, so the run state compared is one a nanoGPT-style loop has.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import START_S, on_marker, release_on_diagnosis
from torch import nn

import fsdp_nb
from fsdp_nb.runtime.cluster import wait_until

FEATURES = ("autosave", "async save", "fp16 scaler", "step view", "metrics out", "profile", "hang watch",
            "memory feed", "merged output", "run state")
EVENTS = ("second optimizer", "failed cell", "ctrl-c", "sigkill + restart", "resize up", "resize down",
          "kernel restart + attach")

MX = '''
import os, time
import torch
import fsdp_nb


class MxBatches:
    """A loader of its own class, as a nanoGPT-style loop draws from one: next(), and its
    position through state_dict() / load_state_dict()."""

    def __init__(self, n=64, dim=16):
        g = torch.Generator().manual_seed(11 + rank)
        self.x = torch.randn(n, dim, generator=g)
        self.pos = 0

    def next(self):
        i = self.pos % len(self.x)
        self.pos += 4
        return self.x[i:i + 4]

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def mx_setup(two=False):
    """The run's objects: its loader, one optimizer or two (the first layer's, the rest's),
    a scheduler."""
    global mx_opts, mx_batches, mx_sched
    mx_batches = MxBatches()
    if two:
        globals()["mx_opt"] = torch.optim.AdamW(mx.a.parameters(), lr=0.01)
        globals()["mx_opt2"] = torch.optim.AdamW(mx.b.parameters(), lr=0.02)
        mx_opts = ("mx_opt", "mx_opt2")
    else:
        globals()["mx_opt"] = torch.optim.AdamW(mx.parameters(), lr=0.01)
        globals().pop("mx_opt2", None)
        mx_opts = ("mx_opt",)
    mx_sched = torch.optim.lr_scheduler.StepLR(globals()[mx_opts[0]], step_size=2, gamma=0.8)


def mx_train(n, fail_on=None, mark=None):
    """n fp16 steps with the session's scaler. ``fail_on``: (rank, i) raises at the top of
    iteration i, and ``mark``: (rank, i, path) writes the marker there and sleeps (a Ctrl-C,
    a kill): the other ranks draw their next batch and wait in its forward."""
    losses = []
    for i in range(n):
        if fail_on is not None and (rank, i) == tuple(fail_on):
            raise RuntimeError("the cell fails here, at the top of an iteration")
        if mark is not None and rank == mark[0] and i == mark[1]:
            open(mark[2], "w").close()
            time.sleep(60)
        x = mx_batches.next()
        loss = mx(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        for o in mx_opts:
            scaler.step(globals()[o])
        scaler.update()
        globals().setdefault("mx_skips", []).append(scaler.skipped)  # optimizer steps skipped so far
        for o in mx_opts:
            globals()[o].zero_grad()
        mx_sched.step()
        fsdp_nb.log(loss=loss)
        losses.append(loss.item())
    print(f"trained {n}")
    return losses
'''


class Net(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.a = nn.Linear(dim, 4 * dim)
        self.b = nn.Linear(4 * dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


CELLS: dict[tuple[str, str], str | None] = {}
"""(feature, event) -> None when the feature went on, else what failed (a traceback)."""


def check(event: str, feature: str, fn: Callable[[], Any]) -> None:
    """Run ``fn``, the check of ``feature`` after ``event``, and keep its outcome."""
    try:
        fn()
    except (Exception, pytest.fail.Exception) as exc:  # noqa: BLE001 - any failure is the cell's, read by its test
        CELLS[(feature, event)] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    else:
        CELLS.setdefault((feature, event), None)


# -- what every scene reads ---------------------------------------------------------------


def train(s: fsdp_nb.Session, n: int, **kwargs: Any) -> list[list[float]]:
    """``n`` steps on every rank; each rank's losses."""
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    s.execute(f"mx_losses = mx_train({n}{', ' + args if args else ''})")
    return s.pull("mx_losses")


@contextlib.contextmanager
def printed() -> Iterator[io.StringIO]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        yield out


def arm_autosave(s: fsdp_nb.Session, root: str, opts: tuple[str, ...]) -> None:
    """Autosave to disk every 2 steps, and into memory after every step."""
    s.autosave(root, every=2, model="mx", optimizer=list(opts), state=["mx_sched", "scaler"],
               loaders=["mx_batches"], keep_last=None, in_memory=True)


def last_saved(s: fsdp_nb.Session) -> tuple[int, str | None]:
    """(the autosave's step count, its last committed save) on rank 0."""
    auto = s.autosave()
    assert auto is not None and auto.ranks and auto.ranks[0] is not None
    r0 = auto.ranks[0]
    failed = [r.failed for r in auto.ranks if r is not None and r.failed]
    assert not failed, failed
    return r0.step, r0.saved


def autosave_goes_on(s: fsdp_nb.Session) -> None:
    """Two more steps: the next due save is committed, under its step, and named."""
    step, _ = last_saved(s)
    train(s, 2)
    want = (step + 2) // 2 * 2
    assert wait_until(lambda: (last_saved(s)[1] or "").endswith(f"step-{want}"), 60), s.autosave()
    saved = last_saved(s)[1]
    assert saved is not None and fsdp_nb.inspect(saved).extra.get("step") == want


def _scale() -> float:
    """The engine global ``scaler``'s scale (run on the ranks)."""
    return float(globals()["scaler"].get_scale())


def one_scale(s: fsdp_nb.Session, n: int) -> None:
    """Every rank holds the same scale, and the next fp16 step runs (it would hang on a
    rank whose scaler reduced over another group)."""
    scales = s.run(_scale)
    assert len(scales) == n and len(set(scales)) == 1, scales
    s.execute("mx_train(1)", timeout=120)


def fresh_window(s: fsdp_nb.Session, view: Any, n: int) -> None:
    """Three steps after the event: every rank's window holds the same steps, all after it."""
    before = view.view.updated
    train(s, 3)
    view.view.refresh()
    assert view.view.updated > before
    counts = {r: p.steps for r, p in view.ranks.items()}
    assert sorted(counts) == list(range(n)) and len(set(counts.values())) == 1, counts


def written(tb_dir: Any) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under ``tb_dir``: tag -> (step, value)s."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def metrics_go_on(s: fsdp_nb.Session, scene: Scene, n: int) -> None:
    """Three steps after the event reach TensorBoard through the view's ``log_to``: each of
    the ``n`` ranks' times and the logged loss, numbered on from before the event, and no
    step or value written twice in the whole run."""
    before = written(scene.tb_dir)
    train(s, 3)
    scene.steps.view.refresh()
    scene.writer.flush()
    after = written(scene.tb_dir)
    for tag in [f"step_ms/rank{r}" for r in range(n)] + ["loss"]:
        steps = [k for k, _ in after.get(tag, [])]
        assert steps == sorted(set(steps)), (tag, steps)  # in order, each once
        new = steps[len(before.get(tag, [])):]
        assert len(new) >= 3 and (not before.get(tag) or new[0] > before[tag][-1][0]), (tag, before.get(tag), new)
    newest = {after[f"step_ms/rank{r}"][-1][0] for r in range(n)}
    assert len(newest) == 1, newest  # every rank's newest step is the same step


def trained_counting_skips(s: fsdp_nb.Session, n: int) -> list[int]:
    """Train ``n`` steps; how many optimizer steps the fp16 scaler skipped in each (an
    inf in an optimizer's gradients, on every rank alike: a fresh scale overflows at first,
    as does a new rank's after a resize, depending on the weights)."""
    s.execute("mx_skips = [scaler.skipped]")
    train(s, n)
    counts = s.pull("mx_skips")[0]
    return [b - a for a, b in zip(counts, counts[1:], strict=False)]


def profiled_steps(trace: dict[str, Any], n: int, opts: int, skipped: list[int]) -> None:
    """Each of the ``n`` ranks' 2 profiled steps holds every optimizer's step of its
    iteration (a second optimizer's joins the first's), less those the scaler skipped (a
    skipped step has no event; the step owner is told of it all the same)."""
    steps = [e for e in trace["traceEvents"] if e.get("name", "").startswith("Optimizer.step#")]
    for r in range(n):
        windows = [(e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                   if e.get("cat") == "fsdp_nb" and e["pid"] == r]
        held = [sum(a <= e["ts"] <= b for e in steps if e["pid"] == r) for a, b in windows]
        assert held == [opts - k for k in skipped[:2]], (r, held, skipped, windows)


def profile_again(s: fsdp_nb.Session, n: int, opts: int) -> None:
    """A new profile of 2 steps: every rank's trace, each step holding every optimizer's step."""
    prof = s.profile(steps=2)
    skipped = trained_counting_skips(s, 3)
    trace = json.loads(open(prof.trace).read())
    assert sorted(p.rank for p in prof.parts) == list(range(n))
    profiled_steps(trace, n, opts, skipped)


def hang_explained(s: fsdp_nb.Session, n: int, tmp: Any) -> None:
    """The last rank waits on a file the first diagnosis creates; the others wait for it in
    an all_reduce: the diagnosis names it."""
    go = tmp / f"go-{os.urandom(4).hex()}"
    code = ("import os, time, torch\nimport torch.distributed as dist\n"
            f"if rank == {n - 1}:\n    while not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
            "dist.all_reduce(torch.ones(1))\n")
    with release_on_diagnosis(s, go) as seen:
        s.execute(code, hang_after=0.5, timeout=120)
    assert seen and seen[0].splitlines()[0].startswith(f"rank {n - 1} is not in it"), seen


def feed_follows(s: fsdp_nb.Session, w: Any, n: int) -> None:
    """The memory feed opened before the event has a sample from every rank since."""
    s.execute("mx_train(1)")
    mark = {r: len(w.feed.samples(r)) for r in range(n)} if w.feed.world_size == n else {}
    assert wait_until(lambda: w.feed.world_size == n and all(
        len(w.feed.samples(r)) > mark.get(r, 0) for r in range(n)), 60), [w.feed.samples(r)[-1:] for r in range(n)]


def merged(s: fsdp_nb.Session, n: int) -> None:
    with printed() as out:
        s.execute("print('the same on every rank')")
    assert out.getvalue().splitlines().count(f"[ranks 0-{n - 1}] the same on every rank") == 1, out.getvalue()


def run_state_round_trip(s: fsdp_nb.Session, tmp: Any, opts: tuple[str, ...]) -> None:
    """Save the run (model, optimizers, scheduler, scaler, the loader, each rank's random
    state), train 2 steps, load it back, train 2 again: the same losses, bit for bit."""
    path = str(tmp / f"run-{os.urandom(4).hex()}")
    auto = s.autosave()
    step = auto.ranks[0].step if auto is not None and auto.ranks and auto.ranks[0] is not None else 0
    state = ["mx_sched", "scaler", "mx_batches"]
    s.save(path, "mx", optimizer=list(opts), state=state, extra={"step": step})
    first = train(s, 2)
    s.load(path, "mx", optimizer=list(opts), state=state)
    assert train(s, 2) == first


class Scene:
    """One session's features, armed before its events."""

    def __init__(self, s: fsdp_nb.Session, tmp: Any, opts: tuple[str, ...] = ("mx_opt",)):
        self.s, self.tmp, self.opts = s, tmp, opts
        from torch.utils.tensorboard import SummaryWriter

        self.memory = s.memory(interval=0.2)
        self.tb_dir = tmp / "tb"
        self.writer = SummaryWriter(str(self.tb_dir))
        self.steps = s.steps(interval=0.2).log_to(self.writer)

    def goes_on(self, event: str, n: int, *, autosave: bool = True, scaler: bool = True) -> None:
        """The checks every feature passes after ``event`` on ``n`` ranks."""
        s = self.s
        check(event, "memory feed", lambda: feed_follows(s, self.memory, n))
        check(event, "merged output", lambda: merged(s, n))
        check(event, "hang watch", lambda: hang_explained(s, n, self.tmp))
        if scaler:
            check(event, "fp16 scaler", lambda: one_scale(s, n))
        check(event, "step view", lambda: fresh_window(s, self.steps, n))
        check(event, "metrics out", lambda: metrics_go_on(s, self, n))
        check(event, "profile", lambda: profile_again(s, n, len(self.opts)))
        if autosave:
            check(event, "autosave", lambda: autosave_goes_on(s))
        check(event, "run state", lambda: run_state_round_trip(s, self.tmp, self.opts))

    def close(self) -> None:
        self.memory.close()
        self.steps.close()
        self.writer.close()


def async_committed(h: Any, before: dict[str, torch.Tensor], tmp: Any) -> None:
    """The user's async save finished and holds the weights of the moment it was called."""
    h.wait()
    out = str(tmp / f"async-{os.urandom(4).hex()}.pt")
    fsdp_nb.consolidate(h.path, out)
    saved = torch.load(out, weights_only=True)
    saved = saved.get("model", saved)
    for k, v in before.items():
        got = saved[k] if k in saved else saved[f"model.{k}"]
        assert torch.equal(got.float(), v.float()), k


def under_way(scene: Scene, name: str) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """What is under way as an event hits: a profile of 4 steps, and an async save of the
    user's own (with the weights of its moment, to compare with what it wrote)."""
    s = scene.s
    prof = s.profile(steps=4)
    before = s.models["mx"].state_dict()
    handle = s.save(str(scene.tmp / name), "mx", optimizer=list(scene.opts), async_save=True)
    return prof, before, handle


def profile_ended(prof: Any) -> None:
    """The profile under way when the event hit ended, and reading it says so (a profile
    still waiting for its steps would say they have not all run)."""
    with pytest.raises(RuntimeError, match="ended before they all ran"):
        _ = prof.trace


# -- scene 1: a second optimizer, a failed cell, Ctrl-C -----------------------------------


@pytest.fixture(scope="module")
def scene1(session_factory, tmp_path_factory):
    s = session_factory(2, private=True)
    s.wrap(Net, name="mx", mixed_precision="16-mixed")
    s.execute(MX)
    scene = Scene(s, tmp_path_factory.mktemp("scene1"), opts=("mx_opt", "mx_opt2"))
    yield scene
    scene.close()
    s.shutdown()


@pytest.fixture(scope="module")
def second_optimizer(scene1):
    s, tmp, event = scene1.s, scene1.tmp, "second optimizer"
    s.execute("mx_setup(two=True)")
    arm_autosave(s, str(tmp / "auto"), scene1.opts)
    before = s.models["mx"].state_dict()
    handle = s.save(str(tmp / "users-async"), "mx", optimizer=list(scene1.opts), async_save=True)
    prof = s.profile(steps=2)  # after the save: its own optimizer steps (making their state) are no step's
    skipped = trained_counting_skips(s, 4)  # both optimizers step; the async save's copy is taken meanwhile
    check(event, "async save", lambda: async_committed(handle, before, tmp))

    def both_optimizers_come_back() -> None:  # a resume from the autosave brings both back
        assert wait_until(lambda: (last_saved(s)[1] or "").endswith("step-4"), 60), s.autosave()
        step, saved = last_saved(s)
        assert step == 4 and saved is not None, (step, saved)
        ahead = train(s, 2)
        s.load(saved, "mx", optimizer=list(scene1.opts), state=["mx_sched", "scaler", "mx_batches"])
        assert train(s, 2) == ahead

    check(event, "autosave", both_optimizers_come_back)

    def iterations_profiled() -> None:  # 2 iterations, each one step of both optimizers' steps
        profiled_steps(json.loads(open(prof.trace).read()), 2, 2, skipped)

    check(event, "profile", iterations_profiled)
    check(event, "step view", lambda: fresh_window(s, scene1.steps, 2))
    scene1.goes_on(event, 2)
    return scene1


@pytest.fixture(scope="module")
def failed_cell(second_optimizer):
    scene = second_optimizer
    s, tmp, event = scene.s, scene.tmp, "failed cell"
    prof, before, handle = under_way(scene, "users-async-failed")
    step, _ = last_saved(s)
    due = step + 2 - step % 2  # the step that makes the next save due, ended by the cell's iteration j
    j = due - step - 1
    # rank 1 fails at the top of the next iteration; rank 0 draws its batch and, at the
    # iteration boundary, starts the due save, whose collectives rank 1 never joins
    with pytest.raises(fsdp_nb.RankError, match="the cell fails here") as failed:
        train(s, 4, fail_on=(1, j + 1))
    # both ranks took the iterations before j + 1: no note of ranks at different steps
    assert not any("different numbers" in n for n in getattr(failed.value, "__notes__", [])), failed.value

    check(event, "profile", lambda: profile_ended(prof))
    check(event, "async save", lambda: async_committed(handle, before, tmp))

    def due_save_dropped() -> None:  # the save of the step the cell cut short was not written
        _, saved = last_saved(s)
        assert saved is not None and not saved.endswith(f"step-{due}"), saved
        assert not os.path.exists(tmp / "auto" / f"step-{due}")

    check(event, "autosave", due_save_dropped)
    scene.goes_on(event, 2)
    return scene


@pytest.fixture(scope="module")
def ctrl_c(failed_cell):
    import _thread

    scene = failed_cell
    s, tmp, event = scene.s, scene.tmp, "ctrl-c"
    prof, before, handle = under_way(scene, "users-async-ctrl-c")
    marker = tmp / "sleeping"
    on_marker(marker, _thread.interrupt_main)
    with pytest.raises(KeyboardInterrupt):
        train(s, 4, mark=(1, 1, str(marker)))
    check(event, "profile", lambda: profile_ended(prof))
    check(event, "async save", lambda: async_committed(handle, before, tmp))
    scene.goes_on(event, 2)
    return scene


# -- scene 2: SIGKILL + restart, resize up, resize down -----------------------------------

NEW_RANKS = """
import torch.distributed as dist
if "mx_batches" not in globals():  # a rank a resize added: the run's objects a cell made, as the others hold them
    mx_batches, mx_opts = MxBatches(), ("mx_opt",)
    mx_sched = torch.optim.lr_scheduler.StepLR(mx_opt, step_size=2, gamma=0.8)
_held = [mx_sched.state_dict() if rank == 0 else None]
dist.broadcast_object_list(_held, src=0)
mx_sched.load_state_dict(_held[0])
"""

@pytest.fixture(scope="module")
def scene2(session_factory, tmp_path_factory):
    s = session_factory(2, private=True, hang_after=None)
    s.wrap(Net, name="mx", mixed_precision="16-mixed")
    s.execute(MX + "\nmx_setup()")
    scene = Scene(s, tmp_path_factory.mktemp("scene2"))
    yield scene
    scene.close()
    s.shutdown()


@pytest.fixture(scope="module")
def sigkill_restart(scene2):
    scene = scene2
    s, tmp, event = scene.s, scene.tmp, "sigkill + restart"
    state = ["mx_sched", "scaler", "mx_batches"]
    train(s, 4)
    s.save(str(tmp / "at-4"), "mx", optimizer="mx_opt", state=state, extra={"step": 4})
    ahead = train(s, 5)  # the run that never stopped: steps 5 to 9
    s.load(str(tmp / "at-4"), "mx", optimizer="mx_opt", state=state)
    arm_autosave(s, str(tmp / "auto"), scene.opts)
    train(s, 2)  # steps 5 and 6: the autosave writes step 6 (its step-2) at the cell's end
    assert wait_until(lambda: (last_saved(s)[1] or "").endswith("step-2"), 60)
    prof, before, handle = under_way(scene, "users-async")
    marker = tmp / "killed"
    on_marker(marker, lambda: s.cluster.signal([1], signal.SIGKILL))  # by the session's verified handle
    with pytest.raises(fsdp_nb.DeadRankError):
        train(s, 4, mark=(1, 1, str(marker)))  # step 7 runs; rank 1 dies in step 8
    report = s.restart(restore="latest", setup=lambda: mx_setup())  # noqa: F821 - on the ranks

    def saved_or_named() -> None:  # the user's async save: committed, or its failure named
        try:
            async_committed(handle, before, tmp)
        except fsdp_nb.CheckpointError as exc:
            assert "users-async" in str(exc), exc
            assert not os.path.exists(tmp / "users-async")  # nothing half written under its name

    check(event, "async save", saved_or_named)

    def resumed_bit_for_bit() -> None:  # back at step 6 (the autosave's step 2): steps 7-9 as never stopped
        # rank 1 died before step 7's iteration ended (its boundary, step 8's forward): the
        # newest state whole in memory is step 6's, as new as the disk's, so memory serves
        assert report.restored is not None and report.restored.step == 2, report
        assert report.restored.memory is not None and "nothing was read from disk" in str(report), report
        assert "autosave goes on from step 2" in str(report), report
        assert [losses[:3] for losses in train(s, 3)] == [losses[2:] for losses in ahead]

    check(event, "autosave", resumed_bit_for_bit)
    check(event, "profile", lambda: profile_ended(prof))
    scene.goes_on(event, 2)
    return scene


def resized(scene: Scene, n: int, event: str) -> Scene:
    """Resize ``scene``'s session to ``n`` ranks with an async save of the user's and a
    profile under way, an autosave armed and a step view open, then check each feature."""
    s, tmp = scene.s, scene.tmp
    prof, before, handle = under_way(scene, f"users-async-{n}")
    report = s.resize(n)
    s.execute(NEW_RANKS)
    check(event, "async save", lambda: async_committed(handle, before, tmp))

    def followed_by_name() -> None:  # shrunk: armed again, each rank's state in its new buddy's memory
        auto = s.autosave()
        assert auto is not None and auto.in_memory and len(auto.buddies) == n, auto
        assert "autosave armed again from step" in str(report) and "scaler" not in report.variables, report
        newest = {r.copies.own[-1] for r in auto.ranks if r is not None and r.copies is not None}
        assert auto.ranks[0] is not None and newest == {auto.ranks[0].step}, auto
        autosave_goes_on(s)

    def stopped_by_name() -> None:  # grown: the new rank lacks the loader a cell made; it says so and stops
        assert s.autosave() is None
        assert "not armed again" in str(report) and "'mx_batches'" in str(report), report
        arm_autosave(s, str(tmp / f"auto{n}"), scene.opts)  # armed again once NEW_RANKS made it, it goes on
        autosave_goes_on(s)

    check(event, "autosave", stopped_by_name if event == "resize up" else followed_by_name)
    check(event, "profile", lambda: profile_ended(prof))
    scene.goes_on(event, n, autosave=False)
    return scene


@pytest.fixture(scope="module")
def resize_up(sigkill_restart):
    return resized(sigkill_restart, 3, "resize up")


@pytest.fixture(scope="module")
def resize_down(resize_up):
    return resized(resize_up, 2, "resize down")


# -- scene 3: a kernel restart, and attach --------------------------------------------------

KERNEL_SETUP = """
import os, json, torch, fsdp_nb
from torch import nn
sess = fsdp_nb.Session(2, backend="gloo", keep_alive=True)

class Net(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.a = nn.Linear(dim, 4 * dim)
        self.b = nn.Linear(4 * dim, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

sess.wrap(Net, name="mx", mixed_precision="16-mixed")
"""


@pytest.fixture(scope="module")
def kernel_attach(tmp_path_factory):
    from helpers import Kernel

    event = "kernel restart + attach"
    tmp = tmp_path_factory.mktemp("scene3")
    ipythondir = str(tmp / "ipython")
    old = os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = ipythondir
    k = Kernel(ipythondir)
    try:
        k.run(KERNEL_SETUP, timeout=START_S)
        k.run(f"sess.execute({MX!r} + '\\nmx_setup()')")
        k.run(f"sess.autosave({str(tmp / 'auto')!r}, every=2, model='mx', optimizer=['mx_opt'], "
              "state=['mx_sched', 'scaler'], loaders=['mx_batches'], keep_last=None, in_memory=True)")
        k.run("view = sess.steps(interval=0.2)\nmem = sess.memory(interval=0.2)\nprof = sess.profile(steps=50)")
        k.run("sess.execute('mx_train(3)')")
        k.run(f"before = {{k: v.tolist() for k, v in sess.models['mx'].state_dict().items()}}\n"
              f"h = sess.save({str(tmp / 'users-async')!r}, 'mx', optimizer='mx_opt', async_save=True)")
        before = k.value("before")
        scale = k.value("sess.run(lambda: float(scaler.get_scale()))")
        waiting = k.value("sess.cluster.standby.go_file") + ".waiting"
        assert wait_until(lambda: os.path.exists(waiting), 120)  # the standby's imports are done
        k.restart()
        k.run("import os, json, torch, fsdp_nb\nsess = fsdp_nb.Session.attach()", timeout=START_S)
        n = 2

        def as_before_then_on() -> None:  # the ranks' autosave comes back and saves on
            assert k.value("[r.step for r in sess.autosave().ranks]") == [3, 3]  # counting on from step 3
            assert k.value("sess.autosave().in_memory") is True  # and copying into memory
            k.run("sess.execute('mx_train(2)')")
            assert wait_until(lambda: (k.value("sess.autosave().ranks[0].saved") or "").endswith("step-4"), 60)

        check(event, "autosave", as_before_then_on)

        def committed_without_its_kernel() -> None:  # the handle died with the kernel; the ranks finished
            path = str(tmp / "users-async")
            assert wait_until(lambda: fsdp_nb.inspect(path).problem is None, 60)
            out = str(tmp / "async.pt")
            fsdp_nb.consolidate(path, out)
            saved = torch.load(out, weights_only=True)
            saved = saved.get("model", saved)
            for key, v in before.items():
                got = saved[key] if key in saved else saved[f"model.{key}"]
                assert got.float().tolist() == torch.tensor(v).float().tolist(), key

        check(event, "async save", committed_without_its_kernel)

        def same_scale_and_a_step() -> None:
            assert k.value("sess.run(lambda: float(scaler.get_scale()))") == scale
            k.run("sess.execute('mx_train(1)', timeout=120)")

        check(event, "fp16 scaler", same_scale_and_a_step)

        def a_new_view() -> None:
            k.run("view = sess.steps(interval=0.2)\nsess.execute('mx_train(3)')\nview.view.refresh()")
            counts = k.value("{r: p.steps for r, p in view.ranks.items()}")
            assert sorted(counts) == list(range(n)) and len(set(counts.values())) == 1, counts

        check(event, "step view", a_new_view)

        def new_metrics() -> None:  # the old kernel's writer is gone; a view of the new one writes
            tb = str(tmp / "tb-attached")
            k.run("from torch.utils.tensorboard import SummaryWriter\n"
                  f"writer = SummaryWriter({tb!r})\nlogged = sess.steps(interval=0.2).log_to(writer)\n"
                  "sess.execute('mx_train(3)')\nlogged.view.refresh()\nwriter.flush()")
            got = written(tb)
            steps = {r: [k for k, _ in got.get(f"step_ms/rank{r}", [])] for r in range(n)}
            assert steps[0] == steps[1] and len(steps[0]) >= 3, steps
            assert [k for k, _ in got.get("loss", [])] == list(range(len(got.get("loss", [])))), got.get("loss")
            assert len(got.get("loss", [])) >= 3, got.get("loss")

        check(event, "metrics out", new_metrics)

        def a_new_profile() -> None:  # the old kernel's capture is replaced, not left running
            k.run("prof = sess.profile(steps=2)\nsess.execute('mx_train(3)')")
            assert k.value("sorted(p.rank for p in prof.parts)") == [0, 1]

        check(event, "profile", a_new_profile)

        def explained() -> None:
            go = str(tmp / "go")
            code = ("import os, time, torch\n"
                    f"if rank == 1:\n    while not os.path.exists({go!r}): time.sleep(0.02)\n"
                    "torch.distributed.all_reduce(torch.ones(1))\n")
            k.run(f"seen = []\ndef _release(e):\n    if e.phase == 'hang':\n        seen.append(e.note)\n"
                  f"        open({go!r}, 'w').close()\nsess.dispatcher.observers.append(_release)")
            k.run(f"sess.execute({code!r}, hang_after=0.5)")
            assert k.value("seen[0].splitlines()[0]").startswith("rank 1 is not in it")

        check(event, "hang watch", explained)

        def a_new_feed() -> None:
            k.run("mem = sess.memory(interval=0.2)\nsess.execute('mx_train(2)')")
            assert wait_until(lambda: k.value("[len(mem.feed.samples(r)) for r in range(2)]") >= [1, 1], 60)

        check(event, "memory feed", a_new_feed)
        check(event, "merged output", lambda: "[ranks 0-1] the same" in k.run("sess.execute(\"print('the same')\")")
              or pytest.fail("no merged line"))

        def round_trip() -> None:
            path = str(tmp / "run")
            k.run(f"step = sess.autosave().ranks[0].step\nsess.save({path!r}, 'mx', optimizer=['mx_opt'], "
                  "state=['mx_sched', 'scaler', 'mx_batches'], extra={'step': step})")
            k.run("sess.execute('mx_losses = mx_train(2)')\nfirst = sess.pull('mx_losses')")
            k.run(f"sess.load({path!r}, 'mx', optimizer=['mx_opt'], state=['mx_sched', 'scaler', 'mx_batches'])")
            k.run("sess.execute('mx_losses = mx_train(2)')\nagain = sess.pull('mx_losses')")
            assert k.value("first == again") is True

        check(event, "run state", round_trip)
        k.run("sess.shutdown()", timeout=60)
        yield
    finally:
        try:
            k.run("import fsdp_nb.session as s\nfor x in list(s._LIVE): x.shutdown()", timeout=60)
        finally:
            k.close()
            for rec in fsdp_nb.sessions():
                fsdp_nb.Session.attach(rec.cluster_id).shutdown()
            if old is None:
                os.environ.pop("IPYTHONDIR", None)
            else:
                os.environ["IPYTHONDIR"] = old


SCENES = {
    "second optimizer": "second_optimizer", "failed cell": "failed_cell", "ctrl-c": "ctrl_c",
    "sigkill + restart": "sigkill_restart", "resize up": "resize_up", "resize down": "resize_down",
    "kernel restart + attach": "kernel_attach",
}


@pytest.mark.parametrize("event", EVENTS)
@pytest.mark.parametrize("feature", FEATURES)
def test_a_feature_goes_on_after_an_event_or_is_refused_by_name(feature: str, event: str, request) -> None:
    request.getfixturevalue(SCENES[event])
    assert (feature, event) in CELLS, f"the {event} scene did not check {feature}"
    failed = CELLS[(feature, event)]
    if failed is not None:
        pytest.fail(f"{feature} after {event}:\n{failed}", pytrace=False)
