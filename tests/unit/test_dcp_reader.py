"""The checked DCP readers in one process with real DCP files: the check-then-copy load
reads each item straight into a target that takes its bytes as stored (one copy), the
rest through a buffer and ``copy_``; a local folder is read by two to four threads, a
remote store (a real fsspec file system: ``memory://``) by one."""

from __future__ import annotations

import gc
import io
import os
import threading
import uuid
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import StreamTransformExtension

from fsdp_nb.errors import CorruptCheckpointError
from fsdp_nb.formats import dcp_reader
from fsdp_nb.formats.checksums import ALGORITHM, checksum
from fsdp_nb.formats.pickles import load_planner
from fsdp_nb.formats.reader import named_corruption
from fsdp_nb.formats.storage import dcp_writer, url_to_fs
from fsdp_nb.torch_compat import dcp_load_into


def _save(url: str, state: dict) -> None:
    fs, p = url_to_fs(url, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: one process saves alone
        dcp.save(state, storage_writer=dcp_writer(fs, p, {}))


def _saved(tmp_path):
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 32), "half": torch.randn(16, 8), "cols": torch.randn(8, 4),
             "flag": torch.tensor([True, False, True]), "empty": torch.empty(0, 3)}
    _save(str(tmp_path), state)
    return state


def _load(url, targets, before_commit: Callable[[bool], bool] | None = lambda read_all: read_all, on_read=None,
          readers=None):
    fs, p = url_to_fs(str(url), None)
    reader = dcp_reader.safe_reader(fs, p, {}, before_commit=before_commit, on_read=on_read, readers=readers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load_into(targets, reader, load_planner(True))


@pytest.mark.parametrize("check_first", [True, False], ids=["check-then-copy", "stream"])
def test_every_kind_of_target_gets_the_stored_values_and_nothing_around_them(tmp_path, check_first):
    state = _saved(tmp_path)
    wide = torch.zeros(8, 6)
    targets = {"w": torch.zeros(64, 32), "half": torch.zeros(16, 8, dtype=torch.bfloat16),
               "cols": wide[:, 1:5], "flag": torch.zeros(3, dtype=torch.bool), "empty": torch.ones(0, 3)}
    read: list[int] = []
    _load(tmp_path, targets, (lambda read_all: read_all) if check_first else None, on_read=read.append)
    assert torch.equal(targets["w"], state["w"])
    assert torch.equal(targets["half"], state["half"].to(torch.bfloat16))  # another dtype: converted by copy_
    assert torch.equal(wide[:, 1:5], state["cols"]) and not wide[:, 0].any() and not wide[:, 5].any()
    assert torch.equal(targets["flag"], state["flag"])
    stored = FileSystemReader(str(tmp_path)).read_metadata().storage_data
    # each stored item counted once as it is read (the empty tensor has nothing to read)
    assert sorted(read) == sorted(s.length for i, s in stored.items() if i.fqn != "empty")


def _peak_added(fn: Callable[[], None]) -> int:
    """The most resident memory ``fn`` added to this process (Linux's peak, reset first)."""
    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the resident size now
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS")
@pytest.mark.parametrize(("stored", "target", "straight"), [
    (torch.float32, torch.float32, True), (torch.bool, torch.bool, True),
    (torch.float32, torch.bfloat16, False),
], ids=["f32", "bool", "f32-into-bf16"])
def test_a_checked_load_reads_an_item_straight_into_a_target_that_takes_its_bytes(tmp_path, stored, target,
                                                                                   straight):
    """The check keeps only an item's ends and the copy reads its bytes into the target
    itself: no item-sized memory. A target of another dtype takes them through a buffer
    (which shows that this measure sees an item-sized buffer)."""
    n = 64 << 20  # bytes of the stored tensor: above malloc's largest mmap threshold, so fresh pages
    values = (torch.arange(n // stored.itemsize) % 7).to(stored)
    _save(str(tmp_path), {"t": values})
    into = torch.zeros(values.shape, dtype=target)  # touched: resident before the load
    added = _peak_added(lambda: _load(tmp_path, {"t": into}))
    assert torch.equal(into, values.to(target))
    if straight:
        assert added < n // 8, f"the load added {added >> 20} MiB for a {n >> 20} MiB item"
    else:
        assert added > n * 3 // 4


def test_a_file_cut_short_after_the_check_is_named_not_read_short(tmp_path):
    _saved(tmp_path)
    data = next(f for f in os.listdir(tmp_path) if f.endswith(".distcp"))

    def cut(read_all):
        with open(tmp_path / data, "r+b") as f:
            f.truncate(os.path.getsize(tmp_path / data) // 2)
        return read_all

    targets = {"w": torch.zeros(64, 32), "half": torch.zeros(16, 8), "cols": torch.zeros(8, 4),
               "flag": torch.zeros(3, dtype=torch.bool), "empty": torch.ones(0, 3)}
    with pytest.raises(CorruptCheckpointError, match=r"'__0_0.distcp' is shorter than when it was checked"):
        with named_corruption(str(tmp_path)):
            _load(tmp_path, targets, before_commit=cut)


def test_the_items_are_cut_into_runs_of_about_equal_bytes_in_file_order():
    from types import SimpleNamespace as Item

    def item(path, offset, length):
        return Item(relative_path=path, offset=offset, length=length)

    big, small = item("a", 0, 600), item("a", 600, 100)
    items = [("r3", item("b", 0, 300)), ("r1", big), ("r2", small), ("r1b", big)]
    runs = dcp_reader._runs(items, 2)
    # two requests for one stored item stay in one run; files and offsets in order
    assert [[r for r, _ in run] for run in runs] == [["r1", "r1b"], ["r2", "r3"]]
    assert [[r for r, _ in run] for run in dcp_reader._runs(items, 1)] == [["r1", "r1b", "r2", "r3"]]
    assert len(dcp_reader._runs(items, 8)) == 3  # never more runs than stored items
    assert dcp_reader._runs([], 4) == [[]]


@pytest.mark.parametrize(("cores", "ranks", "want"), [(2, 2, 2), (2, 4, 2), (16, 8, 2), (16, 4, 4), (64, 1, 4)])
def test_a_local_share_is_read_by_two_to_four_threads_by_the_cores_a_rank_has(tmp_path, monkeypatch, cores, ranks,
                                                                              want):
    """A check-pass reader waits on the disk most of the time, so even ranks that fill
    the host's cores read with two threads each; more where a rank has cores to itself."""
    assert dcp_reader.local_readers(cores, ranks) == want
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))  # the ranks on this host, as the rendezvous sets them
    assert dcp_reader.local_readers(cores) == want
    fs, p = url_to_fs(str(tmp_path), None)
    assert dcp_reader.safe_reader(fs, p, {}).readers == dcp_reader.local_readers()


@pytest.fixture
def memory_folder():
    """A folder on fsspec's in-memory file system (a real one, not local), removed after."""
    url = f"memory://fsdp-nb-test-{uuid.uuid4().hex}/ckpt"
    yield url
    fs, p = url_to_fs(url, None)
    if fs.exists(p):
        fs.rm(p, recursive=True)


def test_a_remote_store_is_read_by_one_thread_where_a_local_folder_takes_several(tmp_path, memory_folder,
                                                                                 monkeypatch):
    """torch's fsspec reader subclasses its local one, yet a remote store's client keeps
    its own connections: its items are all read on the loading thread."""
    state = {f"p{i}": torch.full((256, 64), float(i)) for i in range(8)}
    threads: dict[str, set[str]] = {}
    for where in (str(tmp_path), memory_folder):
        _save(where, state)
        targets = {k: torch.zeros_like(v) for k, v in state.items()}
        seen = threads[where] = set()
        _load(where, targets, on_read=lambda n, seen=seen: seen.add(threading.current_thread().name), readers=4)
        assert all(torch.equal(targets[k], v) for k, v in state.items())
    assert len(threads[str(tmp_path)]) > 1
    assert threads[memory_folder] == {threading.current_thread().name}
    fs, p = url_to_fs(memory_folder, None)
    reader = dcp_reader.safe_reader(fs, p, {}, readers=4)
    assert isinstance(reader, FileSystemReader) and reader.readers == 1


_FLIP = bytes(i ^ 0x5A for i in range(256))


class _Flipped(io.RawIOBase):
    """A stream whose bytes are ``inner``'s with some bits flipped, each way; closing it
    leaves ``inner`` open."""

    def __init__(self, inner):
        self.inner = inner

    def readable(self):
        return True

    def writable(self):
        return True

    def readinto(self, b):
        data = self.inner.read(len(b)).translate(_FLIP)
        b[:len(data)] = data
        return len(data)

    def write(self, b):
        self.inner.write(bytes(b).translate(_FLIP))
        return len(b)


class _Flip(StreamTransformExtension):
    """A stream transform, as compression is one: only DCP's own read undoes it."""

    @staticmethod
    def registry_name():
        return "test.flip"

    @staticmethod
    def from_descriptor(version):
        return _Flip()

    def get_descriptor(self):
        return "test.flip/1"

    def transform_to(self, output):
        return _Flipped(output)

    def transform_from(self, input):
        return _Flipped(input)


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "a-byte-flipped"])
def test_items_only_dcp_decodes_are_counted_and_checked_before_it_reads_them(tmp_path, corrupt):
    """Each is counted and its stored bytes checked against the recorded checksum in the
    check pass, so a bad one stops the load on every rank before anything is copied."""
    state = {"w": torch.randn(64, 32), "b": torch.arange(10)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path), _extensions=[_Flip()]))
    md = FileSystemReader(str(tmp_path)).read_metadata()
    assert not dcp_reader.can_stage(md)
    checks = {}
    for info in md.storage_data.values():
        with open(tmp_path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            checks[(info.relative_path, info.offset)] = (info.length, checksum(f.read(info.length)), ALGORITHM)
    if corrupt:
        info = md.storage_data[next(i for i in md.storage_data if i.fqn == "w")]
        with open(tmp_path / info.relative_path, "r+b") as f:
            f.seek(info.offset + info.length // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
    fs, p = url_to_fs(str(tmp_path), None)
    told, read = [], []
    reader = dcp_reader.safe_reader(fs, p, {}, metadata=md, checks=checks, on_read=read.append,
                                    before_commit=lambda ok: told.append(ok) or ok)
    reader.transforms.extension_registry.register(_Flip)
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if corrupt:
            with pytest.raises(CorruptCheckpointError, match="is corrupt in bytes"), named_corruption(str(tmp_path)):
                dcp_load_into(targets, reader, load_planner(True))
        else:
            dcp_load_into(targets, reader, load_planner(True))
    assert told == [not corrupt]
    lengths = sorted(i.length for i in md.storage_data.values())
    if corrupt:
        assert read and set(read) <= set(lengths)  # counted up to the bad one
    else:
        assert sorted(read) == lengths
    for k, v in state.items():
        assert torch.equal(targets[k], torch.zeros_like(v) if corrupt else v)
