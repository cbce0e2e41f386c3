"""Widgets: objects without a kernel (layer 1) and a notebook run headless (layer 2).

The browser layer is tests/test_browser.py.
"""

from __future__ import annotations

import os
import sys
import time

import psutil
import pytest

from fsdp_nb.checkpoints import checkpoint_view as view
from fsdp_nb.checkpoints.checkpoints_widget import CheckpointBrowser
from fsdp_nb.engine import side_channel as ms
from fsdp_nb.formats.info import rank_of_file
from fsdp_nb.formats.listing import list_checkpoints
from fsdp_nb.formats.metadata import MARKER
from fsdp_nb.frontends.dashboard import dashboard, session_status
from fsdp_nb.memory.memory_widget import MemorySnapshot
from fsdp_nb.memory.rank_memory_kinds import MemoryReading
from fsdp_nb.models.layout_widget import LayoutData, LayoutWidget
from fsdp_nb.steps.steps_view import stop_measuring

sys.path.insert(0, os.path.dirname(__file__))
from helpers import TABLE_CODE, forget_models, hand_table, hybrid_table  # noqa: E402
from test_checkpoint import GATE, UNGATE  # noqa: E402

from fsdp_nb.runtime.cluster import wait_until  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _engines_running(sess) -> list[list[str]]:
    d = sess.dispatcher
    return d.gather(d.apply("samplers running", ms.running))


# -- layout ------------------------------------------------------------------------


def test_layout_uneven_shards_sorting_and_static_forms():
    w = LayoutWidget(hand_table())
    data = w.data
    assert data.table.bytes_per_rank() == [120, 120, 40]
    # uneven shards shown as they are: rank 2 holds 2 rows of 10, and nothing of the head
    text = repr(w)
    assert "[2x4]@(8,0) 32 B" in text and "[0x10]@(2,0) 0 B" in text
    assert "TOTAL" in text and "280 B total" in text
    assert w.heatmap.value[:4] == b"\x89PNG"
    first = w.table.value

    w.sort_key.value = "bytes"
    assert w.table.value != first
    t = w.table.value
    assert t.index("blocks.0.lin.bias") < t.index("head.weight") < t.index("blocks.0.lin.weight")
    w.sort_key.value = "rank 2"
    w.descending.value = True
    names = [p.name for p in data.params("rank 2", True)]
    assert names == ["blocks.0.lin.weight", "blocks.0.lin.bias", "head.weight"]
    assert w.table.value.index("blocks.0.lin.weight") < w.table.value.index("head.weight")
    w.sort_key.value = "name"
    w.descending.value = False
    assert w.table.value.index("blocks.0.lin.bias") < w.table.value.index("blocks.0.lin.weight")

    bundle = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "data:image/png;base64," in bundle["text/html"]
    assert bundle["text/plain"].startswith("model: 3 parameters")
    with pytest.raises(ValueError, match="unknown sort key 'rank 7'"):
        data.params("rank 7")
    with pytest.raises(TypeError, match="ShardTable"):
        LayoutWidget({"not": "a table"})


def test_layout_hybrid_mesh_grid():
    d = LayoutData(hybrid_table())
    assert d.mesh_grid() == [[0, 1], [2, 3]]
    html = d.mesh_html()
    assert "dp_replicate=1" in html and "dp_shard=1" in html and "rank 3" in html
    assert "Replicate(), Shard(0)" in d.to_text()


def test_layout_of_a_wrapped_model(sess):
    import torch

    model = sess.wrap(torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2)),
                      name="widgets_model")
    w = model.layout()
    table = model.shards()
    assert [p.name for p in w.data.table.params] == [p.name for p in table.params]
    assert sum(table.bytes_per_rank()) == table.total_bytes  # every byte held exactly once
    assert w.heatmap.value[:4] == b"\x89PNG" and "TOTAL" in repr(w)


# -- memory ------------------------------------------------------------------------


