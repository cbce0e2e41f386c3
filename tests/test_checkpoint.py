"""Checkpoints on real engines: sharded/full save and load, resharding, atomicity,
corruption, async, retention, offline inspect/consolidate (API and CLI), and S3
through a real S3 API on loopback (moto's server).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from helpers import forget_models, page_cache

import fsdp_nb
from fsdp_nb import CheckpointError, CorruptCheckpointError, inspect
from fsdp_nb.formats.storage import set_storage_options
from fsdp_nb.runtime.cluster import wait_until

BUILD = """
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh

class CkNet(torch.nn.Module):
    def __init__(self, dim, layers=2, extra=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, 3)
        if extra:
            self.tail = torch.nn.Linear(3, 3)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        x = self.head(x)
        return self.tail(x) if hasattr(self, "tail") else x

def ck_build(name, dim=16, seed=0, layers=2, extra=False):
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world_size,))
    m = CkNet(dim, layers, extra)
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    globals()[name] = m
    globals()[name + "_opt"] = torch.optim.AdamW(m.parameters(), lr=1e-2)

def ck_step(name, dim=16):
    m, opt = globals()[name], globals()[name + "_opt"]
    torch.manual_seed(100 + rank)
    m(torch.randn(4, dim)).square().mean().backward()
    opt.step()
    opt.zero_grad()

