"""The session core: ranks, environment, shipping, errors, magics, lifecycle."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

import fsdp_nb
from fsdp_nb.errors import RankError
from fsdp_nb.runtime.cluster import wait_until
from fsdp_nb.runtime.launch_settings import HEARTBEAT_MS, quick_heartbeat


def _env():
    import os

    import torch.distributed as dist

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS")
    return {k: os.environ.get(k) for k in keys} | {"dist_rank": dist.get_rank(), "pid": os.getpid()}


def test_rank_order_and_env(sess):
    envs = sess.run(_env)
    assert [e["dist_rank"] for e in envs] == [0, 1]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert int(envs[0]["MASTER_PORT"]) > 0
    assert {e["OMP_NUM_THREADS"] for e in envs} == {str(max(1, os.cpu_count() // 2))}
    assert [e["pid"] for e in envs] == [r.pid for r in sess.ranks]
    assert [r.rank for r in sess.ranks] == [0, 1]
    assert sess.world_size == 2 and sess.backend == "gloo"
    assert all(r.device == "cpu" for r in sess.ranks)
    assert sess.all_reduce_check() == 1.0


def test_run_pull_push_in_rank_order(sess):
    assert sess.run(lambda x: x + rank, 10) == [10, 11]  # noqa: F821 - engine global
    sess.push({"pushed": [1, 2, 3]})
    assert sess.pull("pushed") == [[1, 2, 3], [1, 2, 3]]
    sess.execute("per_rank = rank * 7")
    assert sess.pull("per_rank") == [0, 7]


def test_repr_shows_ranks_hosts_pids(sess):
    text = repr(sess)
    html = sess._repr_html_()
    for r in sess.ranks:
        assert str(r.pid) in text and str(r.pid) in html
        assert r.host in text and r.host in html
    assert "gloo" in text and "ready" in text and "<table" in html


NOTEBOOK_CELL = '''
import torch
from torch import nn

scale = 3

class Block(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin(x) * scale

def make_and_run():
    torch.manual_seed(0)
    return tuple(Block()(torch.ones(1, 4)).shape)

inst = Block(4)
'''


def test_notebook_defined_objects_reach_engines(sess, shell):
    shell.run_cell(NOTEBOOK_CELL).raise_error()
    ns = shell.user_ns
    assert ns["Block"].__module__ == "__main__"
    # a function using a notebook class (zero-argument super()) and a notebook global
    assert sess.run(ns["make_and_run"]) == [(1, 4), (1, 4)]
    # a lambda, the class itself and an instance with its weights
    assert sess.run(shell.ev("lambda: scale * 2 + rank")) == [6, 7]
    sess.push({"Block": ns["Block"], "inst": ns["inst"]})
    sess.execute("b = Block(8); y = b(torch.ones(2, 8)).shape")
    assert sess.pull("y") == [(2, 8), (2, 8)]
    w = ns["inst"].lin.weight.detach()
    pulled = sess.run(lambda: inst.lin.weight.detach().clone())  # noqa: F821
    assert all((p == w).all() for p in pulled)
    # nn.Module subclass instance built on the engine by the shipped class is a real Module
    assert sess.run(lambda: isinstance(b, torch.nn.Module)) == [True, True]  # noqa: F821


def test_px_magic_through_ipython(sess, shell, capsys):
    from fsdp_nb.frontends.magics import activate_px

    activate_px(sess)
    shell.run_cell_magic("px", "", "px_value = rank + 100\nprint('hello from', rank)")
    assert sess.pull("px_value") == [100, 101]
    out = capsys.readouterr().out
    # lines stream as they arrive, each tagged with its rank
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    shell.run_cell_magic("px", "", "rank * 2")
    out = capsys.readouterr().out
    # cell results come back in rank order
    assert "Out[rank 0]: 0" in out and "Out[rank 1]: 2" in out
    assert out.index("Out[rank 0]") < out.index("Out[rank 1]")
    shell.run_line_magic("px", "line_value = 5")
    assert sess.pull("line_value") == [5, 5]
    # %%px --timeout: the cell is stopped on every rank and the session stays usable
    with pytest.raises(fsdp_nb.RankTimeoutError):
        shell.run_cell_magic("px", "--timeout 1", "import time\ntime.sleep(60)")
    assert sess.all_reduce_check() == 1.0


def test_fsdp_line_magic(sess, shell, capsys):
    shell.run_line_magic("load_ext", "fsdp_nb")
    from fsdp_nb.frontends.magics import activate_px

    activate_px(sess)
    assert shell.run_line_magic("fsdp", "status") is sess
    with pytest.raises(ValueError, match="allowed: start, status, stop"):
        shell.run_line_magic("fsdp", "explode")


def test_error_on_one_rank_names_it_and_session_survives(sess):
    with pytest.raises(RankError) as ei:
        sess.execute("if rank == 1:\n    raise ValueError('only rank one breaks')")
    err = ei.value
    assert err.ranks == [1]
    assert err.first.ename == "ValueError" and "only rank one breaks" in err.first.evalue
    assert "only rank one breaks" in str(err) and "rank 1" in str(err)
    assert "raise ValueError" in err.first.traceback
    # still usable: a collective answers
    assert sess.all_reduce_check() == 1.0


def test_error_on_all_ranks_first_failure_first(sess, tmp_path):
    from fsdp_nb.runtime.results import completed as _completed

    release = tmp_path / "release"
    code = (  # engine code: rank 0 fails only after the moment rank 1's failure was recorded
        "import os as _os, time as _t\n"
        "if rank == 0:\n"
        f"    while not _os.path.exists({str(release)!r}) or not open({str(release)!r}).read():\n"
        "        _t.sleep(0.01)\n"
        f"    _after = float(open({str(release)!r}).read())\n"
        "    while _t.time() <= _after:\n"
        "        _t.sleep(0.001)\n"
        "raise KeyError(f'rank {rank}')\n"
    )
    d = sess.dispatcher
    pending = d.execute(code)
    deadline = time.monotonic() + 30
    while not pending.results[1].ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    first = _completed(pending.results[1])
    assert first != float("inf"), pending.results[1].metadata  # the engine said when it finished
    release.write_text(repr(first))
    with pytest.raises(RankError) as ei:
        d.gather(pending)
    assert ei.value.ranks == [1, 0] and "KeyError: 'rank 1'" in str(ei.value.first)
    assert sess.run(lambda: 1) == [1, 1]


def test_pull_missing_name_is_clear(sess):
    with pytest.raises(RankError, match="'no_such_thing' is not defined"):
        sess.pull("no_such_thing")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 0}, "n must be a positive int"),
        ({"n": -3}, "n must be a positive int"),
        ({"backend": "mpi"}, "allowed: gloo, nccl"),
        ({"launcher": "kubernetes"}, "allowed: .*local.*slurm"),
        ({"standby": "yes"}, "standby must be True or False"),
    ],
)
def test_bad_input_before_any_process(kwargs, match):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=match):
        fsdp_nb.Session(**kwargs)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_nccl_beyond_gpu_count_is_refused():
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"this machine has {gpus}"):
        fsdp_nb.Session(gpus + 1, backend="nccl")


def test_heartbeat_settings_the_user_gave_win():
    kw = {"controller_args": ["--ip=*"]}
    quick_heartbeat(kw)
    assert kw["controller_args"][0] == "--ip=*" and any("HeartMonitor.period" in a for a in kw["controller_args"])
    kw = {"controller_args": ["--HeartMonitor.period=3000"]}
    quick_heartbeat(kw)
    assert kw["controller_args"] == ["--HeartMonitor.period=3000"]


def test_a_cpu_session_needs_no_torch_in_the_notebook_to_start():
    """Counting GPUs imports torch (seconds); without GPU device files, or with
    backend="gloo", the engines start without waiting for it."""
    import glob

    from fsdp_nb.runtime.checks import GPU_DEVICE_NODES

    gpu_host = any(glob.glob(p) for p in GPU_DEVICE_NODES)
    code = ("import sys; from fsdp_nb.runtime.checks import validate; "
            "print(validate(2, 'gloo', 'local'), 'torch' in sys.modules)"
            + ("" if gpu_host else "; print(validate(None, None, 'local'), 'torch' in sys.modules)"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    want = "(2, 'gloo') False\n" + ("" if gpu_host else "(2, 'gloo') False\n")
    assert out == want


def test_second_session_side_by_side_and_clean_shutdown(sess, capsys):
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    with fsdp_nb.Session(2, backend="gloo", activate=False, verbose=True,
                         environment={"FSDP_NB_MARK": "yes", "OMP_NUM_THREADS": "3"}) as other:
        # verbose: the start's phases, printed and kept
        phases = ["controller and engines launched", "engines registered",
                  "probe engines (torch imported)", "process group formed", "health hooks",
                  "session record", "standby engine launched"]
        assert list(other.start_phases) == phases
        printed = capsys.readouterr().out
        assert printed.startswith("session start:") and all(p in printed for p in [*phases, "total"])
        # engines boot with torch first; the controller beats fast, so registration is quick
        engine = psutil.Process(other.ranks[0].pid)
        assert engine.cmdline()[1:3] == ["-m", "fsdp_nb.engine.boot"]
        assert engine.children() == []  # no ipyparallel nanny process beside it
        controller = psutil.Process(other.cluster.cluster.controller.process.pid).cmdline()
        assert f"--HeartMonitor.period={HEARTBEAT_MS}" in controller
        p1 = sess.run(lambda: __import__("os").environ["MASTER_PORT"])[0]
        p2 = other.run(lambda: __import__("os").environ["MASTER_PORT"])[0]
        assert p1 != p2
        # environment= reaches every engine, and the user's OMP_NUM_THREADS wins over fsdp_nb's
        marks = other.run(lambda: [__import__("os").environ.get(k) for k in ("FSDP_NB_MARK", "OMP_NUM_THREADS")]
                          + [__import__("torch").get_num_threads()])
        assert marks == [["yes", "3", 3]] * 2
        assert other.all_reduce_check() == 1.0 and sess.all_reduce_check() == 1.0
        pids = [r.pid for r in other.ranks]
        assert not set(pids) & ours
        # a standby engine waits, booted as the ranks are, but not registered
        assert wait_until(other.cluster.standby.waiting, 120)  # its imports done
        standby = other.cluster.standby.pid
        assert psutil.Process(standby).cmdline()[1:3] == ["-m", "fsdp_nb.engine.boot"]
        assert standby not in pids and len(other.cluster.client.ids) == 2
        started = {p.pid for p in psutil.Process().children(recursive=True)} - ours
        assert {*pids, standby} <= started
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in started):
        time.sleep(0.2)
    alive = [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert alive == [], f"processes left after shutdown: {alive}"
    assert other.state == "closed"
    with pytest.raises(fsdp_nb.SessionClosedError):
        other.run(lambda: 1)
    assert sess.all_reduce_check() == 1.0  # the shared session is untouched


def test_a_standby_engine_leaves_when_the_process_it_watches_ends(tmp_path):
    """Its controller gone, a standby engine exits by itself, without starting an engine."""
    from fsdp_nb.engine.boot import STANDBY_ENV, WATCH_ENV

    watched = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE)
    go = tmp_path / "go"
    env = {**os.environ, STANDBY_ENV: str(go), WATCH_ENV: str(watched.pid), "FSDP_NB_ENGINE_WAIT": "5"}
    standby = subprocess.Popen(
        [sys.executable, "-m", "fsdp_nb.engine.boot", f"--profile-dir={tmp_path / 'profile'}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    waiting = tmp_path / "go.waiting"
    assert wait_until(lambda: waiting.exists() or standby.poll() is not None, 120)
    assert standby.poll() is None  # imports done, it waits
    watched.stdin.close()
    watched.wait()
    out, _ = standby.communicate(timeout=120)
    assert standby.returncode == 0, out
    assert "connection file" not in out.lower() and not waiting.exists()  # no engine started


def test_connect_to_running_cluster_leaves_its_engines(tmp_path, monkeypatch):
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # its own session records
    profile_dir = tmp_path / "profile"
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=2, profile_dir=str(profile_dir), cluster_id="ext", log_level=40)
    cluster.start_cluster_sync()
    try:
        url_file = profile_dir / "security" / "ipcontroller-ext-client.json"
        deadline = time.monotonic() + 30
        while not url_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        s = fsdp_nb.Session.connect(str(url_file), n=2, backend="gloo", activate=False)
        assert s.world_size == 2 and s.launcher == "connected"
        assert s.all_reduce_check() == 1.0
        pids = [r.pid for r in s.ranks]
        s.shutdown()
        # the same engine processes answer a fresh connection: shutdown left them running
        s2 = fsdp_nb.Session.connect(str(url_file), n=2, backend="gloo", activate=False)
        assert [r.pid for r in s2.ranks] == pids and all(psutil.pid_exists(p) for p in pids)
        assert s2.all_reduce_check() == 1.0
        s2.shutdown()
        # kept alive: what a kernel formed on connected engines outlives it; attach takes
        # it back (here the kernel is a process that exits without shutting down)
        script = (
            "import os, torch, fsdp_nb\n"
            f"s = fsdp_nb.Session.connect({str(url_file)!r}, n=2, backend='gloo', keep_alive=3600)\n"
            "s.wrap(torch.nn.Linear(2, 2), name='kept')\n"
            "s.execute('left_here = rank + 5')\n"
            "os._exit(0)\n"
        )
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
        (found,) = fsdp_nb.sessions()
        assert not found.attached and found.world_size == 2
        assert found.keep_alive == 3600.0  # the seconds given, not True
        # meanwhile the ranks left their group (as after a failed collective): attach
        # sees it and forms the group again, keeping the engines' variables and models
        from fsdp_nb.engine.process_group import destroy

        read_port = "import os; group_port = os.environ['MASTER_PORT']"
        direct = ipp.Client(str(url_file))
        direct[:].execute(read_port, block=True)
        port = direct[:].pull("group_port", block=True)
        direct[:].apply_sync(destroy)
        direct.close()
        s3 = fsdp_nb.Session.attach(activate=False)
        assert [r.pid for r in s3.ranks] == pids and s3.launcher == "connected"
        s3.execute(read_port)
        assert s3.pull("group_port") != port  # a new rendezvous
        assert s3.pull("left_here") == [5, 6] and sorted(s3.models) == ["kept"]
        assert s3.all_reduce_check() == 1.0
        s3.execute("kept(torch.ones(1, 2)).sum().backward()")  # the model's mesh was re-pointed
        # a dead engine of a cluster attached to: restart says to start one, then takes it
        victim = psutil.Process(pids[1])
        victim.kill()
        victim.wait(30)
        with pytest.raises(RuntimeError, match=r"start 1 with the cluster's launcher, then call sess.restart"):
            s3.restart(drop=["kept"])
        cluster.start_engines_sync(n=1)
        deadline = time.monotonic() + 120  # until the new engine has registered
        while not set(s3.cluster.client.ids) - set(s3.cluster.engine_ids) and time.monotonic() < deadline:
            time.sleep(0.1)
        s3.restart(drop=["kept"])
        assert s3.ranks[0].pid == pids[0] and s3.ranks[1].pid != pids[1]
        s3.execute("kept_here = 'left_here' in globals()")
        assert s3.pull("kept_here") == [True, False] and s3.all_reduce_check() == 1.0  # the survivor's kept
        pids = [r.pid for r in s3.ranks]
        s3.shutdown()  # leaves the engines (not ours) and forgets the session
        assert fsdp_nb.sessions() == [] and all(psutil.pid_exists(p) for p in pids)
    finally:
        cluster.stop_cluster_sync()


def test_demo_command_runs_end_to_end():
    """`fsdp-nb demo` (the README's first command) in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_nb.cli", "demo", "-n", "2", "--backend", "gloo", "--steps", "3"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # the first thing a new user reads: no warnings (the engines' stderr is relayed)
    assert "Warning" not in out.stderr and "Warning" not in out.stdout, out.stderr[-3000:]
    for expected in ("all_reduce(sum of ranks) = 1 (expected 1)", "trained 3 steps",
                     "saved and inspected offline", "valid, world_size=2",
                     "session shut down cleanly"):
        assert expected in out.stdout


