"""The docs site as a reader gets it: built with warnings as errors (the tutorials executed
in real kernels, each starting a 2-rank session), every tutorial showing what it must,
every internal link resolving, the how-to pages' code run in a real kernel, the pages
opened in headless Chromium, the performance figures found in benchmarks/RESULTS.md.

Nothing is written outside temporary folders: the build's cache, output, kernels'
``TMPDIR`` and ``IPYTHONDIR`` all live in one, and the build must leave the ``TMPDIR``
empty and no session running.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

import fsdp_nb

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
HOW_TO = sorted((DOCS / "how-to").glob("*.md"))

pytestmark = pytest.mark.timeout(1500)  # the build runs six notebooks, each a session

EXPECTED = {
    # what each tutorial must show: text a broken session, wrap or recovery would change
    "01_quickstart": ["rank 0 of 2 on cpu", "rank 1 of 2 on cpu", "final loss"],
    "02_checkpoints": ["valid, world_size=2", "(2, {'step': 5},", "({'step': 5}, True)",
                       "resized 3 -> 2 ranks in", "model 'model' re-sharded with optimizer",
                       "world size 2 same weights: True"],
    "03_large_model": ["full model:", "planned peak", "cheapest change that fits", "what if",
                       "rank 0: step ok", "rank 1: step ok", "CountingScaler: scale", "steps skipped 0"],
    "04_failures": ["caught:", "rank 1 found bad data", "interrupted; session state: ready",
                    "rank(s) 1", "all_reduce after recovery: 1.0",
                    # the status widget's log, printed at the end
                    "execute failed (rank 1): rank 1: RuntimeError: rank 1 found bad data",
                    "execute interrupted (rank 0", "restart recovered: rank(s) 1 replaced",
                    # a hang explained while it waits, then ended by the straggler; a mismatch
                    "rank 1 is not in it: in data_step (cell line 3): while not os.path.exists(",
                    "fsdp_nb: execute: the collective completed",
                    "mismatch on the default group (different collectives): rank 0 in all_reduce #"],
    "05_workflow": ["no kernel attached, keep_alive", "attached: 2 ranks, models ['model']",
                    "same weights: True", "[rank 1] step 2 on rank 1", "reloaded on ranks [0, 1]",
                    "straggler: rank 1:", "in other (data loading",
                    "[ranks 0-1] version 2, edited", "(Pdb rank 1) p scaled\ntensor([nan, nan, nan, nan])",
                    "[rank 1] rank 1 batch sum: 0.0", "sessions left: []"],
    "06_huggingface": ["'config.json'", "auto_wrap=ClassNames(names=('LlamaDecoderLayer',))",
                       "[rank 0] step 4: loss", "'config.json', 'generation_config.json', 'model.safetensors'",
                       "read back: LlamaForCausalLM same weights: True"],
    "07_debugging": ["CollectiveMismatchError: the ranks called different collectives on default_pg",
                     "rank 0: all_reduce(float32[4]) at cell [2] line 5",
                     "rank 1: all_reduce(float32[3]) at cell [2] line 5", "[ranks 0-1] [2.0, 2.0, 2.0, 2.0]",
                     "rank 1: finished the cell without it",
                     "rank 1 stopped at a breakpoint in cell [5] line 3", "(Pdb rank 1) p x", "tensor([0., 2., 4.])",
                     "  4  ->\tdist.all_reduce(y)", "[ranks 0-1] y = [0.0, 6.0, 12.0]",
                     "(Pdb rank 1) p step, round(loss.item(), 4)", "(2, 0."],
    "08_performance": ["straggler: rank 1:", "in other (data loading, Python, the host)", "[(1, 'other')]",
                       "exposed comm ms", "trace written: True", "'step_ms/rank1'", "'throughput/samples_per_s'",
                       "20 steps of rank 1; its other part: 3"],
}


def _env(base: Path) -> dict[str, str]:
    """Where everything the build and its kernels write goes, all under ``base``; the
    tutorials are the CPU path, so any GPU is hidden from the kernels and their engines."""
    for d in ("tmp", "ipython"):
        (base / d).mkdir(exist_ok=True)
    return dict(os.environ, FSDP_NB_DOCS_CACHE=str(base / "cache"), TMPDIR=str(base / "tmp"),
                IPYTHONDIR=str(base / "ipython"), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def _stop_left_sessions(ipython_dir: Path) -> list[str]:
    """Stop every session a kernel kept alive under ``ipython_dir``; their ids."""
    old = os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = str(ipython_dir)
    try:
        left = fsdp_nb.sessions()
        for s in left:
            fsdp_nb.Session.attach(s.cluster_id, activate=False).shutdown()
        return [s.cluster_id for s in left]
    finally:
        if old is None:
            os.environ.pop("IPYTHONDIR", None)
        else:
            os.environ["IPYTHONDIR"] = old


@dataclass
class Built:
    html: Path
    cache: Path
    left_in_tmp: list[str]
    left_sessions: list[str]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    base = tmp_path_factory.mktemp("docs")
    env = _env(base)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS),
             str(base / "html")], env=env, capture_output=True, text=True, timeout=1400)
        assert proc.returncode == 0, f"the docs build failed:\n{proc.stdout}\n{proc.stderr}"
    finally:
        left = _stop_left_sessions(base / "ipython")
    # torch makes its inductor cache folder in TMPDIR when torch._dynamo is imported (any
    # process that wraps or plans does): torch's cache, not a file of ours
    ours = sorted(p.name for p in (base / "tmp").iterdir() if not p.name.startswith("torchinductor_"))
    return Built(base / "html", base / "cache", ours, left)


# -- the build ------------------------------------------------------------------------


def test_the_reference_documents_every_public_name(built):
    pages = "".join((built.html / "reference" / p).read_text() for p in os.listdir(built.html / "reference"))
    missing = [n for n in fsdp_nb.__all__ if not n.startswith("__") and f'id="fsdp_nb.{n}"' not in pages]
    assert missing == []
    cli = (built.html / "reference" / "cli.html").read_text()
    assert all(f"fsdp-nb {c}" in cli for c in ("demo", "inspect", "consolidate", "export"))
    assert "--trust-pickles" in cli


def test_the_architecture_page_draws_the_layers_and_lists_every_module(built):
    from helpers import import_contracts

    page = (built.html / "explanation" / "architecture.html").read_text()
    layers = import_contracts()["layers"]["layers"]
    assert page.count('class="fsdp-layers"') == 1 and page.count("<rect ") == len(layers)
    modules = {".".join(("fsdp_nb", *p.relative_to(REPO / "fsdp_nb").with_suffix("").parts))
               for p in (REPO / "fsdp_nb").rglob("*.py")}
    modules = {m.removesuffix(".__init__") for m in modules if not m.endswith("__main__")}
    assert sorted(m for m in modules if f"<code class=\"docutils literal notranslate\"><span class=\"pre\">{m}</span>"
                  not in page) == []


def _stored_runs():
    """``docs/_ext/stored_runs.py``, the build's own module."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import stored_runs
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return stored_runs


