"""Every private torch name fsdp_nb uses, called on the torch installed: CI runs this on
the lowest supported torch and on the newest, so a rename fails here, in one place.
One process, a one-rank gloo group, no engines."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import sys

import pytest
import torch
import torch.distributed as dist

from fsdp_nb import torch_compat as tc
from fsdp_nb import torch_compat_planning as tcp


def test_the_installed_torch_is_in_the_range_pyproject_declares():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml")) as f:
        pin = re.search(r'"torch>=(\d+)\.(\d+)', f.read())
    assert pin, "pyproject.toml declares no lower bound for torch"
    installed = tuple(int(x) for x in torch.__version__.split("+", 1)[0].split(".")[:2])
    assert installed >= (int(pin[1]), int(pin[2])), (torch.__version__, pin[0])


def test_groups_their_counts_and_backends(group):
    assert tc.default_group() is group and group in tc.process_groups()
    store = tc.default_store()  # the store the group formed on: keys beside the group
    store.set("fsdp_nb/test", "1")
    assert store.get("fsdp_nb/test") == b"1" and store.delete_key("fsdp_nb/test")
    before = tc.group_sequence_numbers(group)
    assert list(before) == ["gloo"]
    dist.all_reduce(torch.ones(2))
    assert tc.group_sequence_numbers(group)["gloo"] == before["gloo"] + 1
    assert type(tc.group_backend(group, "cpu")).__name__ == "ProcessGroupGloo"
    assert tc.resolve_process_group(group.group_name) is group


def test_a_mesh_names_its_groups_and_can_be_pointed_at_others(group):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    names = tc.mesh_group_names(mesh)
    assert names and all(tc.resolve_process_group(n) is not None for n in names)
    sub = dist.new_group([0])
    tc.set_mesh_group_names(mesh, [sub.group_name])
    assert tc.mesh_group_names(mesh) == [sub.group_name] and mesh.get_group(0) is sub


def test_the_flight_recorder_dump_is_json(group):
    dump = tc.flight_recorder(collectives=True)
    assert dump is not None and "version" in dump and "pg_status" in dump, sorted(dump)


RECORDED = """
import json, os, sys, time, torch, torch.distributed as dist
from fsdp_nb import torch_compat as tc
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
for _ in range(2):  # the group formed twice, as a recovery does: the second takes the first's name
    t0 = time.time_ns()
    dist.all_reduce(torch.ones(1))
    dist.barrier()
    until = time.monotonic() + 10  # gloo's worker marks a record retired just after the caller returns
    while True:
        dump = tc.flight_recorder(collectives=True)
        ended = [e["retired"] for e in dump["entries"] if e["profiling_name"].endswith("all_reduce")]
        if all(ended) or time.monotonic() > until:
            break
        time.sleep(0.01)
    print(json.dumps({"t0": t0, "t1": time.time_ns(), "status": sorted(dump["pg_status"]),
                      "entries": dump["entries"]}))
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1] + str(len(dump["pg_status"])), 1), rank=0,
                            world_size=1)
dist.destroy_process_group()
"""


def test_the_flight_recorders_records_say_their_group_and_when_they_ended(tmp_path):
    """What the hang watch reads of a record (``rank_hang_watch._recorded``), as this torch
    writes it: ``pg_id``, the key of the groups' status, which a group formed again does
    not reuse though its name is reused; ``retired`` once the collective ended; when it
    was made, in Unix ns. Run in a process of its own with the recorder on."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RECORDED, str(tmp_path / "store")], check=True, text=True,
                         capture_output=True, env={**os.environ, "TORCH_FR_BUFFER_SIZE": "100"}, timeout=120)
    first, second = (json.loads(line) for line in out.stdout.splitlines())
    for run in (first, second):
        ops = [e for e in run["entries"] if e["profiling_name"].endswith("all_reduce")]
        assert ops and all(e["retired"] is True for e in ops), ops  # ended, and said so
        assert run["t0"] <= ops[-1]["time_created_ns"] <= run["t1"], (run["t0"], ops[-1], run["t1"])
    new = [e for e in second["entries"] if e["time_created_ns"] >= second["t0"]]
    assert {e["process_group"][0] for e in new} == {"0"}  # the new default group, named as the old
    newest = [max(run["status"], key=int) for run in (first, second)]
    assert {str(e["pg_id"]) for e in new} == {newest[1]} != {newest[0]}  # keyed anew


