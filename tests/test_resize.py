"""``sess.resize``: a live session grown and shrunk with its models, on real engines.

One private session goes 2 -> 3 -> 1 -> 2 ranks: after each step every weight and every
optimizer state is bit-equal to before, the variables of the ranks that stayed are
still there, new ranks have the session's imports, classes and optimizers. Training
afterwards matches a fresh session (the shared fixture) loaded from a checkpoint. A
resize that fails after staging keeps the state, private, where ``sess.load`` reads it.
Refusals (a mesh that does not fit, an optimizer over two models, bad arguments) are
checked on the shared session, which must come out unchanged.
"""

from __future__ import annotations

import glob
import os
import stat
import subprocess

import psutil
import pytest
import torch
from helpers import assert_same, forget_models, full_state
from torch import nn

from fsdp_nb.errors import ResizeError
from fsdp_nb.runtime.cluster import wait_until

DIM = 16

SETUP = '''
import torch
import torch.nn.functional as F
from torch import nn as tnn

class Scale(tnn.Module):
    def __init__(self, k=2.0):
        super().__init__()
        self.k = k
    def forward(self, x):
        return self.k * x

def batch(step, r):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(4, 16, generator=g)
'''

TRAIN = '''
for step in range({start}, {stop}):
    loss = net(batch(step, rank)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
'''


