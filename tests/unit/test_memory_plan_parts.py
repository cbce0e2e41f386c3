"""Memory plans without engines: the checks before any work, the what-ifs and their
costs, the report, and ``fsdp_nb.plan`` run for real in its planner process (a fake
process group and fake tensors: nothing allocated)."""

from __future__ import annotations

import os

import psutil
import pytest
import torch
from torch import nn

import fsdp_nb
from fsdp_nb.memory.memory_plan import PlanError
from fsdp_nb.memory.memory_report import MemoryPlan, WhatIf
from fsdp_nb.memory.rank_memory_plan import rank_kinds
from fsdp_nb.memory.what_if import check_what_ifs, cost, label, standard
from fsdp_nb.memory.wire_memory_plan import CATEGORIES, RankMemory, TensorSpec, categories
from fsdp_nb.models.wire_mesh_plan import plan_mesh
from fsdp_nb.models.wire_wrap_options import WrapOptions


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Tower(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


BATCH = torch.randn(32, 16, 64)


# -- checked before any work ---------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, words", [
    ({"world_size": 0}, ValueError, "world_size must be a positive int"),
    ({"world_size": 2, "device": "tpu"}, ValueError, "allowed: cpu, cuda"),
    ({"world_size": 2, "batch": [1, 2]}, TypeError, "batch[0] must be a tensor"),
    ({"world_size": 2, "what_if": [{"gpus": 4}]}, ValueError, "allowed: world_size, batch"),
    ({"world_size": 2, "what_if": "some"}, TypeError, "what_if must be 'auto'"),
    ({"world_size": 2, "what_if": {"mixed_precision": "fp8"}}, ValueError, "mixed_precision='fp8' is not allowed"),
    ({"world_size": 2, "step": lambda m: m}, TypeError, "takes 1 parameter"),
    ({"world_size": 2, "optimizer": "opt"}, TypeError, "optimizer must be an optimizer class"),
    ({"world_size": 2, "budget": -1}, ValueError, "budget must be a positive number"),
    ({"world_size": 2, "sharding": "zero3"}, ValueError, "allowed: full, grad_op"),
    ({"world_size": 2, "widht": 3}, TypeError, "neither a wrap option"),
])
def test_bad_input_is_refused_before_any_planning(kwargs, error, words):
    kwargs.setdefault("batch", BATCH)
    with pytest.raises(error) as info:
        fsdp_nb.plan(Tower, **kwargs)
    assert words in str(info.value)


def test_a_name_of_an_engine_global_cannot_be_planned():
    with pytest.raises(TypeError, match="measure_memory"):
        fsdp_nb.plan("model", world_size=2, batch=BATCH)


# -- pure parts -----------------------------------------------------------------------------


def test_categories_fold_every_tracker_category_and_keep_unknown_ones():
    detail = {"Sharded Param": 1, "Unsharded Param": 2, "Buffer": 3, "Sharded Grad": 4, "Unsharded Grad": 5,
              "OptState": 6, "Activation": 7, "Inputs": 8, "All Gather": 9, "Reduce Scatter": 10,
              "Temp": 11, "Something New": 12}
    got = categories(detail)
    assert list(got) == list(CATEGORIES)
    assert got == {"parameters": 6, "gradients": 9, "optimizer": 6, "activations": 15,
                   "communication": 19, "other": 23}
    assert sum(got.values()) == sum(detail.values())


def test_ranks_with_equal_shards_share_a_plan_and_uneven_ones_do_not():
    opts = WrapOptions()
    even = rank_kinds([64, 128], plan_mesh(4, "gloo", ["h"] * 4, opts), 4)
    assert even == {0: [0, 1, 2, 3]}
    uneven = rank_kinds([10], plan_mesh(4, "gloo", ["h"] * 4, opts), 4)  # rows 3, 3, 3, 1
    assert uneven == {0: [0, 1, 2], 3: [3]}
    hybrid = rank_kinds([9], plan_mesh(4, "gloo", ["a", "a", "b", "b"], WrapOptions(sharding="hybrid")), 4)
    assert hybrid == {0: [0, 2], 1: [1, 3]}  # rows 5, 4: shard index = rank % 2


