"""Several hosts: namespace hosts on a bridge, Open MPI, Slurm; and the pure rank logic.

The root tests build real infrastructure on this machine and tear it down in
finally blocks / fixtures: two network-namespace "hosts" with their own hostnames
(controller in the root namespace, ``ipengine`` in each namespace, then
``Session.connect``), ``Session(launcher="mpi")`` through Open MPI's mpiexec, and
``Session(launcher="slurm")`` against munged + slurmctld + slurmd on loopback.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import fsdp_nb
from fsdp_nb.runtime.launch_settings import prepare_batch_job, split_cluster_kwargs
from fsdp_nb.runtime.rendezvous import (
    local_ranks,
    loopback_routes,
    rank_env,
    rank_order,
    with_routes,
)
from fsdp_nb.wire.probe import EngineProbe

sys.path.insert(0, str(Path(__file__).parent))
import netns_hosts  # noqa: E402
import slurm_local  # noqa: E402
from helpers import assert_same, full_state  # noqa: E402

TRAIN = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

torch.manual_seed(0)
_mh_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
_mh_mesh = init_device_mesh("cpu", (world_size,))
for _m in _mh_model:
    if isinstance(_m, torch.nn.Linear):
        fully_shard(_m, mesh=_mh_mesh)
fully_shard(_mh_model, mesh=_mh_mesh)
_mh_opt = torch.optim.SGD(_mh_model.parameters(), lr=0.05)
_g = torch.Generator().manual_seed(rank)
_x = torch.randn(64, 8, generator=_g)
_y = _x.sum(1, keepdim=True)
mh_losses = []
for _ in range(8):
    _loss = ((_mh_model(_x) - _y) ** 2).mean()
    _loss.backward()
    _mh_opt.step()
    _mh_opt.zero_grad()
    mh_losses.append(_loss.item())
mh_checksum = float(sum(p.full_tensor().double().sum() for p in _mh_model.parameters()))
"""


def train_and_check(sess: fsdp_nb.Session) -> None:
    """Train a small FSDP2 model across the session; every rank learns, weights agree."""
    sess.execute(TRAIN, timeout=120)
    for rank, losses in enumerate(sess.pull("mh_losses")):
        assert losses[-1] < losses[0], f"rank {rank} did not learn: {losses}"
    sums = sess.pull("mh_checksum")
    assert all(abs(s - sums[0]) < 1e-9 for s in sums), f"ranks disagree on weights: {sums}"


def env_of(sess: fsdp_nb.Session, *names: str) -> list[dict[str, str | None]]:
    return sess.run(lambda: {n: __import__("os").environ.get(n) for n in names})


# -- pure functions (no engines) ---------------------------------------------------


def _probe(host: str, launcher_rank: int | None = None, pid: int = 1) -> EngineProbe:
    return EngineProbe(
        host=host, pid=pid, addr="10.0.0.1", ifname="eth0", launcher_rank=launcher_rank,
        launcher_var="SLURM_PROCID" if launcher_rank is not None else None, cuda_devices=0,
    )


def test_a_rank_that_reached_the_controller_over_loopback_gets_a_routable_address():
    """Rank 0 on the controller's host registered over 127.0.0.1 (a controller on ``*``):
    it is asked for its route to a rank of another host, never one of its own host."""
    probes = [replace(_probe("a"), addr="127.0.0.1", ifname="lo"), _probe("a"),
              replace(_probe("b"), addr="10.0.0.2"), replace(_probe("b"), addr="node-b")]
    assert loopback_routes(probes) == {0: "10.0.0.2"}
    fixed = with_routes(probes, {0: ("10.0.0.9", "eth1")})
    assert (fixed[0].addr, fixed[0].ifname) == ("10.0.0.9", "eth1") and fixed[1:] == probes[1:]
    with pytest.raises(RuntimeError, match="rank 0 on a reached the controller over loopback and has no route"):
        with_routes(probes, {0: ("127.0.0.1", "lo")})
    # every host on loopback (one network namespace), or one host: nothing to ask
    assert loopback_routes([replace(p, addr="127.0.0.1") for p in probes]) == {}
    assert loopback_routes([replace(probes[0], host="b"), *probes[2:]]) == {}


