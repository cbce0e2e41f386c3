"""Every Python block of the how-to pages names only what exists: the blocks the docs test
runs in a kernel, and the ones shown and never run (Slurm, containers, CUDA), which would
otherwise drift from the code unseen.

A block's ``%%px`` line is read by the magic's own parser; the rest is parsed, and each
``fsdp_nb`` module, name and call it makes is looked up: ``import fsdp_nb.x``, ``from
fsdp_nb.x import y``, ``fsdp_nb.y``, and ``sess.y`` (``sess``, or a name bound to
``fsdp_nb.Session(...)`` or ``fsdp_nb.Session.attach(...)``). A call's keyword arguments
must be ones its signature takes. A dotted ``fsdp_nb.`` name in any page's prose must
resolve too."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import fsdp_nb
from fsdp_nb.frontends.magics import parse_px

DOCS = Path(__file__).resolve().parents[2] / "docs"
HOW_TO = sorted((DOCS / "how-to").glob("*.md"))
_BLOCK = re.compile(r"^```(?:python|\{code-block\} python)\n(.*?)^```$", flags=re.S | re.M)


def attributes(cls: type) -> set[str]:
    """What an object of ``cls`` has: its classes' attributes and what their methods set on
    ``self`` (``self.x = ...``, ``self.x: T = ...``; not ``self.x == ...``)."""
    names = set(dir(cls))
    for c in cls.__mro__:
        if c.__module__.startswith("fsdp_nb"):
            names |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", inspect.getsource(c)))
    return names


SESSION = attributes(fsdp_nb.Session)


def returned(method: object) -> type | None:
    """The fsdp_nb class a method's return annotation names (``"StepsWidget"``), or None."""
    try:
        ann = inspect.signature(method).return_annotation  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    cls = getattr(fsdp_nb, ann, None) if isinstance(ann, str) else ann
    return cls if inspect.isclass(cls) and cls.__module__.startswith("fsdp_nb") else None


def _keywords_problems(call: ast.Call, target: object, what: str) -> list[str]:
    try:
        sig = inspect.signature(target)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return []
    return [f"{what}() takes no argument {k.arg}= (it takes {', '.join(sig.parameters)})"
            for k in call.keywords if k.arg is not None and k.arg not in sig.parameters]


def _parsed(code: str) -> tuple[ast.Module | None, list[str]]:
    """``code`` parsed, its ``%%px`` line read by the magic's parser (other magics and
    shell lines left out), and what failed."""
    found, lines = [], []
    for line in code.splitlines():
        if line.startswith("%%px"):
            try:
                parse_px(line[len("%%px"):])
            except ValueError as err:
                found.append(f"%%px: {err}")
            line = ""
        lines.append("" if line.lstrip().startswith(("%", "!")) else line)
    try:
        return ast.parse("\n".join(lines)), found
    except SyntaxError as err:
        return None, [*found, f"does not parse: {err}"]


