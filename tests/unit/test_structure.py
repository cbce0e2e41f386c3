"""The package's shape, as the architecture page and the import contract describe it."""

from __future__ import annotations

import importlib
import pkgutil
import types
from pathlib import Path

import grimp
import pytest

import fsdp_nb

ROOT = Path(fsdp_nb.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages(fsdp_nb.__path__, "fsdp_nb."))


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycle_among_the_modules_at_import_time():
    graph = grimp.build_graph("fsdp_nb", exclude_type_checking_imports=True, cache_dir=None)
    assert _cycles(graph) == []


def test_at_most_sixteen_modules_at_the_top():
    # the layers' packages (display: what every layer above the runtime prints through;
    # formats: the file formats, below the engines), the command line (above the facade,
    # so no package holds both a layer above the facade and one below it), the facade,
    # the context, the errors, and torch_compat: the one module that touches torch's
    # private API (below every layer that uses it)
    top = [p.name for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()]
    assert len(top) <= 16, sorted(top)


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_450_lines(path):
    assert len(path.read_text().splitlines()) <= 450


def test_every_module_imports_and_no_package_hides_a_module_behind_a_name():
    for name in MODULES:
        module = importlib.import_module(name)
        parent, _, leaf = name.rpartition(".")
        value = getattr(importlib.import_module(parent), leaf)
        assert isinstance(value, types.ModuleType), f"{parent}.{leaf} is {value!r}, not its module"
        assert module.__doc__, f"{name} says nothing of what it holds"



def test_binder_installs_the_package_with_its_declared_dependencies():
    binder = ROOT.parent / "binder"
    pinned = [ln.split("=")[0].split(">")[0] for ln in (binder / "requirements.txt").read_text().splitlines()
              if ln.strip() and not ln.startswith(("#", "--"))]
    assert pinned == ["torch", "jupyterlab"]  # the CPU torch first; the rest from pyproject
    post = (binder / "postBuild").read_text()
    assert "pip install -e" in post and "--no-deps" not in post


def test_the_facade_documents_every_parameter():
    import inspect

    from fsdp_nb.session import Session

    calls = {"Session": (Session.__init__, Session.__doc__)}
    for name, fn in inspect.getmembers(Session, inspect.isfunction):
        if not name.startswith("_"):
            calls[name] = (fn, fn.__doc__)
    for name in ("connect", "attach"):
        fn = getattr(Session, name)
        calls[name] = (fn, fn.__doc__)
    missing = {}
    for name, (fn, doc) in calls.items():
        params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
        lost = [p for p in params if f"{p}:" not in (doc or "")]
        if lost:
            missing[name] = lost
    assert missing == {}
