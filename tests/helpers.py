"""Helpers the tests share (polling for a condition is the package's own
``fsdp_nb.runtime.cluster.wait_until``): a real kernel driven through
jupyter_client, hand-built shard tables, the page cache's view of a file, a pickle
that runs code (what an attacker puts in a checkpoint), the fakes
of the unit tier (a cluster and a dispatcher that run nothing), and the whole state of
a model and its optimizer, gathered and compared bit for bit.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from jupyter_client.manager import KernelManager
from torch import nn

# -- an attacker's pickle -----------------------------------------------------------


class RunsCode:
    """Pickles to ``exec(code)``: what an attacker puts into a checkpoint."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


# -- a real kernel -------------------------------------------------------------------

START_S = 180
"""A kernel cell that starts a session gets this long."""


class Kernel:
    """A real IPython kernel and a blocking client; ``run`` returns a cell's stdout."""

    def __init__(self, ipythondir: str):
        env = dict(os.environ, IPYTHONDIR=ipythondir, OMP_NUM_THREADS="1")
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        pid = getattr(self.km.provisioner, "pid", None)  # a local provisioner's (jupyter_client types it None)
        if not isinstance(pid, int):
            raise RuntimeError(f"the kernel has no local process id (provisioner {self.km.provisioner!r})")
        return pid

    def run(self, code: str, timeout: float = 120, answers: list[str] | None = None) -> str:
        """Run ``code``; its stdout (stderr too). A cell that raises fails the test
        with the kernel's traceback. ``answers`` reply to ``input()`` prompts in order."""
        out: list[str] = []
        errors: list[str] = []
        pending = list(answers or [])

        def on_output(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                errors.append("\n".join(content["traceback"]))

        def on_stdin(msg):
            out.append(msg["content"]["prompt"])
            self.kc.input(pending.pop(0) if pending else "q")

        reply = self.kc.execute_interactive(
            code, timeout=timeout, output_hook=on_output, stdin_hook=on_stdin,
            allow_stdin=answers is not None,
        )
        if reply["content"]["status"] != "ok":
            pytest.fail(f"kernel cell failed:\n{code}\n{''.join(out)}\n" + "\n".join(errors))
        return "".join(out)

    def value(self, expr: str) -> object:
        """A Python literal computed in the kernel."""
        return ast.literal_eval(self.run(f"print(repr(({expr})))").strip().splitlines()[-1])

    def restart(self) -> None:
        """Kill the kernel process and start a new one (as Jupyter's restart does)."""
        self.km.restart_kernel(now=True)
        self.kc.wait_for_ready(timeout=60)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


# -- shard tables ----------------------------------------------------------------

TABLE_CODE = '''
from fsdp_nb.models.wire_shards import ParamShard, ShardTable

def _param(name, shape, sizes, mesh=(3,), dims=("dp_shard",), placements=("Shard(0)",)):
    rest = 1
    for d in shape[1:]:
        rest *= d
    offsets, o = [], 0
    for s in sizes:
        offsets.append((o,) + (0,) * (len(shape) - 1))
        o += s
    return ParamShard(name, tuple(shape), "float32", placements, mesh, dims,
                      tuple((s,) + tuple(shape[1:]) for s in sizes), tuple(offsets),
                      tuple(s * rest * 4 for s in sizes))

def hand_table():
    """3 ranks, uneven shards (10 rows over 3 ranks), one rank holding nothing of one."""
    return ShardTable("model", 3, (3,), ("dp_shard",), (
        _param("blocks.0.lin.weight", (10, 4), (4, 4, 2)),
        _param("blocks.0.lin.bias", (10,), (4, 4, 2)),
        _param("head.weight", (2, 10), (1, 1, 0)),
    ))

def hybrid_table():
    """4 ranks on a 2x2 (dp_replicate, dp_shard) mesh: replicated across rows."""
    mesh, dims, pl = (2, 2), ("dp_replicate", "dp_shard"), ("Replicate()", "Shard(0)")
    p = ParamShard("w", (8, 2), "float32", pl, mesh, dims, ((4, 2),) * 4,
                   ((0, 0), (4, 0), (0, 0), (4, 0)), (32,) * 4)
    return ShardTable("hybrid", 4, mesh, dims, (p,))
'''

_ns: dict = {}
exec(TABLE_CODE, _ns)
hand_table = _ns["hand_table"]
hybrid_table = _ns["hybrid_table"]


# -- the page cache ----------------------------------------------------------------

class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recent")]


def page_cache(fd: int) -> tuple[int, int] | None:
    """(pages of file ``fd`` in the page cache, of which not yet handed to the disk);
    None where this kernel lacks the call."""
    libc = ctypes.CDLL(None, use_errno=True)
    st = _Stat()
    if libc.syscall(451, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(st), 0) != 0:  # cachestat
        return None
    return st.cache, st.dirty


# -- fakes of the unit tier ---------------------------------------------------------


class FakeReply:
    """One rank's answer, as a ``RankReply``, set by the test: a value, an error, or
    still running (``done=False``) until ``finish`` is called."""

    def __init__(self, value: Any = None, *, error: BaseException | None = None, done: bool = True,
                 completed: float | str | None = None, stdout: str = "", stderr: str = ""):
        self.value, self.error, self.done = value, error, done
        self.metadata: dict[str, Any] = {"stdout": stdout, "stderr": stderr}
        if completed is not None:
            from datetime import datetime, timezone

            self.metadata["completed"] = (completed if isinstance(completed, str)
                                          else datetime.fromtimestamp(completed, timezone.utc))

    def finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error, self.done = value, error, True

    def ready(self) -> bool:
        return self.done

    def successful(self) -> bool:
        if not self.done:
            raise RuntimeError("not done")
        return self.error is None

    def get(self, timeout: float | None = None) -> Any:
        if not self.done:
            raise TimeoutError("Result not ready.")
        if self.error is not None:
            raise self.error
        return self.value

    def wait_for_output(self, timeout: float = -1) -> bool:
        return self.done

    @property
    def data(self) -> dict[str, Any] | None:
        return self.metadata.get("data")


class FakeCluster:
    """The part of an ``EngineCluster`` the dispatcher, context and policies read: ranks,
    deaths (set ``dead``), and a log of what was asked of it."""

    def __init__(self, n: int = 2):
        from fsdp_nb.runtime.rendezvous import RankInfo

        self.ranks = [RankInfo(rank=r, engine_id=r, host="here", pid=1000 + r, device="cpu",
                               local_rank=r, local_world_size=n, addr="127.0.0.1") for r in range(n)]
        self.dead: set[int] = set()
        self.asked: list[tuple[str, Any]] = []

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def dead_ranks(self) -> list[int]:
        return sorted(self.dead)

    def start_replacements(self, dead: list[int]) -> None:
        self.asked.append(("start_replacements", list(dead)))

    def keep_standby(self, adopt: bool = False) -> None:
        self.asked.append(("keep_standby", adopt))


def pending_of(replies: dict[int, FakeReply], what: str = "call",
               waiter: Callable[[list[Any], float], Any] | None = None) -> Any:
    """A dispatcher's ``Pending`` over fake replies; ``waiter`` runs at each wait (a test
    finishes replies there) after a short sleep."""
    from fsdp_nb.runtime.dispatch import Pending

    def wait(results: list[Any], timeout: float) -> None:
        time.sleep(min(timeout, 0.005))
        if waiter is not None:
            waiter(results, timeout)

    return Pending(what, dict(replies), waiter=wait)


def fake_context(n: int = 2) -> Any:
    """A ``SessionContext`` over a ``FakeCluster`` whose dispatchers only report."""
    from fsdp_nb.context import SessionContext
    from fsdp_nb.runtime.dispatch import Dispatcher

    cluster: Any = FakeCluster(n)
    d = Dispatcher(cluster)
    d.echo = False
    return SessionContext(cluster=cluster, recovering=d, plain_dispatcher=d, channel=None,  # type: ignore[arg-type]
                          health=None, backend="gloo", launcher="local", pg_timeout=60.0,  # type: ignore[arg-type]
                          omp_threads=None)


class FakeDispatcher:
    """A dispatcher that runs nothing: ``apply`` records the call, ``gather`` answers
    with ``answers[fn.__name__]`` (a list per rank, or an exception to raise)."""

    def __init__(self, answers: dict[str, Any]):
        self.answers = answers
        self.sent: list[tuple[str, str, tuple]] = []

    def apply(self, what: str, fn: Callable[..., Any], args: tuple = (), **kwargs: Any) -> Any:
        self.sent.append((what, fn.__name__, tuple(args)))
        return fn.__name__

    def gather(self, name: str, timeout: float | None = None) -> list[Any]:
        answer = self.answers[name]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def killable_session(session_factory: Any, n: int, code: str) -> Iterator[Any]:
    """A module fixture's body: an ``n``-rank session of its own (for tests that kill
    engines: a short grace), ``code`` run on it, shut down when the module ends. Each
    test takes it through :func:`whole`, so a rank a test before left dead, or a world it
    resized, is mended first."""
    s = session_factory(n, private=True, grace=1.0)
    s.execute(code)
    yield s
    s.shutdown()


def whole(s: Any, n: int) -> Any:
    """``s`` with ``n`` ranks, every one alive, and usable: what a test's kill or resize
    left (a rank dead, a restart left unfinished, another world size) is mended here, by a
    plain restart or a resize, and said in the log. What a test bound on the ranks stays:
    each test arms what it uses."""
    import logging

    from fsdp_nb.errors import DeadRankError, SessionUnfinishedError

    log = logging.getLogger("fsdp_nb")
    try:
        s.execute("pass")
    except (DeadRankError, SessionUnfinishedError) as exc:
        log.warning("tests: a test before left the session broken (%s); restarting it", exc)
        s.restart()
    if s.world_size != n:
        log.warning("tests: a test before left %d ranks; resizing to %d", s.world_size, n)
        s.resize(n)
    return s


def on_marker(path, action, timeout: float = 60.0) -> threading.Thread:
    """Run ``action`` in a thread once ``path`` exists: a marker the engine writes when
    it has reached the point where the fault should hit (never a timer)."""

    def wait() -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        action()

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


def mark_code(path) -> str:
    """Engine code that writes the marker ``path``."""
    return f"open({str(path)!r}, 'w').close()\n"


def full_state(model_name: str, optim_name: str) -> Callable[[], Any]:
    """A function for ``sess.run``: the full state of engine globals ``model_name`` and
    ``optim_name`` (model and optimizer state dicts, CPU tensors) on rank 0, None elsewhere."""

    def get() -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        g = globals()
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd, osd = get_state_dict(g[model_name], [g[optim_name]], options=opts)
        return (msd, osd) if g["rank"] == 0 else None

    return get


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` (nested dicts, lists, tensors, values) are equal, tensors bit for bit."""
    import torch

    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    else:
        assert a == b, where


def straggle(go: Any) -> str:
    """A cell line on which rank 1 polls for the file ``go`` (which
    :func:`release_on_diagnosis` creates): one line, so a stack sample names it
    whether it lands in the test or in the sleep."""
    return f"while rank == 1 and not os.path.exists({str(go)!r}): time.sleep(0.02)\n"


@contextlib.contextmanager
def release_on_diagnosis(sess: Any, go: Any) -> Iterator[list[str]]:
    """While inside, the first hang diagnosis ``sess`` reports creates the file ``go``
    (which a straggling rank polls for); yields the diagnoses' texts as they come."""
    seen: list[str] = []

    def release(event: Any) -> None:
        if event.phase == "hang":
            seen.append(event.note)
            go.touch()

    sess.dispatcher.observers.append(release)
    try:
        yield seen
    finally:
        sess.dispatcher.observers.remove(release)


def import_contracts() -> dict[str, dict[str, Any]]:
    """The import contracts of pyproject.toml, by id (``tomllib``, or ``tomli`` on Python 3.10)."""
    import importlib
    import sys
    from pathlib import Path

    toml = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
    config = toml.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    return {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}


def forget_models(sess: Any, *names: str, optimizers: tuple[str, ...] = ()) -> None:
    """Take models a test wrapped (and the engine globals ``optimizers``) off a shared
    session, on the ranks and in the notebook, so a later restart does not rebuild them."""
    from fsdp_nb.models.rank_wrap import forget_all

    sess.run(forget_all, names)
    for name in names:
        sess.context.wraps.pop(name, None)
        sess.context.models.pop(name, None)
    if optimizers:
        sess.execute("".join(f"del {o}\n" for o in optimizers))


# -- a training run that resumes (tests of run state, autosave and restart) -------------

class DropNet(nn.Module):
    """Dropout between two layers: a resumed run that drew other masks would differ."""

    def __init__(self, dim: int = 8, hidden: int = 32):
        super().__init__()
        self.inp = nn.Linear(dim, hidden)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.inp(x))))


RUN_LOOP = """
import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

def rs_setup(name, scale=1.0, lr=0.02, eps=1e-8):
    global rs_opt, rs_sched, rs_loader, rs_it, rs_scale
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=5)
    # a generator of its own: making an iterator then draws nothing from torch's global
    # one, so a resumed loop's dropout masks are the saved run's
    rs_loader = StatefulDataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
    rs_opt = torch.optim.AdamW(globals()[name].parameters(), lr=lr, eps=eps)
    rs_sched = torch.optim.lr_scheduler.StepLR(rs_opt, step_size=2, gamma=0.7)
    rs_it, rs_scale = None, scale

def rs_train(name, n, scaled=False):
    global rs_it
    m, losses = globals()[name], []
    m.train()
    for _ in range(n):
        if rs_it is None:
            rs_it = iter(rs_loader)
        xb, yb = next(rs_it)
        loss = torch.nn.functional.mse_loss(m(xb), yb) * rs_scale
        if scaled:
            scaler.scale(loss).backward()
            scaler.step(rs_opt)
            scaler.update()
        else:
            loss.backward()
            rs_opt.step()
        rs_opt.zero_grad()
        rs_sched.step()
        losses.append(loss.item() / rs_scale)
    return losses

def rs_eval(name):
    m = globals()[name]
    m.eval()
    with torch.no_grad():
        x, y = rs_loader.dataset.tensors
        return torch.nn.functional.mse_loss(m(x), y).item()

def rs_weights(name):
    return {k: v.full_tensor().clone() for k, v in globals()[name].state_dict().items()}
"""


def run_out(sess: Any, code: str) -> list:
    """Run ``code`` on every rank; each rank's ``rs_out`` after it."""
    sess.execute(code)
    return sess.pull("rs_out")