def _sessions(tree: ast.Module) -> set[str]:
    """``sess`` and the names bound to ``fsdp_nb.Session(...)`` or ``fsdp_nb.Session.attach(...)``."""
    names = {"sess"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and ast.unparse(node.value.func) in ("fsdp_nb.Session", "fsdp_nb.Session.attach"):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _import_problems(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        found = []
        for alias in node.names:
            if alias.name.split(".")[0] == "fsdp_nb":
                try:
                    importlib.import_module(alias.name)
                except ImportError:
                    found.append(f"no module {alias.name}")
        return found
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fsdp_nb":
        try:
            module = importlib.import_module(node.module or "")
        except ImportError:
            return [f"no module {node.module}"]
        return [f"{node.module} has no {a.name}" for a in node.names if not hasattr(module, a.name)]
    return []


def _session_call(node: ast.AST, sessions: set[str]) -> type | None:
    """What ``sess.method(...)`` returns, when ``node`` is such a call and says (one level)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
            and node.func.value.id in sessions:
        return returned(getattr(fsdp_nb.Session, node.func.attr, None))
    return None


def _typed(tree: ast.Module, sessions: set[str]) -> dict[str, type]:
    """Names bound to what a session's method returns (``view = sess.steps()``)."""
    out: dict[str, type] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and (cls := _session_call(node.value, sessions)) is not None:
            out |= {t.id: cls for t in node.targets if isinstance(t, ast.Name)}
    return out


def _returned_problems(node: ast.AST, sessions: set[str], typed: dict[str, type]) -> list[str]:
    """``sess.steps(...).log_to`` and ``view.log_to`` (``view = sess.steps()``): the attribute
    must be one the returned class has."""
    if not isinstance(node, ast.Attribute):
        return []
    value = node.value
    cls = typed.get(value.id) if isinstance(value, ast.Name) else _session_call(value, sessions)
    if cls is None or node.attr in attributes(cls):
        return []
    return [f"a {cls.__name__} has no {node.attr}"]


def _use_problems(node: ast.AST, sessions: set[str]) -> list[str]:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id == "fsdp_nb" and not hasattr(fsdp_nb, node.attr):
            return [f"fsdp_nb has no {node.attr}"]
        if node.value.id in sessions and node.attr not in SESSION:
            return [f"a Session has no {node.attr}"]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
        owner, name = node.func.value.id, node.func.attr
        if owner == "fsdp_nb" and hasattr(fsdp_nb, name):
            return _keywords_problems(node, getattr(fsdp_nb, name), f"fsdp_nb.{name}")
        if owner in sessions and callable(getattr(fsdp_nb.Session, name, None)):
            return _keywords_problems(node, getattr(fsdp_nb.Session, name), f"sess.{name}")
    return []


def problems(code: str) -> list[str]:
    """What ``code`` names that does not exist, in words; [] when all of it does."""
    tree, found = _parsed(code)
    if tree is None:
        return found
    sessions = _sessions(tree)
    typed = _typed(tree, sessions)
    for node in ast.walk(tree):
        found += _import_problems(node) + _use_problems(node, sessions) + _returned_problems(node, sessions, typed)
    return found


@pytest.mark.parametrize("page", HOW_TO, ids=[p.stem for p in HOW_TO])
def test_a_how_to_pages_code_names_only_what_exists(page):
    said = {f"block {i + 1}: {p}" for i, code in enumerate(_BLOCK.findall(page.read_text())) for p in problems(code)}
    assert sorted(said) == []


def test_the_check_finds_a_name_an_argument_or_a_module_that_is_gone():
    assert sorted(problems("import fsdp_nb\nsess = fsdp_nb.Session(2)\nsess.savez('x')\nsess.autosave('d', evry=9)")) == [
        "a Session has no savez", "sess.autosave() takes no argument evry=" + _takes("autosave")]
    assert problems("from fsdp_nb.checkpoints import nothing_here") == ["fsdp_nb.checkpoints has no nothing_here"]
    assert problems("import fsdp_nb.no_such") == ["no module fsdp_nb.no_such"]
    assert problems("fsdp_nb.WireError") == ["fsdp_nb has no WireError"]
    assert problems("s = fsdp_nb.Session.attach()\ns.save('p', model, optimiser='opt')") == [
        "sess.save() takes no argument optimiser=" + _takes("save")]
    assert problems("%%px --debugg 1\nx = 1") and problems("x = (") == [
        "does not parse: '(' was never closed (<unknown>, line 1)"]
    assert problems("%%px --debug 1 --check-collectives\nbreakpoint()\nsess.steps(window=20).log_to(w)") == []
    assert problems("sess.steps(window=20).log_tooo(w)") == ["a StepsWidget has no log_tooo"]
    assert problems("v = sess.steps()\nv.log_to(w)\nv.refreshh()") == ["a StepsWidget has no refreshh"]


def _takes(name: str) -> str:
    return f" (it takes {', '.join(inspect.signature(getattr(fsdp_nb.Session, name)).parameters)})"


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` (``fsdp_nb.errors.WireError``) names a module or an attribute."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_dotted_fsdp_nb_name_the_pages_give_resolves():
    pages = [*DOCS.rglob("*.md"), DOCS.parent / "README.md"]
    named = {(str(p.relative_to(DOCS.parent)), m) for p in pages
             for m in re.findall(r"`(fsdp_nb(?:\.\w+)+)(?:\(|`)", p.read_text())}
    assert len(named) > 20 and resolves("fsdp_nb.errors.RankError") and not resolves("fsdp_nb.WireError")
    files = ("sbatch", "sh", "def", "sif", "sqsh", "py", "log", "json")  # fsdp_nb.sbatch: a file's name
    assert sorted((page, name) for page, name in named if not resolves(name) and name.split(".")[-1] not in files) == []
