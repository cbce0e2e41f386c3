"""The rest of a training loop, as users write it under FSDP2, on real gloo ranks.

Gradient accumulation with ``set_requires_gradient_sync``, clipping with
``clip_grad_norm_`` across shards (FSDP alone, and tensor parallelism with FSDP) and
the ``compile`` wrap option: each compared with one process that trains the same start
on the whole batch. Every model is class-built on the ranks (random init there); the
reference starts from its full weights, read back from the ranks.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import forget_models
from torch import nn

DIM = 6
BATCH = 12  # K micro-batches of 4, each split over 2 ranks (or 2 data-parallel groups)
K = 3
STEPS = 2
LR = 0.1
MAX_NORM = 0.005  # far below any of these models' gradient norms: every step is clipped
F64 = torch.float64


class Block(nn.Module):
    def __init__(self, dim: int = DIM, dtype: torch.dtype = F64):
        super().__init__()
        self.lin = nn.Linear(dim, dim, dtype=dtype)
        self.compiling = None  # what the last forward saw: torch.compiler.is_compiling()

    def forward(self, x):
        self.compiling = torch.compiler.is_compiling()
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, dim: int = DIM, depth: int = 2, dtype: torch.dtype = F64):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, dtype) for _ in range(depth))
        self.head = nn.Linear(dim, 3, dtype=dtype)  # the root unit's own parameters
        self.compiling = None

    def forward(self, x):
        self.compiling = torch.compiler.is_compiling()
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Mlp(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = 8, dtype: torch.dtype = F64):
        super().__init__()
        self.up = nn.Linear(dim, hidden, dtype=dtype)
        self.down = nn.Linear(hidden, 3, dtype=dtype)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _tp_plan(model, mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    return parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, DIM, generator=g, dtype=F64), torch.randn(BATCH, 3, generator=g, dtype=F64)


def _full_params(model) -> dict[str, torch.Tensor]:
    """On a rank: every parameter whole (DTensor ``full_tensor``: a collective)."""
    return {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}


def _full_grads(model) -> dict[str, torch.Tensor]:
    """On a rank: every gradient whole."""
    return {k: p.grad.full_tensor().detach().clone() for k, p in model.named_parameters()}


def _reference(sess, sm, cls: type[nn.Module]) -> nn.Module:
    """One process, the ranks' start: ``cls`` loaded with the full weights read back."""
    start = sess.run(_full_params, sm)
    for k in start[0]:  # every rank sees the same whole model
        assert all(torch.equal(start[0][k], s[k]) for s in start[1:]), k
    ref = cls()
    ref.load_state_dict(start[0])
    return ref


def _assert_params(sess, sm, ref: nn.Module, atol: float = 1e-12) -> None:
    want = dict(ref.named_parameters())
    for got in sess.run(_full_params, sm):
        assert set(got) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v.detach(), atol=atol, rtol=0, msg=k)


# -- gradient accumulation -----------------------------------------------------------------

ACCUMULATE = """
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

optimizer = torch.optim.SGD(acc.parameters(), lr=LR)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for step in range(STEPS):
        for i, (xb, yb) in enumerate(zip(x.chunk(K), y.chunk(K))):
            acc.set_requires_gradient_sync(not no_sync or i == K - 1)  # reduce on the last only
            xs, ys = xb.chunk(world_size)[rank], yb.chunk(world_size)[rank]
            (nn.functional.mse_loss(acc(xs), ys) / K).backward()  # the micro-batches' mean
        optimizer.step()
        optimizer.zero_grad()
acc.set_requires_gradient_sync(True)
# every reduce-scatter the process group ran (the c10d op, whichever Python call issued it)
reduce_scatters = sum(1 for e in prof.events()
                      if e.name.startswith("c10d::") and "reduce_scatter" in e.name)
"""
CELL_GLOBALS = ("x", "y", "K", "STEPS", "LR", "no_sync", "optimizer", "prof", "reduce_scatters")


def _train_whole_batch(ref: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = STEPS,
                       max_norm: float | None = None) -> list[float]:
    """The reference loop: one step per whole batch; returns the total norms clipped."""
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    norms = []
    for _ in range(steps):
        nn.functional.mse_loss(ref(x), y).backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
    return norms