def test_rank_order_prefers_distinct_launcher_ranks():
    ids = [0, 1, 2, 3]
    probes = [_probe("a", 2), _probe("b", 0), _probe("a", 3), _probe("b", 1)]
    order = rank_order(ids, probes)
    assert [probes[i].launcher_rank for i in order] == [0, 1, 2, 3]
    assert order == [1, 3, 0, 2]


def test_rank_order_groups_hosts_without_launcher_ranks():
    # engines registered interleaved across hosts, ids not in host order
    ids = [5, 2, 7, 3, 9]
    probes = [_probe("b"), _probe("a"), _probe("b"), _probe("a"), _probe("c")]
    order = rank_order(ids, probes)
    assert [probes[i].host for i in order] == ["a", "a", "b", "b", "c"]
    assert [ids[i] for i in order] == [2, 3, 5, 7, 9]


def test_rank_order_ignores_partial_or_duplicate_launcher_ranks():
    ids = [0, 1, 2]
    partial = [_probe("b", 0), _probe("a", None), _probe("b", 1)]
    assert [partial[i].host for i in rank_order(ids, partial)] == ["b", "b", "a"]
    dup = [_probe("a", 0), _probe("b", 0), _probe("a", 0)]  # e.g. separate mpiexec runs
    assert [ids[i] for i in rank_order(ids, dup)] == [0, 2, 1]


def test_local_ranks_by_host():
    assert local_ranks(["a", "a", "b", "b", "b"]) == [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    assert local_ranks(["x"]) == [(0, 1)]


def test_rank_env_sets_ifnames_unless_preset():
    env = rank_env(1, 4, (1, 2), "10.1.2.3", 29500, "veth0")
    assert env["MASTER_ADDR"] == "10.1.2.3" and env["MASTER_PORT"] == "29500"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "veth0"
    assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "1", "2")
    kept = rank_env(0, 2, (0, 1), "10.1.2.3", 1, "veth0", (("NCCL_SOCKET_IFNAME", "ib0"),))
    assert kept["GLOO_SOCKET_IFNAME"] == "veth0" and "NCCL_SOCKET_IFNAME" not in kept
    assert "GLOO_SOCKET_IFNAME" not in rank_env(0, 1, (0, 1), "127.0.0.1", 1, None)


def test_launcher_settings_become_config():
    kw = split_cluster_kwargs(
        "mpi", {"mpi_args": ["--oversubscribe"], "controller_ip": "0.0.0.0", "delay": 0.5}
    )
    assert kw["controller_ip"] == "0.0.0.0" and kw["delay"] == 0.5
    assert kw["config"].MPIEngineSetLauncher.mpi_args == ["--oversubscribe"]
    kw = split_cluster_kwargs("slurm", {"batch_template": "#!/bin/sh\nsrun {program_and_args}\n",
                                        "queue": "gpu", "timelimit": "1:00:00"})
    c = kw["config"].SlurmEngineSetLauncher
    assert c.queue == "gpu" and c.timelimit == "1:00:00" and "srun" in c.batch_template


def _slurm_job(profile: Path, **settings) -> Any:
    """The Slurm engine launcher's config once fsdp_nb settled the job (nothing starts)."""
    import ipyparallel as ipp

    kw = split_cluster_kwargs("slurm", settings)
    cluster = ipp.Cluster(n=2, engines="slurm", profile_dir=str(profile), **kw)
    prepare_batch_job(cluster, "slurm")
    return cluster.config.SlurmEngineSetLauncher


