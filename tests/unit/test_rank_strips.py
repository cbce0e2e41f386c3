"""The memory, step and status views at 64 ranks (a strip, not 64 rows), throughput and
MFU from the ranks' batches, the logged curves, and ``fsdp_nb.log`` itself: no engines."""

from __future__ import annotations

import math
import re

import pytest
import torch

from fsdp_nb.engine.registry import part
from fsdp_nb.memory.memory_widget import MemorySnapshot
from fsdp_nb.memory.wire_memory_sample import MemorySample
from fsdp_nb.recovery.status import RankStatus, SessionStatus
from fsdp_nb.steps import rank_logged as logged
from fsdp_nb.steps.step_rates import curves, peak_flops, step_rates
from fsdp_nb.steps.steps_view import StepsView
from fsdp_nb.steps.wire_step_times import RankSteps

N = 64


def _steps(r, n=5, compute=0.01, other=0.0, collective=0.01, samples=8, tokens=0, logged_=None, **kw):
    return RankSteps(rank=r, index=list(range(n)), seconds=[compute + other + collective] * n, compute=[compute] * n,
                     collective=[collective] * n, other=[other] * n, device=kw.pop("device", "cpu"),
                     samples=[samples] * n, tokens=[tokens] * n, logged=logged_ or {}, **kw)


def _cells(html: str) -> list[str]:
    return re.findall(r"class='fsdp-nb-strip-cell' data-rank='(\d+)'", html)


def test_the_step_view_at_64_ranks_is_a_strip_that_names_the_straggler():
    got = [_steps(r, other=0.02 if r == 37 else 0.0, collective=0.03 if r != 37 else 0.01) for r in range(N)]
    view = StepsView(ctx=None, window=5)  # type: ignore[arg-type]  # apply needs no session
    view.apply(got)
    assert [(s.rank, s.part) for s in view.stragglers] == [(37, "other")]
    text = view.to_text()
    assert len(text.splitlines()) <= 8 and "straggler: rank 37" in text and "ranks   0-31" in text
    html = view.to_html()
    assert _cells(html) == [str(r) for r in range(N)] and "<tr>" not in html
    assert "rank 37: step 40.0 ms" in html
    small = StepsView(ctx=None, window=5)  # type: ignore[arg-type]
    small.apply(got[:4])
    assert "<tr>" in small.to_html() and not _cells(small.to_html())  # a table at few ranks


def test_the_memory_view_at_64_ranks_is_a_strip_with_the_fullest_named():
    gib = 1 << 30
    latest = tuple(MemorySample(rank=r, t=0.0, device="cpu", resident=(2 + (r == 9) * 5) * gib,
                                resident_peak=8 * gib, budget=8 * gib) for r in range(N))
    snap = MemorySnapshot(latest=latest, history=tuple(() for _ in range(N)))
    text = snap.to_text()
    assert len(text.splitlines()) == 4 and "fullest: rank 9 88%" in text
    html = snap.to_html()
    assert _cells(html) == [str(r) for r in range(N)] and "rank 9 (cpu): 7.0 GiB of 8.0 GiB (88%)" in html
    assert html.count("<tr") == 0


def test_the_status_view_at_64_ranks_lists_only_the_ranks_that_stand_out():
    ranks = tuple(RankStatus(rank=r, engine_id=r, host=f"node{r // 8}", pid=1000 + r, device=f"cuda:{r % 8}",
                             state="dead" if r == 12 else "busy", stack="File x.py, line 3 in step\n" if r != 12 else None)
                  for r in range(N))
    st = SessionStatus(state="degraded", backend="nccl", ranks=ranks)
    text = st.to_text()
    assert "63 busy (b), 1 dead (x)" in text and "bbbbbbbbbbbbx" in text
    table = [line for line in text.splitlines() if line.strip().startswith("12 ")]
    assert len(table) == 1 and "dead" in table[0]
    assert text.count("--- ranks 0-11,13-63 at") == 1  # one stack for the ranks stopped in one place
    html = st.to_html()
    assert _cells(html) == [str(r) for r in range(N)] and html.count("<tr>") == 2  # header and rank 12