def _as_built(built: Built, path: Path) -> nbformat.NotebookNode:
    """The tutorial as the build showed it: its stored run when that ran this code and
    package, else the run the build made (MyST-NB's cache, kept per state of the package)."""
    from jupyter_cache import get_cache

    runs = _stored_runs()
    if runs.is_fresh(path, REPO):
        return nbformat.read(path, as_version=4)
    _, nb = get_cache(built.cache / "jupyter_cache" / runs.package_key(REPO)[:16]).merge_match_into_file(str(path))
    return nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_tutorial_shows_what_it_must(built, path):
    nb = _as_built(built, path)
    shown = "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") + o.get("evalue", "")
                      for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))  # errors too
    missing = [text for text in EXPECTED[path.stem] if text not in shown]
    assert not missing, f"{path.name} did not show {missing}"
    assert [line for line in _unclean(nb) if WARNING.search(line)] == []  # as built (the stored run, or the build's)
    page = (built.html / "tutorials" / f"{path.stem}.html").read_text()
    if "application/vnd.jupyter.widget-view+json" in json.dumps(nbformat.writes(nb)):
        assert 'type="application/vnd.jupyter.widget-state+json"' in page  # drawn without a kernel
        assert "_static/widgets/embed.js" in page


WARNING = re.compile(r"\b\w*Warning: ")
"""A warning as Python prints one (``UserWarning: ...``)."""