def test_slurm_options_reach_sbatch_whatever_the_script(tmp_path):
    """ipyparallel's default script never says ``{options}``: they go on sbatch's command
    line, after a submit command of the user's or the profile's; a template that places
    ``{options}`` itself (given, or in a file) keeps them there only."""
    from traitlets.config import Config

    profile = tmp_path / "profile"
    job = _slurm_job(profile, options="--gpus-per-task=1 --comment='a b'")
    assert job.submit_command == ["sbatch", "--gpus-per-task=1", "--comment=a b"]
    assert job.batch_file_name.startswith(str(profile / "log"))  # not in the notebook's folder
    job = _slurm_job(profile, options="--exclusive", submit_command=["/opt/sbatch"],
                     batch_template="#!/bin/sh\nsrun {program_and_args}\n")
    assert job.submit_command == ["/opt/sbatch", "--exclusive"]
    placed = "#!/bin/sh\n#SBATCH {options}\nsrun {program_and_args}\n"
    assert "submit_command" not in _slurm_job(profile, options="--exclusive", batch_template=placed)
    (tmp_path / "job.sh").write_text(placed)
    assert "submit_command" not in _slurm_job(profile, options="--exclusive",
                                              batch_template_file=str(tmp_path / "job.sh"))
    mine = Config({"SlurmEngineSetLauncher": {"options": "--exclusive"}})
    for _ in range(2):  # the same config twice (a cell run again): never edited, never piled up
        assert _slurm_job(profile, config=mine).submit_command == ["sbatch", "--exclusive"]
    assert "submit_command" not in mine.SlurmEngineSetLauncher
    base = Config({"SlurmLauncher": {"options": "--exclusive", "submit_command": ["wrap-sbatch"]}})
    assert _slurm_job(profile, config=base).submit_command == ["wrap-sbatch", "--exclusive"]  # a base's section
    (profile / "ipcluster_config.py").write_text(
        "c.SlurmEngineSetLauncher.options = '--exclusive'\n"
        "c.SlurmEngineSetLauncher.submit_command = ['site-sbatch']\n")
    assert _slurm_job(profile).submit_command == ["site-sbatch", "--exclusive"]  # the profile's own
    with pytest.raises(ValueError, match=r"options='--comment=\"a b' cannot be split as sbatch arguments"):
        split_cluster_kwargs("slurm", {"options": '--comment="a b'})


def test_unknown_launcher_setting_fails_before_start():
    with pytest.raises(ValueError, match=r"mpi_argz.*MPIEngineSetLauncher settings:.*mpi_args"):
        fsdp_nb.Session(2, backend="gloo", launcher="mpi", mpi_argz=["--oversubscribe"])
    with pytest.raises(ValueError, match="batch_template"):  # a Slurm setting, wrong launcher
        split_cluster_kwargs("mpi", {"batch_template": "x"})
    with pytest.raises(ValueError, match="use Session"):
        split_cluster_kwargs("local", {"n": 3})


# -- two namespace hosts -----------------------------------------------------------

_netns_missing = netns_hosts.missing_requirements()


@pytest.fixture(scope="module")
def netns_session():
    """4 engines on two namespace hosts (2 each, registered interleaved), connected."""
    if _netns_missing:
        pytest.skip(f"namespace hosts: {_netns_missing}")
    hosts = netns_hosts.NetnsHosts(n_hosts=2)
    sess = None
    try:
        hosts.setup()
        client_file, engine_file = hosts.start_controller()
        hosts.engine_file = engine_file  # for engines started later, in place of dead ones
        a, b = hosts.hosts
        pids = {}
        for host in (a, b, a, b):
            # the user's own choice of NCCL interface on host b must survive
            env = {"NCCL_SOCKET_IFNAME": "user-choice"} if host is b else None
            pids[hosts.start_engine(host, engine_file, env)] = host
        try:
            sess = fsdp_nb.Session.connect(
                str(client_file), n=4, backend="gloo", timeout=120, activate=False
            )
        except Exception as exc:
            raise RuntimeError(f"{exc}\n{hosts.logs()}") from exc
        yield sess, hosts, pids
    finally:
        if sess is not None:
            sess.shutdown()
        hosts.close()