def ck_full(name):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    m, opt = globals()[name], globals()[name + "_opt"]
    msd, osd = get_state_dict(m, [opt], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return msd, {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in osd.get("state", {}).items()}
"""


def build(sess, name, **kw):
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    sess.execute(BUILD + f"\nck_build({name!r}{', ' + args if args else ''})\n")


def step(sess, name, dim=16):
    sess.execute(f"ck_step({name!r}, {dim})")


def snapshot(sess, name):
    """(model, optimizer state) as full CPU tensors, from rank 0."""
    sess.execute(f"_ck_snap = ck_full({name!r})")
    return sess.pull("_ck_snap")[0]


def same(a, b) -> bool:
    """Bit-for-bit equality of two (model, optim) snapshots (or of two model dicts)."""
    if isinstance(a, tuple):
        return same(a[0], b[0]) and same(a[1], b[1])
    if set(a) != set(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not same(x, y):
                return False
        elif not (x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))):
            return False
    return True


def _bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def test_sharded_roundtrip_bit_exact_then_train(sess, tmp_path):
    build(sess, "ck_a")
    step(sess, "ck_a")
    s0 = snapshot(sess, "ck_a")
    path = str(tmp_path / "step1")
    info = sess.save(path, "ck_a", optimizer="ck_a_opt", extra={"step": 1, "note": "x"})
    assert info.valid and info.kind == "sharded" and info.world_size == 2
    assert info.extra == {"step": 1, "note": "x"} and info.has_optimizer
    assert info.mesh["shape"] == [2] and info.model_class.endswith("CkNet")
    assert info.param_count == 2 * (16 * 16 + 16) + 16 * 3 + 3
    assert {c.file for c in info.tensors["model.blocks.0.weight"].chunks} == {"__0_0.distcp", "__1_0.distcp"}
    step(sess, "ck_a")
    s1 = snapshot(sess, "ck_a")
    assert not same(s0, s1)
    assert sess.load(path, "ck_a", optimizer="ck_a_opt") == {"step": 1, "note": "x"}
    assert same(snapshot(sess, "ck_a"), s0)
    step(sess, "ck_a")  # training after load repeats the same step exactly (optimizer state restored)
    assert same(snapshot(sess, "ck_a"), s1)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_full_file_roundtrip_and_convert(sess, tmp_path, suffix):
    build(sess, "ck_f")
    step(sess, "ck_f")
    s0 = snapshot(sess, "ck_f")
    path = str(tmp_path / f"full{suffix}")
    info = sess.save(path, "ck_f", optimizer="ck_f_opt", sharded=False, extra={"k": [1, 2]})
    assert info.kind == "full" and info.valid and info.extra == {"k": [1, 2]}
    # no temporary left behind; safetensors keeps the optimizer state beside the weights
    beside = ["full.optim.safetensors"] if suffix == ".safetensors" else []
    assert sorted(os.listdir(tmp_path)) == sorted([f"full{suffix}", *beside])
    step(sess, "ck_f")
    assert sess.load(path, "ck_f", optimizer="ck_f_opt") == {"k": [1, 2]}
    assert same(snapshot(sess, "ck_f"), s0)
    # full -> sharded (offline), then load the sharded one onto the session
    back = str(tmp_path / "back")
    binfo = fsdp_nb.consolidate(path, back)
    assert binfo.kind == "sharded" and binfo.valid and binfo.world_size == 1
    step(sess, "ck_f")
    sess.load(back, "ck_f", optimizer="ck_f_opt")
    assert same(snapshot(sess, "ck_f"), s0)


def test_refusals_write_nothing(sess, tmp_path):
    build(sess, "ck_r")
    path = tmp_path / "c"
    with pytest.raises(TypeError, match=r"extra\['bad'\].*not a JSON value"):
        sess.save(str(path), "ck_r", extra={"bad": object()})
    with pytest.raises(TypeError, match="JSON keys must be str"):
        sess.save(str(path), "ck_r", extra={1: 2})
    with pytest.raises(ValueError, match="must end in .pt or .safetensors"):
        sess.save(str(path), "ck_r", sharded=False)
    with pytest.raises(NameError, match="no model named 'nope'"):
        sess.save(str(path), "nope")
    with pytest.raises(NameError, match="no optimizer named 'nope'"):
        sess.save(str(path), "ck_r", optimizer="nope")
    assert os.listdir(tmp_path) == []
    sess.save(str(path), "ck_r", extra={"v": 1})
    before = {f: os.stat(path / f).st_mtime_ns for f in os.listdir(path)}
    with pytest.raises(FileExistsError, match="overwrite=True"):
        sess.save(str(path), "ck_r", extra={"v": 2})
    assert {f: os.stat(path / f).st_mtime_ns for f in os.listdir(path)} == before
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert sess.save(str(path), "ck_r", extra={"v": 3}, overwrite=True).extra == {"v": 3}
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == ["c"]
    deadline = time.monotonic() + 30  # the replaced folder is removed in the background
    while sorted(os.listdir(tmp_path)) != ["c"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    sess.all_reduce_check()  # the session is still usable


def test_checksums_taken_while_writing_tile_every_file(sess, tmp_path):
    """The marker's segments cover each file end to end and match its bytes read back."""
    import json
    import zlib

    from fsdp_nb.formats.checksums import checksum, file_problem
    from fsdp_nb.formats.metadata import MARKER

    build(sess, "ck_s")
    path = tmp_path / "c"
    sess.save(str(path), "ck_s", optimizer="ck_s_opt")
    files = json.loads((path / MARKER).read_text())["files"]
    # each rank's own file (its random state) is checksummed as it was written too
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "train/rank0.pt", "train/rank1.pt"]
    for name, rec in files.items():
        data = (path / name).read_bytes()
        assert rec["size"] == len(data)
        ends = 0
        for off, length, crc in rec["segments"]:
            assert off == ends and checksum(data[off:off + length], 0, rec["algorithm"]) == crc
            ends = off + length
        assert ends == len(data)  # no byte left unchecked
    assert len(files["__0_0.distcp"]["segments"]) > 4  # one per stored item, not one per file
    # an older marker's whole-file CRC-32 still verifies, and catches a change
    data = (path / "__0_0.distcp").read_bytes()
    old = {"size": len(data), "crc32": zlib.crc32(data)}
    assert file_problem(LocalFileSystem(), str(path / "__0_0.distcp"), "__0_0.distcp", old) is None
    old["crc32"] ^= 1
    assert "is corrupt" in file_problem(LocalFileSystem(), str(path / "__0_0.distcp"), "__0_0.distcp", old)
    # a flipped byte in .metadata is caught before anything is read
    md = path / ".metadata"
    raw = md.read_bytes()
    md.write_bytes(raw[:-3] + bytes([raw[-3] ^ 0x01]) + raw[-2:])
    with pytest.raises(CorruptCheckpointError, match=r"'.metadata' is corrupt"):
        sess.load(str(path), "ck_s", optimizer="ck_s_opt")
    sess.execute("del ck_s, ck_s_opt")


class _ShortWrites(io.BytesIO):
    """A raw file that takes at most ``cap`` bytes per write, as a raw stream may."""

    cap = 5 << 20

    def write(self, b):
        return super().write(memoryview(b)[: self.cap])


@pytest.mark.parametrize("raw", [io.BytesIO, _ShortWrites])
def test_large_writes_are_checksummed_beside_the_write(raw):
    """Writes over OVERLAP_BYTES are checksummed in a helper thread while the file takes
    them; the segments are those of the bytes that reached the file, short writes too."""
    from fsdp_nb.formats.checksums import OVERLAP_BYTES, ChecksumStream, checksum

    g = torch.Generator().manual_seed(3)
    items = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
             for n in (100, OVERLAP_BYTES + 3, 7, 3 * OVERLAP_BYTES)]
    f, got = raw(), {}
    s = ChecksumStream(f, got.update)
    for item in items:
        s.tell()  # DCP asks for the position at each item's start
        view = memoryview(item)
        while view:
            view = view[s.write(view):]
    s.close()
    assert f.closed
    assert got["size"] == sum(map(len, items))
    assert [(off, n) for off, n, _ in got["segments"]] == [
        (sum(map(len, items[:i])), len(item)) for i, item in enumerate(items)]
    assert [crc for *_, crc in got["segments"]] == [checksum(item) for item in items]


