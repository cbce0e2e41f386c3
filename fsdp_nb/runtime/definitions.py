"""The session's definitions: what a rank that joins later must be given to run the next cell.

Every ``%%px`` cell (and ``sess.execute`` on every rank) that succeeds is read for its
top-level imports, classes and functions; ``sess.push`` of a class, function or module
is kept as it was shipped. Variables are not: they belong to the ranks that made them.
A rank that joins later (``sess.resize`` growing the world, ``sess.restart`` replacing a
dead one) gets them replayed in the order they were made (``fsdp_nb.engine.definitions``);
a definition made again replaces the earlier one.
"""

from __future__ import annotations

import ast
import functools
import logging
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..engine import definitions as _defs
from .shipping import by_value

if TYPE_CHECKING:
    from .dispatch import Dispatcher

__all__ = ["Definitions", "top_level_definitions"]

log = logging.getLogger("fsdp_nb")

_KEPT = (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@functools.cache
def _transformer() -> Any:
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager()


def _python(code: str) -> str:
    """``code`` as IPython runs it: magics and shell escapes turned into Python."""
    return _transformer().transform_cell(code)


def top_level_definitions(code: str) -> list[tuple[str, str]]:
    """``(key, source)`` of each top-level import, class and function in cell ``code``:
    the key is the name a definition binds (``import:`` + the statement for imports);
    empty when the cell is not Python (it would not have run either). This runs after
    every cell, so a cell without those words is not parsed, and IPython's transforms
    (magics, ``!`` lines) are applied only to a cell that is not plain Python."""
    if not any(word in code for word in ("import", "class", "def")):
        return []
    try:
        tree = ast.parse(code)
    except SyntaxError:
        try:
            tree = ast.parse(_python(code))
        except SyntaxError:
            return []
    out = []
    for node in tree.body:
        if not isinstance(node, _KEPT):
            continue
        source = ast.unparse(node)
        key = f"import:{source}" if isinstance(node, (ast.Import, ast.ImportFrom)) else node.name
        out.append((key, source))
    return out


def _shippable(value: Any) -> bool:
    return isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType))


class Definitions:
    """The definitions a session made on every rank, in the order they were made."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[str, Any]] = {}
        """Key -> ``("source", code)`` or ``("value", (name, ByValue))``; insertion order is
        the replay order (a key made again moves to the end)."""

    def note_code(self, code: str) -> None:
        """Keep the top-level imports, classes and functions of ``code``, which ran on
        every rank."""
        for key, source in top_level_definitions(code):
            self.items.pop(key, None)
            self.items[key] = ("source", source)

    def note_push(self, mapping: Mapping[str, Any]) -> None:
        """Keep the classes, functions and modules of a ``sess.push``, as shipped."""
        for name, value in mapping.items():
            self.items.pop(name, None)
            if _shippable(value):
                try:
                    self.items[name] = ("value", (name, by_value(value)))
                except TypeError as exc:  # the push itself shipped it: this is not expected
                    log.debug("definition %r not kept for later ranks: %s", name, exc)

    def __len__(self) -> int:
        return len(self.items)

    def replay(self, d: Dispatcher, ranks: list[int], timeout: float = 120.0) -> list[str]:
        """Run every definition on ``ranks`` (ranks that joined later), in order; what
        failed there, one line each (``[rank r] what: error``)."""
        if not ranks or not self.items:
            return []
        answers = d.gather(d.apply("replay definitions", _defs.replay, args=(list(self.items.values()),),
                                   ranks=ranks), timeout)
        return [f"[rank {r}] {line}" for r, failed in zip(ranks, answers) for line in failed]