@pytest.mark.root
def test_netns_ranks_group_by_host(netns_session):
    sess, hosts, pids = netns_session
    ranks = sess.ranks
    by_name = {h.name: h for h in hosts.hosts}
    assert {r.pid for r in ranks} == set(pids), "ranks are not the engines we started"
    for r in ranks:
        assert r.host == pids[r.pid].name, f"rank {r.rank} reports host {r.host}"
        assert r.addr == by_name[r.host].addr
    assert [r.host for r in ranks][0] == ranks[1].host != ranks[2].host == ranks[3].host
    assert [(r.local_rank, r.local_world_size) for r in ranks] == [(0, 2), (1, 2)] * 2
    text = repr(sess)
    assert all(h.name in text for h in hosts.hosts)


@pytest.mark.root
def test_netns_env_points_at_rank0_over_the_bridge(netns_session):
    sess, hosts, _ = netns_session
    by_name = {h.name: h for h in hosts.hosts}
    rank0_addr = by_name[sess.ranks[0].host].addr
    assert rank0_addr.startswith("10.")
    envs = env_of(sess, "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                  "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK")
    for r, env in zip(sess.ranks, envs):
        host = by_name[r.host]
        assert env["MASTER_ADDR"] == rank0_addr
        assert env["GLOO_SOCKET_IFNAME"] == host.ifname
        assert env["NCCL_SOCKET_IFNAME"] == ("user-choice" if host is hosts.hosts[1] else host.ifname)
        assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
            str(r.rank), str(r.local_rank), str(r.local_world_size))
    assert sess.all_reduce_check() == 6.0


@pytest.mark.root
def test_netns_trains_and_checkpoints_across_hosts(netns_session):
    sess, _, _ = netns_session
    train_and_check(sess)
    ckpt = tempfile.mkdtemp(prefix="fsdp_nb_mh_ckpt_")  # both hosts share this filesystem
    try:
        sess.push({"mh_ckpt": ckpt})
        sess.execute(
            "import torch.distributed.checkpoint as _dcp\n"
            "_dcp.save({'model': _mh_model.state_dict()}, checkpoint_id=mh_ckpt)\n"
            "with torch.no_grad():\n"
            "    for _p in _mh_model.parameters(): _p.zero_()\n"
            "_sd = {'model': _mh_model.state_dict()}\n"
            "_dcp.load(_sd, checkpoint_id=mh_ckpt)\n"
            "_mh_model.load_state_dict(_sd['model'])\n"
            "mh_reloaded = float(sum(p.full_tensor().double().sum() for p in _mh_model.parameters()))\n",
            timeout=120,
        )
        assert sess.pull("mh_reloaded") == sess.pull("mh_checksum")
        assert sorted(p.name for p in Path(ckpt).glob("*.distcp")) == [
            f"__{r}_0.distcp" for r in range(4)
        ]
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


@pytest.mark.root
def test_netns_hybrid_shards_within_host_replicates_across(netns_session):
    import torch

    sess, _, _ = netns_session
    sess.wrap(torch.nn.Linear(8, 8), name="mh_hybrid", sharding="hybrid")
    groups = sess.run(lambda: sorted(  # ranks this rank shards with, per parameter
        {tuple(__import__("torch").distributed.get_process_group_ranks(
            p.device_mesh.get_group(p.device_mesh.ndim - 1)))
         for p in mh_hybrid.parameters()}))  # noqa: F821 (engine global)
    hosts = [r.host for r in sess.ranks]
    for r, g in enumerate(groups):
        assert len(g) == 1, g
        assert [hosts[x] for x in g[0]] == [hosts[r]] * 2, f"rank {r} shards with {g[0]}"


