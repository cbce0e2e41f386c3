"""The in-memory autosave's pure logic: the buddy map, which generation a restart can take
from memory, and a state packed into one flat buffer and written back."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from fsdp_nb.autosave.memory_copies import MemoryRestore, buddy_map, cover
from fsdp_nb.autosave.wire_autosave import HeldCopies
from fsdp_nb.formats.packed_state import LEAF, Leaf, fill, leaf_bytes, split, stage, view
from fsdp_nb.recovery.restart_report import RestorePlan


def test_on_one_host_each_ranks_buddy_is_the_next_rank():
    assert buddy_map(["vm"] * 4) == (1, 2, 3, 0)
    assert buddy_map(["vm"] * 2) == (1, 0)
    assert buddy_map(["vm"]) == (0,)


def test_on_several_hosts_every_buddy_is_on_another_host():
    assert buddy_map(["a", "a", "b", "b"]) == (2, 3, 0, 1)
    hosts = ["a", "a", "b", "b", "c", "c"]
    m = buddy_map(hosts)
    assert all(hosts[r] != hosts[b] for r, b in enumerate(m))


def test_uneven_hosts_put_as_many_buddies_across_as_any_stride_can():
    hosts = ["a", "a", "a", "b"]
    m = buddy_map(hosts)
    across = sum(hosts[r] != hosts[b] for r, b in enumerate(m))
    best = max(sum(hosts[r] != hosts[(r + s) % 4] for r in range(4)) for s in range(1, 4))
    assert across == best


def test_the_map_is_a_permutation_with_no_rank_its_own_buddy():
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(2, 12)
        hosts = [rng.choice("abc") for _ in range(n)]
        m = buddy_map(hosts)
        assert sorted(m) == list(range(n)) and all(b != r for r, b in enumerate(m))


def _held(own, held=None):
    return HeldCopies(own=tuple(own), held={w: tuple(s) for w, s in (held or {}).items()})


def test_every_rank_alive_rolls_back_to_the_newest_step_all_hold():
    said = {r: _held([5, 6], {(r - 1) % 4: [5, 6]}) for r in range(4)}
    assert cover(4, said, (1, 2, 3, 0)) == MemoryRestore(6, {})


def test_a_dead_ranks_state_comes_from_its_buddy():
    said = {0: _held([5, 6], {3: [5, 6]}), 1: _held([5, 6], {0: [5, 6]}), 3: _held([5, 6], {2: [5, 6]}),
            2: _held([])}  # rank 2: a new engine, holding nothing; its buddy is rank 3
    got = cover(4, said, (1, 2, 3, 0))
    assert got.step == 6 and got.sources == {2: 3}
    assert "rank 2 from rank 3's memory" in got.what()


def test_a_copy_cut_short_leaves_the_step_before_it():
    # rank 2 died while its copy of step 7 went to rank 3: rank 3 holds 6 only
    said = {0: _held([6, 7], {3: [6, 7]}), 1: _held([6, 7], {0: [6, 7]}), 3: _held([6, 7], {2: [6]})}
    got = cover(4, said, (1, 2, 3, 0))
    assert got.step == 6 and got.sources == {2: 3}


def test_a_rank_and_its_buddy_dead_together_is_said_by_name():
    said = {0: _held([6], {3: [6]}), 3: _held([6], {2: [6]})}  # ranks 1 and 2 dead; 1's buddy is 2
    got = cover(4, said, (1, 2, 3, 0))
    assert got.step is None
    assert "rank 1 (its buddy: rank 2)" in got.why and "both died" in got.why


def test_nothing_copied_yet_is_said_so():
    got = cover(2, {0: _held([]), 1: _held([])}, (1, 0))
    assert got.step is None and "none was taken" in got.why


def test_the_restart_report_says_where_the_state_came_from():
    mem = RestorePlan("memory", "m", "opt", ("loader",), True, 6, memory=MemoryRestore(6, {2: 3}))
    assert "step 6 from memory (rank 2 from rank 3's memory" in mem.what()
    assert "nothing was read from disk" in mem.what()
    disk = RestorePlan("/ck/step-4", "m", "opt", (), True, 4, fallback="rank 1 and its buddy died")
    assert disk.what().endswith("(step 4); from disk, because rank 1 and its buddy died")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-rank gloo group in this process, and its mesh, for DTensors."""
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _tree(mesh, seed):
    from torch.distributed.tensor import DTensor, Shard

    g = torch.Generator().manual_seed(seed)

    def sharded(*shape, dtype=torch.float32):
        return DTensor.from_local(torch.randn(*shape, generator=g).to(dtype), mesh, [Shard(0)])

    return {"model": {"w": sharded(4, 3), "b": sharded(5, dtype=torch.bfloat16), "buf": torch.ones(2) * seed},
            "optim": {"state": {"w": {"step": torch.tensor(float(seed)), "exp_avg": sharded(4, 3)}},
                      "param_groups": [{"lr": 0.1 * seed, "params": ["w", "b"]}]}}