def test_ipyparallel_logs_follow_the_fsdp_nb_logger():
    import logging

    from fsdp_nb.runtime.launch_settings import ipp_log_level

    logger = logging.getLogger("fsdp_nb")
    old = logger.level
    try:
        logger.setLevel(logging.WARNING)
        assert ipp_log_level() == logging.ERROR  # engines' stop noise stays out of the notebook
        logger.setLevel(logging.DEBUG)
        assert ipp_log_level() == logging.DEBUG  # asking fsdp_nb for detail shows ipyparallel's
    finally:
        logger.setLevel(old)


def test_lines_printed_alike_show_once_at_eight_ranks_and_each_on_request(session_factory, capsys, monkeypatch):
    """8 CPU engines: a line every rank prints alike shows once, naming the ranks; lines
    that differ keep their tags, in order; ``output="each"`` and ``merge_output=False``
    show every rank's own. A line waits for the others' as long as they run (no hold:
    8 engines on 2 cores may lag each other by more than the default second)."""
    from fsdp_nb.runtime import output_lines

    monkeypatch.setattr(output_lines, "HOLD", 600.0)
    s = session_factory(8, private=True)
    try:
        s.execute("for i in range(3):\n"
                  "    print(f'step {i} loss 2.31')\n"
                  "    print('even' if rank % 2 == 0 else 'odd')\n"
                  "print(f'rank {rank} done')")
        lines = capsys.readouterr().out.splitlines()
        steps = [f"[ranks 0-7] step {i} loss 2.31" for i in range(3)]
        assert [ln for ln in lines if "step" in ln] == steps
        assert lines.count("[ranks 0,2,4,6] even") == lines.count("[ranks 1,3,5,7] odd") == 3
        assert all(lines.index(steps[i]) < lines.index(steps[i + 1]) for i in range(2))
        assert sorted(ln for ln in lines if "done" in ln) == [f"[rank {r}] rank {r} done" for r in range(8)]
        s.execute("print('hello')", output="each")
        assert sorted(capsys.readouterr().out.splitlines()) == [f"[rank {r}] hello" for r in range(8)]
        s.merge_output = False
        s.execute("print('hello')")
        assert len(capsys.readouterr().out.splitlines()) == 8
        s.merge_output = True
        s.execute("if rank == 0:\n    print('only rank 0')")
        assert capsys.readouterr().out == "[rank 0] only rank 0\n"
        with pytest.raises(TypeError, match="merge_output must be True or False"):
            s.merge_output = "yes"
        s.execute("print('quiet')", output="none")
        assert capsys.readouterr().out == ""
        with pytest.raises(RankError, match="loud"):  # nothing shown, but a failure still raises
            s.execute("print('x')\nif rank == 3:\n    raise ValueError('loud')", output=None)
        with pytest.raises(ValueError, match=r"allowed: 'all', 'each', 'none', 'rank0'"):
            s.execute("pass", output="every")
    finally:
        s.shutdown()
