"""Shared fixtures: one real 2-rank gloo session for the whole run.

Every test uses real ipyparallel engines and real gloo process groups. IPYTHONDIR
points at a temporary folder so profiles and connection files never touch ~/.ipython.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # started in the background by a non-interactive shell, which ignores SIGINT: the
    # Ctrl-C tests press it with _thread.interrupt_main(), which needs Python's handler,
    # and the engines started from here would inherit the ignoring
    signal.signal(signal.SIGINT, signal.default_int_handler)
IPYTHONDIR = tempfile.mkdtemp(prefix="fsdp_nb_ipython_")
os.environ["IPYTHONDIR"] = IPYTHONDIR

import pytest  # noqa: E402

import fsdp_nb  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _private_ipythondir():
    """Profiles and connection files live in a temporary IPYTHONDIR, removed at the end
    (after every session fixture has shut its cluster down)."""
    yield IPYTHONDIR
    shutil.rmtree(IPYTHONDIR, ignore_errors=True)


@pytest.fixture(scope="session")
def session_factory():
    """Extra real sessions: ``session_factory(n, **options)``.

    Sessions with the same ``n`` and options are shared across test files (one 3-rank
    session for the run, not one per file); ``private=True`` gives a test its own, for
    tests that kill engines. Every session made is shut down at the end of the run
    (a test or module may shut its own down earlier: shutdown is idempotent).
    """
    made: dict[object, fsdp_nb.Session] = {}

    def make(n: int, *, private: bool = False, **options) -> fsdp_nb.Session:
        options.setdefault("backend", "gloo")
        options.setdefault("activate", False)
        key = (n, tuple(sorted(options.items())))
        if not private and key in made and made[key].state != "closed":
            return made[key]
        s = fsdp_nb.Session(n, **options)
        made[object() if private else key] = s
        return s

    yield make
    for s in made.values():
        s.shutdown()


@pytest.fixture(scope="session")
def sess():
    """The shared 2-rank CPU session; tests must leave it usable."""
    s = fsdp_nb.Session(2, backend="gloo")
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo group in this test process (unit tests of what reads groups); left at
    the module's end."""
    import torch.distributed as dist

    if dist.is_initialized():  # left by an earlier module: its tests, not these, must be fixed
        pytest.fail("a process group is already formed in this test process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def artifacts(tmp_path):
    """Where a test leaves what a person may want to look at (screenshots, console logs):
    the folder ``FSDP_NB_ARTIFACTS`` names, if set; else the test's temporary folder, so a
    run writes nothing outside the temporary folders pytest removes."""
    kept = os.environ.get("FSDP_NB_ARTIFACTS")
    if kept:
        os.makedirs(kept, exist_ok=True)
        return kept
    return str(tmp_path)


@pytest.fixture(scope="session")
def shell():
    """A real IPython shell (the notebook's kernel without the kernel)."""
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    return ip


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a machine with a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A real Jupyter kernel (``kernels.Kernel``) with its own IPYTHONDIR (this test
    process looks there too); whatever session it left running is shut down."""
    from helpers import Kernel

    ipythondir = str(tmp_path / "ipython")
    monkeypatch.setenv("IPYTHONDIR", ipythondir)
    k = Kernel(ipythondir)
    yield k
    try:
        k.run("import fsdp_nb.session as s\nfor x in list(s._LIVE): x.shutdown()", timeout=60)
    finally:
        k.close()
    for rec in fsdp_nb.sessions():  # anything still running from this test's folder
        fsdp_nb.Session.attach(rec.cluster_id).shutdown()