def test_where_direct_io_is_off_a_save_hands_its_bytes_to_the_disk_as_it_writes(tmp_path, monkeypatch):
    """Through the page cache (``FSDP_NB_DIRECT_IO=0``, or a filesystem that refuses
    ``O_DIRECT``), the stream DCP writes each file through starts the disk write every
    STEP_BYTES, so that the save's closing fsync waits only for the tail: before that
    fsync, at most one step (plus the last write) is still only in memory."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from fsdp_nb.formats.checksums import RecordingFileSystem
    from fsdp_nb.formats.writeback import STEP_BYTES

    monkeypatch.setenv("FSDP_NB_DIRECT_IO", "0")
    fs = RecordingFileSystem(FileSystem())
    data = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8).numpy().tobytes()
    with fs.create_stream(tmp_path / "__0_0.distcp", "wb") as stream:
        writeback = stream.raw.writeback  # the file under the checksumming stream
        if writeback is None:
            pytest.skip("no sync_file_range on this system")
        for _ in range(12):  # 48 MB in DCP-sized writes
            stream.write(data)
        stream.flush()
        pages = page_cache(stream.fileno())
        if pages is None:
            pytest.skip("this kernel has no cachestat to count a file's dirty pages")
        assert writeback.requests >= 48 // (STEP_BYTES >> 20) - 1
        assert pages[1] * os.sysconf("SC_PAGE_SIZE") <= STEP_BYTES + len(data)
    assert fs.records["__0_0.distcp"]["size"] == 12 * len(data)


def test_saves_write_their_files_past_the_page_cache(sess, tmp_path):
    """Sharded and full saves, consolidation and the export write their files with
    O_DIRECT: once written, no page of a sharded or exported file but the last (the
    partial block, written through the cache) is in memory, and of a full file only
    what the writer reads back of it; each save loads back bit for bit."""
    from fsdp_nb.formats.direct_io import enabled

    if not enabled():
        pytest.skip("no O_DIRECT here, or FSDP_NB_DIRECT_IO=0")
    build(sess, "ck_dio", dim=256)
    step(sess, "ck_dio", dim=256)
    want = snapshot(sess, "ck_dio")
    sharded, pt, st = tmp_path / "d", tmp_path / "d.pt", tmp_path / "d.safetensors"
    for p in (sharded, pt, st):
        sess.save(str(p), "ck_dio", optimizer="ck_dio_opt", sharded=p is sharded)
    page = os.sysconf("SC_PAGE_SIZE")

    def check(files: list, full: list) -> None:
        for f in files + full:
            fd = os.open(f, os.O_RDONLY)
            try:
                pages = page_cache(fd)
            finally:
                os.close(fd)
            if pages is None:
                pytest.skip("this kernel has no cachestat to count a file's cached pages")
            n = -(-f.stat().st_size // page)
            assert n > 64, f.name
            # a .distcp or exported file is never read back; the save's (or
            # consolidate's) inspect() reads a full file's header and pickle, and the
            # kernel's readahead around them: never most of it
            assert pages[0] <= (n // 4 if f in full else 1), (f.name, n, pages)

    check(list(sharded.glob("*.distcp")), [pt, st, tmp_path / "d.optim.safetensors"])
    # offline, in this process (these read the saves, so they come after the check):
    # consolidation both ways, and the export
    fsdp_nb.consolidate(str(sharded), str(tmp_path / "c.pt"))
    fsdp_nb.consolidate(str(pt), str(tmp_path / "c"))
    fsdp_nb.export_safetensors(str(sharded), str(tmp_path / "hf"))
    check([*(tmp_path / "c").glob("*.distcp"), tmp_path / "hf" / "model.safetensors"], [tmp_path / "c.pt"])
    for p in (sharded, pt, st):
        build(sess, "ck_dio", dim=256, seed=1)
        sess.load(str(p), "ck_dio", optimizer="ck_dio_opt")
        assert same(snapshot(sess, "ck_dio"), want), p.name
    sess.execute("del ck_dio, ck_dio_opt")


def test_corrupt_or_truncated_file_named_model_unchanged(sess, tmp_path):
    build(sess, "ck_c")
    path = tmp_path / "c"
    sess.save(str(path), "ck_c", optimizer="ck_c_opt")
    full = tmp_path / "c.safetensors"
    sess.save(str(full), "ck_c", sharded=False)
    step(sess, "ck_c")
    s1 = snapshot(sess, "ck_c")
    # truncated rank file
    f1 = path / "__1_0.distcp"
    data = f1.read_bytes()
    f1.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=r"(?s)c'.*'__1_0.distcp'.*truncated"):
        sess.load(str(path), "ck_c", optimizer="ck_c_opt")
    assert same(snapshot(sess, "ck_c"), s1)
    assert not inspect(str(path)).valid
    # same size, flipped bytes: caught by the CRC-32
    f1.write_bytes(data[:100] + bytes(b ^ 0xFF for b in data[100:200]) + data[200:])
    with pytest.raises(CorruptCheckpointError, match=r"'__1_0.distcp' is corrupt"):
        sess.load(str(path), "ck_c", optimizer="ck_c_opt")
    assert same(snapshot(sess, "ck_c"), s1)
    assert not inspect(str(path), verify=True).valid
    # truncated full file
    fd = full.read_bytes()
    full.write_bytes(fd[: len(fd) - 50])
    with pytest.raises(CorruptCheckpointError, match=r"c.safetensors"):
        sess.load(str(full), "ck_c")
    assert same(snapshot(sess, "ck_c"), s1)
    with pytest.raises(FileNotFoundError):
        sess.load(str(tmp_path / "missing"), "ck_c")


def test_a_late_corrupt_item_stops_the_load_before_any_rank_changes(sess, tmp_path):
    """The load checks every item (a large one through a small window, keeping only its
    ends) before it copies anything: a flipped byte far into rank 0's file, in the
    middle of an item, still leaves both ranks' models as they were."""
    build(sess, "ck_late", dim=1536)  # a weight's shard is over 4 MiB: its middle is checked, not kept
    path = tmp_path / "late"
    sess.save(str(path), "ck_late", optimizer="ck_late_opt")
    s0 = snapshot(sess, "ck_late")
    step(sess, "ck_late", dim=1536)
    s1 = snapshot(sess, "ck_late")
    f0 = path / "__0_0.distcp"
    data = bytearray(f0.read_bytes())
    at = len(data) * 3 // 4
    data[at] ^= 0xFF
    f0.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"'__0_0.distcp' is corrupt"):
        sess.load(str(path), "ck_late", optimizer="ck_late_opt")
    assert same(snapshot(sess, "ck_late"), s1)
    data[at] ^= 0xFF  # mended: the same load goes through
    f0.write_bytes(bytes(data))
    sess.load(str(path), "ck_late", optimizer="ck_late_opt")
    assert same(snapshot(sess, "ck_late"), s0)
    sess.execute("del ck_late, ck_late_opt")


