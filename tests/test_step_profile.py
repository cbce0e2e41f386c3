"""``sess.profile(steps=N)`` on real gloo ranks: torch.profiler on every rank for the next N
optimizer steps, one merged Chrome trace, each rank's time split into parts."""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat
import tempfile

import pytest
from helpers import forget_models
from torch import nn

TRAIN = """
import time
import torch
prof_opt = torch.optim.AdamW(prof_net.parameters(), lr=1e-3)
prof_x = torch.randn(64, 256)

def prof_steps(n, slow_rank=None):
    for _ in range(n):
        if rank == slow_rank:
            time.sleep(0.06)  # its data step: no operator, no collective
        prof_net(prof_x).sum().backward()
        prof_opt.step()
        prof_opt.zero_grad()
"""


def _capture_left():
    from fsdp_nb.engine.registry import part
    from fsdp_nb.steps.rank_step_profile import Profiling

    return part(Profiling).capture


def _rank_traces() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), "fsdp_nb-rank-trace-*"))


def test_a_profile_merges_every_ranks_steps_into_one_private_trace_split_into_parts(sess, tmp_path):
    sess.wrap(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]), name="prof_net", auto_wrap={nn.Linear})
    sess.execute(TRAIN)
    try:
        with pytest.raises(ValueError, match="steps must be an int from 1 to 100"):
            sess.profile(steps=0)
        before = _rank_traces()
        (tmp_path / "steps.json").write_text("left world-readable")  # a file already there, 0644
        os.chmod(tmp_path / "steps.json", 0o644)
        prof = sess.profile(steps=3, path=str(tmp_path / "steps.json"))
        with pytest.raises(RuntimeError, match=r"3 steps have not all run \(rank 0: 0, rank 1: 0 run so far\)"):
            _ = prof.trace
        sess.execute("prof_steps(4, slow_rank=1)")
        path = prof.trace
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        trace = json.loads(open(path).read())
        procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
        assert sorted(p for p in procs if isinstance(p, int)) == [0, 1] and procs[1].startswith("rank 1 (")
        steps = sorted((e["pid"], e["name"]) for e in trace["traceEvents"] if e.get("cat") == "fsdp_nb")
        assert steps == [(r, f"step {k}") for r in (0, 1) for k in (1, 2, 3)]
        ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op" and e.get("pid") in (0, 1)]
        assert {e["pid"] for e in ops} == {0, 1} and any("_reduce_scatter_base_" in e["name"] for e in ops)
        p0, p1 = prof.parts
        for p in (p0, p1):
            assert p.compute > 0 and p.device == "cpu"
            assert p.compute + p.exposed + p.idle == pytest.approx(p.step, rel=1e-6)
        # rank 1 sleeps 60 ms a step outside any operator: its idle; rank 0 waits for it in
        # the collectives: its exposed communication
        assert p1.idle - p0.idle > 0.01 and p0.exposed > p1.exposed
        text = prof.to_text()
        assert "exposed comm ms" in text and text.count("cpu trace") == 2
        svg = prof.picture()
        assert svg.startswith("<svg") and "rank 0" in svg and "rank 1" in svg and "<rect" in svg
        assert "Profiled steps" in prof._repr_html_()
        # nothing stays on the ranks: the traces left with the read, their files were removed
        assert sess.run(_capture_left) == [None] * 2
        assert _rank_traces() == before
        again = sess.profile(steps=1)  # a second profile, in a fresh private folder of its own
        sess.execute("prof_steps(1)")
        try:
            assert stat.S_IMODE(os.stat(os.path.dirname(again.trace)).st_mode) == 0o700
        finally:
            shutil.rmtree(os.path.dirname(again.trace))
    finally:
        forget_models(sess, "prof_net", optimizers=("prof_opt", "prof_x", "prof_steps"))
