"""The package's shape, as the architecture page and the import contract describe it."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import types
from pathlib import Path
from typing import Any

import pytest

import fsdp_nb

grimp = pytest.importorskip("grimp")  # the import graph's reader (test-core); a GPU machine may lack it

ROOT = Path(fsdp_nb.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages(fsdp_nb.__path__, "fsdp_nb."))


def _cycles(graph: Any) -> list[list[str]]:
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


MACHINERY = {"__init__", "cli", "context", "errors", "session", "torch_compat", "torch_compat_planning", "display",
             "engine", "formats", "frontends", "lifetime", "runtime", "wire"}
"""The shared machinery at the top: the front ends, the façade and its context, the
errors, torch_compat, and the packages every feature uses (the architecture page)."""
FEATURES = {"models", "checkpoints", "autosave", "memory", "steps", "hangs", "debugging", "recovery"}
"""The feature folders, each holding a feature's notebook half, rank half (``rank_*``), the
messages between them (``wire_*``) and its views."""


def test_the_top_holds_the_machinery_and_a_folder_per_feature():
    top = {p.stem for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert top == MACHINERY | FEATURES


def _rank_side() -> tuple[list[str], list[str]]:
    """(the features' rank halves and messages, their notebook halves), as named."""
    rank: list[str] = []
    notebook: list[str] = []
    for name in MODULES:
        parts = name.split(".")
        if len(parts) == 3 and parts[1] in FEATURES:
            (rank if parts[2].startswith(("rank_", "wire_")) else notebook).append(name)
    return rank, notebook


def test_the_rank_contract_names_every_rank_half_and_every_notebook_half():
    from helpers import import_contracts

    contract = import_contracts()["ranks"]
    rank, notebook = _rank_side()
    machinery = [f"fsdp_nb.{m}" for m in ("cli", "session", "context", "runtime", "lifetime", "frontends", "display")]
    for listed, named in ((contract["source_modules"], ["fsdp_nb.engine", *rank]),
                          (contract["forbidden_modules"], [*machinery, *notebook])):
        assert {"not in pyproject.toml's list": sorted(set(named) - set(listed)),
                "listed, not a module": sorted(set(listed) - set(named))} == {
            "not in pyproject.toml's list": [], "listed, not a module": []}


def test_no_feature_folder_holds_a_subpackage():
    for feature in FEATURES:
        assert [p.name for p in (ROOT / feature).iterdir() if (p / "__init__.py").exists()] == [], feature


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


# -- torch's private names: only in torch_compat*.py ------------------------------------------

OTHER_LIBRARIES_PRIVATE = {
    "_no_split_modules": "transformers: the blocks a model asks FSDP to cut at (a documented convention)",
    "_init_weights": "transformers: a model's initialiser of one module",
    "_is_hf_initialized": "transformers: the flag its initialiser skips modules by",
    "_view_name": "ipywidgets: a widget's view class, in its saved state",
    "_model_id": "ipywidgets: a widget's id, in its saved state",
    "_config": "ipyparallel: a client's connection settings",
    "_children": "ipyparallel: an AsyncResult's per-engine futures",
    "_output": "ipyparallel: a launcher's captured output",
    "_current_frames": "Python: every thread's innermost frame (sys)",
}
"""Private names of the other libraries fsdp_nb reads, each with whose it is: everything
else private that the package names outside torch_compat*.py is torch's, or a mistake."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_here(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name these modules define: modules, functions, classes, attributes, variables,
    arguments (torch_compat's left out: what it assigns on torch's objects is torch's)."""
    names = {p.stem for p in trees}
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
    return names


def _torch_private_uses(path: Path, tree: ast.Module, ours: set[str]) -> list[str]:
    """Where module ``tree`` names something of torch's that is private: an import of a
    private module or name, an attribute or a name in a string (``getattr(t, "_x")``, a
    frame's function name) that fsdp_nb does not define and no other library owns."""
    out = []
    for n in ast.walk(tree):
        found: list[str] = []
        if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "torch":
            module = n.module or ""
            found += [module] if any(_private(x) for x in module.split(".")) else []
            found += [a.name for a in n.names if _private(a.name)]
        elif isinstance(n, ast.Import):
            found += [a.name for a in n.names if a.name.split(".")[0] == "torch"
                      and any(_private(x) for x in a.name.split("."))]
        elif isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in ours:
            found.append("." + n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            v = n.value
            if v.isidentifier() and _private(v) and v not in ours:
                found.append(repr(v))
            elif v.startswith("torch.") and any(_private(x) for x in v.split(".")):
                found.append(repr(v))
        out += [f"{path.relative_to(ROOT.parent)}:{getattr(n, 'lineno', 0)}: {f}" for f in found
                if f.strip("'.") not in OTHER_LIBRARIES_PRIVATE]
    return out


TORCH_COMPAT = ("torch_compat.py", "torch_compat_planning.py")
"""The modules that may name torch's private API (paths under the package)."""


def test_torchs_private_names_appear_only_in_torch_compat():
    """A new torch breaks its private names first: they live in one module, which CI runs
    on both ends of the supported range. Read from the package's source (its syntax tree)."""
    trees = {p: ast.parse(p.read_text()) for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).as_posix() not in TORCH_COMPAT}
    ours = _defined_here(trees) - set(OTHER_LIBRARIES_PRIVATE)
    found = [use for p, tree in trees.items() for use in _torch_private_uses(p, tree, ours)]
    assert found == []


def test_the_scan_sees_each_way_of_naming_a_private_torch_name(tmp_path):
    """The scan itself, on code that uses torch's private names in each way it looks for."""
    code = ("from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader\n"
            "from torch.distributed.distributed_c10d import _get_default_group\n"
            "import torch._dynamo\n"
            "t = getattr(x, '_local_tensor', x)\n"
            "m = mesh._dim_group_names\n"
            "where = 'torch.distributed.checkpoint._extension'\n"
            "ok = (model._no_split_modules, self.mine)\n")
    path = ROOT / "example.py"
    uses = _torch_private_uses(path, ast.parse(code), {"mine"})
    assert sorted(u.split(": ", 1)[1] for u in uses) == sorted([
        "torch.distributed.checkpoint._fsspec_filesystem", "_get_default_group", "torch._dynamo",
        "'_local_tensor'", "._dim_group_names", "'torch.distributed.checkpoint._extension'"])


def _subclasses(cls: type) -> list[type]:
    """Every class under ``cls``, at any depth (asked of ``type``: a metaclass's own
    ``__subclasses__`` wants an argument)."""
    out: list[type] = []
    subs: list[type] = type.__subclasses__(cls)
    for sub in subs:
        out += [sub, *_subclasses(sub)]
    return out


def test_no_class_of_the_package_overrides_a_private_method_of_torch():
    """Overriding one of torch's private hooks (a reader's ``_slice_file``) is a private name
    too: every class the package defines, those its functions make on first use (the DCP
    readers and planners) included, against its torch bases."""
    from fsdp_nb.formats import dcp_reader, pickles

    for name in MODULES:
        importlib.import_module(name)
    dcp_reader.reader_classes()  # classes made when first needed, over torch's
    pickles.full_load_planner(True)
    pickles.load_planner(True)
    ours = {c for c in _subclasses(object) if str(vars(c).get("__module__", "")).startswith("fsdp_nb.")
            and c.__module__ not in ("fsdp_nb.torch_compat", "fsdp_nb.torch_compat_planning")}
    found = []
    for cls in ours:
        for attr in (a for a in vars(cls) if _private(a) and a != "_abc_impl"):  # Python's, on every ABC
            owners = [b.__module__ for b in cls.__mro__[1:] if attr in vars(b)]
            if any(o.split(".")[0] == "torch" for o in owners):
                found.append(f"{cls.__module__}.{cls.__qualname__}.{attr}")
    assert len(ours) > 100 and found == []


# -- the rank's state lives in its registry ---------------------------------------------------

_CONSTANT_CALLS = frozenset({"frozenset", "tuple", "Struct", "getLogger", "compile", "TypeVar", "MappingProxyType"})
"""Calls whose result a module may hold at its top: immutable values, a logger, a type variable."""


def _constant(node: ast.expr) -> bool:
    """Whether ``node``, the value of a module-level assignment, makes no mutable object: a
    literal, a tuple of constants, a name or attribute (an alias), a type expression, or a
    call of ``_CONSTANT_CALLS``."""
    if isinstance(node, (ast.Constant, ast.Name, ast.Attribute, ast.Subscript)):
        return True
    if isinstance(node, ast.Tuple):
        return all(_constant(e.value if isinstance(e, ast.Starred) else e) for e in node.elts)
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return all(_constant(n) for n in ast.iter_child_nodes(node) if isinstance(n, ast.expr))
    if isinstance(node, ast.Call):
        f = node.func
        return (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) in _CONSTANT_CALLS
    return False


def _rank_side_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] == "engine"
                  or (p.parent.name in FEATURES and p.name.startswith(("rank_", "wire_"))))


