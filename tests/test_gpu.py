"""The GPU path: NCCL sessions on CUDA engines (``-m gpu``; skipped without CUDA), and the
same tests' logic on two CPU engines over gloo wherever it is not CUDA's own: the
``gsess`` fixture is parametrized by device, so CI runs them on every push and a test
cannot rot unseen between GPU runs. CUDA-only tests ask for ``cuda`` alone.

Run on a GPU machine (``pytest -m gpu``; the README says what has run there): one engine per GPU, an NCCL group
formed as ``cpu:gloo,cuda:nccl``; wrap with bf16-mixed, auto_wrap, activation
checkpointing and CPU offload on CUDA; training against one process; sync and async
saves and loads; the memory feed's CUDA fields; an error cell, Ctrl-C in a GPU loop,
kill -9 then ``restart(restore=)``; ``connect()`` choosing nccl; consolidate; the NCCL
abort-and-re-form path that one GPU can show; the hang watch on NCCL's flight recorder;
``sess.resize`` on NCCL (refused past the host's GPUs; n -> n-1 -> n with two or more).
"""

from __future__ import annotations

import _thread
import copy
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
from helpers import assert_same, forget_models, full_state, release_on_diagnosis, straggle
from torch import nn

import fsdp_nb
from fsdp_nb.errors import DeadRankError, RankError
from fsdp_nb.runtime.cluster import wait_until

DIM = 64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
"""What ``gsess`` runs on: two CPU engines over gloo, or one engine per GPU over NCCL."""
CUDA_ONLY = pytest.mark.parametrize("gsess", [pytest.param("cuda", marks=pytest.mark.gpu)], indirect=True)
"""For a test whose subject is CUDA's own (its memory counters, NCCL's abort)."""


class Block(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, dim: int = DIM, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _batch(seed: int = 1, dim: int = DIM):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, dim, generator=g)
    return x, x.roll(1, dims=-1)


def _train_on_ranks(name: str, x, y, steps: int = 3) -> list[float]:
    import torch as t

    model = globals()[name]
    dev = globals()["device"]
    opt = t.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        loss = t.nn.functional.mse_loss(model(x.to(dev)).float(), y.to(dev))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _train_local(model, x, y, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture(scope="module", params=DEVICES)
def gsess(request):
    if request.param == "cuda":
        s = fsdp_nb.Session(activate=False, grace=1.0)  # the default: one engine per GPU, nccl
    else:
        s = fsdp_nb.Session(2, backend="gloo", activate=False, grace=1.0, standby=False)
    try:
        yield s
    finally:
        s.shutdown()


def _device(s: fsdp_nb.Session) -> str:
    return "cuda" if s.backend == "nccl" else "cpu"


def test_session_picks_its_backend_and_devices(gsess: fsdp_nb.Session):
    assert gsess.all_reduce_check() == float(sum(range(gsess.world_size)))
    backends = gsess.run(lambda: str(__import__("torch.distributed").distributed.get_backend()))
    if _device(gsess) == "cpu":
        assert gsess.backend == "gloo" and set(backends) == {"gloo"}
        assert [r.device for r in gsess.ranks] == ["cpu"] * gsess.world_size
        return
    assert gsess.backend == "nccl"
    assert gsess.world_size == torch.cuda.device_count()
    assert [r.device for r in gsess.ranks] == [f"cuda:{r.local_rank}" for r in gsess.ranks]
    assert set(backends) == {"cpu:gloo,cuda:nccl"}


def test_class_wrap_on_meta_with_bf16_autowrap_checkpointing(gsess: fsdp_nb.Session):
    sm = gsess.wrap(Net, name="gnet", auto_wrap={Block}, mixed_precision="bf16-mixed",
                    activation_checkpointing={Block})
    assert sm.summary.param_dtype == "float32" and len(sm.summary.checkpointed) == 2
    x, y = _batch()
    losses = gsess.run(_train_on_ranks, "gnet", x, y)
    assert all(ls[-1] < ls[0] for ls in losses)
    on = gsess.run(lambda: {p.device.type for p in globals()["gnet"].parameters()})
    assert on == [{_device(gsess)}] * gsess.world_size


def test_cpu_offload(gsess: fsdp_nb.Session):
    sm = gsess.wrap(Net, name="goff", cpu_offload=True, mixed_precision="bf16-mixed")
    x, y = _batch()
    losses = gsess.run(_train_on_ranks, "goff", x, y)
    assert all(ls[-1] < ls[0] for ls in losses)
    assert gsess.run(lambda: {p.device.type for p in globals()["goff"].parameters()}) == [
        {"cpu"}
    ] * gsess.world_size
    assert sm.summary.num_params > 0


def test_training_equals_one_process_within_bf16_tolerance(gsess: fsdp_nb.Session):
    torch.manual_seed(0)
    start = Net()
    sm = gsess.wrap(start, name="geq", mixed_precision="bf16-mixed", auto_wrap={Block})
    x, y = _batch()
    ref = copy.deepcopy(start)
    _train_local(ref, x, y)
    gsess.run(_train_on_ranks, "geq", x, y)  # every rank the whole batch: the same mean
    got = sm.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=5e-2, rtol=0)