IN_PLACE = """
from torch.distributed.checkpoint.state_dict import get_state_dict as _gsd
from fsdp_nb.checkpoints.rank_dcp_load import over_model as _over_model
_in_place = _over_model(ck_i, _gsd(ck_i, [])[0])
_copied = _over_model(ck_i, {k: v.clone() for k, v in _gsd(ck_i, [])[0].items()})
"""


def test_a_wrapped_model_is_loaded_in_place_after_every_rank_read_its_share(sess, tmp_path):
    """A sharded load reads and checks every item, then (once every rank has) copies
    them into the model's own shards: no second model-sized copy. A state dict that is
    not over the model's memory is read into fresh tensors and set afterwards instead."""
    build(sess, "ck_i")
    step(sess, "ck_i")
    s0 = snapshot(sess, "ck_i")
    path = tmp_path / "i"
    sess.save(str(path), "ck_i", optimizer="ck_i_opt")
    sess.execute(IN_PLACE)
    assert sess.pull("_in_place") == [True] * sess.world_size
    assert sess.pull("_copied") == [False] * sess.world_size
    step(sess, "ck_i")
    s1 = snapshot(sess, "ck_i")
    sess.load(str(path), "ck_i", optimizer="ck_i_opt")
    assert same(snapshot(sess, "ck_i"), s0)
    # rank 0's own file damaged near its end: rank 1 read all of its share, yet copies nothing
    step(sess, "ck_i")
    s1 = snapshot(sess, "ck_i")
    f0 = path / "__0_0.distcp"
    data = f0.read_bytes()
    f0.write_bytes(data[:-200] + bytes(b ^ 0xFF for b in data[-200:-100]) + data[-100:])
    with pytest.raises(CorruptCheckpointError, match=r"'__0_0.distcp' is corrupt"):
        sess.load(str(path), "ck_i", optimizer="ck_i_opt")
    assert same(snapshot(sess, "ck_i"), s1)
    sess.execute("del ck_i, ck_i_opt")


def test_strict_keys_and_shapes(sess, tmp_path):
    build(sess, "ck_s")
    path = str(tmp_path / "c")
    sess.save(path, "ck_s")
    build(sess, "ck_s8", dim=8)
    with pytest.raises(CheckpointError, match=r"(?s)shape mismatch model.blocks.0.weight: checkpoint \[16, 16\], model \[8, 8\]"):
        sess.load(path, "ck_s8")
    build(sess, "ck_sx", seed=1, extra=True)
    before = snapshot(sess, "ck_sx")
    with pytest.raises(CheckpointError, match=r"(?s)missing keys \(2\): model.tail.bias, model.tail.weight"):
        sess.load(path, "ck_sx")
    assert same(snapshot(sess, "ck_sx"), before)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        sess.load(path, "ck_s", optimizer="ck_s_opt")
    sess.load(path, "ck_sx", strict=False)  # loads what both have, keeps the rest
    after = snapshot(sess, "ck_sx")[0]
    ref = snapshot(sess, "ck_s")[0]
    assert all(torch.equal(after[k], ref[k]) for k in ref)
    assert torch.equal(after["tail.weight"], before[0]["tail.weight"])