def _unclean(nb: nbformat.NotebookNode) -> list[str]:
    """The output lines of ``nb`` that show a warning (unless its cell is tagged
    ``explains-warning``: the page says why it is there) or a path of the machine that ran
    it (``stored_runs.machine_paths``: the repository, site-packages, the home folder)."""
    paths = [p for p in _stored_runs().machine_paths(REPO) if p != "/"]
    bad = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        explained = "explains-warning" in cell.get("metadata", {}).get("tags", [])
        for out in cell.get("outputs", []):
            texts = [out.get("text", ""), out.get("evalue", ""), *out.get("traceback", []),
                     *(v for k, v in out.get("data", {}).items() if k.startswith("text/") and isinstance(v, str))]
            for line in "\n".join(texts).splitlines():
                if (WARNING.search(line) and not explained) or any(p in line for p in paths):
                    bad.append(f"cell {i}: {line[:160]}")
    return bad


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_stored_tutorial_ran_this_code_and_shows_no_warning_and_no_machine_path(path):
    """What a code host shows: the outputs of a run of the tutorial's current code and
    package, with no warning the reader did not cause and no path of the machine."""
    assert _stored_runs().is_fresh(path, REPO), f"{path.name}: run python docs/_ext/stored_runs.py"
    assert _unclean(nbformat.read(path, as_version=4)) == []


def test_a_rank_error_in_a_tutorial_shows_the_users_frames_not_fsdp_nbs():
    """IPython leaves out the frames fsdp_nb marks ``__tracebackhide__`` (the magic, the
    session, the dispatcher) but the one that raised (the failure policy's, or the
    dispatcher's when every rank failed): a failing cell's traceback is the
    cell, that one line, and each rank's own error."""
    errors = [out for path in NOTEBOOKS for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"
              for out in c.get("outputs", []) if out.get("output_type") == "error" and out.get("ename") == "RankError"]
    assert errors, "no tutorial shows a RankError"
    for out in errors:
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in out["traceback"]]
        # the last part is the error's message, each rank's own traceback in it: only the
        # collective check's raise, where the rank's error is fsdp_nb's own, is ours there
        ranks = re.findall(r"^File (fsdp_nb/\S+), in (\w+)", lines[-1], flags=re.M)
        assert all(f.startswith("fsdp_nb/debugging/rank_collective_check.py:") and fn == "checked_call"
                   for f, fn in ranks), ranks
        ours = [line for line in lines[:-1] if re.search(r"^File fsdp_nb/", line, flags=re.M)]
        # the failure policy's raise after a recovery, or the dispatcher's when every rank failed
        assert len(ours) == 1 and ("failure_policy" in ours[0] or "Dispatcher._settle" in ours[0]), ours
        assert any("skipping hidden" in line for line in lines)


def test_the_build_left_no_temporary_files_and_no_session(built):
    assert built.left_in_tmp == [] and built.left_sessions == []


def _build_copy(tmp_path: Path, fault) -> str:
    """Build a copy of docs/ with ``fault(docs)`` applied, as CI builds it but with the
    tutorials not executed (unless a notebook asks to be); the build's output."""
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs, ignore=shutil.ignore_patterns("_build"))  # the tutorials' links copied as files
    fault(docs)
    env = dict(_env(tmp_path), FSDP_NB_DOCS_EXECUTE="off")
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(docs),
                           str(tmp_path / "html")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, "the build passed with a fault in it"
    return proc.stdout + proc.stderr


def test_the_build_fails_on_a_broken_reference_a_missing_name_and_a_bare_parameter(tmp_path):
    def fault(docs: Path) -> None:
        page = docs / "reference" / "checkpoints.md"
        page.write_text(page.read_text().replace(".. autofunction:: fsdp_nb.inspect\n", ""))
        (docs / "_ext" / "probe_module.py").write_text(
            '"""A probe."""\n\n\ndef probe(documented, forgotten):\n    """Does nothing with ``documented``."""\n')
        more = docs / "reference" / "more.md"
        more.write_text(more.read_text() + "\n```{eval-rst}\n.. autofunction:: probe_module.probe\n```\n\n"
                        "See {py:func}`fsdp_nb.no_such_function`.\n")

    out = _build_copy(tmp_path, fault)
    assert "fsdp_nb.inspect is public but no reference page documents it" in out
    assert "probe_module.probe: parameter 'forgotten' is not described" in out
    assert "'documented'" not in out
    assert "fsdp_nb.no_such_function" in out