def test_memory_samples_arrive_while_a_cell_runs(sess):
    w = sess.memory(interval=0.2)
    base = w.feed.updates  # made while it waited for every rank's first sample: no widget yet
    try:
        t0 = time.time()
        sess.execute("import time as _t; _t.sleep(3)")
        t1 = time.time()
        for r in range(sess.world_size):
            during = [s for s in w.feed.samples(r) if t0 < s.t < t1 and s.received < t1]
            # arrived while the engines' task queues were busy with the cell
            assert len(during) >= 5, (r, [(s.t - t0, s.received - t0) for s in w.feed.samples(r)])
            assert all(s.rank == r and s.device == "cpu" and s.resident > 0 and not s.on_device for s in during)
            # what a rank may hold: its share of the host's RAM (the rule a plan's budget follows too)
            share = psutil.virtual_memory().total // sess.ranks[r].local_world_size
            assert all(0 < s.resident <= s.resident_peak and s.budget == share for s in during)
        snap = w.snapshot
        assert all(s is not None for s in snap.latest)
        assert "rank 1" in w.view.value and "<svg" in w.view.value
        assert repr(w).splitlines()[0] == "fsdp_nb memory (process RSS)"
        assert all(len(x) == 1 for x in _engines_running(sess))
    finally:
        w.close()
    assert not w.feed.running
    # one redraw per feed update since the widget listens (one more if an update came
    # between its listening and `base`), at most one per interval, read once the feed's
    # thread ended
    assert 0 <= w.renders - (w.feed.updates - base) <= 1 and w.renders >= 5
    assert w.feed.updates <= (time.time() - t0) / 0.2 + 2
    # the engines' samplers saw the unsubscribe and ended
    assert wait_until(lambda: _engines_running(sess) == [[], []], 10)


def test_memory_sampler_without_subscriber_ends_and_bad_interval(sess):
    d = sess.dispatcher
    args = [("lonely", r.rank, r.addr, 0.1, 0.3, None, MemoryReading) for r in sess.ranks]
    started = d.gather(d.apply("start sampler", ms.start, args))
    assert all(e.startswith("tcp://127.0.0.1:") and len(nonce) == 16 for e, nonce in started)
    assert wait_until(lambda: _engines_running(sess) == [[], []], 10)
    with pytest.raises(ValueError, match="interval must be a positive number"):
        sess.memory(interval=0)
    assert sess.all_reduce_check() == 1.0  # session still usable


def test_memory_snapshot_static_form_gpu_fields():
    from fsdp_nb.memory.wire_memory_sample import MemorySample

    s = MemorySample(rank=0, t=1.0, device="cuda:0", resident=1 << 30, resident_peak=1 << 30, budget=80 << 30,
                     device_allocated=40 << 30, device_reserved=50 << 30, device_peak=60 << 30)
    snap = MemorySnapshot((s, None), ((s,), ()))
    text = snap.to_text()
    assert "CUDA allocated" in text and "40.0 GiB  80.0 GiB  50.0%  60.0 GiB  50.0 GiB" in text
    assert "waiting for the first sample" in snap.to_html() and "reserved 50.0 GiB" in snap.to_html()
    assert "1     waiting for the first sample" in text and "?" not in text


def test_a_live_memory_view_samples_an_fsdp_model_as_it_trains_and_every_rank_lives(sess):
    """The sampler's thread once read the model's tensors itself while the main thread
    trained: engines died of SIGSEGV in ``untyped_storage()`` on the sampler's thread, about
    1 quickstart in 20. Sampling every 5 ms through 100 FSDP2 steps killed a rank
    that way at once; now the samples carry what the main thread read, and every rank
    lives with its state."""
    import torch

    w = sess.memory(interval=0.005)
    try:
        sess.wrap(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]), name="busy_model",
                  auto_wrap={torch.nn.Linear})
        sess.execute("busy_opt = torch.optim.AdamW(busy_model.parameters())\n"
                     "for _ in range(100):\n"
                     "    busy_model(torch.randn(8, 64)).sum().backward()\n"
                     "    busy_opt.step()\n"
                     "    busy_opt.zero_grad()\n"
                     "busy_steps = 100")
        assert sess.pull("busy_steps") == [100, 100] and sess.all_reduce_check() == 1.0
        t = time.time()
        assert wait_until(lambda: all(s is not None and s.t > t and s.optimizer for s in w.feed.latest()), 10)
        assert all(s.parameters > 0 for s in w.feed.latest())
    finally:
        w.close()
        forget_models(sess, "busy_model", optimizers=("busy_opt",))


