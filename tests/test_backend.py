"""The GPU path's decisions, checked on CPU: the backend a session forms and the group
checkpoints run on.

- ``connect()`` decides the backend from the engines' probes (a GPU of its own on every
  rank -> nccl), before any rank joins a group: ``rendezvous.choose_backend``.
- An NCCL world is formed as ``"cpu:gloo,cuda:nccl"``, and saves run on a dedicated
  gloo group, so DCP's async save (which refuses a group without a CPU backend) works
  on one NCCL rank too. A world whose default group has no CPU backend is made here
  with ``"cuda:gloo"`` (gloo registered for CUDA only), which CPU torch accepts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from fsdp_nb.engine.process_group import init_backend
from fsdp_nb.runtime.rendezvous import choose_backend, gpu_indexes
from fsdp_nb.wire.probe import EngineProbe


def probe(host: str, gpus: int, visible: str | None = None) -> EngineProbe:
    return EngineProbe(
        host=host, pid=1, addr="10.0.0.1", ifname=None, launcher_rank=None,
        launcher_var=None, cuda_devices=gpus, visible_devices=visible,
    )


@pytest.mark.parametrize(
    "probes, requested, backend, indexes",
    [
        # one host, every engine sees both GPUs: local rank i takes cuda:i
        ([probe("a", 2), probe("a", 2)], None, "nccl", [0, 1]),
        # two hosts with 2 GPUs each
        ([probe("a", 2), probe("a", 2), probe("b", 2), probe("b", 2)], None, "nccl", [0, 1, 0, 1]),
        # Slurm --gpus-per-task=1: each engine sees its own single GPU as cuda:0
        ([probe("a", 1, "0"), probe("a", 1, "1")], None, "nccl", [0, 0]),
        # two engines sharing one GPU: not a GPU each
        ([probe("a", 1), probe("a", 1)], None, "gloo", None),
        ([probe("a", 1, "0"), probe("a", 1, "0")], None, "gloo", None),
        # a CPU-only host among GPU hosts
        ([probe("a", 1), probe("b", 0)], None, "gloo", None),
        ([probe("a", 0), probe("a", 0)], None, "gloo", None),
        # the user's choice wins where it can be done
        ([probe("a", 2), probe("a", 2)], "gloo", "gloo", [0, 1]),
        ([probe("a", 1)], "nccl", "nccl", [0]),
    ],
)
def test_backend_is_decided_from_probes(probes, requested, backend, indexes):
    assert choose_backend(requested, probes) == backend
    assert gpu_indexes(probes) == indexes


def test_nccl_without_a_gpu_per_rank_is_refused_by_name():
    with pytest.raises(RuntimeError, match=r"'nccl' needs a GPU of its own.*b \(0 GPU"):
        choose_backend("nccl", [probe("a", 1), probe("b", 0)])


def test_nccl_groups_carry_a_cpu_backend():
    assert init_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert init_backend("gloo") == "gloo"


def test_connect_without_backend_forms_gloo_on_cpu_engines(sess):
    """The shared session's engines have no GPU: the probes say gloo (the wiring of
    ``connect()`` on GPU engines is covered by ``tests/test_gpu.py``)."""
    from fsdp_nb.runtime import rendezvous

    probes = rendezvous.probe_engines(sess.cluster, sess.dispatcher)
    assert all(p.cuda_devices == 0 for p in probes)
    assert choose_backend(None, probes) == sess.backend == "gloo"


ASYNC_ON_CUDA_ONLY_WORLD = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert torch.device("cpu") not in dist.group.WORLD._device_types
    from fsdp_nb.checkpoints.wire_checkpoint import LoadSpec, SaveSpec
    from fsdp_nb.formats.metadata import base_metadata
    from fsdp_nb.formats.storage import options_for
    from fsdp_nb.checkpoints import rank_async_saves as async_saves, rank_save as cio, rank_load as checkpoint_load
    from fsdp_nb.engine.namespace import user_ns

    torch.manual_seed(0)
    user_ns()["net"] = net = torch.nn.Linear(4, 2)
    url = {url!r}
    spec = SaveSpec(url=url, storage_options=options_for(url), model="net", optimizer=None,
                    sharded=True, async_save=True, keep_last=None, token="t0",
                    meta=base_metadata({{}}, "sharded"), check_exists=True)
    out = cio.save(spec)
    assert out.ok and out.pending, out
    done = async_saves.async_wait("t0")
    assert done.ok, done
    with torch.no_grad():
        net.weight.zero_()
    loaded = checkpoint_load.load(LoadSpec(url=url, storage_options=spec.storage_options, model="net",
                               optimizer=None, strict=True))
    assert loaded.ok, loaded
    torch.manual_seed(0)
    assert torch.equal(net.weight, torch.nn.Linear(4, 2).weight)
    print("committed", done.info.valid)
    """
)