class Block(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.up = nn.Linear(dim, 3 * dim)
        self.down = nn.Linear(3 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, dim: int = DIM, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, dim)
        self.register_buffer("scale", torch.full((dim,), 0.5))

    def reset_parameters(self):
        # built on the meta device, a buffer has no values until its module computes them
        # (a rank's memory may hold anything, NaN included, where it lands)
        self.scale.fill_(0.5)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.scale


class Trap(nn.Module):
    """Builds on any world size but 4: a resize to 4 fails after the state was staged."""

    def __init__(self):
        super().__init__()
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() == 4:
            raise RuntimeError("Trap refuses 4 ranks")
        self.w = nn.Linear(4, 4)


def _drop(sess, *names: str) -> None:
    """Take models a test wrapped off the shared session."""
    forget_models(sess, *names)


def _as_outsider(cmd: list[str]) -> subprocess.CompletedProcess:
    """``cmd`` run as another user (nobody): what someone else on a shared node gets."""
    def drop() -> None:
        os.setgid(65534)
        os.setuid(65534)

    return subprocess.run(cmd, preexec_fn=drop, capture_output=True, text=True, timeout=30)


def _gone(proc: psutil.Process) -> bool:
    """The process exited (a zombie its launcher has not reaped yet counts)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _ours_in_shm() -> set[str]:
    return set(glob.glob("/dev/shm/fsdp_nb-resize-*"))


def test_resize_2_3_1_2_keeps_models_and_trains_like_a_fresh_session(session_factory, sess, tmp_path):
    s = session_factory(2, private=True)
    s.execute(SETUP)
    s.wrap(Trap, name="trap")  # resized along, without an optimizer; it fails the last resize
    s.wrap(Net, name="net", auto_wrap={Block})
    s.execute("optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)\n"
              "scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)\n"
              "mine = f'made on rank {rank}'\n" + TRAIN.format(start=0, stop=3))
    before = s.run(full_state("net", "optimizer"))[0]
    assert before[1]["state"], "the optimizer has state to carry"
    left = _ours_in_shm()
    widget = s.memory(interval=0.2)
    steps = s.steps(window=5, interval=0.2)

    report = s.resize(3)
    assert s.world_size == 3 and s.pull("world_size") == [3, 3, 3]
    assert_same(before, s.run(full_state("net", "optimizer"))[0], "2->3")
    assert report.models == ("trap", "net") and report.optimizers == {"net": ("optimizer",)}
    assert {"mine", "scheduler", "loss"} <= set(report.variables) and "batch" not in report.variables
    assert len(report.peak_rss) == 3 and all(b > 0 for b in report.peak_rss) and report.staged_bytes > 0
    assert s.run(lambda: globals().get("mine")) == ["made on rank 0", "made on rank 1", None]
    # the scheduler on the ranks that stayed still drives the same optimizer object
    s.execute("assert scheduler.optimizer is optimizer", ranks=[0, 1])  # raises if not
    # the new rank has the session's imports, classes and functions, and the optimizer
    assert s.run(lambda: (type(Scale(3.0)).__name__, F.relu(torch.tensor(-1.0)).item(),  # noqa: F821
                          type(tnn.Linear).__name__, batch(0, 0).shape,  # noqa: F821
                          type(optimizer).__name__, optimizer.param_groups[0]["weight_decay"]))[2] == (  # noqa: F821
        "Scale", 0.0, "type", torch.Size([4, 16]), "AdamW", 0.1)
    assert _ours_in_shm() == left, "the staging folder is removed"
    assert s.models["net"].summary.mesh_shape == (3,)
    # an open memory widget follows the new world: samples from all three ranks
    assert wait_until(lambda: all(widget.feed.latest()), 30) and len(widget.feed.latest()) == 3
    widget.close()
    # and the step view measures on the rank that joined (one step of a throwaway optimizer)
    s.execute("_o = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1); _o.step(); del _o")
    assert wait_until(lambda: sorted(steps.ranks) == [0, 1, 2], 30), steps.ranks
    steps.stop()

    retired = [psutil.Process(r.pid) for r in s.ranks[1:]]
    s.resize(1)
    assert s.world_size == 1 and s.run(lambda: globals().get("mine")) == ["made on rank 0"]
    assert_same(before, s.run(full_state("net", "optimizer"))[0], "3->1")
    # the retired engines (this session's) are gone, and unregistered
    assert all(_gone(p) for p in retired)
    assert wait_until(lambda: set(s.cluster.client.ids) == set(s.cluster.engine_ids), 30)

    s.resize(2)
    assert s.world_size == 2
    assert_same(before, s.run(full_state("net", "optimizer"))[0], "1->2")
    assert s.all_reduce_check() == 1.0

    # training on from here matches a fresh 2-rank session loaded from a checkpoint
    ckpt = str(tmp_path / "ck")
    s.save(ckpt, "net", optimizer="optimizer")
    s.execute(TRAIN.format(start=3, stop=6))
    resized = s.run(full_state("net", "optimizer"))[0]

    sess.execute(SETUP)
    sess.wrap(Net, name="net", auto_wrap={Block})
    try:
        sess.execute("optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)\n"
                     "scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)")
        sess.load(ckpt, "net", optimizer="optimizer")
        sess.execute(TRAIN.format(start=3, stop=6))
        assert_same(resized, sess.run(full_state("net", "optimizer"))[0], "fresh")
    finally:
        sess.execute("del optimizer, scheduler")
        _drop(sess, "net")

    # a resize that fails after staging (Trap, rebuilt first, refuses 4 ranks): the state
    # stays, private, where sess.load reads it; the session is degraded until a restart
    with pytest.raises(ResizeError, match="Trap refuses 4 ranks") as info:
        s.resize(4)
    staged = info.value.staged
    try:
        assert s.state == "degraded" and f"{staged}/net" in str(info.value)
        assert stat.S_IMODE(os.stat(staged).st_mode) == 0o700
        for root, dirs, files in os.walk(staged):  # nobody else may read the model's state
            assert all(stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o700 for d in dirs)
            assert all(stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o600 for f in files)
        if os.geteuid() == 0:  # another user on the node tries to list and read it
            for target in (staged, f"{staged}/net", f"{staged}/net/.metadata"):
                got = _as_outsider(["cat", target] if target.endswith(".metadata") else ["ls", target])
                assert got.returncode != 0 and "Permission denied" in got.stderr, (target, got)
        assert not s.models, "models no longer on the engines are not in the session"
        s.restart()
        assert s.world_size == 4 and s.state == "ready"
        s.wrap(Net, name="net", auto_wrap={Block})
        s.execute("optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)\n"
                  "scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)")
        s.load(f"{staged}/net", "net", optimizer="optimizer")
        assert_same(resized, s.run(full_state("net", "optimizer"))[0], "from the staged folder")
    finally:
        import shutil

        shutil.rmtree(staged, ignore_errors=True)


def _tp_plan(model, mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    return parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _tp_model():
    return nn.Sequential(nn.Linear(DIM, 8), nn.ReLU(), nn.Linear(8, DIM))


def test_resize_refuses_before_changing_anything(sess, tmp_path):
    before = (list(sess.cluster.engine_ids), sess.pull("world_size"))
    # the models other tests left on the shared session are set aside: only this test's are checked
    others = dict(sess.context.wraps)
    sess.context.wraps.clear()
    sess.wrap(_tp_model, name="tp", parallelize=_tp_plan, tensor_parallel_size=2)
    weights = sess.models["tp"].state_dict()
    try:
        with pytest.raises(ValueError, match=r"model 'tp' cannot be sharded over 3 ranks: tensor_parallel_size=2"):
            sess.resize(3)
        for bad in (0, -1, True, "3", 2.0):
            with pytest.raises(ValueError, match="positive int"):
                sess.resize(bad)
        with pytest.raises(ValueError, match="not an existing folder"):
            sess.resize(1, staging=str(tmp_path / "nowhere"))
        sess.wrap(nn.Linear(DIM, DIM), name="other")
        sess.execute("both = torch.optim.SGD([*tp.parameters(), *other.parameters()], lr=0.1)")
        with pytest.raises(ValueError, match="optimizer 'both' steps parameters of several wrapped models"):
            sess.resize(4)
        sess.execute("del both\nloose = torch.optim.SGD([*tp.parameters(), torch.nn.Parameter(torch.ones(2))], lr=0.1)")
        with pytest.raises(ValueError, match="optimizer 'loose' steps parameters of wrapped model 'tp' and others"):
            sess.resize(4)
        sess.execute("del loose")
        assert sess.resize(2).new == 2  # the same size: nothing to do
        assert (list(sess.cluster.engine_ids), sess.pull("world_size")) == before
        assert sess.state == "ready" and sess.all_reduce_check() == 1.0
        assert_same(weights, sess.models["tp"].state_dict())
    finally:
        _drop(sess, "tp", "other")
        sess.context.wraps.update(others)


def test_resize_magic(sess, shell):
    from fsdp_nb.frontends.magics import activate_px, fsdp_command

    activate_px(sess)
    with pytest.raises(ValueError, match="usage: %fsdp resize N"):
        fsdp_command("resize two", shell)
    assert str(fsdp_command("resize 2", shell)) == "resize: already 2 rank(s); nothing changed"
