"""Shared fixtures: one real 2-rank gloo session for the whole run.

Every test uses real ipyparallel engines and real gloo process groups. IPYTHONDIR
points at a temporary folder so profiles and connection files never touch ~/.ipython.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["IPYTHONDIR"] = tempfile.mkdtemp(prefix="fsdp_nb_ipython_")

import pytest  # noqa: E402

import fsdp_nb  # noqa: E402


@pytest.fixture(scope="session")
def sess():
    """The shared 2-rank CPU session; tests must leave it usable."""
    s = fsdp_nb.Session(2, backend="gloo")
    yield s
    s.shutdown()


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
    skip = pytest.mark.skip(reason="needs CUDA (run with the device tool where a GPU is lent)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
