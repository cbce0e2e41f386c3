"""A session and its kernel, in a real Jupyter kernel driven through jupyter_client.

- kept alive: wrap, train, restart the kernel (``restart_kernel(now=True)`` kills it),
  ``Session.attach()`` in the new kernel: same ranks, weights, optimizer and
  variables, ``%%px``, widgets and post-mortem pdb (answered through the kernel's
  stdin channel) work, training goes on; ``shutdown()`` then stops the engines;
- not kept alive: the controller and engines are gone within 30 s of the kernel's
  death (the watchdog), and ``keep_alive=<seconds>`` stops an unattended session.

Each test has its own IPYTHONDIR (profiles, cluster files, session records).
"""

from __future__ import annotations

import os

import pytest
from helpers import START_S, Kernel

import fsdp_nb
from fsdp_nb.engine.process_handles import process_alive
from fsdp_nb.runtime.cluster import wait_until


def _gone(pids: list[int]) -> bool:
    return not any(process_alive(p) for p in pids)


def _wait_gone(pids: list[int], within: float) -> None:
    """Wait until every process in ``pids`` is gone; fail after ``within`` seconds."""
    if not wait_until(lambda: _gone(pids), within, 0.2):
        pytest.fail(f"processes {[p for p in pids if process_alive(p)]} still run after {within} s")


_SETUP = """
import os, torch, fsdp_nb
sess = fsdp_nb.Session(2, backend="gloo", keep_alive={keep})

class Net(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.a = torch.nn.Linear(d, d)
        self.b = torch.nn.Linear(d, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

model = sess.wrap(Net, d=8, name="model")
"""

_STEP = """%%px
torch.manual_seed(rank)
loss = model(torch.randn(4, 8)).pow(2).sum()
loss.backward()
opt.step()
opt.zero_grad()
steps = steps + 1
"""

_WEIGHTS = "{k: v.tolist() for k, v in sess.models['model'].state_dict().items()}"


def _processes(k: Kernel) -> list[int]:
    """Engine pids, the controller's and the standby engine's of the kernel's session."""
    engines = k.value("[r.pid for r in sess.ranks]")
    controller = k.value("sess.cluster.cluster.controller.pid")
    standby = k.value("sess.cluster.standby.pid")
    assert isinstance(engines, list) and isinstance(controller, int) and isinstance(standby, int)
    return [*engines, controller, standby]


def test_kept_alive_session_survives_a_kernel_restart_and_attach_gets_it_back(kernel, tmp_path):
    k = kernel
    k.run(_SETUP.format(keep=True), timeout=START_S)
    k.run("%%px\nopt = torch.optim.AdamW(model.parameters(), lr=0.01)\nsteps = 0\nnote = f'rank {rank}'")
    k.run(f"auto = {str(tmp_path)!r}\nsess.autosave(auto, every=1, model='model', optimizer='opt')")
    k.run(_STEP)
    before = k.value(_WEIGHTS)
    pids = _processes(k)
    ports = k.value("sess.run(lambda: os.environ['MASTER_PORT'])")
    cluster_id = k.value("sess.context.keeper.record.cluster_id")
    # while its kernel runs, nobody else may take it
    with pytest.raises(RuntimeError, match=f"held by the kernel with pid {k.pid}"):
        fsdp_nb.Session.attach(cluster_id)

    waiting = k.value("sess.cluster.standby.go_file") + ".waiting"
    assert wait_until(lambda: os.path.exists(waiting), 120)  # the standby's imports are done
    k.restart()
    assert not _gone(pids)  # the engines outlived the kernel
    assert [(s.cluster_id, s.attached) for s in fsdp_nb.sessions()] == [(cluster_id, False)]
    k.run("import os, torch, fsdp_nb\nsess = fsdp_nb.Session.attach()", timeout=START_S)
    assert k.value("sess.state") == "ready"
    assert k.value("[r.pid for r in sess.ranks]") == pids[:2]  # same ranks, same order
    assert k.value("sess.cluster.standby.pid") == pids[3]  # the standby waited for it
    assert k.value("sorted(sess.models)") == ["model"]
    # the ranks' autosave comes back with them, counting on from where it was
    assert k.value("[r.step for r in sess.autosave().ranks]") == [1, 1]
    assert k.value(_WEIGHTS) == before
    assert k.value("sess.pull('note'), sess.pull('steps')") == (["rank 0", "rank 1"], [1, 1])
    assert "FSDPNet" in k.value("repr(sess.models['model'])")
    # the group is the one formed before the restart (a re-formed one would be on a
    # fresh port) and it works
    assert k.value("sess.run(lambda: os.environ['MASTER_PORT'])") == ports
    assert k.value("sess.all_reduce_check()") == 1.0
    # %%px and the optimizer still work: training goes on from where it was
    k.run(_STEP)
    after = k.value(_WEIGHTS)
    assert after != before and k.value("sess.pull('steps')") == [2, 2]
    assert k.value("len(sess.pull('opt')[0].state)") > 0
    # widgets: live memory samples from every rank, the layout of the attached model
    k.run("w = sess.memory(interval=0.2)\nsess.execute('import time; time.sleep(1.5)')\nw.close()")
    got = k.value("[len(w.feed.samples(r)) for r in range(2)]")
    assert all(c >= 3 for c in got), got
    assert "a.weight" in k.value("sess.models['model'].layout().to_text()")
    # post-mortem pdb in the kernel, commands answered on its stdin channel
    k.run("try:\n    sess.execute('if rank == 1:\\n    secret = 41\\n    raise ValueError(\"x\")')\n"
          "except fsdp_nb.RankError:\n    pass")
    out = k.run("sess.debug()", answers=["p secret + 1", "q"])
    assert "(Pdb rank 1) " in out and "42" in out
    out = k.run("%fsdp debug 1", answers=["p secret", "q"])
    assert "41" in out
    assert cluster_id in k.run("%fsdp list")

    k.run("sess.shutdown()", timeout=60)
    _wait_gone(pids, 30)
    assert fsdp_nb.sessions() == []


def test_without_keep_alive_the_engines_stop_when_the_kernel_dies(kernel):
    k = kernel
    k.run(_SETUP.format(keep=False), timeout=START_S)
    pids = _processes(k)
    k.restart()
    _wait_gone(pids, 30)
    assert fsdp_nb.sessions() == []
    with pytest.raises(LookupError, match="no kept-alive fsdp_nb session to attach to"):
        fsdp_nb.Session.attach()


def test_keep_alive_seconds_stops_an_unattended_idle_session(kernel, tmp_path):
    k = kernel
    k.run(_SETUP.format(keep=2), timeout=START_S)
    pids = _processes(k)
    record = k.value("sess.context.keeper.record.path")
    k.restart()
    _wait_gone(pids, 30)
    log = open(record.removesuffix(".json") + ".watchdog.log").read()
    assert "no kernel and no work for keep_alive=2.0 s" in log
    assert fsdp_nb.sessions() == []