def test_fsdp_mesh_infos_local_tensors_and_shapes(group):
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    net = torch.nn.Linear(4, 3)
    fully_shard(net, mesh=mesh)

    def instances(*classes):
        return [o for o in gc.get_objects() if isinstance(o, classes)]

    assert tc.repoint_fsdp_groups(instances) >= 1  # this model's mesh info, at least
    net(torch.ones(2, 4)).sum().backward()  # its collectives run on the group it points at
    w = net.weight
    assert isinstance(w, DTensor)
    tc.local_tensor(w).fill_(2.0)  # the shard itself, not a copy
    assert torch.equal(w.full_tensor(), torch.full((3, 4), 2.0))
    assert tc.local_tensor(torch.ones(1)).shape == (1,)
    shape, offset = tc.compute_local_shape_and_global_offset((3, 4), mesh, [Shard(0)])
    assert tuple(shape) == (3, 4) and tuple(offset) == (0, 0)


def test_an_fsdp_iteration_a_failure_cut_short_is_reset(group):
    """A forward that raised half-way leaves its unit unsharded (plain parameters) and an
    iteration under way; the reset shards every unit again, keeps ``.grad`` as plain torch
    does (torch 2.15's own reset clears it), and the next step runs."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (1,))
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for unit in net:
        fully_shard(unit, mesh=mesh)
    fully_shard(net, mesh=mesh)
    net(torch.ones(2, 4)).sum().backward()
    before = {n: p.grad.clone() for n, p in net.named_parameters()}  # the first backward's, every unit's

    def boom(module, args):
        raise RuntimeError("the forward failed here")

    handle = net[1].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="failed here"):
        net(torch.ones(2, 4))
    handle.remove()
    assert not isinstance(net[1].weight, DTensor)  # left unsharded by the failure

    def instances(cls):
        return [o for o in gc.get_objects() if isinstance(o, cls)]

    roots = [r for r in tc.fsdp_roots(instances) if any(r is m for m in net.modules())]
    assert len(roots) == 1 and roots[0] is net
    tc.reset_fsdp_iteration(roots[0])
    assert all(isinstance(p, DTensor) for p in net.parameters()) and len(before) == 6
    assert all(torch.equal(net.get_parameter(n).grad, g) for n, g in before.items())  # .grad stays, on every torch
    net.zero_grad()
    net(torch.ones(2, 4)).sum().backward()
    assert all(isinstance(p.grad, DTensor) and p.grad.abs().sum() > 0 for p in net[2].parameters())


@pytest.mark.parametrize("reduce_dtype", [None, torch.float64], ids=["in .grad", "upcast"])
def test_unsynced_gradients_are_dropped_where_zero_grad_does_not_reach(group, reduce_dtype):
    """Under ``set_requires_gradient_sync(False)`` FSDP2 keeps each backward's gradients
    unsharded in its units (in the unsharded parameter's ``.grad``, upcast there to a reduce
    dtype from torch 2.15, apart before), not in ``.grad``: ``zero_grad`` leaves them and the next synced backward
    adds them in. After the drop, that backward gives a fresh model's gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (1,))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(net[0], mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    x = torch.ones(2, 4)
    net(x).sum().backward()
    clean = [p.grad.full_tensor().clone() for p in net.parameters()]
    net.zero_grad()
    net.set_requires_gradient_sync(False)
    net(x).sum().backward()  # a micro-batch of a step a failure then cut short
    net.zero_grad()
    assert tc.drop_unsynced_gradients(net) == 4 and tc.drop_unsynced_gradients(net) == 0
    groups = [g for m in (net, net[0]) for g in tc._param_groups(m._get_fsdp_state())]
    assert not any(getattr(g, "_post_backward_pending", False) for g in groups)  # torch 2.15 marks the void reduction
    net.set_requires_gradient_sync(True)
    net(x).sum().backward()
    assert all(torch.equal(p.grad.full_tensor(), c) for p, c in zip(net.parameters(), clean, strict=True))