@pytest.mark.root
def test_netns_session_saves_and_loads_across_hosts(netns_session, tmp_path):
    """``sess.save`` / ``sess.load`` (sharded, then full) with ranks on two namespace hosts
    that share one file system: the model and its optimizer come back bit for bit."""
    import torch

    sess, _, _ = netns_session
    sess.wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)), name="mh_saved")
    step = "mh_saved(torch.randn(4, 8)).sum().backward(); mh_saved_opt.step(); mh_saved_opt.zero_grad()"
    sess.execute(f"mh_saved_opt = torch.optim.AdamW(mh_saved.parameters(), lr=0.01)\n{step}", timeout=120)
    before = sess.run(full_state("mh_saved", "mh_saved_opt"))[0]
    for sharded in (True, False):
        path = str(tmp_path / ("sharded" if sharded else "full.pt"))
        sess.save(path, "mh_saved", optimizer="mh_saved_opt", sharded=sharded)
        sess.execute(step, timeout=60)  # weights and optimizer state move on
        sess.load(path, "mh_saved", optimizer="mh_saved_opt")
        assert_same(sess.run(full_state("mh_saved", "mh_saved_opt"))[0], before, f"sharded={sharded}")
    assert len(list((tmp_path / "sharded").glob("*.distcp"))) == 4  # a file per rank, both hosts'


@pytest.mark.root
def test_netns_resize_across_hosts(netns_session):
    """4 ranks on two hosts -> 2 (rank 0's host keeps them; the other's engines stay with their
    launcher, out of the group) -> 4 again (the spare engines come back), staged in a
    folder both hosts share; /dev/shm alone is refused. The state survives bit for bit."""
    import torch

    sess, hosts, _ = netns_session
    a = sess.ranks[0].host  # ranks 0 and 1 share a host (ranks group by host)
    b = next(h.name for h in hosts.hosts if h.name != a)
    sess.wrap(torch.nn.Linear(8, 8), name="mh_rs", sharding="hybrid")
    sess.execute("mh_opt = torch.optim.AdamW(mh_rs.parameters(), lr=0.1)\n"
                 "mh_rs(torch.ones(2, 8)).sum().backward()\nmh_opt.step()\nmh_opt.zero_grad()")
    before = sess.run(full_state("mh_rs", "mh_opt"))[0]
    with pytest.raises(ValueError, match="/dev/shm is each host's own"):
        sess.resize(2)
    staging = tempfile.mkdtemp(prefix="fsdp_nb_mh_stage_")  # both hosts share this filesystem
    try:
        sess.resize(2, staging=staging)
        assert [r.host for r in sess.ranks] == [a, a] and sess.all_reduce_check() == 1.0
        assert_same(before, sess.run(full_state("mh_rs", "mh_opt"))[0])
        assert len(sess.client.ids) == 4, "the attached cluster's engines stay registered"
        sess.resize(4, staging=staging)
        assert sorted(r.host for r in sess.ranks) == sorted([a, a, b, b]) and sess.all_reduce_check() == 6.0
        assert_same(before, sess.run(full_state("mh_rs", "mh_opt"))[0])
        assert sess.models["mh_rs"].summary.mesh_shape == (2, 2)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remake_mh():
    """``restart(setup=)``: the run's objects on every rank (AM_LOOP's), for ``mh_mem``."""
    am_setup("mh_mem")  # noqa: F821 - an engine global (AM_LOOP), replayed on a new engine