@pytest.mark.parametrize("sharded, async_save", [(True, False), (True, True), (False, False), (False, True)])
def test_save_and_load(gsess: fsdp_nb.Session, tmp_path, sharded, async_save):
    sm = gsess.wrap(Net, name="gck")
    gsess.execute("gck_opt = torch.optim.AdamW(gck.parameters(), lr=1e-3)")
    x, y = _batch()
    gsess.run(_train_on_ranks, "gck", x, y, 1)
    saved = sm.state_dict()
    path = str(tmp_path / ("ck" if sharded else "ck.safetensors"))
    out = gsess.save(path, sm, optimizer="gck_opt", sharded=sharded, async_save=async_save,
                     extra={"step": 1})
    info = out.wait() if isinstance(out, fsdp_nb.AsyncCheckpoint) else out
    assert info.valid and info.extra == {"step": 1}
    gsess.execute("with torch.no_grad():\n    [p.zero_() for p in gck.parameters()]")
    assert gsess.load(path, sm, optimizer="gck_opt") == {"step": 1}
    after = sm.state_dict()
    assert all(torch.equal(saved[k], after[k]) for k in saved)


def _copy_and_restore(name: str) -> tuple[bool, bool]:
    """On each rank: copy ``name`` and its optimizer into a copy part of its own (each rank
    its own buddy: staged, not sent), train a step, restore the copy; whether the staging
    buffer is pinned, and whether every shard and moment came back bit for bit."""
    import torch as t

    from fsdp_nb.autosave.rank_memory_copies import MemoryCopies
    from fsdp_nb.checkpoints.rank_run_state import rng_state

    model, opt = globals()[name], globals()[name + "_opt"]
    x = t.randn(4, 8, model.head.in_features, device=globals()["device"])
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    want = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    moments = [st["exp_avg"].to_local().clone() for st in opt.state.values()]
    c = MemoryCopies()
    c.assign(tuple(range(t.distributed.get_world_size())))
    c.take(1, model, [opt], {"state": {}, "rng": rng_state()})
    c.wait_exchange()
    pinned = bool(c.own[0].flat.is_pinned())
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    c.restore(1, {}, model, [opt], ())
    same = all(t.equal(v.to_local(), want[k]) for k, v in model.state_dict().items()) and all(
        t.equal(st["exp_avg"].to_local(), m) for st, m in zip(opt.state.values(), moments))
    c.closed()
    return pinned, same