def test_the_memory_view_opens_with_numbers_and_splits_a_wrapped_models_memory(sess):
    """Printed right after it is made, the view shows every rank's numbers (it waited for
    the first samples); with a model and its optimizer, each rank's memory splits into
    parameters, gradients, optimizer state and the rest, from the live samples."""
    import torch

    w = sess.memory(interval=0.2)
    try:
        text = str(w.to_text())
        assert "waiting" not in text and "?" not in text
        assert all(s is not None for s in w.feed.latest())
        model = sess.wrap(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)),
                          name="split_model")
        sess.execute("split_opt = torch.optim.AdamW(split_model.parameters())\n"
                     "split_model(torch.randn(8, 256)).sum().backward()\nsplit_opt.step()")
        half = sum(p.numel() for p in model.state_dict().values()) * 4 // 2
        t = time.time()
        assert wait_until(lambda: all(s is not None and s.t > t and s.optimizer for s in w.feed.latest()), 10)
        for s in w.feed.latest():
            assert s.parameters >= half and s.gradients >= half and s.optimizer >= 2 * half
            assert sum(s.kinds.values()) == s.used
        text = w.to_text()
        assert "parameters" in text.splitlines()[1] and "optimizer" in text.splitlines()[1]
        assert "title='optimizer'" in w.to_html() and "</span> optimizer " in w.to_html()
    finally:
        w.close()
        forget_models(sess, "split_model", optimizers=("split_opt",))


# -- checkpoints ---------------------------------------------------------------------


@pytest.fixture
def browser_model(sess):
    """A small wrapped model to save: ``Linear(4, 4)``, rows sharded 2 and 2 over the ranks."""
    import torch

    return sess.wrap(torch.nn.Linear(4, 4), name="browser_model")


def test_checkpoint_browser_listing_details_and_confirmed_delete(sess, browser_model, tmp_path):
    import shutil

    sess.save(str(tmp_path / "step20"), browser_model, extra={"step": 20})
    sess.save(str(tmp_path / "step100"), browser_model, extra={"step": 100})
    sess.save(str(tmp_path / "run-7"), browser_model)
    shutil.copytree(tmp_path / "step100", tmp_path / "broken")
    (tmp_path / "broken" / MARKER).unlink()  # written but never committed: listed as invalid
    shutil.copytree(tmp_path / "step20", tmp_path / ".ck.tmp-1")  # a save in flight: not listed
    (tmp_path / "notes").mkdir()  # not a checkpoint: not listed
    (tmp_path / "notes.txt").write_text("hello")
    b = CheckpointBrowser(sess.context, str(tmp_path))
    assert [e.name for e in b.entries] == ["step20", "broken", "step100", "run-7"]
    assert [e.step for e in b.entries] == [20, 100, 100, None]
    assert [e.valid for e in b.entries] == [True, False, True, True]
    assert "INVALID" in view.label(b.entries[1]) and "not committed" in b.entries[1].problem
    assert b.selected.name == "run-7"  # the newest is selected
    b.select("step100")
    e = b.selected
    assert e.world_size == 2 and e.files_by_rank() == {0: ["__0_0.distcp"], 1: ["__1_0.distcp"]}
    assert "rank 1:__1_0.distcp@(2,0)[2x4]" in b.details.value
    assert view.tensor_tree(e)["model"]["weight"].shape == (4, 4)
    assert "step100" in repr(b) and "world" in b.to_html()

    b.b_delete.click()  # step one: asks, deletes nothing
    assert b.confirm.layout.display == "flex" and "step100" in b.confirm_text.value
    assert (tmp_path / "step100").exists()
    b.b_no.click()
    assert b.confirm.layout.display == "none" and (tmp_path / "step100").exists()
    b.b_delete.click()
    b.b_yes.click()
    assert not (tmp_path / "step100").exists()
    assert [e.name for e in b.entries] == ["step20", "broken", "run-7"]
    assert b.last_message[0] == "ok"

    b.b_save.click()  # no model given: a clear message, nothing written
    assert b.last_message[0] == "error" and "model=" in b.last_message[1]
    b.save_name.value = "a/b"
    b.model = browser_model
    b.b_save.click()
    assert b.last_message[0] == "error" and "one folder name" in b.last_message[1]
    assert sorted(os.listdir(tmp_path)) == [".ck.tmp-1", "broken", "notes", "notes.txt", "run-7", "step20"]
    b.select("broken")
    b.b_load.click()  # an invalid checkpoint: refused, shown, the browser stays usable
    assert b.last_message[0] == "error" and "load failed" in b.last_message[1]