def test_async_save_on_a_world_whose_default_group_has_no_cpu_backend(tmp_path):
    """What every one-GPU NCCL session hit: DCP's async save refused the default group."""
    script = ASYNC_ON_CUDA_ONLY_WORLD.format(url=str(tmp_path / "ckpt"))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "committed True" in out.stdout


def test_abort_channel_reaches_every_engine_and_spares_gloo(sess):
    """The NCCL abort listener's round trip, on CPU engines: each engine's listener
    thread gets the request while nothing runs through its task queue, finds no NCCL
    communicator to abort, and the gloo group still answers."""
    from fsdp_nb.engine import nccl_abort

    sess.context.health.start_abort_listeners(sess.context.plain_dispatcher)
    endpoints = {r: ep for r, (ep, _) in sess.context.health.abort_links.items()}
    sess.context.health.start_abort_listeners(sess.context.plain_dispatcher)  # once per engine
    assert {r: ep for r, (ep, _) in sess.context.health.abort_links.items()} == endpoints
    assert all(ep.startswith("tcp://127.0.0.1:") for ep in endpoints.values())  # loopback
    before = sess.run(nccl_abort.received)
    sess.context.health.abort([0, 1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait for the listeners' marker, not a timer
        got = sess.run(nccl_abort.received)
        if all(g[0] > b[0] for g, b in zip(got, before)):
            break
    assert [g[0] - b[0] for g, b in zip(got, before)] == [1, 1]
    assert [g[1] - b[1] for g, b in zip(got, before)] == [0, 0]
    assert sess.all_reduce_check() == 1.0


def test_launched_engines_are_probed_before_the_backend_is_chosen():
    """mpi / slurm engines run elsewhere: the notebook's own GPU count decides nothing."""
    from fsdp_nb.runtime.checks import validate

    assert validate(None, None, "mpi") == (2, None)
    assert validate(4, None, "slurm") == (4, None)
    assert validate(2, "gloo", "mpi") == (2, "gloo")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # local engines share this machine's GPUs: one rank per GPU on nccl, else 2 on gloo
    assert validate(None, None, "local") == ((gpus, "nccl") if gpus else (2, "gloo"))


@pytest.mark.parametrize(
    "url, host",
    [("tcp://10.0.0.5:4242", "10.0.0.5"), ("tcp://[::1]:4242", "::1"), ("tcp://*:4242", None),
     ("tcp://0.0.0.0:1", None), ("", None), ("10.0.0.5:1", None)],
)
def test_controller_urls_parse_one_way(url, host):
    from fsdp_nb.engine.probe import url_host

    assert url_host(url) == host


def test_dtype_table_matches_torch():
    import torch

    from fsdp_nb.formats.dtypes import from_safetensors, itemsize

    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                 "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"):
        assert itemsize(name) == torch.empty((), dtype=getattr(torch, name)).element_size(), name
    assert [from_safetensors(c) for c in ("F32", "BF16", "F8_E4M3", "BOOL")] == [
        "float32", "bfloat16", "float8_e4m3fn", "bool"]
