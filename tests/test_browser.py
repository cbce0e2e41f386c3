"""Layer 3: the widgets in a real JupyterLab, driven by headless Chromium.

Needs Debian's chromium (``apt-get install -y chromium``) and the Python playwright
package (``pip install playwright``; no ``playwright install``: we use /usr/bin/chromium).
JupyterLab runs on loopback with an empty token and a temporary root, config and
runtime folder; the notebook starts its own 2-rank session and shuts it down last.
A screenshot goes to the ``artifacts`` fixture's folder (``FSDP_NB_ARTIFACTS`` keeps it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import TABLE_CODE  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.browser

FEED64_CODE = '''
from IPython.display import HTML, display
from fsdp_nb.memory.memory_widget import MemorySnapshot
from fsdp_nb.steps.steps_view import StepsView
from fsdp_nb.recovery.status import RankStatus, SessionStatus
from fsdp_nb.memory.wire_memory_sample import MemorySample
from fsdp_nb.steps.wire_step_times import RankSteps

def feed64(n=64):
    """What 64 ranks would send the memory, step and status views (rank 37 slow, 12 dead)."""
    gib = 1 << 30
    mem = MemorySnapshot(latest=tuple(MemorySample(rank=r, t=0.0, device=f"cuda:{r % 8}", resident=gib,
                                                   resident_peak=gib, budget=80 * gib,
                                                   device_allocated=(40 + r % 8) * gib, device_peak=60 * gib)
                                      for r in range(n)), history=tuple(() for _ in range(n)))
    steps = StepsView(ctx=None, window=5)
    steps.apply([RankSteps(rank=r, index=list(range(5)), seconds=[0.05 + 0.02 * (r == 37)] * 5, compute=[0.03] * 5,
                           collective=[0.02] * 5, other=[0.02 * (r == 37)] * 5, device="cpu") for r in range(n)])
    status = SessionStatus(state="degraded", backend="nccl", ranks=tuple(
        RankStatus(rank=r, engine_id=r, host=f"node{r // 8}", pid=1000 + r, device=f"cuda:{r % 8}",
                   state="dead" if r == 12 else "busy") for r in range(n)))
    return mem, steps, status
'''
"""A cell's code: ``feed64()`` builds the three views from what 64 ranks would send."""

CELLS = [
    "import tempfile, time\nimport fsdp_nb\n" + TABLE_CODE,
    "sess = fsdp_nb.Session(2, backend='gloo')\nsess",
    "mem = sess.memory(interval=0.25)\nmem",
    "steps = sess.steps(window=5, interval=0.25)\nsteps",
    "from fsdp_nb.models.layout_widget import layout_widget\nlayout_widget(hand_table())",
    "root = tempfile.mkdtemp(dir='.')  # in the notebook's temporary folder\nsess.checkpoints(root)",
    "sess.execute('import time as _t; _t.sleep(2)')  # a busy cell: memory keeps streaming",
    "sess.execute('import time as _t, torch, fsdp_nb\\n_o = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))])\\n'\n"
    "             'for _i in range(12):\\n    _t.sleep(0.05); _o.step(); fsdp_nb.log(loss=1.0 / (1 + _i))')",
    FEED64_CODE + "\nfor _view in feed64():\n    display(HTML(_view.to_html()))",
    "print('renders', mem.renders)\nsess.shutdown()  # ends the samplers and the feed too\n"
    "print('SHUTDOWN' + '-DONE', 'feed running:', mem.feed.running)",
]


def _missing() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} missing (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright missing (pip install playwright)"
    if shutil.which("jupyter-lab") is None:
        return "jupyterlab missing (pip install jupyterlab)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_notebook(path: str, cells: list[str]) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                json.loads(r.read())
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on loopback, empty token, everything in tmp; stopped after."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path / "root"
    root.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR",
                "JUPYTERLAB_WORKSPACES_DIR"):
        env[var] = str(tmp_path / var.lower())
    # start the notebook's kernel without the "Select Kernel" dialog; no news pop-up
    settings = tmp_path / "jupyterlab_settings_dir"
    (settings / "@jupyterlab/notebook-extension").mkdir(parents=True)
    (settings / "@jupyterlab/notebook-extension/tracker.jupyterlab-settings").write_text(
        json.dumps({"autoStartDefaultKernel": True}))
    (settings / "@jupyterlab/apputils-extension").mkdir(parents=True)
    (settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false"}))
    port = _free_port()
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--IdentityProvider.token=", "--ServerApp.ip=127.0.0.1", f"--port={port}",
         f"--ServerApp.root_dir={root}", "--ServerApp.disable_check_xsrf=True",
         "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/api/status", 60)
        yield f"http://127.0.0.1:{port}", root
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # our own process group: lab and its kernels
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()


