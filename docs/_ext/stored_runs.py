"""The tutorials as last run, stored in their notebooks, and whether that run still stands.

Each tutorial in ``notebooks/`` is committed with the outputs and widget state of its last
run, and under ``metadata["fsdp_nb"]["ran_with"]`` the key of what it ran with: its own
code cells, every source file of the package, and ``pyproject.toml``. The docs build
(``conf.py``) renders a tutorial whose key still matches as stored, and runs the others
(MyST-NB's cache: once per change of their code). So a code host shows the tutorials
with their outputs, and a build of an unchanged tree runs none of them, while any change
to a tutorial or to the package makes the build run it again against the new code.

Refresh the stored runs after changing the package or a tutorial (it runs each one in a
real kernel, as the build would)::

    python docs/_ext/stored_runs.py            # the stale ones
    python docs/_ext/stored_runs.py --all      # every tutorial
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["KEY", "is_fresh", "machine_paths", "package_key", "ran_with", "refresh", "scrub"]

KEY = "ran_with"
"""Where in a notebook's ``metadata["fsdp_nb"]`` its run's key is kept."""


def package_key(repo: Path) -> str:
    """The key of the package under ``repo``: its sources and its ``pyproject.toml``."""
    h = hashlib.sha256()
    for f in sorted([*(repo / "fsdp_nb").rglob("*.py"), repo / "pyproject.toml"]):
        h.update(str(f.relative_to(repo)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def ran_with(notebook: Path, repo: Path) -> str:
    """The key of what ``notebook`` runs with: its code cells and the package under ``repo``
    (``package_key``); markdown and outputs left out."""
    h = hashlib.sha256(package_key(repo).encode())
    cells = json.loads(notebook.read_text())["cells"]
    for cell in cells:
        if cell["cell_type"] == "code":
            source = cell["source"]
            h.update(("".join(source) if isinstance(source, list) else source).encode() + b"\0")
    return h.hexdigest()


def is_fresh(notebook: Path, repo: Path) -> bool:
    """Whether ``notebook``'s stored outputs came from a run of its code with this package."""
    stored = json.loads(notebook.read_text()).get("metadata", {}).get("fsdp_nb", {}).get(KEY)
    return stored == ran_with(notebook, repo)


def _stop_left_sessions(ipython_dir: Path) -> None:
    """Stop every session a tutorial's kernel kept alive under ``ipython_dir``."""
    import fsdp_nb

    saved = os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = str(ipython_dir)  # where fsdp_nb.sessions() reads the records
    try:
        for s in fsdp_nb.sessions():
            fsdp_nb.Session.attach(s.cluster_id, activate=False).shutdown()
    finally:
        if saved is None:
            os.environ.pop("IPYTHONDIR", None)
        else:
            os.environ["IPYTHONDIR"] = saved


def refresh(notebook: Path, repo: Path, timeout: int = 600) -> None:
    """Run ``notebook`` in a real kernel as the docs build runs a tutorial (a temporary
    working folder, ``TMPDIR`` and ``IPYTHONDIR``, no GPU, one thread per rank), then store
    its outputs, its widget state and the key of what it ran with in the notebook itself."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    with tempfile.TemporaryDirectory(prefix="fsdp_nb_tutorial_") as scratch:
        base = Path(scratch)
        for d in ("cwd", "tmp", "ipython"):
            (base / d).mkdir()
        env = dict(os.environ, TMPDIR=str(base / "tmp"), IPYTHONDIR=str(base / "ipython"), OMP_NUM_THREADS="1",
                   CUDA_VISIBLE_DEVICES="")
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
                           resources={"metadata": {"path": str(base / "cwd")}}).execute(env=env)
        finally:
            _stop_left_sessions(base / "ipython")
    scrub(nb, repo)
    nb.metadata.setdefault("fsdp_nb", {})[KEY] = ran_with(notebook, repo)
    nbformat.write(nb, notebook)


def machine_paths(repo: Path) -> dict[str, str]:
    """The paths of the machine that ran a tutorial, each with what a stored output shows
    instead: the package's own files relative to the repository, the libraries' as
    ``<site-packages>/``, and the home folder as ``~``."""
    import site
    import sysconfig

    libs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    out = {str(repo) + "/": "", **{lib.rstrip("/") + "/": "<site-packages>/" for lib in libs}}
    home = str(Path.home())
    if home not in ("/", ""):
        out[home + "/"] = "~/"
    return out


def scrub(nb: Any, repo: Path) -> None:
    """Take the machine's paths out of ``nb``'s outputs (``machine_paths``): a stored run
    reads the same on a code host whoever made it."""
    paths = sorted(machine_paths(repo).items(), key=lambda kv: -len(kv[0]))  # the longest first

    def clean(text: str) -> str:
        for path, shown in paths:
            text = text.replace(path, shown)
        return text

    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = clean(out["text"])
            if "traceback" in out:
                out["traceback"] = [clean(line) for line in out["traceback"]]
            if "evalue" in out:
                out["evalue"] = clean(out["evalue"])
            for kind, value in out.get("data", {}).items():
                if kind.startswith("text/") and isinstance(value, str):
                    out["data"][kind] = clean(value)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the stale tutorials and store their outputs.")
    parser.add_argument("notebooks", nargs="*", type=Path, help="tutorials to refresh (default: all stale)")
    parser.add_argument("--all", action="store_true", help="refresh every tutorial, stale or not")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[2]
    chosen = args.notebooks or sorted((repo / "notebooks").glob("*.ipynb"))
    for nb in chosen:
        if args.all or args.notebooks or not is_fresh(nb, repo):
            sys.stderr.write(f"running {nb.name}\n")
            refresh(nb, repo)
        # the key is read back after writing: a run that changed the notebook's code is caught
        if not is_fresh(nb, repo):
            raise SystemExit(f"{nb.name}: its stored run does not match its code")


if __name__ == "__main__":
    main()