def test_throughput_and_mfu_from_the_ranks_batches():
    cpu = step_rates([_steps(r, samples=8) for r in range(2)])  # 8 samples a 20 ms step, on each rank
    assert cpu.samples_per_s == pytest.approx(2 * 8 / 0.02) and cpu.tokens_per_s is None and cpu.mfu is None
    assert "800.0 samples/s" in str(cpu)
    gpu = [_steps(r, samples=4, tokens=4 * 2048, parameters=100_000_000, device="cuda",
                  device_name="NVIDIA H100 80GB HBM3") for r in range(8)]
    rates = step_rates(gpu)
    assert rates.tokens_per_s == pytest.approx(3_276_800)  # 8 ranks x 8192 tokens a 20 ms step
    # 6 x 1e8 parameters x 3,276,800 tokens/s = 1.966e15 FLOP/s, over 8 x 989e12
    assert rates.mfu == pytest.approx(0.24849, rel=1e-4) and "MFU 24.8%" in str(rates)
    gpu.append(_steps(8, n=0, device="cuda", device_name="NVIDIA H100 80GB HBM3"))  # a rank with no step yet
    assert step_rates(gpu).mfu == pytest.approx(0.24849, rel=1e-4)
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("Tesla K80") is None
    assert peak_flops("NVIDIA L40") == 181e12 and peak_flops("NVIDIA L4") == 121e12  # whole words: L4 is not L40
    assert step_rates([_steps(0, samples=0)]).samples_per_s is None


def test_curves_are_the_ranks_mean_lined_up_from_the_newest():
    got = [_steps(0, logged_={"loss": [9.0, 4.0, 2.0]}), _steps(1, logged_={"loss": [6.0, 4.0, math.nan]}),
           _steps(2, logged_={"lr": [0.1]})]
    c = curves(got)
    assert c["lr"] == [0.1]
    assert c["loss"][0] == pytest.approx(7.5) and c["loss"][1] == pytest.approx(4.0)
    assert c["loss"][2] == pytest.approx(2.0)  # rank 1's nan left out of that point
    view = StepsView(ctx=None, window=5)  # type: ignore[arg-type]
    view.apply(got)
    assert "loss: 2 (last of 3)" in view.to_text() and "<polyline" in view.to_html()


def test_log_keeps_numbers_and_one_element_tensors_and_refuses_the_rest():
    logged.clear()
    before = logged.count()
    logged.log(loss=torch.tensor([2.5], requires_grad=True) * 1, lr=1e-3, step=3)
    with pytest.raises(TypeError, match=r"grad= must be a number or a one-element tensor, got Tensor of 4"):
        logged.log(loss=1.0, grad=torch.ones(4))
    with pytest.raises(TypeError, match="name= must be a number"):
        logged.log(name="x")
    assert logged.count() == before + 1  # a refused call keeps nothing, not even its good values
    assert logged.latest() == {"loss": [2.5], "lr": [1e-3], "step": [3.0]}
    assert all(isinstance(v, float) for v in part(logged.Logged).values["loss"])  # read once, kept as a number
    for i in range(logged.KEEP + 5):
        logged.log(lr=float(i))
    assert len(logged.latest()["lr"]) == logged.KEEP and logged.latest()["lr"][-1] == logged.KEEP + 4
    logged.clear()
    assert logged.latest() == {}


def test_a_view_takes_its_own_window_of_what_a_rank_keeps():
    """A rank keeps the largest window any view asked for; a view of 5 reads the last 5."""
    got = [RankSteps(rank=r, index=list(range(20)), seconds=[1.0] * 15 + [0.1] * 5, compute=[0.5] * 15 + [0.05] * 5,
                     collective=[0.25] * 15 + [0.025] * 5, other=[0.25] * 15 + [0.025] * 5, device="cpu")
           for r in range(2)]
    view = StepsView(ctx=None, window=5)  # type: ignore[arg-type]
    view.apply(got)
    assert view.ranks[0].steps == 5 and view.ranks[0].step == pytest.approx(0.1)
