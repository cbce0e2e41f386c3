"""The checked DCP reader's second pass, in one process with real DCP files: after every
item was read and checked, each request whose stored bytes are its target's is read
straight into the target (one copy); the rest go through a buffer and ``copy_``."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from fsdp_nb.errors import CorruptCheckpointError
from fsdp_nb.formats import dcp_reader
from fsdp_nb.formats.pickles import load_planner
from fsdp_nb.formats.reader import named_corruption
from fsdp_nb.formats.storage import url_to_fs


def _saved(tmp_path):
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 32), "half": torch.randn(16, 8), "cols": torch.randn(8, 4),
             "flag": torch.tensor([True, False, True]), "empty": torch.empty(0, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: one process saves alone
        dcp.save(state, checkpoint_id=str(tmp_path))
    return state


def _load(tmp_path, targets, before_commit=lambda read_all: read_all):
    fs, p = url_to_fs(str(tmp_path), None)
    reader = dcp_reader.safe_reader(fs, p, {}, before_commit=before_commit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(targets, storage_reader=reader, planner=load_planner(True), no_dist=True)


def test_the_checked_copy_reads_straight_into_targets_that_hold_the_stored_bytes(tmp_path, monkeypatch):
    state = _saved(tmp_path)
    wide = torch.zeros(8, 6)
    targets = {"w": torch.zeros(64, 32), "half": torch.zeros(16, 8, dtype=torch.bfloat16),
               "cols": wide[:, 1:5], "flag": torch.zeros(3, dtype=torch.bool), "empty": torch.ones(0, 3)}
    direct: list[tuple[int, ...]] = []
    read_into_target = dcp_reader._read_into_target

    def spy(planner, req, sinfo, file, start):
        direct.append(tuple(planner.resolve_tensor(req).shape))
        return read_into_target(planner, req, sinfo, file, start)

    monkeypatch.setattr(dcp_reader, "_read_into_target", spy)
    _load(tmp_path, targets)
    assert torch.equal(targets["w"], state["w"])
    assert torch.equal(targets["half"], state["half"].to(torch.bfloat16))  # another dtype: converted by copy_
    assert torch.equal(wide[:, 1:5], state["cols"]) and not wide[:, 0].any() and not wide[:, 5].any()
    assert torch.equal(targets["flag"], state["flag"])
    # straight in: the contiguous targets of the stored dtype; through the buffer: the
    # bf16 one, the strided view, and the empty one (no bytes to read)
    assert sorted(direct) == [(3,), (64, 32)]


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
    monkeypatch.setattr(dcp_reader.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    fs, p = url_to_fs(str(tmp_path), None)
    assert dcp_reader.safe_reader(fs, p, {})._readers() == want