def test_a_copy_in_memory_is_staged_and_comes_back_bit_for_bit(gsess: fsdp_nb.Session):
    """The in-memory autosave's copy of a rank's shards (``in_memory=True``): on a GPU,
    staged into pinned host memory on a stream of its own after the training stream's
    step, and written back into the device's shards bit for bit (on CPU, the same path
    with plain host memory)."""
    gsess.wrap(Net, name="gmem")
    gsess.execute("gmem_opt = torch.optim.AdamW(gmem.parameters(), lr=1e-3)")
    got = gsess.run(_copy_and_restore, "gmem")
    on_gpu = _device(gsess) == "cuda"
    assert all(same for _, same in got) and all(pinned == on_gpu for pinned, _ in got)
    forget_models(gsess, "gmem", optimizers=("gmem_opt",))


@CUDA_ONLY
def test_sharded_load_reads_into_the_model_without_device_memory(gsess: fsdp_nb.Session, tmp_path):
    """A checked sharded load stages its reads in host memory and copies them into the
    model's own shards: it allocates no second model on the GPU."""
    sm = gsess.wrap(Net(dim=256, depth=4), name="gin")
    gsess.execute("gin_opt = torch.optim.AdamW(gin.parameters(), lr=1e-3)")
    x, y = _batch(dim=256)
    gsess.run(_train_on_ranks, "gin", x, y, 1)
    path = str(tmp_path / "in")
    gsess.save(path, sm, optimizer="gin_opt")
    saved = sm.state_dict()
    gsess.execute("with torch.no_grad():\n    [p.zero_() for p in gin.parameters()]\n"
                  "torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()\n"
                  "_gin_base = torch.cuda.memory_allocated()")
    gsess.load(path, sm, optimizer="gin_opt")
    added, shard = gsess.run(lambda: (
        __import__("torch").cuda.max_memory_allocated() - globals()["_gin_base"],
        sum(p.to_local().numel() * p.element_size() for p in globals()["gin"].parameters())))[0]
    assert added < shard / 2, (added, shard)  # a fresh copy of the weights alone is `shard`
    after = sm.state_dict()
    assert all(torch.equal(saved[k], after[k]) for k in saved)


def test_a_plan_matches_the_measured_step_on_the_device(gsess: fsdp_nb.Session):
    """The plan (fake tensors of the session's device type) within 10% of the measured
    step; on CUDA also within 10% of ``max_memory_allocated`` over the step, with what
    CUDA adds beyond the tensors named in the plan's notes."""
    x = torch.randn(16, 128, DIM)  # activations well above the allocator's 512-byte rounding
    kw: dict[str, Any] = dict(auto_wrap={Block}, mixed_precision="bf16-mixed")
    plan = gsess.plan(Net, batch=x, optimizer=torch.optim.AdamW, **kw)
    model = gsess.wrap(Net, name="gpu_planned", **kw)
    try:
        got = model.measure_memory(x, optimizer=torch.optim.AdamW)
    finally:
        forget_models(gsess, "gpu_planned")
    assert plan.device == _device(gsess) == got.device
    for p, m in zip(plan.ranks, got.ranks):
        assert abs(p.peak - m.peak) <= 0.1 * m.peak, (p, m)
        if _device(gsess) == "cuda":
            assert m.device_peak is not None and abs(p.peak - m.device_peak) <= 0.1 * m.device_peak, (p, m)
    if _device(gsess) == "cuda":
        assert any("CUDA context" in n for n in plan.notes)


@CUDA_ONLY
def test_memory_feed_has_cuda_fields(gsess: fsdp_nb.Session):
    from fsdp_nb.memory.rank_memory_kinds import by_kind
    from fsdp_nb.memory.rank_memory_sample import read

    samples = gsess.run(lambda: read(rank, by_kind()))  # type: ignore[name-defined]  # noqa: F821 - engine globals
    for s in samples:
        assert s.device.startswith("cuda") and s.on_device
        assert s.device_allocated > 0 and s.budget > s.device_reserved > 0 and s.device_peak >= s.device_allocated