def test_the_build_fails_on_a_tutorial_that_fails(tmp_path):
    def fault(docs: Path) -> None:
        bad = nbformat.v4.new_notebook(metadata={
            "mystnb": {"execution_mode": "force"},  # runs though the others are not executed here
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
        bad.cells = [nbformat.v4.new_markdown_cell("# Broken"),
                     nbformat.v4.new_code_cell("raise ValueError('broken tutorial')")]
        nbformat.write(bad, docs / "tutorials" / "broken.ipynb")
        index = docs / "tutorials" / "index.md"
        index.write_text(index.read_text().replace("06_huggingface\n```", "06_huggingface\nbroken\n```"))

    out = _build_copy(tmp_path, fault)
    assert "ExecutionError" in out and "broken.ipynb" in out


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])  # type: ignore[arg-type]
        for key in ("href", "src"):
            if a.get(key):
                self.links.append(a[key])  # type: ignore[arg-type]


def test_every_internal_link_resolves(built):
    pages = {p: _Links() for p in built.html.rglob("*.html")}
    for p, parser in pages.items():
        parser.feed(p.read_text())
    broken = []
    for p, parser in pages.items():
        for link in parser.links:
            if re.match(r"^(https?:|mailto:|data:|javascript:)", link):
                continue
            target, _, fragment = link.partition("#")
            dest = (p.parent / target.split("?")[0]).resolve() if target else p
            if dest.is_dir():
                dest = dest / "index.html"
            if not dest.exists():
                broken.append(f"{p.relative_to(built.html)}: {link}")
            elif fragment and dest.suffix == ".html" and fragment not in pages[dest].ids:
                broken.append(f"{p.relative_to(built.html)}: {link} (no such anchor)")
    assert broken == []


# -- the how-to pages' code -----------------------------------------------------------


def _blocks(page: Path) -> list[str]:
    """The page's plain ```python blocks, in order (a ```{code-block} is shown, not run)."""
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


RUNNABLE = [p for p in HOW_TO if _blocks(p)]


NEEDS_S3 = {"checkpoints"}
"""The pages whose code saves to ``s3://bucket/``: they run against moto's S3 server."""


@pytest.mark.parametrize("page", RUNNABLE, ids=[p.stem for p in RUNNABLE])
def test_a_how_to_pages_code_runs_in_a_kernel(page, tmp_path):
    assert ("s3://" in page.read_text()) == (page.stem in NEEDS_S3), "NEEDS_S3 names the pages that use S3"
    if page.stem not in NEEDS_S3:
        _run_blocks(page, tmp_path)
        return
    with _s3_on_loopback() as s3_env:
        _run_blocks(page, tmp_path, extra_env=s3_env)