def test_async_save_commits_staged_state(sess, tmp_path):
    build(sess, "ck_y")
    step(sess, "ck_y")
    s0 = snapshot(sess, "ck_y")
    path = str(tmp_path / "a")
    h = sess.save(path, "ck_y", optimizer="ck_y_opt", async_save=True, extra={"step": 7})
    step(sess, "ck_y")  # training goes on while the write runs
    info = h.wait()
    assert info.valid and info.extra == {"step": 7} and "committed" in repr(h)
    assert inspect(path).valid
    sess.load(path, "ck_y", optimizer="ck_y_opt")
    assert same(snapshot(sess, "ck_y"), s0)  # the state at save time, not after the step
    # next session call commits a pending one without wait()
    h2 = sess.save(str(tmp_path / "b.pt"), "ck_y", sharded=False, async_save=True)
    sess.load(path, "ck_y")
    assert h2.done() and inspect(str(tmp_path / "b.pt")).valid


HOLD_STAGING = """
import sys as _sys, threading as _th, time as _time
from fsdp_nb.checkpoints import rank_async_saves as _as
_staging_go = _th.Event()
from fsdp_nb.engine.registry import part as _part
_waited_before = _part(_as.AsyncSaves).waited_s
_stager = _as.stager(False)
_plain_stage = _stager._stage
def _held_stage(sd, **kw):
    _staging_go.wait(120)  # the copy waits until the test lets it go
    return _plain_stage(sd, **kw)
_stager._stage = _held_stage

def _main_thread_waits_for_staging():
    f = _sys._current_frames().get(_th.main_thread().ident)
    while f is not None and f.f_code.co_name != "wait_staged":
        f = f.f_back
    return f is not None

def held_step(name):
    # Let the copy go once this thread waits for it in the optimizer's step, or, if the
    # step does not wait, once the step is over (then the copy sees the stepped weights).
    stepped = _th.Event()
    def release():
        while not (stepped.is_set() or _main_thread_waits_for_staging()):
            _time.sleep(0.002)
        _staging_go.set()
    _th.Thread(target=release, daemon=True).start()
    ck_step(name)
    stepped.set()
"""


def test_async_save_returns_before_the_copy_and_the_next_step_waits_for_it(sess, tmp_path):
    build(sess, "ck_h")
    step(sess, "ck_h")
    s0 = snapshot(sess, "ck_h")
    path = str(tmp_path / "h")
    sess.execute(HOLD_STAGING)
    try:
        h = sess.save(path, "ck_h", optimizer="ck_h_opt", async_save=True)
        # returned while every rank's copy is held
        assert h.progress().phase == "staging" == h.phase and not h.done()
        sess.execute("held_step('ck_h')")  # training goes on: its step waits for the copy
        assert not same(snapshot(sess, "ck_h"), s0)
        assert h.wait().valid
        sess.execute("_waited = _part(_as.AsyncSaves).waited_s - _waited_before")
        assert all(w > 0 for w in sess.pull("_waited"))  # each rank's step did wait
    finally:
        sess.execute("_staging_go.set(); del _stager._stage")
    sess.load(path, "ck_h", optimizer="ck_h_opt")
    assert same(snapshot(sess, "ck_h"), s0)  # the state at save time, not after the step
    sess.execute("del ck_h, ck_h_opt")


WRITER_PRIORITY = """
import os as _os
import fsdp_nb.formats.checksums as _cs
_unprobed_write = _cs.ChecksumStream.write
_write_nice = set()
def _probed_write(self, b):
    _write_nice.add(_os.getpriority(_os.PRIO_PROCESS, 0))  # the writing thread's
    return _unprobed_write(self, b)
_cs.ChecksumStream.write = _probed_write
"""


def test_async_save_writes_at_a_lower_cpu_priority(sess, tmp_path):
    """An async save's write yields the cores to the ranks' foreground work (a rank still
    answering the save's call, the next training step); a sync save writes at the
    engine's own priority."""
    build(sess, "ck_n")
    sess.execute(WRITER_PRIORITY)
    try:
        sess.save(str(tmp_path / "sync"), "ck_n", optimizer="ck_n_opt")
        sess.execute("_sync_nice, _write_nice = set(_write_nice), set()")
        assert sess.save(str(tmp_path / "async"), "ck_n", optimizer="ck_n_opt", async_save=True).wait().valid
        sess.execute("_async_nice, _main_nice = set(_write_nice), _os.getpriority(_os.PRIO_PROCESS, 0)")
    finally:
        sess.execute("_cs.ChecksumStream.write = _unprobed_write")
    for main, sync, background in zip(*(sess.pull(v) for v in ("_main_nice", "_sync_nice", "_async_nice"))):
        assert sync == {main} and background == {min(19, main + 10)}, (main, sync, background)
    sess.execute("del ck_n, ck_n_opt")