def test_checkpoint_listing_missing_root_step_from_name_rank_files(sess, browser_model, tmp_path):
    assert list_checkpoints(str(tmp_path / "nope")) == []
    sess.save(str(tmp_path / "iter_30"), browser_model)
    sess.save(str(tmp_path / "full.safetensors"), browser_model, sharded=False, extra={"step": 7})
    infos = list_checkpoints(str(tmp_path))
    assert [(i.name, i.step, i.kind) for i in infos] == [
        ("full.safetensors", 7, "full"), ("iter_30", 30, "sharded")]
    assert infos[0].files_by_rank() == {None: ["full.safetensors"]}
    assert list_checkpoints(str(tmp_path / "iter_30"))[0].name == "iter_30"  # root itself
    assert rank_of_file("__1_3.distcp") == 1 and rank_of_file("model.safetensors") is None
    assert "full.safetensors" in view.listing_text(str(tmp_path), infos)


def test_checkpoint_browser_real_save_load_consolidate(sess, tmp_path):
    import torch

    model = sess.wrap(torch.nn.Linear(4, 3), name="ckpt_widget_model")
    b = sess.checkpoints(str(tmp_path / "ck"), model=model, extra={"step": 5})
    b.save_name.value = "step5"
    b.b_save.click()
    assert b.last_message[0] == "ok", b.last_message
    assert [e.name for e in b.entries] == ["step5"] and b.selected.step == 5
    assert b.selected.world_size == sess.world_size and b.progress.value == 1.0
    b.b_load.click()
    assert b.last_message[0] == "ok", b.last_message
    b.b_consolidate.click()
    assert b.last_message[0] == "ok", b.last_message
    assert (tmp_path / "ck" / "step5.safetensors").exists()
    (tmp_path / "ck" / "notes").mkdir()  # a plain folder: not listed
    b.save_name.value, b.async_save.value, b.extra = "step6", True, {"step": 6}
    release = tmp_path / "release"
    sess.execute(GATE.format(release=str(release)))  # holds each rank after its first write
    try:
        b.b_save.click()  # async: copied, then written in the background
        assert b.save_handle is not None and b.progress.description == "staging"
        h = b.save_handle
        assert wait_until(lambda: h.progress().written > 0, 60)
        assert not b.check_save()  # still in flight: the bar shows the bytes written so far
        assert b.progress.description.startswith("writing ") and b.progress.description.endswith("%")
        assert 0.1 < b.progress.value <= 0.95
        release.touch()
        assert wait_until(b.check_save, 60)
    finally:
        release.touch()
        sess.execute(UNGATE)
    assert b.last_message[0] == "ok", b.last_message
    assert [e.name for e in b.entries] == ["step5", "step5.safetensors", "step6"]
    assert b.selected.name == "step6" and b.progress.value == 1.0


# -- dashboard -----------------------------------------------------------------------


def test_status_right_after_a_call_is_idle(sess):
    """The controller hears that a task finished after the notebook does (its count
    comes from the schedulers' monitor stream), so the status must not read its queue
    count alone: read that way, about one call in ten still showed a rank busy here."""
    for i in range(40):
        sess.execute(f"_status_probe = {i}")
        assert [r.state for r in session_status(sess.context).ranks] == ["idle", "idle"], i