def test_standard_what_ifs_follow_the_options():
    base = standard(WrapOptions(auto_wrap={Block}), 2, TensorSpec((8, 4), "float32"), fixed_world=False)
    assert {"mixed_precision": "bf16-mixed"} in base
    assert {"activation_checkpointing": frozenset({Block})} in base
    assert {"batch": 0.5} in base and {"world_size": 4} in base and {"cpu_offload": True} in base
    fixed = standard(WrapOptions(mixed_precision="bf16-mixed", sharding="grad_op"), 2,
                     TensorSpec((1, 4), "float32"), fixed_world=True)
    assert fixed == [{"reshard_after_forward": True}, {"cpu_offload": True}]
    assert check_what_ifs(None, WrapOptions(), 2, None, True) == []
    # a batch nested deeper than one level still has a first dimension to halve
    nested = {"x": [TensorSpec((8, 4), "float32"), TensorSpec((6, 2), "float32")], "mask": TensorSpec((), "bool")}
    assert {"batch": 0.5} in standard(WrapOptions(), 2, nested, fixed_world=True)
    assert {"batch": 0.5} not in standard(WrapOptions(), 2, {"x": [TensorSpec((1, 4), "float32")]}, True)


def test_costs_order_changes_from_free_to_dear():
    order = [cost({"mixed_precision": "bf16-mixed"}, 2), cost({"reshard_after_forward": True}, 2),
             cost({"activation_checkpointing": {Block}}, 2), cost({"batch": 0.5}, 2),
             cost({"cpu_offload": True}, 2), cost({"world_size": 4}, 2)]
    ranks = [r for r, _ in order]
    assert ranks[0] == 0 and all(a < b for a, b in zip(ranks, ranks[1:])), order
    assert "recompute" in order[2][1] and "transfers" in order[4][1] and "more GPUs" in order[5][1]
    both_rank, both_words = cost({"mixed_precision": "bf16-mixed", "cpu_offload": True}, 2)
    assert both_rank == order[4][0] and "bf16" in both_words and "transfers" in both_words


def test_undoing_a_costly_option_is_free_and_says_what_it_undoes():
    """Turning CPU offload or activation checkpointing off, or unwrapping, costs nothing
    in speed, and the words say so; only fewer ranks is "fewer GPUs"."""
    undo = {"cpu_offload": False, "activation_checkpointing": None, "auto_wrap": None, "batch": 2.0}
    for k, v in undo.items():
        rank, words = cost({k: v}, 2)
        assert rank == 0 and words.startswith("none:") and "GPUs" not in words, (k, words)
    assert "stay on the device" in cost({"cpu_offload": False}, 2)[1]
    assert "no forward runs again" in cost({"activation_checkpointing": None}, 2)[1]
    assert cost({"world_size": 1}, 2) == (0, "none: fewer GPUs")
    ifs = [WhatIf(c, label(c), 50, True, *cost(c, 2)) for c in ({"cpu_offload": False}, {"world_size": 1})]
    text = MemoryPlan([_rank(0, 200)], 2, "cpu", 100, what_ifs=ifs).to_text()
    assert "cpu_offload=False" in text and text.count("fewer GPUs") == 1


def _rank(r: int, peak: int) -> RankMemory:
    return RankMemory(rank=r, peak=peak, parameters=peak // 2, gradients=0, optimizer=peak // 4, activations=peak // 4,
                      communication=0, other=0, peak_unit="blocks.1", peak_phase="backward")


def test_the_report_says_whether_it_fits_and_the_cheapest_change_that_does():
    ifs = [WhatIf({"cpu_offload": True}, "cpu_offload=True", 60, True, 4, "transfers"),
           WhatIf({"batch": 0.5}, "batch=x0.5", 80, True, 3, "fewer samples"),
           WhatIf({"world_size": 4}, "world_size=4", 150, False, 5, "hardware")]
    p = MemoryPlan([_rank(0, 200), _rank(1, 120)], 2, "cpu", 100, what_ifs=ifs)
    assert p.peak == 200 and p.fits is False
    assert p.cheapest_fit is ifs[1]
    text = p.to_text()
    assert "does NOT fit" in text and "cheapest change that fits: batch=x0.5" in text
    assert "blocks.1 backward" in text and "what if" in text
    html = p._repr_html_()
    assert "fsdp-nb-memory-plan" in html and html.count("rank ") >= 2 and "activations" in html
    assert MemoryPlan([_rank(0, 50)], 1, "cpu", None).fits is None
    assert "no budget known" in MemoryPlan([_rank(0, 50)], 1, "cpu", None).verdict()