def test_no_module_rebinds_a_global():
    rebinds = [f"{p.relative_to(ROOT)}:{n.lineno} global {', '.join(n.names)}"
               for p in sorted(ROOT.rglob("*.py")) for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.Global)]
    assert rebinds == []


def test_the_rank_side_holds_no_mutable_state_but_the_registry():
    """Every rank-side module (engine/, rank_*, wire_*) keeps what changes in a part of the
    rank's registry (``fsdp_nb.engine.registry.RANK``, the one exception)."""
    held = []
    for p in _rank_side_files():
        for n in ast.parse(p.read_text()).body:
            if not isinstance(n, (ast.Assign, ast.AnnAssign)) or n.value is None:
                continue
            names = [t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)]
            if names in (["__all__"], ["RANK"]) or _constant(n.value):
                continue
            held.append(f"{p.relative_to(ROOT)}:{n.lineno} {', '.join(names)} = {ast.unparse(n.value)[:60]}")
    assert held == []
    registry = (ROOT / "engine" / "registry.py").read_text()
    assert "\nRANK = Registry()\n" in registry


def test_no_feature_hooks_an_optimizer_or_a_model_but_the_step_owner():
    """The step owner (``engine/step.py``) holds the only hooks on optimizers, modules and
    IPython's cell events; a feature listens to it."""
    hooks = ("register_step_pre_hook", "register_step_post_hook", "register_forward_pre_hook",
             "register_forward_hook", "register_optimizer_step_pre_hook", "register_optimizer_step_post_hook",
             "register_module_forward_pre_hook", "register_full_backward_hook")
    found = []
    for p in sorted(ROOT.rglob("*.py")):
        if p == ROOT / "engine" / "step.py":
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            name = n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else ""
            if name in hooks or (name == "register" and "events" in ast.unparse(n)):
                found.append(f"{p.relative_to(ROOT)}:{n.lineno} {name}")
    assert found == []
