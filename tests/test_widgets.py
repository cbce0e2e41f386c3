"""Widgets: objects without a kernel (layer 1) and a notebook run headless (layer 2).

The browser layer is tests/test_browser.py.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from fsdp_nb.engine import memory_sampler as ms
from fsdp_nb.widgets.checkpoints import CheckpointBrowser, entry_from_info, scan
from fsdp_nb.widgets.dashboard import dashboard, session_status
from fsdp_nb.widgets.layout import LayoutData, LayoutWidget
from fsdp_nb.widgets.memory import MemorySnapshot

sys.path.insert(0, os.path.dirname(__file__))
from widget_data import (  # noqa: E402
    TABLE_CODE,
    fake_inspect,
    hand_table,
    hybrid_table,
    write_fake_checkpoint,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _engines_running(sess) -> list[list[str]]:
    d = sess.dispatcher
    return d.gather(d.apply("samplers running", ms.running))


def _wait_for(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


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
    try:
        t0 = time.time()
        sess.execute("import time as _t; _t.sleep(3)")
        t1 = time.time()
        for r in range(sess.world_size):
            during = [s for s in w.feed.samples(r) if t0 < s.t < t1 and s.received < t1]
            # arrived while the engines' task queues were busy with the cell
            assert len(during) >= 5, (r, [(s.t - t0, s.received - t0) for s in w.feed.samples(r)])
            assert all(s.rank == r and s.device == "cpu" and s.rss > 0 for s in during)
            assert all(0 < s.rss <= s.rss_peak and s.limit == s.ram_total for s in during)
        # one redraw per feed update, at most one per interval
        assert w.renders == w.feed.updates >= 5
        assert w.feed.updates <= (time.time() - t0) / 0.2 + 2
        snap = w.snapshot
        assert all(s is not None for s in snap.latest)
        assert "rank 1" in w.view.value and "<svg" in w.view.value
        assert repr(w).splitlines()[0] == "fsdp_nb memory (process RSS)"
        assert all(len(x) == 1 for x in _engines_running(sess))
    finally:
        w.close()
    assert not w.feed.running
    # the engines' samplers saw the unsubscribe and ended
    assert _wait_for(lambda: _engines_running(sess) == [[], []])


def test_memory_sampler_without_subscriber_ends_and_bad_interval(sess):
    d = sess.dispatcher
    args = [("lonely", r.rank, r.addr, r.device, 0.1, 0.3) for r in sess.ranks]
    eps = d.gather(d.apply("start sampler", ms.start, args))
    assert all(e.startswith("tcp://") for e in eps)
    assert _wait_for(lambda: _engines_running(sess) == [[], []])
    with pytest.raises(ValueError, match="interval must be a positive number"):
        sess.memory(interval=0)
    assert sess.all_reduce_check() == 1.0  # session still usable


def test_memory_snapshot_static_form_gpu_fields():
    from fsdp_nb.widgets._feed import MemorySample

    s = MemorySample(0, 1.0, "cuda:0", 1 << 30, 1 << 30, 64 << 30, cuda_allocated=40 << 30,
                     cuda_reserved=50 << 30, cuda_peak=60 << 30, cuda_total=80 << 30)
    snap = MemorySnapshot((s, None), ((s,), ()))
    text = snap.to_text()
    assert "CUDA allocated" in text and "40.0 GiB  80.0 GiB  50.0%  60.0 GiB  50.0 GiB" in text
    assert "waiting for samples" in snap.to_html() and "reserved 50.0 GiB" in snap.to_html()


# -- checkpoints ---------------------------------------------------------------------


def test_checkpoint_browser_listing_details_and_confirmed_delete(sess, tmp_path):
    write_fake_checkpoint(tmp_path, "step20", 20)
    write_fake_checkpoint(tmp_path, "step100", 100, world=3)
    write_fake_checkpoint(tmp_path, "run-7", None)
    (tmp_path / "notes").mkdir()  # not a checkpoint: skipped
    b = CheckpointBrowser(sess, str(tmp_path), inspect=fake_inspect)
    assert [e.name for e in b.entries] == ["step20", "step100", "run-7"]
    assert [e.step for e in b.entries] == [20, 100, None]
    assert b.selected.name == "run-7"  # the newest is selected
    b.select("step100")
    e = b.selected
    assert e.world_size == 3 and e.files_by_rank() == {
        0: ["__0_0.distcp"], 1: ["__1_0.distcp"], 2: ["__2_0.distcp"]}
    assert "rank 2:__2_0.distcp@(4,0)[2x4]" in b.details.value
    assert e.tree()["model"]["l1"]["weight"].shape == (4, 4)
    assert "step100" in repr(b) and "world" in b.to_html()

    b.b_delete.click()  # step one: asks, deletes nothing
    assert b.confirm.layout.display == "flex" and "step100" in b.confirm_text.value
    assert (tmp_path / "step100").exists()
    b.b_no.click()
    assert b.confirm.layout.display == "none" and (tmp_path / "step100").exists()
    b.b_delete.click()
    b.b_yes.click()
    assert not (tmp_path / "step100").exists()
    assert [e.name for e in b.entries] == ["step20", "run-7"]
    assert b.last_message[0] == "ok"

    b.b_save.click()  # no model given: a clear message, nothing written
    assert b.last_message[0] == "error" and "model=" in b.last_message[1]
    b.save_name.value = "a/b"
    b.model = "widgets_model"
    b.b_save.click()
    assert b.last_message[0] == "error" and "one folder name" in b.last_message[1]


def test_checkpoint_scan_missing_root_and_adapter_names_rank_files(tmp_path):
    assert scan(str(tmp_path / "nope"), inspect=fake_inspect) == []
    entry = entry_from_info("s3://b/ckpt/iter_30", {
        "kind": "sharded", "world_size": 2, "total_bytes": 0, "extra": {},
        "tensors": {"w": {"name": "w", "shape": (2,), "dtype": "bfloat16", "bytes": 4,
                          "chunks": [{"file": "__1_3.distcp", "offsets": (1,), "sizes": (1,)}]}}})
    assert entry.step == 30 and entry.size == 4 and entry.name == "iter_30"
    assert entry.tensors[0].chunks[0].rank == 1


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
    b.b_save.click()  # async: staged, then written in the background
    assert b.save_handle is not None and b.progress.description == "writing"
    assert _wait_for(b.check_save, timeout=60)
    assert b.last_message[0] == "ok", b.last_message
    assert [e.name for e in b.entries] == ["step5", "step5.safetensors", "step6"]
    assert b.selected.name == "step6" and b.progress.value == 1.0


# -- dashboard -----------------------------------------------------------------------


def test_dashboard_status_busy_idle(sess, tmp_path):
    st = session_status(sess)
    assert [r.state for r in st.ranks] == ["idle", "idle"]
    d = sess.dispatcher
    pending = d.execute("import time as _t; _t.sleep(1.5)")
    try:
        assert _wait_for(lambda: [r.state for r in session_status(sess).ranks] == ["busy", "busy"],
                         timeout=1.0)
    finally:
        d.gather(pending)
    write_fake_checkpoint(tmp_path, "step1", 1)
    db = dashboard(sess, models=[hand_table()], root=str(tmp_path), inspect=fake_inspect,
                   interval=0.5)
    try:
        assert db.tabs.titles == ("Status", "Memory", "Layout: model", "Checkpoints")
        assert [e.name for e in db.checkpoints.entries] == ["step1"]
        assert db.refresh_status().ranks[0].state == "idle"
        text = repr(db)
        assert "backend gloo, 2 ranks" in text and "blocks.0.lin.weight" in text
    finally:
        db.close()
    assert not db.memory.feed.running


# -- layer 2: a notebook executed headless with a real kernel ------------------------

NOTEBOOK_CELLS = [
    "import os, tempfile, time\nimport fsdp_nb\n" + TABLE_CODE,
    "sess = fsdp_nb.Session(2, backend='gloo')",
    "mem = sess.memory(interval=0.25)\nmem",
    "time.sleep(1.5)\nmem.refresh()",
    "from fsdp_nb.widgets.layout import layout_widget\nlayout_widget(hand_table())",
    "root = tempfile.mkdtemp()\nsess.checkpoints(root)",
    "print(repr(mem).splitlines()[0])",
    "mem.close()\nsess.shutdown()\nprint('feed running after shutdown:', mem.feed.running)",
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
    print({i: (c.metadata.get("execution", {}).get("shell.execute_reply", "")[11:23])
           for i, c in enumerate(nb.cells)})