def test_the_step_view_reads_the_devices_own_times(gsess: fsdp_nb.Session):
    """On CUDA the view's steps come from CUDA events (a step, the idle before it, the
    model part), the device's name gives MFU; on CPU from host clocks, split in four."""
    gsess.wrap(Net, name="gsteps", auto_wrap={Block})
    x, y = _batch()
    written: dict[tuple[str, int], float] = {}

    class Writer:  # a SummaryWriter's call, kept: log_to writes what the view read
        def add_scalar(self, tag, value, step):
            written[tag, step] = value

    view = gsess.steps(window=4).log_to(Writer())
    try:
        gsess.run(_train_on_ranks, "gsteps", x, y)
        view.refresh()
        for r in range(gsess.world_size):  # each step's parts add up to it, as the device ran it on CUDA
            steps = sorted(k for t, k in written if t == f"step_ms/rank{r}")
            assert steps and all(sum(written[f"{p}_ms/rank{r}", k] for p in ("compute", "communication", "other"))
                                 == pytest.approx(written[f"step_ms/rank{r}", k], rel=1e-6) for k in steps)
            if _device(gsess) == "cuda":
                assert {written[f"communication_ms/rank{r}", k] for k in steps} == {0.0}
        assert view.device == _device(gsess) and sorted(view.ranks) == list(range(gsess.world_size))
        for p in view.ranks.values():
            # the model part (on CPU split by a 10 ms sampler: three short steps may give compute no sample)
            assert p.step > 0 and p.compute + p.communication + p.waiting > 0
            assert p.compute + p.communication + p.waiting + p.other == pytest.approx(p.step, rel=1e-6)
        assert view.rates.samples_per_s is not None
        if _device(gsess) == "cuda":
            assert "model ms" in view.to_text() and "CUDA events" in view.to_text()
    finally:
        view.stop()


def test_error_cell_then_usable(gsess: fsdp_nb.Session):
    with pytest.raises(RankError, match="gpu boom"):
        gsess.execute("t = torch.ones(1, device=device)\nraise ValueError('gpu boom')")
    assert gsess.all_reduce_check() == float(sum(range(gsess.world_size)))


def test_ctrl_c_during_a_device_loop(gsess: fsdp_nb.Session, tmp_path):
    marker = tmp_path / "looping"
    sync = "torch.cuda.synchronize()" if _device(gsess) == "cuda" else "float(x[0, 0])"
    code = (
        "x = torch.ones(256, 256, device=device)\n"
        f"open({str(marker)!r}, 'w').close()\n"
        f"while True:\n    x = (x @ x).clamp_(-1, 1)\n    {sync}\n"
    )

    def interrupt_when_looping():
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_when_looping, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        gsess.execute(code)
    assert wait_until(lambda: gsess.status().busy == [], 10)  # the controller may trail a moment
    assert gsess.all_reduce_check() == float(sum(range(gsess.world_size)))


def test_a_breakpoint_and_the_collective_check_on_the_device(gsess: fsdp_nb.Session, capsys):
    """A rank stopped at a breakpoint shows its device tensors (with two ranks or more, the
    others wait in an NCCL collective, which returns to the host at once and waits on the
    device); FSDP2's collectives of device tensors pass the check; with two ranks or more,
    a mismatch of device tensors is named before it is issued, and the group goes on."""
    dev, last = _device(gsess), gsess.world_size - 1
    gsess.execute("x = torch.ones(3, device=device) * (rank + 1)\nbreakpoint()\ntorch.distributed.all_reduce(x)\n"
                  "dbg_out = x.tolist()", debug=[last], debug_commands="p x.device.type, x.sum().item();; c")
    assert f"('{dev}', {3.0 * (last + 1)})" in capsys.readouterr().out
    total = float(sum(range(1, gsess.world_size + 1)))
    assert gsess.pull("dbg_out") == [[total] * 3] * gsess.world_size
    gsess.execute("from torch.distributed.fsdp import fully_shard\n"
                  "from fsdp_nb.debugging.rank_collective_check import CollectiveCheck\n"
                  "from fsdp_nb.engine.registry import part\n"
                  "dbg_net = fully_shard(torch.nn.Linear(8, 8).to(device))\n"
                  "dbg_net(torch.ones(2, 8, device=device)).sum().backward()\n"
                  "dbg_out = sum(part(CollectiveCheck).counts.values())\ndel dbg_net", check_collectives=True)
    assert all(n >= 2 for n in gsess.pull("dbg_out"))  # the all-gather and the reduce-scatter, checked
    if gsess.world_size > 1:
        with pytest.raises(RankError, match=r"rank 0: all_reduce\(float32\[4\]\)"):
            gsess.execute("torch.distributed.all_reduce(torch.ones(4 if rank == 0 else 3, device=device))",
                          check_collectives=True)
    assert gsess.all_reduce_check() == float(sum(range(gsess.world_size)))