@pytest.fixture(scope="module")
def profiled(session_factory):
    """Two ranks of their own for the tests that run torch.profiler on the engines: a
    profiler's native state is left in the process after it, not on the shared session."""
    s = session_factory(2, private=True)
    yield s
    s.shutdown()


@pytest.mark.parametrize("no_sync", [True, False], ids=["accumulate", "sync_every_micro_batch"])
def test_gradient_accumulation_is_the_large_batch_step(profiled, no_sync):
    sess = profiled
    sm = sess.wrap(Net, name="acc", auto_wrap={Block})
    units = sm.summary.units
    assert units == ("blocks.0", "blocks.1", "")  # each holds parameters: one reduce-scatter each
    try:
        ref = _reference(sess, sm, Net)
        x, y = _data(1)
        sess.push({"x": x, "y": y, "K": K, "STEPS": STEPS, "LR": LR, "no_sync": no_sync})
        sess.execute(ACCUMULATE)
        _train_whole_batch(ref, x, y)
        _assert_params(sess, sm, ref)  # accumulated micro-batches == the whole batch's step
        # with accumulation: one reduce-scatter per unit per step; syncing every
        # micro-batch (the control: the count does see each one) gives K per unit per step
        per_step = len(units) * (1 if no_sync else K)
        assert sess.pull("reduce_scatters") == [STEPS * per_step] * sess.world_size
    finally:
        sess.execute(f"[globals().pop(n, None) for n in {CELL_GLOBALS!r}]", output=None)
        forget_models(sess, "acc")


CUT_SHORT = """
cut_x = torch.ones(2, 4)

def cut_grads():
    cut_net.set_requires_gradient_sync(True)
    cut_net(cut_x).sum().backward()
    grads = [p.grad.full_tensor().clone() for p in cut_net.parameters()]
    cut_net.zero_grad()
    return grads

def cut_micro_batch():
    cut_net.set_requires_gradient_sync(False)
    cut_net(cut_x).sum().backward()
"""


