"""Sphinx configuration of fsdp_nb's documentation (``python -m sphinx -W docs docs/_build/html``).

Sphinx with MyST-NB: the tutorials are the repository's notebooks, stored with the outputs
and widget state of their last run and the key of the code it ran (``_ext/stored_runs.py``):
one whose code and package are unchanged is rendered as stored, the others run during the
build (once per change of their code), so the memory, layout and checkpoint widgets render
without a kernel; the
reference is autodoc over the docstrings (Google style, through napoleon); ``_ext``
holds what is ours: the ipywidgets renderer fetched once from the npm registry (no CDN
at reading time), the CLI and layer pictures drawn from the code, and the completeness
checks (every public name documented, every parameter described).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

import stored_runs  # noqa: E402 - from _ext, just put on the path
from fsdp_nb_docs import REPO  # noqa: E402

project = "fsdp_nb"
author = "the fsdp_nb developers"
copyright = "2026, the fsdp_nb developers"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "fsdp_nb_docs",
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
root_doc = "index"
nitpicky = True  # a cross-reference that resolves to nothing is a warning (an error with -W)
nitpick_ignore_regex = [
    # names of the libraries we stand on, where autodoc meets them in signatures
    ("py:class", r"(torch|ipywidgets|ipyparallel|IPython|argparse|collections|typing|pathlib|concurrent|numpy|fsspec)(\..*)?"),
    ("py:class", r"(Any|Callable|Sequence|Iterator|Mapping|Path|optional|NoneType)"),
    ("py:class", r"nn\.Module|torch\.nn\.Module|Tensor|Module"),
    # fsdp_nb's own parts that are not public, named unqualified in type hints
    ("py:class", r"CallChannel|CheckpointBrowser|ClassNames|Dashboard|Definitions|Dispatcher|EngineCluster|"
                 r"Keeper|Lifecycle|MemorySample|MemoryWidget|RankHealth|SessionStatus|StatusWidget|StepsFeed|WrapRecord|WrapSummary"),
    ("py:class", r"MixedPrecisionPolicy|CPUOffloadPolicy"),  # torch's, named unqualified in WrapOptions
    ("py:class", r"(ipp|W|np|dist|dcp)\..*"),
    # the session's internals (its context's parts) and the mixins the façade is made of
    ("py:class", r"fsdp_nb\.(runtime|lifetime)\..*"),
    ("py:class", r"fsdp_nb\.(context\.SessionFacts|checkpoints\.session_checkpoints\.SessionCheckpoints|"
                 r"autosave\.session_autosave\.SessionAutosave|recovery\.session_recovery\.SessionRecovery|"
                 r"memory\.session_planning\.SessionPlanning|frontends\.session_widgets\.SessionWidgets|"
                 r"steps\.step_profile\.SessionProfiling|display\.widget_parts\.StaticForm)"),
]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

nb_execution_mode = os.environ.get("FSDP_NB_DOCS_EXECUTE", "cache")
"""``cache`` (default): run a tutorial whose stored run is stale, once per change of its
code; ``force``: run every tutorial; ``off``: render the notebooks as committed."""
_TUTORIALS = os.path.join(os.path.dirname(__file__), "tutorials")
nb_execution_excludepatterns = [] if nb_execution_mode == "force" else [
    f"tutorials/{name}" for name in sorted(os.listdir(_TUTORIALS))
    if name.endswith(".ipynb") and stored_runs.is_fresh(Path(_TUTORIALS, name), REPO)]
"""The tutorials rendered as stored: those whose last run (committed with the notebook)
was of this code and this package (``_ext/stored_runs.py``)."""
nb_execution_timeout = 600
nb_execution_in_temp = True  # a notebook's relative files land in a folder the build removes
nb_execution_raise_on_error = True  # a tutorial that fails fails the build
nb_execution_show_tb = True
CACHE = os.environ.get("FSDP_NB_DOCS_CACHE") or os.path.join(os.path.dirname(__file__), "_build", "cache")
"""Where the build keeps what it fetched or ran once: the executed notebooks (jupyter-cache)
and the widget renderer; ``FSDP_NB_DOCS_CACHE`` moves it (the tests put it in a temporary folder)."""
nb_execution_cache_path = os.path.join(CACHE, "jupyter_cache", stored_runs.package_key(REPO)[:16])
"""MyST-NB's cache of the tutorials it ran, one per state of the package: its own key is
the code cells alone, so a run against older code is never shown for newer."""
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the tutorials are the CPU path, on a GPU machine too
os.environ.setdefault("OMP_NUM_THREADS", "1")
fsdp_nb_cache = CACHE
nb_merge_streams = True
nb_ipywidgets_js = {"widgets/embed.js": {}}
"""The widget renderer: ``embed.js`` of ``@jupyter-widgets/html-manager`` (the standard
widgets, no RequireJS), put in ``_static/widgets/`` by ``_ext/fsdp_nb_docs.py``; never a CDN."""

autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_param = True

html_theme = "furo"
html_title = "fsdp_nb"
html_static_path: list[str] = ["_static"]  # the widget renderer's folder is added by fsdp_nb_docs
html_favicon = "_static/favicon.svg"
html_permalinks_icon = "#"