def test_hsdps_partly_reduced_gradients_are_dropped_too(group):
    """Under HSDP, ``set_requires_all_reduce(False)`` reduce-scatters each backward and keeps
    the result apart (not in ``.grad``) for the next synced one to add in."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(net, mesh=mesh)
    x = torch.ones(2, 4)
    net(x).sum().backward()
    clean = [p.grad.full_tensor().clone() for p in net.parameters()]
    net.zero_grad()
    net.set_requires_all_reduce(False)
    net(x).sum().backward()
    net.zero_grad()
    assert tc.drop_unsynced_gradients(net) == 1  # the group's one partial reduction
    net.set_requires_all_reduce(True)
    net(x).sum().backward()
    assert all(torch.equal(p.grad.full_tensor(), c) for p, c in zip(net.parameters(), clean, strict=True))


def test_activation_checkpoint_keeps_parameter_names():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    names = [n for n, _ in net.named_parameters()]
    tc.activation_checkpoint(net[0])
    assert [n for n, _ in net.named_parameters()] == names
    net(torch.ones(1, 2, requires_grad=True)).sum().backward()


def test_trees():
    tree = {"a": torch.ones(1), "b": [torch.zeros(2), 3]}
    assert len(tc.tree_leaves(tree)) == 3
    doubled = tc.tree_map_only(torch.Tensor, lambda t: t * 2, tree)
    assert torch.equal(doubled["a"], torch.full((1,), 2.0)) and doubled["b"][1] == 3


def test_checkpoint_helpers(tmp_path):
    from torch.distributed.checkpoint import StorageReader, StorageWriter

    assert issubclass(tc.fsspec_writer(), StorageWriter) and issubclass(tc.fsspec_reader(), StorageReader)
    t = torch.arange(12).reshape(3, 4)
    assert torch.equal(tc.narrow_tensor_by_index(t, [1, 1], [2, 2]), t[1:3, 1:3])
    root: dict = {}
    tc.set_element(root, ("optim", "param_groups"), [1])
    assert root == {"optim": {"param_groups": [1]}}


def test_the_weights_only_unpickler_refuses_code_and_reads_tensors():
    unpickler = tc.weights_only_unpickler()
    buf = io.BytesIO()
    pickle.dump({"lr": 0.1}, buf, protocol=2)
    buf.seek(0)
    assert unpickler(buf).load() == {"lr": 0.1}
    evil = io.BytesIO(pickle.dumps(os.system, protocol=2))
    with pytest.raises(pickle.UnpicklingError):
        unpickler(evil).load()


def test_the_fsdp_memory_tracker_counts_by_category_and_reports_where_the_peak_rises(group):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    tracker = tcp.fsdp_memory_tracker(model, opt, lambda active, backward: seen.append((active, backward)))
    with tracker:
        model(torch.randn(32, 64)).sum().backward()
        opt.step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    by = {getattr(k, "value", k): v for k, v in peak.items()}
    params = sum(p.numel() for p in model.parameters()) * 4
    assert by["Sharded Param"] == params  # where the peak falls differs by version: no more asked of it
    now = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
    assert {getattr(k, "value", k): v for k, v in now.items()}["OptState"] == params  # one momentum buffer each
    assert by["Total"] == sum(v for k, v in by.items() if k != "Total") > params
    assert seen and any(backward for _, backward in seen) and all(isinstance(a, set) for a, _ in seen)
    with tcp.fake_tensor_mode():
        fake = torch.empty(1 << 40)  # a TiB that is never allocated
    assert fake.shape == (1 << 40,) and type(fake).__name__ == "FakeTensor"


def _frame_inside(fn_name, call):
    """The frame of torch.distributed's ``fn_name`` while ``call()`` runs it (a profile hook
    on this thread keeps it), with the frames it was called from under it."""
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == fn_name and not seen:
            seen.append(frame)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    assert seen, f"{fn_name} never ran"
    return seen[0]


def test_the_frames_the_hang_watch_reads(group):
    """A group being made and a collective in flight, told from the frames torch runs them
    in; a user's function of the same name is neither."""
    making = _frame_inside("new_group", lambda: dist.new_group([0]))
    assert tc.making_group(making)
    t = torch.ones(3)
    inside = _frame_inside("all_reduce", lambda: dist.all_reduce(t))
    op, pg, tensors = tc.collective_call(inside)
    assert op == "all_reduce" and pg in (None, group) and len(tensors) == 1 and tensors[0] is t

    def new_group():
        return sys._getframe()  # noqa: SLF001 - a frame of this test's own function

    mine = new_group()
    assert not tc.making_group(mine) and tc.collective_call(mine) is None