def test_a_failed_cell_drops_the_unsynced_gradients_of_the_step_it_cut_short_and_no_other(sess):
    """Micro-batches under ``set_requires_gradient_sync(False)`` leave their gradients in
    FSDP2's units, out of ``zero_grad``'s reach. A cell that fails after one (no step view,
    no autosave: the wrap alone) drops them; a cell that fails with no training forward
    (a typo between two accumulating cells) leaves the accumulation whole. A cell that
    fails on one rank after its last collective drops them on the rank where it ended too,
    and ranks that took different numbers of optimizer steps in it are named; a call that
    is no cell failing on one rank leaves them."""
    from fsdp_nb.errors import RankError

    sess.wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), name="cut_net", auto_wrap={nn.Linear})
    try:
        sess.execute(CUT_SHORT)
        clean = sess.run(lambda: cut_grads())  # noqa: F821 - an engine global
        with pytest.raises(RankError, match="a bad batch"):
            sess.execute("cut_micro_batch()\nraise ValueError('a bad batch')")
        assert all(torch.equal(a, b) for got, want in zip(sess.run(lambda: cut_grads()), clean, strict=True)  # noqa: F821
                   for a, b in zip(got, want, strict=True))
        sess.execute("cut_micro_batch()")
        with pytest.raises(RankError, match="NameError"):
            sess.execute("cut_typo")
        doubled = sess.run(lambda: cut_grads())  # noqa: F821 - the kept micro-batch and this one
        assert all(torch.allclose(a, 2 * b) for got, want in zip(doubled, clean, strict=True)
                   for a, b in zip(got, want, strict=True))
        # failing on rank 1 alone after its last collective: rank 0 ended the cell inside the
        # step, and drops its micro-batch too when the notebook says the cell failed
        with pytest.raises(RankError, match="a bad batch on rank 1") as err:
            sess.execute("cut_micro_batch()\nif rank == 1:\n    raise ValueError('a bad batch on rank 1')")
        assert err.value.first.rank == 1 and not err.value.collateral
        assert not any("different numbers" in n for n in getattr(err.value, "__notes__", []))
        assert all(torch.equal(a, b) for got, want in zip(sess.run(lambda: cut_grads()), clean, strict=True)  # noqa: F821
                   for a, b in zip(got, want, strict=True))
        # the same through sess.run, which the ranks run as a cell: over the direct sockets,
        # and through ipyparallel (a call too large for them)
        for direct in (True, False):
            sess.dispatcher.channel.enabled = direct
            try:
                with pytest.raises(RankError, match="ZeroDivisionError"):
                    sess.run(lambda: (cut_micro_batch(), 1 / (torch.distributed.get_rank() - 1)))  # noqa: F821
            finally:
                sess.dispatcher.channel.enabled = True
            assert all(torch.equal(a, b) for got, want in zip(sess.run(lambda: cut_grads()), clean, strict=True)  # noqa: F821
                       for a, b in zip(got, want, strict=True))
        # a call that is no cell (as a save or a wrap) failing on one rank leaves an accumulation whole
        sess.execute("cut_micro_batch()")
        d = sess.dispatcher
        with pytest.raises(RankError, match="ZeroDivisionError"):
            d.gather(d.apply("a call that is no cell", eval, args=("1 / (__import__('torch').distributed.get_rank() - 1)",)))
        doubled = sess.run(lambda: cut_grads())  # noqa: F821
        assert all(torch.allclose(a, 2 * b) for got, want in zip(doubled, clean, strict=True)
                   for a, b in zip(got, want, strict=True))
        # rank 0 steps its optimizer, rank 1 fails before it: the error says so
        sess.execute("cut_opt = torch.optim.SGD(cut_net.parameters(), lr=0.1)")
        with pytest.raises(RankError, match="not finite on rank 1") as err:
            sess.execute("cut_net(cut_x).sum().backward()\nif rank == 1:\n    raise ValueError('not finite on rank 1')\n"
                         "cut_opt.step()")
        assert any("different numbers of optimizer steps in this call (rank 0: 1, rank 1: 0)" in n
                   for n in err.value.__notes__)
        # the same in a loop: rank 0 steps, then waits in the next forward for rank 1, which
        # raised; the recovery frees it, and says so too
        with pytest.raises(RankError, match="not finite on rank 1") as err:
            sess.execute("for _ in range(2):\n    cut_net(cut_x).sum().backward()\n"
                         "    if rank == 1:\n        raise ValueError('not finite on rank 1')\n    cut_opt.step()")
        assert err.value.collateral == [0]
        assert any("(rank 0: 1, rank 1: 0)" in n for n in err.value.__notes__)
    finally:
        sess.execute("[globals().pop(n, None) for n in ('cut_x', 'cut_grads', 'cut_micro_batch', 'cut_opt')]",
                     output=None)
        forget_models(sess, "cut_net")


# -- clipping across shards ----------------------------------------------------------------


def _clip_step(model, x, y, tp: int, max_norm: float, steps: int):
    """On a rank: its data-parallel group's slice of the batch (the ``tp`` ranks of a
    tensor-parallel group are neighbours and see the same slice), ``clip_grad_norm_``
    over the sharded gradients, a step. Returns each step's total norm (whole, from the
    DTensor) and the last step's clipped gradients, whole."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    dp_rank, dp_size = torch.distributed.get_rank() // tp, torch.distributed.get_world_size() // tp
    xs, ys = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms, grads = [], {}
    for _ in range(steps):
        nn.functional.mse_loss(model(xs), ys).backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        assert isinstance(total, DTensor)  # a norm of the sharded gradients
        norms.append(total.full_tensor().item())  # the total over every shard
        grads = _full_grads(model)
        opt.step()
        opt.zero_grad()
    return norms, grads


def _assert_clips_like_one_process(sess, sm, cls: type[nn.Module], tp: int, seed: int) -> None:
    ref = _reference(sess, sm, cls)
    x, y = _data(seed)
    got = sess.run(_clip_step, sm, x, y, tp, MAX_NORM, STEPS)
    want = _train_whole_batch(ref, x, y, max_norm=MAX_NORM)
    assert all(n > MAX_NORM * 10 for n in want)  # clipping does scale the gradients
    for norms, grads in got:
        # every rank: the norm over all shards and ranks, not over its own pieces
        assert norms == pytest.approx(want, rel=1e-12, abs=0)
        # the last step's gradients, whole, scaled to MAX_NORM (clip_grad_norm_ divides by
        # the norm + 1e-6); the weights below check they point where the reference's do
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        assert total.item() == pytest.approx(MAX_NORM * norms[-1] / (norms[-1] + 1e-6), rel=1e-9)
    _assert_params(sess, sm, ref)


def test_clipping_across_fsdp_shards_is_the_one_process_clip(sess):
    torch.manual_seed(0)  # the wrap's seed: the same initial weights whatever ran before
    sm = sess.wrap(Net, name="clip", auto_wrap={Block})
    try:
        _assert_clips_like_one_process(sess, sm, Net, tp=1, seed=2)
    finally:
        forget_models(sess, "clip")


@pytest.fixture
def sess4(session_factory):
    """The run's 4-rank session (shared with the other test files)."""
    return session_factory(4)