STAGED_BUFFERS = """
from fsdp_nb.checkpoints import rank_async_saves as _as
_cache = _as.stager(False)._state_dict_stager._cached_storage_mapping
_mine = [*ck_r.parameters(), *(v for st in ck_r_opt.state.values() for v in st.values() if v.dim())]
_mine = [t.to_local() if hasattr(t, "to_local") else t for t in _mine]
# the CPU buffer this model's tensors were staged into (the cache also holds other
# models' buffers, which go when those models are collected)
_staged = [_cache[t.untyped_storage()].data_ptr() if t.untyped_storage() in _cache else None for t in _mine]
"""


def test_async_saves_reuse_one_stager_that_outlives_close(sess, tmp_path):
    """The second async save copies into the first one's CPU buffers, also where DCP
    closes the stager (or its inner copier, as torch 2.11 does after every staging; the
    second save then failed with "KeyError: <class 'type'>")."""
    build(sess, "ck_r")
    step(sess, "ck_r")
    assert sess.save(str(tmp_path / "r1"), "ck_r", optimizer="ck_r_opt", async_save=True).wait().valid
    sess.execute(STAGED_BUFFERS + "_as.stager(False).close()\n"
                 "_as.stager(False)._state_dict_stager.close()\n_first = _staged")
    step(sess, "ck_r")
    s1 = snapshot(sess, "ck_r")
    path = str(tmp_path / "r2")
    assert sess.save(path, "ck_r", optimizer="ck_r_opt", async_save=True).wait().valid
    sess.execute(STAGED_BUFFERS + "_reused = None not in _staged and _staged == _first")
    assert sess.pull("_reused") == [True] * sess.world_size
    step(sess, "ck_r")
    sess.load(path, "ck_r", optimizer="ck_r_opt")
    assert same(snapshot(sess, "ck_r"), s1)
    sess.execute("del ck_r, ck_r_opt")


GATE = """
import os as _os, time as _time
import fsdp_nb.formats.checksums as _cs
_plain_write = _cs.ChecksumStream.write
def _gated_write(self, b, _release={release!r}):
    n = _plain_write(self, b)
    while not _os.path.exists(_release):  # the test lets the write go on
        _time.sleep(0.01)
    return n
_cs.ChecksumStream.write = _gated_write
"""
UNGATE = "_cs.ChecksumStream.write = _plain_write"


def test_async_save_progress_writing_then_committed(sess, tmp_path):
    build(sess, "ck_g")
    release = tmp_path / "release"
    sess.execute(GATE.format(release=str(release)))
    try:
        h = sess.save(str(tmp_path / "g"), "ck_g", optimizer="ck_g_opt", async_save=True)
        assert wait_until(lambda: h.progress().written > 0, 60)  # each rank's first write done, the rest held
        p = h.progress()
        assert p.phase == "writing" and 0 < p.written < p.total and h.phase == "writing"
        assert p.total >= 3 * (2 * (16 * 16 + 16) + 16 * 3 + 3) * 4  # weights and AdamW's two moments
        assert "writing" in repr(h) and not h.done()
        release.touch()
        assert h.wait().valid
    finally:
        release.touch()
        sess.execute(UNGATE)
    p = h.progress()
    assert p.phase == "committed" == h.phase and p.written == p.total
    sess.execute("del ck_g, ck_g_opt")


def test_progress_bars_follow_save_load_consolidate(sess, tmp_path, capsys):
    import re

    build(sess, "ck_b")
    path = str(tmp_path / "b")
    sess.save(path, "ck_b", optimizer="ck_b_opt", progress=True)  # bars from what the ranks publish
    sess.load(path, "ck_b", optimizer="ck_b_opt", progress=True)
    fsdp_nb.consolidate(path, str(tmp_path / "b.safetensors"), progress=True)
    err = capsys.readouterr().err
    for what in ("save b", "load b", "consolidate b"):
        assert re.search(rf"{what}: 100%", err), err
    sess.save(str(tmp_path / "quiet"), "ck_b")  # a test is no notebook: nothing drawn by default
    sess.load(str(tmp_path / "quiet"), "ck_b")
    assert "100%" not in capsys.readouterr().err
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        sess.save(str(tmp_path / "x"), "ck_b", progress="yes")
    assert not (tmp_path / "x").exists()
    sess.execute("del ck_b, ck_b_opt")