def test_a_whole_checkpoint_is_read_into_an_empty_dict_by_dcps_own_planner(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from fsdp_nb.formats.restricted import load_dcp_metadata

    sd = {"model": {"w": torch.arange(6.0)}, "step": 3}
    dcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    reader = FileSystemReader(str(tmp_path))
    path = tc.dcp_metadata_path(reader, None)
    assert os.path.basename(path) == ".metadata"
    with open(path, "rb") as f:  # torch's metadata classes are all the restricted unpickler needs
        md = load_dcp_metadata(f.read(), True)
    assert set(md.state_dict_metadata) == {"model.w", "step"}
    assert all(isinstance(names, frozenset) for names in tc.DCP_METADATA_GLOBALS.values())
    got: dict = {}
    tc.dcp_load_into(got, reader, tc.empty_state_dict_planner()())
    assert torch.equal(got["model"]["w"], torch.arange(6.0)) and got["step"] == 3


def test_a_stager_kept_open_stages_again():
    stager = tc.kept_open_stager(cuda=False)
    sd = {"w": torch.arange(4.0)}
    first = stager.stage(sd)
    first = first.result() if hasattr(first, "result") else first  # it copies in its own thread
    assert torch.equal(first["w"], torch.arange(4.0))
    buffer = first["w"].data_ptr()
    sd["w"].add_(1)
    stager.close()  # what a save's end does: the stager stays open, its copy tables kept
    second = stager.stage(sd)
    second = second.result() if hasattr(second, "result") else second
    # the same CPU buffer, refreshed: the second save only copies
    assert torch.equal(second["w"], torch.arange(4.0) + 1) and second["w"].data_ptr() == buffer


def test_what_a_module_initialises_and_leaves_out_of_its_state_dict():
    lin = torch.nn.Linear(2, 2)
    lin.register_buffer("table", torch.ones(2), persistent=False)
    assert tc.non_persistent_buffers(lin) == {"table"} and tc.non_persistent_buffers(torch.nn.ReLU()) == set()
    assert tc.parameter_initialiser(lin) == lin.reset_parameters
    mha = torch.nn.MultiheadAttention(4, 2)  # initialises in a method of its own
    assert callable(tc.parameter_initialiser(mha)) and tc.parameter_initialiser(torch.nn.ReLU()) is None


def test_a_planner_plays_one_rank_of_a_fake_world():
    import subprocess

    # in a process of its own: the fake group becomes that process's default group
    code = ("from fsdp_nb import torch_compat_planning as tcp; import torch.distributed as d; "
            f"tcp.{tcp.fake_process_group.__name__}(3, 8); print(d.get_rank(), d.get_world_size(), d.get_backend())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["3", "8", "fake"]
    assert tc.FLIGHT_RECORDER_ENV == "TORCH_FR_BUFFER_SIZE"  # what 2.11 reads first (and warns of the old name)
    import importlib

    assert all(importlib.import_module(m) for m in tc.TORCH_PRELOAD)


def test_every_public_name_of_torch_compat_is_called_here():
    """This file is what CI runs on the supported range's ends: a name it never calls would
    break there unseen."""
    import ast

    with open(__file__) as f:
        tree = ast.parse(f.read())
    used = {(n.value.id, n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    assert sorted(({("tc", n) for n in tc.__all__} | {("tcp", n) for n in tcp.__all__}) - used) == []


def test_a_pickled_tensor_names_only_what_the_loader_unpickler_allows():
    """``pickle.dumps`` of a tensor (in torchtitan's loader state) names these globals on
    this torch; the loader's restricted unpickler resolves only them (and containers)."""
    import pickle
    import pickletools

    names, strings = set(), []
    for op, arg, _ in pickletools.genops(pickle.dumps(torch.arange(4, dtype=torch.uint8))):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            names.add(tuple(strings[-2:]))
    assert {n for n in names if n[0].startswith("torch")} == set(tc.PICKLED_TENSOR)
