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


def test_a_storage_or_a_builtin_that_could_do_harm_is_refused():
    import io

    class _Storage:  # a "storage" whose torch.save bytes hold a global weights-only refuses
        def __reduce__(self):
            buf = io.BytesIO()
            torch.save({"hook": print}, buf)
            return (torch.storage._load_from_bytes, (buf.getvalue(),))

    class _Huge:  # bytearray(n) allocates n bytes
        def __reduce__(self):
            return (bytearray, (1 << 40,))

    for obj, said in ((_Storage(), "storage that torch's weights-only unpickler refuses"),
                      (_Huge(), "names builtins.bytearray")):
        entry = {"dp_rank_0": pickle.dumps({"state": obj}), "world_size": 1}
        with pytest.raises(UnsafeCheckpointError, match=said):
            decode(entry, 0, 1, "ck")


def test_torchtitans_loader_is_refused_for_a_model_whose_mesh_has_more_than_one_dimension():
    from types import SimpleNamespace

    from fsdp_nb.checkpoints.arguments import check_titan_loader

    tp = SimpleNamespace(summary=SimpleNamespace(mesh_dims=("dp", "tp")))
    with pytest.raises(ValueError, match=r"per data-parallel rank, and this model's mesh is \('dp', 'tp'\)"):
        check_titan_loader(("dataloader",), "torchtitan", tp)
    check_titan_loader(("dataloader",), "fsdp_nb", tp)  # fsdp_nb's own layout keeps each rank's
    check_titan_loader(("dataloader",), "torchtitan", SimpleNamespace(summary=SimpleNamespace(mesh_dims=("dp",))))
