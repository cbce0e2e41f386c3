"""torchtitan's ``dataloader`` form: each rank's loader state pickled, read back without
running code (``formats.titan_loader``). No engines."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from fsdp_nb.errors import CheckpointError, UnsafeCheckpointError
from fsdp_nb.formats.titan_loader import decode, encode, is_encoded


def _loader_state(rank: int) -> dict:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True,
                                generator=torch.Generator().manual_seed(rank))
    it = iter(loader)
    next(it), next(it)
    return loader.state_dict()


def test_each_ranks_state_comes_back_as_it_was_tensors_included():
    pytest.importorskip("torchdata")
    entry = {**encode(_loader_state(0), 0, 2), **encode(_loader_state(1), 1, 2)}
    assert is_encoded(entry) and sorted(entry) == ["dp_rank_0", "dp_rank_1", "world_size"]
    for rank in (0, 1):
        got, want = decode(entry, rank, 2, "ck"), _loader_state(rank)
        gen = ("_sampler_iter_state", "sampler_iter_state", "generator")
        assert torch.equal(got[gen[0]][gen[1]][gen[2]], want[gen[0]][gen[1]][gen[2]])
        assert got["_num_yielded"] == want["_num_yielded"] == 2
    assert not is_encoded({"world_size": 2}) and not is_encoded({"dp_rank_0": b""}) and not is_encoded([1])


def test_another_world_size_or_a_missing_rank_is_refused_by_name():
    entry = encode({"_num_yielded": 3}, 0, 2)
    with pytest.raises(CheckpointError, match=r"for 2 data-parallel ranks and this session has 4.*leave 'dataloader'"):
        decode(entry, 0, 4, "ck")
    with pytest.raises(CheckpointError, match=r"holds no 'dp_rank_1'"):
        decode(entry, 1, 2, "ck")
    with pytest.raises(CheckpointError, match="not a readable pickle"):
        decode({"dp_rank_0": b"\x80\x05truncated", "world_size": 1}, 0, 1, "ck")


class _Runs:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_pickle_that_could_run_code_is_refused_unless_trusted(monkeypatch):
    import posix

    entry = {"dp_rank_0": pickle.dumps({"ok": 1, "hook": _Runs()}), "world_size": 1}
    ran: list[str] = []
    monkeypatch.setattr(posix, "system", lambda cmd: ran.append(cmd) or 0)  # what the pickle would call
    with pytest.raises(UnsafeCheckpointError, match=r"'dataloader\.dp_rank_0' names posix\.system.*weights_only=False"):
        decode(entry, 0, 1, "ck")
    assert ran == []
    storage = {"dp_rank_0": pickle.dumps(torch.arange(3)), "world_size": 1}  # a storage: weights-only, never plain
    assert torch.equal(decode(storage, 0, 1, "ck"), torch.arange(3))
    decode(entry, 0, 1, "ck", weights_only=False)  # trusted: plain pickle, as torchtitan reads it
    assert ran == ["true"]