def test_a_packed_state_goes_back_bit_for_bit_into_the_live_tensors(one_rank):
    saved = _tree(one_rank, 1)
    rest, tensors, leaves = split(saved)
    assert rest["model"]["w"] == (LEAF, 0) and rest["optim"]["param_groups"][0]["lr"] == pytest.approx(0.1)
    flat = torch.empty(leaf_bytes(leaves), dtype=torch.uint8)
    stage(tensors, leaves, flat)
    assert all(leaf.offset % 64 == 0 for leaf in leaves)
    want = {k: v.to_local().clone() for k, v in saved["model"].items() if k != "buf"}
    want["exp_avg"] = saved["optim"]["state"]["w"]["exp_avg"].to_local().clone()
    saved["model"]["w"].to_local().add_(1.0)  # what the next step does after the copy: not in it
    live = _tree(one_rank, 2)
    got = fill(live, rest, flat, leaves)
    assert got["model"]["w"] is live["model"]["w"]  # written in place
    assert torch.equal(live["model"]["w"].to_local(), want["w"])
    assert torch.equal(live["model"]["b"].to_local(), want["b"]) and live["model"]["b"].dtype == torch.bfloat16
    assert torch.equal(got["model"]["buf"], torch.ones(2)) and float(got["optim"]["state"]["w"]["step"]) == 1.0
    assert torch.equal(live["optim"]["state"]["w"]["exp_avg"].to_local(), want["exp_avg"])  # the saved moments
    assert torch.equal(view(flat, leaves[2]), want["exp_avg"])


def test_an_optimizers_step_counts_travel_as_leaves_and_a_models_buffers_are_copied_at_once(one_rank):
    """The optimizer's plain tensors (its step counts: only its next step changes them,
    and that step waits for the staging) are staged with the shards; a model's plain
    buffers (its next forward may change them) are copied as the copy is taken."""
    saved = _tree(one_rank, 3)
    rest, tensors, leaves = split(saved, staged=("optim",))
    step_leaf = rest["optim"]["state"]["w"]["step"]
    assert step_leaf[0] == LEAF and not leaves[step_leaf[1]].sharded
    assert torch.equal(rest["model"]["buf"], torch.ones(2) * 3) and rest["model"]["buf"] is not saved["model"]["buf"]
    flat = torch.empty(leaf_bytes(leaves), dtype=torch.uint8)
    stage(tensors, leaves, flat)
    saved["optim"]["state"]["w"]["step"].add_(1)  # the next step: not in the copy
    live = _tree(one_rank, 4)
    live_step = live["optim"]["state"]["w"]["step"]
    got = fill(live, rest, flat, leaves)
    assert got["optim"]["state"]["w"]["step"] is live_step and float(live_step) == 3.0  # written in place
    live["optim"]["state"]["w"]["step"] = torch.tensor([0.0, 0.0])
    with pytest.raises(ValueError, match=r"optim\.state\.w\.step is \(2,\)"):
        fill(live, rest, flat, leaves, write=False)


def test_a_copy_that_does_not_fit_the_live_model_is_refused_by_path(one_rank):
    from torch.distributed.tensor import DTensor, Shard

    rest, tensors, leaves = split(_tree(one_rank, 1))
    flat = torch.empty(leaf_bytes(leaves), dtype=torch.uint8)
    stage(tensors, leaves, flat)
    live = _tree(one_rank, 2)
    live["model"]["w"] = DTensor.from_local(torch.zeros(2, 3), one_rank, [Shard(0)])
    with pytest.raises(ValueError, match=r"model\.w is \(2, 3\) torch.float32 on this rank and was \(4, 3\)"):
        fill(live, rest, flat, leaves, "rank 0's copy")
    live["model"]["w"] = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"model\.w was a sharded tensor in the copy and is Tensor now"):
        fill(live, rest, flat, leaves)


def test_the_memory_view_counts_the_copies_apart_on_a_cpu_rank_and_beside_a_gpus():
    from fsdp_nb.memory.wire_memory_sample import MemorySample

    cpu = MemorySample(rank=0, t=0.0, device="cpu", resident=1000, resident_peak=1000, budget=None, parameters=100,
                       gradients=100, optimizer=200, copies=400)
    assert cpu.kinds == {"parameters": 100, "gradients": 100, "optimizer": 200, "copies": 400, "rest": 200}
    gpu = MemorySample(rank=0, t=0.0, device="cuda:0", resident=5000, resident_peak=5000, budget=None,
                       device_allocated=1000, parameters=100, gradients=100, optimizer=200, copies=400)
    assert "copies" not in gpu.kinds and gpu.rest == 600  # host memory: not part of what the GPU holds


def test_a_plan_says_what_the_in_memory_autosave_would_keep():
    from fsdp_nb.memory.memory_report import MemoryPlan
    from fsdp_nb.memory.wire_memory_plan import RankMemory

    def rank(r, state):
        return RankMemory(rank=r, peak=1000, parameters=400, gradients=100, optimizer=300, activations=200,
                          communication=0, other=0, peak_unit="", peak_phase="backward", state=state)

    plan = MemoryPlan([rank(0, 300), rank(1, 200)], 2, "cpu", None)
    assert plan.copies == [2 * 300 + 2 * 300, 2 * 200 + 2 * 300]
    assert "would keep up to 1.2 KiB per rank in the rank's share of host memory" in plan.to_text()
    assert MemoryPlan([rank(0, 0)], 1, "cuda", None).copies_line() == ""


@pytest.mark.parametrize("values", [(0, 8, "torch.float32", (2,)), (0, "8", "torch.float32", (2,), True),
                                    (0, 8, "torch.float32", [2, None], True), (0, 8, 7, (2,), True), "leaf"])
def test_a_copys_leaf_that_is_not_one_is_refused_by_name(values):
    """A peer's copy carries its leaves as plain values: anything else is a ValueError
    naming them, never a TypeError from deep inside."""
    with pytest.raises(ValueError, match="is not \\(offset, bytes, dtype, shape, sharded\\)"):
        Leaf.parse(values)
    assert Leaf.parse((64, 8, "torch.float32", [2], True)) == Leaf(64, 8, "torch.float32", (2,), True)


def test_a_transfer_receives_only_within_a_limit():
    from fsdp_nb.autosave.rank_copy_transfer import transfer

    with pytest.raises(ValueError, match="only within a limit= of bytes"):
        transfer(None, [], 1, limit=None)