@pytest.mark.root
def test_netns_a_whole_host_dies_and_its_ranks_come_back_from_the_other_hosts_memory(netns_session):
    """The in-memory autosave puts each rank's buddy on the other host (0->2, 1->3, 2->0,
    3->1). Both engines of one host are killed together; two new engines start there, and
    restart(restore="latest") takes their ranks' state from the other host's memory, with
    nothing read from disk: the model, optimizer and loader are as they were."""
    from helpers import DropNet, forget_models, run_out
    from test_autosave_meets import AM_LOOP

    from fsdp_nb.runtime.cluster import wait_until

    sess, hosts, pids = netns_session
    forget_models(sess, *sess.models)  # the earlier tests' instance wraps: a restart cannot rebuild them
    sess.execute(AM_LOOP)
    model = sess.wrap(DropNet, name="mh_mem")
    sess.execute("am_setup('mh_mem')")
    auto = sess.autosave(model=model, optimizer="am_opt", loaders=["am_batches"], state=["am_sched"], in_memory=True)
    ranks_host = [r.host for r in sess.ranks]
    assert all(ranks_host[r] != ranks_host[b] for r, b in enumerate(auto.buddies)), auto.buddies
    sess.execute("am_train(3)")
    before = sess.run(full_state("mh_mem", "am_opt"))[0]
    pos = run_out(sess, "rs_out = am_batches.pos")
    gone = ranks_host[-1]
    dead = [r.rank for r in sess.ranks if r.host == gone]
    for p in hosts.procs:  # the engines of that host, by the handles that started them
        if p.pid in {r.pid for r in sess.ranks if r.host == gone}:
            p.kill()
    assert wait_until(lambda: set(dead) <= set(sess.cluster.dead_ranks()), 120)
    host = next(h for h in hosts.hosts if h.name == gone)
    known = set(sess.client.ids)
    for _ in dead:
        hosts.start_engine(host, hosts.engine_file)
    assert wait_until(lambda: len(set(sess.client.ids) - known) >= len(dead), 120)  # registered
    report = sess.restart(restore="latest", setup=_remake_mh)
    assert report.restored.memory is not None and report.restored.step == 3, repr(report)
    assert set(report.restored.memory.sources) == set(dead)
    assert all(ranks_host[h] != gone for h in report.restored.memory.sources.values())
    assert_same(before, sess.run(full_state("mh_mem", "am_opt"))[0])
    assert run_out(sess, "rs_out = am_batches.pos") == pos
    sess.stop_autosave()


# -- Open MPI ----------------------------------------------------------------------

def _mpi_missing() -> str | None:
    if os.geteuid() != 0:
        return "test runs mpiexec as root with --allow-run-as-root"
    if shutil.which("mpiexec") is None:
        return "needs Open MPI (apt-get install -y openmpi-bin libopenmpi-dev)"
    if importlib.util.find_spec("mpi4py") is None:
        return "needs mpi4py (pip install mpi4py)"
    return None


@pytest.mark.root
@pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
def test_mpi_launcher_ranks_and_training():
    sess = fsdp_nb.Session(
        2, backend="gloo", launcher="mpi", mpi_args=["--allow-run-as-root", "--oversubscribe"],
        timeout=120, activate=False,
    )
    try:
        envs = env_of(sess, "OMPI_COMM_WORLD_RANK", "RANK", "LOCAL_RANK")
        assert [e["OMPI_COMM_WORLD_RANK"] for e in envs] == ["0", "1"]
        assert [e["RANK"] for e in envs] == ["0", "1"]
        train_and_check(sess)
    finally:
        sess.shutdown()


@pytest.mark.root
def test_netns_a_rank_that_reached_the_controller_over_loopback_still_joins():
    """An engine on the controller's own host registered over 127.0.0.1 (as with
    ``controller_ip="*"`` and a host name that resolves to 127.0.1.1): its address and
    gloo interface become those toward the other host's rank, and the group forms."""
    if _netns_missing:
        pytest.skip(f"namespace hosts: {_netns_missing}")
    import socket

    import ipyparallel as ipp

    with netns_hosts.NetnsHosts(n_hosts=1) as hosts:
        client_file, engine_file = hosts.start_controller()
        hosts.start_engine_here(engine_file, location="127.0.0.1")
        with ipp.Client(str(client_file)) as client:  # registered first, so it becomes rank 0
            client.wait_for_engines(1, timeout=120)
        hosts.start_engine(hosts.hosts[0], engine_file)
        try:
            sess = fsdp_nb.Session.connect(str(client_file), n=2, backend="gloo", timeout=120, activate=False)
        except Exception as exc:
            raise RuntimeError(f"{exc}\n{hosts.logs()}") from exc
        try:
            assert sess.ranks[0].host == socket.gethostname(), sess.ranks
            assert sess.ranks[0].addr == hosts.bridge_addr, sess.ranks  # not 127.0.0.1
            envs = env_of(sess, "MASTER_ADDR", "GLOO_SOCKET_IFNAME")
            assert [e["MASTER_ADDR"] for e in envs] == [hosts.bridge_addr] * 2
            assert envs[0]["GLOO_SOCKET_IFNAME"] == hosts.bridge
            assert sess.all_reduce_check() == 1.0
        finally:
            sess.shutdown()


