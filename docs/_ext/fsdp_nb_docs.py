"""What fsdp_nb's docs build adds to Sphinx: pictures drawn from the code, the widget
renderer, and the checks that keep the reference complete.

Directives (each drawn from the repository at build time, so it cannot go stale):

- ``fsdp-cli``: every ``fsdp-nb`` subcommand, its usage and options, from the parser.
- ``fsdp-layers``: the layers of the import contract in ``pyproject.toml``, top to bottom.
- ``fsdp-modules``: every module of the package, by folder, with the first line of its docstring.

Checks (warnings, so errors under ``-W``):

- a public name of ``fsdp_nb`` (its ``__all__``) that no reference page documents;
- a parameter of a documented function, method or class that its docstring never names
  (an ``Args:`` entry, or the name in double backquotes in the prose).

The widget renderer: MyST-NB writes each executed notebook's widget state into its page;
``@jupyter-widgets/html-manager``'s ``embed.js`` (the standard widgets, no RequireJS)
draws it in the reader's browser. It is fetched once from the npm registry, checked
against the pinned sha512, kept in the build's cache folder (``fsdp_nb_cache``) and copied into ``_static/`` so the
built site reads offline and loads nothing from a CDN.
"""

from __future__ import annotations

import base64
import hashlib
import html
import importlib
import inspect
import io
import pkgutil
import re
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (the docs extra)
    import tomli as tomllib

log = logging.getLogger("fsdp_nb")

def _repo() -> Path:
    """The repository these docs describe: the one around them, or (a copy of the docs
    elsewhere, as a test builds) the one fsdp_nb is installed from in editable mode."""
    here = Path(__file__).resolve().parents[2]
    if (here / "pyproject.toml").exists():
        return here
    import fsdp_nb

    return Path(fsdp_nb.__file__).resolve().parents[1]


REPO = _repo()

HTML_MANAGER = "1.0.15"
HTML_MANAGER_URL = (
    f"https://registry.npmjs.org/@jupyter-widgets/html-manager/-/html-manager-{HTML_MANAGER}.tgz"
)
HTML_MANAGER_SHA512 = "5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVzRhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA=="
"""npm's ``dist.integrity`` of that release: the tarball is refused unless it matches."""


# -- the widget renderer -------------------------------------------------------------


def _widget_renderer(app: Sphinx) -> None:
    """Put ``embed.js`` (and the fonts it names) in a static folder of the build."""
    root = Path(app.config.fsdp_nb_cache) / f"html-manager-{HTML_MANAGER}"
    if not (root / "widgets" / "embed.js").exists():
        log.info("fetching @jupyter-widgets/html-manager %s from the npm registry", HTML_MANAGER)
        try:
            with urllib.request.urlopen(HTML_MANAGER_URL, timeout=120) as r:  # a pinned https URL
                data = r.read()
        except OSError as exc:
            raise ExtensionError(
                f"could not fetch the widget renderer from {HTML_MANAGER_URL} ({exc}); the docs "
                f"build needs the npm registry once (the file is then kept in {root})"
            ) from exc
        unpack_widget_renderer(data, root)
    app.config.html_static_path.append(str(root))  # conf.py's nb_ipywidgets_js names widgets/embed.js


def unpack_widget_renderer(data: bytes, root: Path) -> None:
    """Check ``data`` (the npm tarball) against the pinned sha512, then put its
    ``package/dist`` files (never a path of the tarball's choosing) in ``root/widgets``:
    unpacked in a private folder beside it and renamed into place, so the folder is
    whole or absent and no one else's file is written through."""
    got = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if got != HTML_MANAGER_SHA512:
        raise ExtensionError(f"{HTML_MANAGER_URL} does not match its pinned sha512 (got {got})")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".widgets-", dir=root))  # 0700, ours
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar.getmembers():
            name = Path(m.name)
            if m.isfile() and name.parent == Path("package/dist") and not name.name.endswith(".map"):
                (staging / name.name).write_bytes(tar.extractfile(m).read())  # type: ignore[union-attr]
    staging.rename(root / "widgets")


# -- pictures drawn from the code ----------------------------------------------------


class _Rst(SphinxDirective):
    """A directive that writes reST and lets Sphinx parse it."""

    def rst(self) -> list[str]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        container = nodes.container()
        self.state.nested_parse(StringList(self.rst(), source="fsdp_nb_docs"), self.content_offset, container)
        return list(container.children)


class CliDirective(_Rst):
    """Every ``fsdp-nb`` subcommand: its help, usage and options."""

    def rst(self) -> list[str]:
        from fsdp_nb.cli import build_parser

        parser = build_parser()
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        helps = {a.dest: a.help for a in sub._choices_actions}
        out: list[str] = []
        for name, p in sub.choices.items():  # type: ignore[union-attr]
            title = f"fsdp-nb {name}"
            out += [title, "~" * len(title), "", helps.get(name) or "", "", ".. code-block:: text", ""]
            out += ["   " + line for line in p.format_usage().strip().splitlines()] + [""]
            for a in p._actions:
                if a.dest == "help":
                    continue
                flag = ", ".join(a.option_strings) or a.dest
                default = "" if a.default in (None, False) or not a.option_strings else f" (default: ``{a.default}``)"
                choices = f" One of: {', '.join(f'``{c}``' for c in a.choices)}." if a.choices else ""
                out += [f"``{flag}``", f"   {a.help or ''}{choices}{default}", ""]
        return out