def test_keep_last(sess, tmp_path):
    build(sess, "ck_k")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    for i in range(1, 5):
        step(sess, "ck_k")
        sess.save(str(tmp_path / f"step{i}"), "ck_k", extra={"step": i}, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "step3", "step4"]
    assert inspect(str(tmp_path / "step4")).extra == {"step": 4}


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "fsdp_nb.cli", *args], capture_output=True, text=True, env=env, timeout=120)


def test_inspect_consolidate_offline_and_cli(sess, tmp_path):
    build(sess, "ck_i")
    step(sess, "ck_i")
    s0 = snapshot(sess, "ck_i")
    path = str(tmp_path / "c")
    sess.save(path, "ck_i", optimizer="ck_i_opt", extra={"step": 3})
    info = inspect(path, verify=True)
    t = info.tensors["model.head.weight"]
    assert t.shape == (3, 16) and t.dtype == "float32" and t.bytes == 3 * 16 * 4
    assert sorted(c.offsets for c in t.chunks) == [(0, 0), (2, 0)]
    assert info.versions["torch"] == torch.__version__ and info.created <= time.time()
    model_bytes = sum(x.bytes for k, x in info.tensors.items() if k.startswith("model."))
    assert info.total_bytes == sum(x.bytes for x in info.tensors.values()) > model_bytes  # + optimizer
    out = _cli("inspect", path)
    assert out.returncode == 0, out.stderr
    assert "model.blocks.1.weight" in out.stdout and "__1_0.distcp" in out.stdout
    st = str(tmp_path / "one.safetensors")
    out = _cli("consolidate", path, st)
    assert out.returncode == 0, out.stderr
    from safetensors.torch import load_file

    assert same(load_file(st), s0[0])  # the model's own names; optimizer state beside it
    assert os.path.exists(str(tmp_path / "one.optim.safetensors"))
    pt = fsdp_nb.consolidate(path, str(tmp_path / "one.pt"))
    assert pt.kind == "full" and pt.extra == {"step": 3}
    with pytest.raises(FileExistsError):
        fsdp_nb.consolidate(path, st)
    # a folder without the completion marker is never valid
    half = tmp_path / "half"
    shutil.copytree(path, half)
    (half / ".fsdp_nb_complete").unlink()
    assert not inspect(str(half)).valid
    assert _cli("inspect", str(half)).returncode == 2
    with pytest.raises(CheckpointError, match="incomplete"):
        sess.load(str(half), "ck_i")


def test_metadata_is_not_unpickled_freely(tmp_path):
    evil = tmp_path / "evil"
    evil.mkdir()
    flag = tmp_path / "pwned"
    (evil / ".metadata").write_bytes(pickle.dumps(_Evil(str(flag))))
    (evil / ".fsdp_nb_complete").write_text(json.dumps({"files": {}}))
    info = inspect(str(evil))
    assert not info.valid and "refusing to unpickle" in info.problem
    assert not flag.exists()


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture
def sess3(session_factory):
    """The run's 3-rank session (shared with the other test files)."""
    return session_factory(3)


def test_reshard_2_to_3_and_train(sess, sess3, tmp_path):
    build(sess, "ck_3")
    step(sess, "ck_3")
    s0 = snapshot(sess, "ck_3")
    sharded, full = str(tmp_path / "c"), str(tmp_path / "c.pt")
    sess.save(sharded, "ck_3", optimizer="ck_3_opt", extra={"n": 2})
    sess.save(full, "ck_3", optimizer="ck_3_opt", sharded=False)
    build(sess3, "ck_3", seed=5)
    assert sess3.load(sharded, "ck_3", optimizer="ck_3_opt") == {"n": 2}
    assert same(snapshot(sess3, "ck_3"), s0)
    step(sess3, "ck_3")
    build(sess3, "ck_3", seed=6)
    sess3.load(full, "ck_3", optimizer="ck_3_opt")
    assert same(snapshot(sess3, "ck_3"), s0)
    # and back: 3 ranks -> 2 ranks
    path3 = str(tmp_path / "c3")
    assert sess3.save(path3, "ck_3", optimizer="ck_3_opt").world_size == 3
    step(sess, "ck_3")
    sess.load(path3, "ck_3", optimizer="ck_3_opt")
    assert same(snapshot(sess, "ck_3"), s0)


def test_reshard_2_to_1(sess, session_factory, tmp_path):
    build(sess, "ck_1")
    step(sess, "ck_1")
    s0 = snapshot(sess, "ck_1")
    sess.save(str(tmp_path / "c"), "ck_1", optimizer="ck_1_opt")
    sess.save(str(tmp_path / "c.safetensors"), "ck_1", optimizer="ck_1_opt", sharded=False)
    with session_factory(1, private=True) as s1:
        build(s1, "ck_1", seed=9)
        s1.load(str(tmp_path / "c"), "ck_1", optimizer="ck_1_opt")
        assert same(snapshot(s1, "ck_1"), s0)
        build(s1, "ck_1", seed=9)
        s1.load(str(tmp_path / "c.safetensors"), "ck_1", optimizer="ck_1_opt")
        assert same(snapshot(s1, "ck_1"), s0)
        step(s1, "ck_1")