def test_clipping_across_tensor_parallel_and_fsdp_shards(sess4):
    torch.manual_seed(0)
    sm = sess4.wrap(Mlp, name="clip_tp", parallelize=_tp_plan, tensor_parallel_size=2)
    assert sm.summary.mesh_dims == ("dp", "tp") and sm.summary.mesh_shape == (2, 2)
    table = {p.name: p for p in sm.shards().params}
    assert table["up.weight"].local_shapes == ((2, DIM),) * 4  # 8 rows: tp halves, dp halves
    try:
        # ranks 0, 1: data-parallel group 0 (a tensor-parallel pair), ranks 2, 3: group 1
        _assert_clips_like_one_process(sess4, sm, Mlp, tp=2, seed=3)
    finally:
        forget_models(sess4, "clip_tp")


# -- compile ---------------------------------------------------------------------------------


def _forward_backward(model, x, y):
    """On a rank: its half of the batch, forward and backward. Returns its output, the
    gradients whole, and what the forwards saw of ``torch.compiler.is_compiling()``: each
    block's inside the model, the root's, and the first block's when it is called on its
    own (outside the root's call: compiled only if the block itself is)."""
    import torch
    from torch import nn

    rank, n = torch.distributed.get_rank(), torch.distributed.get_world_size()
    xs = x.chunk(n)[rank]
    out = model(xs)
    nn.functional.mse_loss(out, y.chunk(n)[rank]).backward()
    seen = [b.compiling for b in model.blocks], model.compiling
    with torch.no_grad():
        model.blocks[0](xs)  # an FSDP unit gathers its own parameters: every rank calls it
    return out.detach(), _full_grads(model), (*seen, model.blocks[0].compiling)


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU (inductor) needs g++ on PATH")
def test_compile_compiles_each_unit_and_computes_the_same(sess):
    torch.manual_seed(4)
    start = Net()
    x, y = _data(4)
    ref = Net()
    ref.load_state_dict(start.state_dict())
    nn.functional.mse_loss(ref(x), y).backward()
    runs = {}
    try:
        for compiled in (False, True):
            sm = sess.wrap(start, name=f"net_{compiled}", auto_wrap={Block}, compile=compiled)
            assert ("compile" in sm.options.describe()) is compiled
            runs[compiled] = sess.run(_forward_backward, sm, x, y)
    finally:
        forget_models(sess, "net_False", "net_True")
    for rank in range(sess.world_size):
        eager_out, eager_grads, eager_seen = runs[False][rank]
        out, grads, seen = runs[True][rank]
        # each block's forward ran under torch.compile, also a block called on its own
        # (a compiled root alone would not compile that call); the root, not a unit of
        # auto_wrap, ran eagerly; without the option nothing was compiled
        assert seen == ([True, True], False, True)
        assert eager_seen == ([False, False], False, False)
        torch.testing.assert_close(out, eager_out, atol=1e-12, rtol=0)
        for k, p in ref.named_parameters():
            torch.testing.assert_close(grads[k], eager_grads[k], atol=1e-12, rtol=0, msg=k)
            torch.testing.assert_close(grads[k], p.grad, atol=1e-12, rtol=0, msg=k)