def _contract() -> dict[str, Any]:
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return next(c for c in tool["contracts"] if c["id"] == "layers")


class LayersDirective(SphinxDirective):
    """The import contract's layers as a stack of boxes, top (may import all below) to bottom."""

    def run(self) -> list[nodes.Node]:
        contract = _contract()
        layers = contract["layers"]
        row, width = 34, 760
        parts = [f'<svg class="fsdp-layers" role="img" aria-label="the layers of fsdp_nb" '
                 f'xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {row * len(layers) + 4}" '
                 f'width="100%">']
        for i, layer in enumerate(layers):
            names = [n.strip().removeprefix("fsdp_nb.") for n in layer.replace(":", "|").split("|")]
            shade = 245 - int(90 * i / max(1, len(layers) - 1))
            y = 2 + i * row
            parts.append(f'<rect x="2" y="{y}" width="{width - 4}" height="{row - 4}" rx="5" '
                         f'fill="rgb({shade},{shade + 5 if shade < 250 else 250},255)" stroke="#557"/>')
            parts.append(f'<text x="{width // 2}" y="{y + row // 2 + 2}" text-anchor="middle" '
                         f'font-family="monospace" font-size="13" fill="#111">'
                         f'{html.escape("  ·  ".join(names))}</text>')
        parts.append("</svg>")
        ignored = contract.get("ignore_imports", [])
        node = nodes.raw("", "\n".join(parts), format="html")
        note = nodes.paragraph(text="The one import the contract lets through: " + "; ".join(ignored) + "."
                               if ignored else "No import is let through.")
        return [node, note]


class ModulesDirective(_Rst):
    """Every module of the package by folder, with the first line of its docstring."""

    def rst(self) -> list[str]:
        import fsdp_nb

        out = [".. list-table::", "   :header-rows: 1", "   :widths: 30 70", "",
               "   * - module", "     - what it holds"]
        names = ["fsdp_nb"] + sorted(m.name for m in pkgutil.walk_packages(fsdp_nb.__path__, "fsdp_nb."))
        for name in names:
            if name.endswith("__main__"):
                continue
            doc = (importlib.import_module(name).__doc__ or "").strip().splitlines()
            first = doc[0] if doc else ""
            out += [f"   * - ``{name}``", f"     - {first}"]
        return out


# -- the checks ----------------------------------------------------------------------

_SKIP = {"self", "cls"}


def _documented_attrs(obj: Any) -> set[str]:
    """Attributes of class ``obj`` with a docstring (``x: int`` then a string under it)."""
    names: set[str] = set()
    for klass in getattr(obj, "__mro__", [])[:-1]:
        try:
            docs = ModuleAnalyzer.for_module(klass.__module__).find_attr_docs()
        except Exception:  # noqa: BLE001 - a class defined where there is no source
            continue
        names |= {attr for (scope, attr) in docs if scope == klass.__qualname__}
    return names


def _check_params(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Warn for each parameter of ``obj`` its docstring does not name."""
    if what not in ("function", "method", "class") or name.split(".")[-1].startswith("_"):
        return
    target = obj.__init__ if what == "class" else obj
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return
    text = "\n".join(lines)
    known = _documented_attrs(obj) if what == "class" else set()
    for p in params.values():
        said = re.compile(rf":param (\\\*){{0,2}}{p.name}:|``\*{{0,2}}{p.name}(``|=)")
        if p.name in _SKIP or p.name in known or said.search(text):
            continue
        log.warning("%s: parameter %r is not described in its docstring", name, p.name,
                    type="fsdp_nb", subtype="param")


def _check_public_names(app: Sphinx, env: Any) -> None:
    """Warn for each name of ``fsdp_nb.__all__`` no page documents."""
    import fsdp_nb

    objects = set(env.get_domain("py").objects)
    for public in fsdp_nb.__all__:
        if public.startswith("__"):
            continue
        if f"fsdp_nb.{public}" not in objects:
            log.warning("fsdp_nb.%s is public but no reference page documents it", public,
                        type="fsdp_nb", subtype="reference")


def _napoleon_skips_attributes(app: Sphinx) -> None:
    """Napoleon reads an attribute's first line ``Who wrote it: ...`` as ``type: text``;
    fsdp_nb's attribute docstrings are prose, so napoleon is kept to functions and classes."""
    for listener in app.events.listeners.get("autodoc-process-docstring", []):
        handler = listener.handler
        if getattr(handler, "__module__", "") == "sphinx.ext.napoleon":

            def prose(app: Sphinx, what: str, *args: Any, _h: Any = handler) -> None:
                if what not in ("attribute", "property", "data"):
                    _h(app, what, *args)

            i = app.events.listeners["autodoc-process-docstring"].index(listener)
            app.events.listeners["autodoc-process-docstring"][i] = listener._replace(handler=prose)


def setup(app: Sphinx) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    app.add_config_value("fsdp_nb_cache", "_build/cache", "env")
    app.add_directive("fsdp-cli", CliDirective)
    app.add_directive("fsdp-layers", LayersDirective)
    app.add_directive("fsdp-modules", ModulesDirective)
    app.connect("builder-inited", _widget_renderer)
    app.connect("builder-inited", _napoleon_skips_attributes)
    app.connect("autodoc-process-docstring", _check_params, priority=600)  # after napoleon's
    app.connect("env-check-consistency", _check_public_names)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