def test_kill_engine_mid_save_keeps_previous(sess, session_factory, tmp_path):
    """kill -9 a rank while it writes: the old checkpoint stays, the half one is never valid."""
    dim, layers = 2048, 6  # ~25M parameters, ~100 MB per save
    path = tmp_path / "ck"
    s = session_factory(2, private=True)  # an engine of it is killed
    try:
        build(s, "big", dim=dim, layers=layers)
        s.save(str(path), "big", extra={"gen": 1})
        s.execute("for _p in big.parameters(): _p.data.add_(1.0)")
        victim = s.ranks[0].pid  # rank 0 commits (and would clean up a failed save): kill it
        written = tmp_path / "rank0-written"
        # rank 0 stops where its files are written and the commit has not begun, and says so
        s.execute(
            "if rank == 0:\n"
            "    import time as _t\n"
            "    import fsdp_nb.checkpoints.rank_save as _io\n"
            "    def _hold(*_a, **_k):\n"
            f"        open({str(written)!r}, 'w').close()\n"
            "        _t.sleep(600)\n"
            "    _io._finish_sharded = _hold\n")
        errors = []

        def run():
            try:
                s.save(str(path), "big", extra={"gen": 2}, overwrite=True)
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 120
        while not written.exists() and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        killed = written.exists()
        if killed:
            os.kill(victim, signal.SIGKILL)
        t.join(120)
        assert killed and not t.is_alive()
        # the session layer reports the death (DeadRankError, or RankError: EngineError "died")
        assert errors and isinstance(errors[0], (fsdp_nb.DeadRankError, fsdp_nb.RankError))
        assert "died" in str(errors[0])
    finally:
        s.shutdown()
    info = inspect(str(path), verify=True)
    assert info.valid and info.extra == {"gen": 1}
    halves = [d for d in os.listdir(tmp_path) if d.startswith(".ck.tmp-")]
    assert halves and not inspect(str(tmp_path / halves[0])).valid
    # the previous checkpoint loads on another session; the half one is refused
    build(sess, "big", dim=dim, layers=layers, seed=3)
    assert sess.load(str(path), "big") == {"gen": 1}
    w = sess.run(lambda: big.blocks[0].weight.full_tensor()[0, :4].clone())[0]  # noqa: F821
    sess.execute("import torch; torch.manual_seed(0); _w = torch.nn.Linear(2048, 2048).weight[0, :4].clone()")
    assert torch.equal(w, sess.pull("_w")[0])
    with pytest.raises(CheckpointError, match="incomplete"):
        sess.load(str(tmp_path / halves[0]), "big")
    forget_models(sess, "big", optimizers=("big_opt",))


def _free_port() -> int:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


@pytest.fixture
def s3_bucket():
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        opts = {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
                "client_kwargs": {"region_name": "us-east-1"}}
        set_storage_options("s3", **opts)
        import boto3

        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="ckpts")
        yield "s3://ckpts"
    finally:
        set_storage_options("s3")
        server.stop()


def test_s3_through_moto_server(sess, s3_bucket):
    build(sess, "ck_s3")
    step(sess, "ck_s3")
    s0 = snapshot(sess, "ck_s3")
    url = f"{s3_bucket}/run/step1"
    info = sess.save(url, "ck_s3", optimizer="ck_s3_opt", extra={"step": 1})
    assert info.valid and info.world_size == 2
    with pytest.raises(FileExistsError):
        sess.save(url, "ck_s3")
    off = inspect(url, verify=True)  # offline, from this process
    assert off.valid and off.extra == {"step": 1} and "__1_0.distcp" in off.files
    full = f"{s3_bucket}/run/full.safetensors"
    sess.save(full, "ck_s3", optimizer="ck_s3_opt", sharded=False)
    step(sess, "ck_s3")
    assert sess.load(url, "ck_s3", optimizer="ck_s3_opt") == {"step": 1}
    assert same(snapshot(sess, "ck_s3"), s0)
    step(sess, "ck_s3")
    sess.load(full, "ck_s3", optimizer="ck_s3_opt")
    assert same(snapshot(sess, "ck_s3"), s0)
    h = sess.save(f"{s3_bucket}/run/step2", "ck_s3", async_save=True, keep_last=1)
    assert h.wait().valid
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **fsdp_nb.formats.storage.options_for(url))
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls("ckpts/run")) == [
        "full.optim.safetensors", "full.safetensors", "step2"]
    assert json.loads(fs.cat_file("ckpts/run/step2/fsdp_nb.json"))["world_size"] == 2