@contextlib.contextmanager
def _s3_on_loopback():
    """Moto's S3 server on a free loopback port with a bucket named ``bucket``; the
    variables that point boto (and s3fs through it) at it, in the kernel and its engines."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # a free port, bound by the server
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="bucket")
        yield env
    finally:
        server.stop()


def _run_blocks(page: Path, tmp_path: Path, cwd: Path | None = None, extra_env: dict[str, str] | None = None) -> None:
    """Run ``page``'s ```python blocks in order in one kernel (working in ``cwd``, by default
    the kernels' temporary folder; ``extra_env`` added to its environment): each must
    succeed, no session may be left running, and no file in the temporary folder."""
    from jupyter_client.manager import start_new_kernel

    env = {**_env(tmp_path), **(extra_env or {})}
    if cwd is not None:
        cwd.mkdir()
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(cwd or tmp_path / "tmp"))
    try:
        for i, code in enumerate(_blocks(page)):
            errors: list[str] = []

            def on_output(msg, errors=errors):
                if msg["msg_type"] == "error":
                    errors.append("\n".join(msg["content"]["traceback"]))

            reply = kc.execute_interactive(code, timeout=240, output_hook=on_output)
            assert reply["content"]["status"] == "ok", f"{page.name} block {i + 1}:\n{code}\n" + "\n".join(errors)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        left = _stop_left_sessions(tmp_path / "ipython")
    assert left == [], f"{page.name} left sessions running"
    ours = sorted(p.name for p in (tmp_path / "tmp").iterdir()  # torch's compile cache and W&B's own temporaries
                  if not p.name.startswith("torchinductor_") and not p.name.endswith(("wandb-artifacts", "wandb-media")))
    assert ours == [], f"{page.name} left temporary files"


# -- the pages in a browser -----------------------------------------------------------


def test_pages_open_in_chromium_without_errors_and_a_tutorial_shows_its_widgets(built, artifacts):
    chromium = "/usr/bin/chromium"
    if not os.path.exists(chromium):
        pytest.skip(f"{chromium} missing (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    handler = functools.partial(_QuietHandler, directory=str(built.html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    problems: list[str] = []
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"])
            page = browser.new_page()
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            # a request the next navigation cancels (the favicon, fetched after "load") is
            # aborted, not broken; a missing file is a 404, which the console reports
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})")
                    if r.failure != "net::ERR_ABORTED" else None)
            for path in ("index.html", "how-to/sessions.html", "reference/session.html",
                         "explanation/architecture.html", "tutorials/02_checkpoints.html",
                         "tutorials/01_quickstart.html"):
                page.goto(f"{base}/{path}", wait_until="load")
            widget = page.locator(".jupyter-widgets.widget-vbox").first
            widget.wait_for(state="visible", timeout=30_000)
            text = widget.inner_text()
            page.screenshot(path=os.path.join(artifacts, "docs_tutorial.png"), full_page=False)
            browser.close()
    finally:
        server.shutdown()
    assert problems == []
    assert "rank 0" in text and "rank 1" in text, text


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


# -- the words around the numbers ------------------------------------------------------


def test_every_performance_figure_is_in_its_results_entry():
    """Each row's figures are in the RESULTS entry it names; a speed ratio the page worked
    out from a time ratio (their time over ours) is the quotient of two of its row's own
    figures (their time and ours, or 1 and a time ratio the entry recorded)."""
    results = (REPO / "benchmarks" / "RESULTS.md").read_text()
    sections = dict(re.findall(r"^## (\d{4}-\d\d-\d\d \([\w-]+\)).*?\n(.*?)(?=^## |\Z)", results, flags=re.S | re.M))
    lines = (DOCS / "explanation" / "performance.md").read_text().splitlines()
    header = next(r for r in lines if r.startswith("| figure"))
    names = [c.strip() for c in header.strip().strip("|").split("|")]
    speed_col = next(n for n in names if n.startswith("speed"))
    rows = [dict(zip(names, (c.strip() for c in r.strip().strip("|").split("|")))) for r in lines
            if r.startswith("| ") and not r.startswith("| figure") and not r.startswith("|---")]
    assert len(rows) >= 15
    number = r"\d+(?:\.\d+)?"
    for row in rows:
        figure, value, speed = row["figure"], row["value"], row[speed_col]
        entry = re.match(r"\d{4}-\d\d-\d\d \([\w-]+\)", row["entry"])
        assert entry and entry[0] in sections, f"no RESULTS entry {row['entry']!r} for {figure!r}"
        body = sections[entry[0]].replace("×", "x")
        shown = " ".join([value, *re.findall(r"\(.*?\)", speed)])  # the figures a speed is worked out from
        for n in re.findall(number, shown):
            assert n in body, f"{figure}: {n} is not in the RESULTS entry {entry[0]}"
        mine = [float(n) for n in re.findall(number, shown)]
        worked_out = [b / a for a in mine for b in mine if a]
        for n in re.findall(number, re.sub(r"\(.*?\)", "", speed)):
            places = len(n.partition(".")[2])
            assert n in body or any(f"{x:.{places}f}" == n for x in worked_out), \
                f"{figure}: speed {n} is neither in the RESULTS entry {entry[0]} nor worked out from it"
        command = row["command"]
        assert row["machine"] and command.startswith("`benchmarks/"), row
        assert command.strip("`").split()[0] in body, (command, entry[0])


def test_a_tutorials_stored_run_stands_only_for_the_code_it_ran(tmp_path):
    """The build renders a tutorial as stored only while its code cells, the package's
    sources and pyproject.toml are what its last run had; anything else runs it again."""
    stored_runs = _stored_runs()
    repo = tmp_path / "repo"
    (repo / "fsdp_nb" / "engine").mkdir(parents=True)
    (repo / "fsdp_nb" / "engine" / "wrap.py").write_text("X = 1\n")
    (repo / "pyproject.toml").write_text("[project]\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A"), nbformat.v4.new_code_cell("x = 1")])
    path = repo / "t.ipynb"
    nbformat.write(nb, path)
    assert not stored_runs.is_fresh(path, repo)  # never run
    nb.metadata["fsdp_nb"] = {stored_runs.KEY: stored_runs.ran_with(path, repo)}
    nbformat.write(nb, path)
    assert stored_runs.is_fresh(path, repo)
    nb.cells[0].source = "# A tutorial"  # prose and outputs are not what it ran
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="seen")]
    nbformat.write(nb, path)
    assert stored_runs.is_fresh(path, repo)
    (repo / "fsdp_nb" / "engine" / "wrap.py").write_text("X = 2\n")  # the package changed
    assert not stored_runs.is_fresh(path, repo)
    (repo / "fsdp_nb" / "engine" / "wrap.py").write_text("X = 1\n")
    assert stored_runs.is_fresh(path, repo)
    nb.cells[1].source = "x = 2"  # its code changed
    nbformat.write(nb, path)
    assert not stored_runs.is_fresh(path, repo)
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    nb.cells[1].source = "x = 1"
    nbformat.write(nb, path)
    assert not stored_runs.is_fresh(path, repo)  # the dependencies changed


def test_the_readme_is_a_front_page():
    """What fsdp_nb is and for whom first, then the two commands, then its maturity; the
    table of what ran where is the GPU guide's."""
    readme = (REPO / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 160
    first = next(i for i, line in enumerate(lines) if line.startswith("```bash"))
    assert lines[2].startswith("**Interactive PyTorch FSDP2") and "is for people who train" in " ".join(lines[2:first])
    assert lines[first + 1].startswith("pip install torch==2.13.0 -e . && fsdp-nb demo")
    assert lines[first + 2].startswith('pip install torch==2.13.0 -e ".[test]"') and "python -m pytest" in lines[first + 2]
    assert lines[first + 5].startswith("**Maturity.** Version 0.1.0") and "never run" in readme[:readme.index("## A taste")]
    assert _ran_where(readme) == _ran_where((DOCS / "how-to" / "gpus.md").read_text()) != []
    assert 'pip install torch==2.13.0 -e ".[docs]" && python -m sphinx -W docs docs/_build/html' in readme
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links and [t for t in links if not t.startswith("http") and not (REPO / t).exists()] == []


def _ran_where(text: str) -> list[str]:
    """The rows of a page's table of what has run where."""
    table = text.split("<!-- what-ran-where", 1)[-1] if "<!-- what-ran-where" in text else ""
    return [line for line in table.splitlines()[1:] if line.startswith("|")][:40] if table else []


def test_the_readmes_taste_runs_as_written(tmp_path):
    """The README's ```python blocks in a kernel, in a folder of their own (the taste saves
    ``ckpt/`` there), leaving no session and no temporary file."""
    _run_blocks(REPO / "README.md", tmp_path, cwd=tmp_path / "work")


def _pages() -> dict[str, str]:
    pages = {"README.md": (REPO / "README.md").read_text()}
    pages.update({str(p.relative_to(REPO)): p.read_text() for p in DOCS.rglob("*.md") if "_build" not in p.parts})
    return pages


def test_the_tutorials_install_line_brings_every_module_they_import():
    """``pip install -e ".[notebook]"`` (the tutorials page's line, and binder's) installs
    every library a tutorial imports: the package's dependencies and its notebook extra."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["notebook"]]
    installed = {re.split(r"[<>=!;\[ ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in wanted}
    local = {"fsdp_nb", "mymodel"}  # the package itself, and the module tutorial 05 writes
    imported = {m for path in NOTEBOOKS for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"
                for m in re.findall(r"^\s*(?:from|import)\s+(\w+)", c.source, flags=re.M)}
    assert sorted(imported - set(sys.stdlib_module_names) - installed - local) == []
    assert '-e ".[notebook]"' in (DOCS / "tutorials" / "index.md").read_text()
    assert '-e ".[notebook]"' in (REPO / "binder" / "postBuild").read_text()


STALE_CLAIMS = {
    r"runs (the|a) cell on every rank in rank order": "the ranks run a cell at once; only results come in rank order",
    r"torch>=2\.13": "pyproject says torch>=2.11",
    r"the CPU build the README's commands install": "pip resolves the build; PyPI's default on Linux is CUDA's",
    r"checkpoint browser \(save, load": "without model= the browser does not save or load",
    # issue 59's read of the docs against the code
    r"newest \w+ checkpoints beside this one": "keep_last=N keeps the newest N in the folder, the new one among them",
    r"fsdp_nb\.WireError": "WireError is fsdp_nb.errors.WireError, and a rank's unreadable message is logged, not raised",
    r"nothing to rebuild from": "restart(restore='latest', setup=...) rebuilds from the autosave on disk",
    r"rank\{r\}/step_ms": "log_to's per-rank tags are step_ms/rank{r}: one chart a series, a line a rank",
}
"""Claims the code once contradicted (issue 48), each with why it is wrong: no page or
file a user reads may make them again."""


def test_no_page_makes_a_claim_the_code_contradicted():
    texts = {**_pages(), "binder/postBuild": (REPO / "binder" / "postBuild").read_text(),
             "CHANGELOG.md": (REPO / "CHANGELOG.md").read_text(),
             **{str(p.relative_to(REPO)): p.read_text() for p in (REPO / "fsdp_nb").rglob("*.py")}}
    found = [(name, pattern, why) for name, text in texts.items() for pattern, why in STALE_CLAIMS.items()
             if re.search(pattern, text)]
    assert found == []


def test_every_file_the_pages_name_exists():
    named = {(page, path) for page, text in _pages().items()
             for path in re.findall(r"`((?:fsdp_nb|tests|benchmarks|docs|notebooks|\.ci)/[\w./-]*\w)`", text)}
    assert len(named) >= 10
    assert sorted((page, path) for page, path in named if not (REPO / path).exists()) == []


def test_every_count_of_notebooks_the_pages_give_is_right():
    words = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}
    said = [(page, m.group(1)) for page, text in _pages().items()
            for m in re.finditer(r"\b(\w+) (?:tutorial )?notebooks\b", text, flags=re.I) if m.group(1).lower() in words]
    assert said, "no page says how many notebooks there are"
    assert [(page, w) for page, w in said if words[w.lower()] != len(NOTEBOOKS)] == []


def _ext():
    sys.path.insert(0, str(DOCS / "_ext"))
    import fsdp_nb_docs

    return fsdp_nb_docs


def test_the_widget_renderer_is_refused_unless_it_is_the_pinned_tarball(tmp_path):
    """An outsider who controls the network (or the registry) hands the build another
    tarball: it is refused before a byte of it is unpacked."""
    from sphinx.errors import ExtensionError

    ext = _ext()
    with pytest.raises(ExtensionError, match="does not match its pinned sha512"):
        ext.unpack_widget_renderer(b"\x1f\x8b not the tarball", tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_the_widget_renderer_unpacks_only_its_dist_files_into_a_private_folder(tmp_path, monkeypatch):
    """A tarball that matched its pin is still not trusted with paths: members outside
    ``package/dist``, with ``..`` or as links are never written."""
    import base64
    import hashlib
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body in (("package/dist/embed.js", b"ok"), ("package/dist/../../escape.js", b"x"),
                           ("package/outside.js", b"x"), ("package/dist/embed.js.map", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
        link = tarfile.TarInfo("package/dist/link.js")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    data = buf.getvalue()
    ext = _ext()
    monkeypatch.setattr(ext, "HTML_MANAGER_SHA512", base64.b64encode(hashlib.sha512(data).digest()).decode())
    root = tmp_path / "cache" / "html-manager"
    ext.unpack_widget_renderer(data, root)
    assert sorted(p.name for p in (root / "widgets").iterdir()) == ["embed.js"]
    assert (root / "widgets" / "embed.js").read_bytes() == b"ok"
    assert (root / "widgets").stat().st_mode & 0o777 == 0o700
    assert root.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["cache", "embed.js", "html-manager", "widgets"]