def test_dashboard_status_busy_idle(sess, browser_model, tmp_path):
    st = session_status(sess.context)
    assert [r.state for r in st.ranks] == ["idle", "idle"]
    d = sess.dispatcher
    started, release = tmp_path / "started-{rank}", tmp_path / "release"
    pending = d.execute(  # each rank says it is inside the cell, then waits to be let go
        "import os as _os, time as _t\n"
        f"open({str(started)!r}.format(rank=rank), 'w').close()\n"
        f"while not _os.path.exists({str(release)!r}):\n    _t.sleep(0.01)")
    try:
        assert wait_until(lambda: all(os.path.exists(str(started).format(rank=r)) for r in (0, 1)),
                         timeout=30)
        assert [r.state for r in session_status(sess.context).ranks] == ["busy", "busy"]
    finally:
        release.touch()
        d.gather(pending)
    assert [r.state for r in session_status(sess.context).ranks] == ["idle", "idle"]
    sess.save(str(tmp_path / "ck" / "step1"), browser_model, extra={"step": 1})
    db = dashboard(sess.context, models=[hand_table()], root=str(tmp_path / "ck"), interval=0.5)
    try:
        assert db.tabs.titles == ("Status", "Memory", "Steps", "Layout: model", "Checkpoints")
        assert [e.name for e in db.checkpoints.entries] == ["step1"]
        assert db.refresh_status().ranks[0].state == "idle"
        sess.run(lambda: 1)  # the status tab is the live widget: it saw the call
        assert all(r.activity.startswith("run(") and r.state == "idle" for r in db.status.ranks)
        text = repr(db)
        assert "backend gloo, 2 ranks" in text and "blocks.0.lin.weight" in text
    finally:
        db.close()
        stop_measuring(sess.context)  # closing the tab leaves the ranks measuring: not into the next test
    assert not db.memory.feed.running and not db.steps.feed.running
    # without models=, a layout tab for every wrapped model
    every = dashboard(sess.context, memory=False, steps=False)
    try:
        assert every.tabs.titles == ("Status", *(f"Layout: {m.name}" for m in sess.models.values())) and sess.models
    finally:
        every.close()


# -- layer 2: a notebook executed headless with a real kernel ------------------------

NOTEBOOK_CELLS = [
    "import os, tempfile, time\nimport fsdp_nb\n" + TABLE_CODE,
    "sess = fsdp_nb.Session(2, backend='gloo')",
    "mem = sess.memory(interval=0.25)\nmem",
    "deadline = time.monotonic() + 60  # until every rank's first sample is in\n"
    "while not all(mem.feed.samples(r) for r in range(2)) and time.monotonic() < deadline:\n"
    "    time.sleep(0.05)\nmem.refresh()",
    "from fsdp_nb.models.layout_widget import layout_widget\nlayout_widget(hand_table())",
    "root = tempfile.mkdtemp(dir='.')  # in the notebook's temporary folder\nsess.checkpoints(root)",
    "print(repr(mem).splitlines()[0])",
    "mem.close()\nsess.shutdown()\nprint('feed running after shutdown:', mem.feed.running)",
    "from fsdp_nb.display.progress import Progress, in_notebook\n"
    "with Progress(1 << 30, 'big') as big, Progress(1 << 20, 'small') as small:\n"
    "    big.update(1 << 30)\n"
    "print('in notebook:', in_notebook(), 'bar for 1 GiB:', big.bar is not None, "
    "'bar for 1 MiB:', small.bar is not None)",
]


def test_notebook_headless_stores_widget_state(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in NOTEBOOK_CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    env_before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = REPO + (os.pathsep + env_before if env_before else "")
    try:
        NotebookClient(nb, timeout=180, kernel_name="python3", store_widget_state=True,
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_before
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    values = [m["state"].get("value", "") for m in state.values()
              if m["model_name"] == "HTMLModel"]
    assert any("Memory per rank" in v and "rank 1" in v for v in values)
    assert any("fsdp-nb-layout-table" in v for v in values)
    assert any(m["model_name"] == "ImageModel" for m in state.values())  # the heatmap
    assert any(m["model_name"] == "SelectModel" for m in state.values())  # the checkpoint list
    outs = {i: c.outputs for i, c in enumerate(nb.cells)}
    static = [o["data"] for o in outs[2] + outs[4] + outs[5] if "data" in o]
    assert all("text/html" in d and "application/vnd.jupyter.widget-view+json" in d
               for d in static) and len(static) == 3
    assert "fsdp_nb memory (process RSS)" in outs[6][0]["text"]
    last = "".join(o.get("text", "") for o in outs[7])
    assert "feed running after shutdown: False" in last
    shown = "".join(o.get("text", "") for o in outs[8])
    assert "in notebook: True bar for 1 GiB: True bar for 1 MiB: False" in shown
    print({i: (c.metadata.get("execution", {}).get("shell.execute_reply", "")[11:23])
           for i, c in enumerate(nb.cells)})