# -- planned for real, in the planner process ------------------------------------------------


def test_a_plan_runs_in_its_own_process_and_ranks_what_ifs():
    me = psutil.Process()
    before = me.memory_info().rss
    p = fsdp_nb.plan(Tower, world_size=4, batch=BATCH, optimizer=torch.optim.AdamW, auto_wrap={Block},
                     what_if="auto", budget=1 << 20)
    assert me.memory_info().rss - before < 300 * 2**20
    assert len(p.ranks) == 4 and [r.rank for r in p.ranks] == [0, 1, 2, 3]
    r = p.ranks[0]
    params = sum(x.numel() for x in Tower().parameters()) * 4
    # AdamW keeps two fp32 moments of this rank's quarter of the parameters (plus its step counters)
    assert params // 2 <= r.optimizer <= params // 2 + 4096
    assert r.activations >= BATCH.numel() * 4 * 4  # every block keeps its input and more
    assert r.peak == sum(r.by_category().values()) and r.peak_phase in ("forward", "backward", "optimizer")
    assert p.fits is False  # 1 MiB
    by = {w.label: w for w in p.what_ifs}
    assert by["activation_checkpointing={Block}"].peak < r.peak
    assert by["batch=x0.5"].peak < r.peak
    assert by["world_size=8"].peak < r.peak
    assert [w.cost_rank for w in p.what_ifs if w.fits is False] == sorted(
        w.cost_rank for w in p.what_ifs if w.fits is False)


class _Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        raise ValueError("the forward of _Broken fails")


def test_a_step_that_fails_is_named_in_the_error():
    with pytest.raises(PlanError, match="the forward of _Broken fails"):
        fsdp_nb.plan(_Broken, world_size=2, batch=torch.randn(2, 4))