@contextlib.contextmanager
def _run_all(lab, artifacts: str, name: str, cells: list[str]):
    """Open a notebook of ``cells`` in JupyterLab in headless Chromium, wait for its
    kernel, run all its cells; yields the page. The browser's console goes to
    ``{name}_console.log`` in ``artifacts``."""
    from playwright.sync_api import sync_playwright

    url, root = lab
    _write_notebook(str(root / f"{name}.ipynb"), cells)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        console: list[str] = []
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 2400})
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.goto(f"{url}/lab/tree/{name}.ipynb", wait_until="domcontentloaded")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            # the kernel is up and idle (accept the kernel dialog should one still come)
            deadline = time.monotonic() + 90
            while not page.locator(".jp-StatusBar-TextItem",
                                   has_text="Python 3 (ipykernel) | Idle").count():
                dialog = page.locator(".jp-Dialog .jp-mod-accept")
                if dialog.count():
                    dialog.first.click()
                assert time.monotonic() < deadline, "kernel did not become idle"
                page.wait_for_timeout(250)
            page.wait_for_timeout(1000)
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.locator(".lm-MenuBar-item", has_text="Run").first.click()
            page.locator("[data-command='runmenu:run-all']").first.click()
            yield page
        finally:
            with open(os.path.join(artifacts, f"{name}_console.log"), "w") as f:
                f.write("\n".join(console))
            browser.close()


def test_widgets_render_in_jupyterlab(lab, artifacts):
    shot = os.path.join(artifacts, "widgets_browser.png")
    with _run_all(lab, artifacts, "widgets", CELLS) as page:
        _check(page, shot)
    assert os.path.getsize(shot) > 10_000


DEBUG_CELLS = [
    "import fsdp_nb\nsess = fsdp_nb.Session(2, backend='gloo')",
    "%%px --debug 1\nimport torch, torch.distributed as dist\nx = torch.ones(3) * (rank + 1)\nbreakpoint()\n"
    "dist.all_reduce(x)\nprint('after the breakpoint', x.tolist())",
    "sess.shutdown()\nprint('SHUTDOWN' + '-DONE')",
]


def test_a_rank_debugger_prompt_appears_under_its_cell_in_jupyterlab(lab, artifacts):
    """``%%px --debug 1`` with ``breakpoint()``: JupyterLab shows ``(Pdb rank 1)`` as the
    kernel's input box under the cell; a command typed there is answered by rank 1."""
    shot = os.path.join(artifacts, "debugger_browser.png")
    with _run_all(lab, artifacts, "debugger", DEBUG_CELLS) as page:
        try:
            cell = page.locator(".jp-Notebook .jp-CodeCell").nth(1)
            box = cell.locator(".jp-Stdin-input").last
            box.wait_for(timeout=120_000)  # the prompt is in this cell's output area
            assert "(Pdb rank 1)" in cell.locator(".jp-Stdin-prompt").last.inner_text()
            assert "rank 1 stopped at a breakpoint in cell [2] line 4" in cell.inner_text()
            box.fill("p x.tolist()")
            box.press("Enter")
            # rank 1's own value, and the prompt again for the next command
            cell.locator(".jp-OutputArea-output", has_text="[2.0, 2.0, 2.0]").first.wait_for(timeout=30_000)
            box = cell.locator(".jp-Stdin-input").last
            box.wait_for(timeout=30_000)
            box.fill("c")
            box.press("Enter")
            cell.locator(".jp-OutputArea-output", has_text="after the breakpoint [3.0, 3.0, 3.0]").first.wait_for(
                timeout=30_000)
            page.wait_for_selector(".jp-OutputArea-output:has-text('SHUTDOWN-DONE')", timeout=90_000)
            assert "waits in" not in cell.inner_text()  # no hang was told while rank 1 stood
        except Exception:
            page.screenshot(path=shot.replace(".png", "_failure.png"), full_page=True)
            raise
        page.screenshot(path=shot, full_page=True)


def _check(page, shot: str) -> None:
    """The three widgets render; a screenshot either way (failure: *_failure.png)."""
    try:
        mem = page.wait_for_selector(".fsdp-nb-memory-widget", timeout=120_000)
        assert "rank 1" in mem.inner_text()
        layout = page.wait_for_selector(".fsdp-nb-layout-widget", timeout=30_000)
        assert "blocks.0.lin.weight" in layout.inner_text()
        assert page.locator(".fsdp-nb-layout-widget img").count() >= 1  # the heatmap
        ck = page.wait_for_selector(".fsdp-nb-checkpoint-browser", timeout=30_000)
        assert "Checkpoints" in ck.inner_text() and "Save now" in ck.inner_text()
        done = page.wait_for_selector(".jp-OutputArea-output:has-text('SHUTDOWN-DONE')",
                                      timeout=90_000)
        assert "feed running: False" in done.inner_text()
        # samples streamed into the page: bars with their history lines, for both ranks
        assert page.locator(".fsdp-nb-memory-widget polyline").count() == 2
        assert page.locator(".jp-OutputArea .widget-html").count() >= 3
        # the step view was fed while the training cell ran: both ranks, the loss curve
        steps = page.locator(".fsdp-nb-steps-widget")
        assert "loss: " in steps.inner_text() and steps.locator("polyline").count() == 1
        assert steps.locator("tr").count() == 3  # a header and 2 ranks
        # 64 ranks: a strip of 64 cells for each view, a few lines high, not 64 rows
        for strip in (".fsdp-nb-memory-strip", ".fsdp-nb-steps-strip", ".fsdp-nb-status-strip"):
            assert page.locator(f"{strip} .fsdp-nb-strip-cell").count() == 64, strip
            box = page.locator(strip).bounding_box()
            assert box is not None and box["height"] < 60 and box["width"] < 700, (strip, box)
        assert "straggler: rank 37" in page.locator(".fsdp-nb-steps:has(.fsdp-nb-steps-strip)").inner_text()
    except Exception:
        page.screenshot(path=shot.replace(".png", "_failure.png"), full_page=True)
        raise
    page.screenshot(path=shot, full_page=True)
