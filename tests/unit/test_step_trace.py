"""Profiled steps split by the union of intervals, and the ranks' traces merged
(``steps.step_trace``): synthetic traces whose parts are known, no engines."""

from __future__ import annotations

import pytest

from fsdp_nb.steps.step_trace import lanes, merge_traces, step_parts, union

MAIN, GLOO = 100, 200


def _x(name, ts, dur, tid=MAIN, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": float(ts), "dur": float(dur), "tid": tid, "pid": 7, "cat": cat}


def test_union_merges_overlaps_and_drops_empty_intervals():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]


def test_a_cpu_step_is_split_so_the_parts_add_up_and_a_wait_is_not_compute():
    events = [
        _x("aten::mm", 0, 10),                              # the training thread computes 0-10...
        _x("FSDP::post_backward_rs_wait (0)", 4, 2, cat="user_annotation"),  # ...but waits 4-6
        _x("gloo:reduce_scatter", 3, 5, tid=GLOO, cat="user_annotation"),     # gloo works 3-8
        _x("aten::add", 100, 1),                            # outside the step: not counted
        {"ph": "M", "name": "thread_name", "tid": MAIN, "pid": 7},
    ]
    compute, comm = lanes(events, (0.0, 12.0), MAIN)
    assert compute == [(0, 4), (6, 10)] and comm == [(3, 8)]
    p = step_parts(0, events, [(0.0, 12.0)], MAIN)
    us = 1e-6
    assert p.step == pytest.approx(12 * us) and p.compute == pytest.approx(8 * us)
    assert p.overlap == pytest.approx(3 * us) and p.exposed == pytest.approx(2 * us)
    assert p.idle == pytest.approx(2 * us) and p.device == "cpu"
    assert p.compute + p.exposed + p.idle == pytest.approx(p.step)


def test_a_gpu_step_is_split_from_device_kernels_and_steps_are_averaged():
    events = [
        _x("aten::mm", 0, 20),  # host work: not the device's compute
        _x("sm90_gemm", 1, 4, tid=7, cat="kernel"),
        _x("ncclDevKernel_AllGather_RING_LL", 3, 4, tid=9, cat="kernel"),
        _x("sm90_gemm", 11, 4, tid=7, cat="kernel"),
        _x("ncclDevKernel_ReduceScatter_RING_LL", 15, 2, tid=9, cat="kernel"),
    ]
    p = step_parts(1, events, [(0.0, 10.0), (10.0, 20.0)], MAIN)
    us = 1e-6
    # step 1: compute 1-5, comm 3-7 (overlap 2, exposed 2); step 2: compute 11-15, comm 15-17
    assert p.device == "gpu" and p.step == pytest.approx(10 * us) and p.compute == pytest.approx(4 * us)
    assert p.overlap == pytest.approx(1 * us) and p.exposed == pytest.approx(2 * us)
    assert p.idle == pytest.approx(4 * us)


def test_merged_trace_has_one_process_per_rank_on_one_clock_with_its_steps():
    ranks = [(r, "node1", [_x("aten::mm", 1000 + r, 5), {"ph": "M", "name": "process_name", "pid": 7}],
              [(1000.0 + r, 1010.0 + r)]) for r in (0, 1)]
    merged = merge_traces(ranks)
    ev = merged["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e.get("name") == "process_name"}
    assert names == {0: "rank 0 (node1)", 1: "rank 1 (node1)"}  # the ranks' own process names dropped
    mm = sorted((e["pid"], e["ts"]) for e in ev if e["name"] == "aten::mm")
    assert mm == [(0, 0.0), (1, 1.0)]  # from the first step's start, one clock
    steps = [(e["pid"], e["name"], e["dur"]) for e in ev if e.get("cat") == "fsdp_nb"]
    assert steps == [(0, "step 1", 10.0), (1, "step 1", 10.0)]