# -- Slurm -------------------------------------------------------------------------

_slurm_missing = slurm_local.missing_requirements()


@pytest.mark.root
@pytest.mark.skipif(_slurm_missing is not None, reason=f"Slurm: {_slurm_missing}")
def test_slurm_launcher_ranks_and_training(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the notebook's folder: no batch script may land here
    with slurm_local.LocalSlurm() as slurm:
        monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
        try:
            sess = fsdp_nb.Session(
                2, backend="gloo", launcher="slurm", timelimit="10", timeout=120, activate=False,
                options="--job-name=fsdp-nb-options",  # the default script has no {options}
            )
        except Exception as exc:
            raise RuntimeError(f"{exc}\n{slurm.logs()}") from exc
        try:
            assert len(slurm.queue()) == 1, "the engines should run as one Slurm job"
            envs = env_of(sess, "SLURM_PROCID", "RANK", "SLURM_JOB_ID", "SLURM_JOB_NAME")
            assert [e["SLURM_PROCID"] for e in envs] == [e["RANK"] for e in envs] == ["0", "1"]
            assert envs[0]["SLURM_JOB_ID"] == slurm.queue()[0]
            assert {e["SLURM_JOB_NAME"] for e in envs} == {"fsdp-nb-options"}  # options= reached sbatch
            train_and_check(sess)
            assert list(tmp_path.iterdir()) == []
        finally:
            sess.shutdown()
        assert _wait_empty(slurm), f"shutdown left Slurm jobs {slurm.queue()}"


def _wait_empty(slurm: slurm_local.LocalSlurm, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while slurm.queue():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)
    return True


@pytest.mark.root
@pytest.mark.skipif(_slurm_missing is not None, reason=f"Slurm: {_slurm_missing}")
def test_connect_to_ipcluster_started_with_slurm(monkeypatch, tmp_path):
    """``ipcluster start --engines=slurm`` from a shell, then ``Session.connect(cluster_id=)``."""
    monkeypatch.chdir(tmp_path)
    cid = "fsdpnb-mh"
    with slurm_local.LocalSlurm() as slurm:
        env = {**slurm.env, "OMP_NUM_THREADS": "1"}
        ipcluster = [sys.executable, "-m", "ipyparallel.cluster", ]
        try:
            subprocess.run(
                [*ipcluster, "start", "-n", "2", "--engines=slurm", f"--cluster-id={cid}",
                 "--daemonize", "--log-level=WARN"],
                env=env, check=True, timeout=60, capture_output=True,
            )
            sess = fsdp_nb.Session.connect(
                cluster_id=cid, n=2, backend="gloo", timeout=120, activate=False
            )
            try:
                assert sess.launcher == "connected"
                envs = env_of(sess, "SLURM_PROCID", "RANK")
                assert [e["SLURM_PROCID"] for e in envs] == [e["RANK"] for e in envs]
                train_and_check(sess)
            finally:
                sess.shutdown()
            assert slurm.queue(), "Session.shutdown must leave engines it did not start"
        finally:
            subprocess.run([*ipcluster, "stop", f"--cluster-id={cid}"], env=env,
                           timeout=60, capture_output=True)
        assert _wait_empty(slurm), f"ipcluster stop left Slurm jobs {slurm.queue()}"