class _Chatty(nn.Module):
    """Prints, from Python and from C, lines that look like the planner's answers."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        print('{"ranks": null, "error": "not the planner"}')
        os.write(1, b'{"bogus": 1}\n')

    def forward(self, x):
        print("{ a line from the step")
        return self.lin(x)


def test_what_a_model_prints_is_never_taken_for_the_planners_answer():
    p = fsdp_nb.plan(_Chatty, world_size=2, batch=torch.randn(2, 4))
    assert len(p.ranks) == 2 and p.peak > 0


def test_a_renamed_or_missing_field_of_a_sample_or_an_answer_fails_loudly():
    from fsdp_nb.errors import WireError
    from fsdp_nb.memory.wire_memory_plan import PlanAnswer
    from fsdp_nb.memory.wire_memory_sample import MemorySample
    from fsdp_nb.wire.decode import encode, loads

    s = MemorySample(rank=0, t=1.0, device="cpu", resident=5, resident_peak=6, budget=None, parameters=1)
    assert loads(MemorySample, encode(s)) == s
    with pytest.raises(WireError, match=r"MemorySample: unknown field\(s\) rss; missing field\(s\) resident"):
        loads(MemorySample, encode(s).replace(b'"resident"', b'"rss"'))
    with pytest.raises(WireError, match=r"MemorySample.budget: expected an int, got '12'"):
        loads(MemorySample, encode(s).replace(b'"budget": null', b'"budget": "12"'))
    answer = PlanAnswer(ranks=[_rank(0, 100)])
    assert loads(PlanAnswer, encode(answer)) == answer
    with pytest.raises(WireError, match=r"PlanAnswer.ranks\[0\]: missing field\(s\) peak_phase"):
        loads(PlanAnswer, encode(answer).replace(b'"peak_phase": "backward", ', b""))


def test_out_of_memory_is_recognised_and_its_allocation_read():
    from fsdp_nb.memory.out_of_memory import failed_allocation, is_out_of_memory

    cpu = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
           "you tried to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)")
    cuda = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of "
            "which 1.2 GiB is free.")
    assert is_out_of_memory("RuntimeError", cpu) and failed_allocation(cpu) == 2 << 30
    assert is_out_of_memory("OutOfMemoryError", cuda) and failed_allocation(cuda) == 2 << 30
    assert is_out_of_memory("MemoryError", "") and failed_allocation("") is None
    assert not is_out_of_memory("ValueError", "shapes do not match")


def test_the_out_of_memory_lines_name_rank_holdings_allocation_and_the_fix():
    from fsdp_nb.errors import RankFailure
    from fsdp_nb.memory.memory_report import cheapest_change
    from fsdp_nb.memory.out_of_memory import lines_for
    from fsdp_nb.memory.wire_memory_sample import MemorySample

    f = RankFailure(3, "OutOfMemoryError", "CUDA out of memory. Tried to allocate 512.00 MiB.", "")
    h = MemorySample(rank=3, t=0.0, device="cuda:3", resident=3 << 30, resident_peak=3 << 30, budget=16 << 30,
                     device_allocated=10 << 30, device_reserved=12 << 30, device_peak=11 << 30,
                     parameters=1 << 30, gradients=1 << 30, optimizer=2 << 30)
    lines = lines_for(f, h, 3 << 30, "cheapest change that fits, from the last plan: activation_checkpointing={Block}")
    assert lines[0] == ("rank 3 ran out of memory: it could not allocate 512.0 MiB while holding 10.0 GiB of "
                        "16.0 GiB (cuda:3):")
    assert "optimizer state 2.0 GiB" in lines[1] and "the rest (activations, temporaries) 6.0 GiB" in lines[1]
    assert "activation_checkpointing={Block}" in lines[2] and "3.0 GiB given back" in lines[3]
    assert "sess.plan" in lines_for(f, h, 0, cheapest_change(None, "the last plan"))[2]
    cpu = MemorySample(rank=0, t=0.0, device="cpu", resident=5 << 30, resident_peak=6 << 30, budget=None,
                       parameters=1 << 30, gradients=0, optimizer=0)
    assert lines_for(f, cpu, 0, "")[:2] == [
        "rank 3 ran out of memory: it could not allocate 512.0 MiB while holding 5.0 GiB (cpu):",
        "  parameters 1.0 GiB, gradients 0 B, optimizer state 0 B, the rest (activations, temporaries, "
        "the process itself) 4.0 GiB"]


def test_a_planner_past_its_timeout_is_stopped_with_a_clear_error():
    with pytest.raises(PlanError, match="took longer than timeout=0.5 s"):
        fsdp_nb.plan(Tower, world_size=2, batch=BATCH, timeout=0.5)


def test_a_cuda_plan_without_a_gpu_here_knows_no_budget_but_plans():
    if torch.cuda.is_available():
        pytest.skip("this process sees a GPU: its memory is the budget")
    p = fsdp_nb.plan(Tower, world_size=2, device="cuda", batch=BATCH)
    assert p.device == "cuda" and p.budget is None and p.fits is None and p.peak > 0
    assert any("CPU fake tensors" in n for n in p.notes) and any("CUDA context" in n for n in p.notes)
    assert "no budget known" in p.verdict()


def test_an_outsider_cannot_feed_the_planner_and_it_listens_on_nothing():
    """The planner unpickles its job from its stdin: a pipe only its parent holds. Another
    user (nobody) cannot open that pipe to write a job of their own, and the planner opens
    no socket anyone could reach."""
    import os
    import subprocess
    import threading

    from fsdp_nb.runtime.cluster import wait_until

    if os.getuid() != 0:
        pytest.skip("becoming another user needs root")
    me = psutil.Process()
    done = threading.Event()
    t = threading.Thread(target=lambda: (fsdp_nb.plan(Tower, world_size=8, batch=torch.randn(256, 16, 64),
                                                      optimizer=torch.optim.AdamW, what_if="auto"), done.set()))
    t.start()

    def planner():
        return next((p for p in me.children() if "fsdp_nb.memory.rank_memory_plan" in " ".join(p.cmdline())), None)

    assert wait_until(lambda: planner() is not None, 30)
    child = planner()
    sockets = child.net_connections(kind="all")
    attack = 'if (echo job > "$1") 2>/dev/null; then echo WROTE; else echo DENIED; fi'

    def drop() -> None:
        os.setgid(65534)
        os.setuid(65534)

    got = subprocess.run(["/bin/sh", "-c", attack, "sh", f"/proc/{child.pid}/fd/0"], preexec_fn=drop,
                         capture_output=True, text=True, timeout=30)
    attacked_while_running = child.is_running()  # its /proc entry existed: a refusal, not a miss
    t.join(120)
    assert done.is_set()
    assert sockets == [] and attacked_while_running
    assert got.stdout.strip() == "DENIED", got