@CUDA_ONLY
def test_nccl_abort_then_reform_trains_on(gsess: fsdp_nb.Session):
    """What one GPU can show of the NCCL recovery: the rank's communicators are aborted
    from its listener thread, the group is re-formed, the model trains on."""
    from fsdp_nb.engine import nccl_abort

    gsess.wrap(Net, name="gab")
    x, y = _batch()
    gsess.run(_train_on_ranks, "gab", x, y, 1)
    before = gsess.run(nccl_abort.received)
    gsess.context.health.abort(list(range(gsess.world_size)))  # listeners started with the session
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = gsess.run(nccl_abort.received)
        if all(g[0] > b[0] for g, b in zip(got, before)):
            break
    assert all(g[1] > b[1] for g, b in zip(got, before)), "no NCCL communicator was aborted"
    gsess.restart()  # healthy session: re-form the group and re-point meshes
    assert gsess.all_reduce_check() == float(sum(range(gsess.world_size)))
    losses = gsess.run(_train_on_ranks, "gab", x, y, 2)
    assert all(math.isfinite(loss) for ls in losses for loss in ls)


def _all_reduce_on_device() -> float:
    t = torch.ones(1, device=globals()["device"])
    torch.distributed.all_reduce(t)
    return float(t)


def test_the_hang_watch_tells_a_straggler_from_the_groups_counts(gsess: fsdp_nb.Session, tmp_path):
    """An NCCL session runs without the flight recorder (each record costs the step);
    gloo keeps it. Either way the ranks' counts of issued collectives agree after one
    all_reduce, and with two ranks or more a straggler is explained while rank 0 has
    issued its all_reduce and blocks outside torch.distributed, as an NCCL rank waits in
    a CUDA sync."""
    from fsdp_nb.hangs import rank_hang_watch as hang_watch

    gsess.run(_all_reduce_on_device)
    recorder = gsess.run(lambda: os.environ.get("TORCH_FR_BUFFER_SIZE"))
    assert recorder == [None if _device(gsess) == "cuda" else "256"] * gsess.world_size
    # the name torch 2.11+ warns about is never set by fsdp_nb (quiet NCCL starts)
    assert gsess.run(lambda: os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")) == [None] * gsess.world_size
    counts = [{(g.name, g.backend): g.seq for g in got} for got in gsess.run(lambda: hang_watch.watch().issued())]
    assert all(c == counts[0] for c in counts) and counts[0]
    if gsess.world_size < 2:
        return
    go = tmp_path / "go"
    wait = ("float(t)" if _device(gsess) == "cuda" else  # NCCL returns at once; the sync waits
            "w = dist.all_reduce(t, async_op=True)\nwhile not w.is_completed():\n    time.sleep(0.01)")
    code = ("import os, time\n" + straggle(go) +
            "t = torch.ones(1, device=device)\n" + ("dist.all_reduce(t)\n" if _device(gsess) == "cuda" else "")
            + wait + "\n")
    with release_on_diagnosis(gsess, go) as seen:
        gsess.execute(code, hang_after=1)
    assert seen and "rank 1 is not in it" in seen[0]
    # NCCL: no recorder, the counts tell it (op unknown); gloo: the recorder names it
    op = "collective" if _device(gsess) == "cuda" else "all_reduce"
    assert re.search(rf"rank 0 waits in {op} #\d+ on the default group", seen[0]), seen[0]


def test_consolidate_a_gpu_trained_checkpoint(gsess: fsdp_nb.Session, tmp_path):
    sm = gsess.wrap(Net, name="gcon")
    gsess.save(str(tmp_path / "ck"), sm)
    info = fsdp_nb.consolidate(str(tmp_path / "ck"), str(tmp_path / "full.pt"))
    assert info.valid
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    got = sm.state_dict()
    model_sd = full.get("model", full)
    for k, v in got.items():
        key = k if k in model_sd else f"model.{k}"
        assert torch.equal(model_sd[key], v)


@pytest.mark.gpu
def test_kill_9_then_restart_restore(tmp_path):
    s = fsdp_nb.Session(activate=False, grace=1.0)
    try:
        sm = s.wrap(Net, name="gkill")
        saved = sm.state_dict()
        s.save(str(tmp_path / "ck"), sm)
        os.kill(s.ranks[0].pid, signal.SIGKILL)
        with pytest.raises(DeadRankError):
            s.all_reduce_check()
        s.restart(restore=str(tmp_path / "ck"))
        assert s.backend == "nccl" and s.ranks[0].device.startswith("cuda")
        after = sm.state_dict()
        assert all(torch.equal(saved[k], after[k]) for k in saved)
    finally:
        s.shutdown()


@pytest.mark.gpu
def test_resize_on_nccl():
    """Growing past this host's GPUs is refused before anything changes (one GPU shows
    that); with two or more, n -> n-1 -> n keeps the CUDA weights and AdamW state
    bit-equal, and the group trains on."""
    n = torch.cuda.device_count()
    s = fsdp_nb.Session(activate=False, grace=1.0)
    try:
        s.execute("import torch")
        s.wrap(Net, name="grs")
        s.execute(f"gopt = torch.optim.AdamW(grs.parameters(), lr=1e-3)\n"
                  f"grs(torch.randn(2, 3, {DIM}, device='cuda')).square().mean().backward()\ngopt.step()")
        before = s.run(full_state("grs", "gopt"))[0]
        with pytest.raises(ValueError, match=f"this host has {n} GPU"):
            s.resize(n + 1)
        assert s.world_size == n and s.state == "ready"
        if n < 2:
            return
        for size in (n - 1, n):
            s.resize(size)
            assert s.backend == "nccl" and s.world_size == size
            assert_same(before, s.run(full_state("grs", "gopt"))[0], f"{size} ranks")
        assert s.all_reduce_check() == float(sum(range(n)))
    finally:
        s.shutdown()


@pytest.mark.gpu
def test_connect_to_gpu_engines_picks_nccl(tmp_path):
    import ipyparallel as ipp

    n = torch.cuda.device_count()
    cluster = ipp.Cluster(n=n, profile_dir=str(tmp_path / "profile"), cluster_id="gpu", log_level=40)
    cluster.start_cluster_sync()
    try:
        url = tmp_path / "profile" / "security" / "ipcontroller-gpu-client.json"
        deadline = time.monotonic() + 60
        while not url.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        s = fsdp_nb.Session.connect(str(url), n=n, activate=False)
        try:
            assert s.backend == "nccl"
            assert all(r.device.startswith("cuda") for r in s.ranks)
            assert s.all_reduce_check() == float(sum(range(n)))
        finally:
            s.shutdown()
    finally:
        cluster.stop_cluster_sync()


@pytest.mark.gpu
def test_demo_runs_on_the_gpu():
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_nb.cli", "demo", "--steps", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "backend=nccl" in out.stdout and "Warning" not in out.stderr
