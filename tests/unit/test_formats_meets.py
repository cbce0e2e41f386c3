"""Where checkpoint formats meet the rest, without engines (issue 56): a ``.metadata``
that asks the unpickler for memory by a count, a CUDA random state saved on one device
index and loaded on another, notes on an error where Python has no ``add_note`` (3.10),
a remote file's items fetched once, a progress count that never passes its total, and
the magics' target held without ``global``.

Their engine halves (an S3 load's bytes, an async save's progress) are in
``tests/test_checkpoints_meets.py``.
"""

from __future__ import annotations

import ast
import io
import json
import pathlib
import subprocess
import sys
import types
from typing import Any

import pytest
import torch

import fsdp_nb
from fsdp_nb import errors
from fsdp_nb.checkpoints import rank_run_state
from fsdp_nb.errors import CorruptCheckpointError, DeadRankError, RankError, RankFailure, add_note
from fsdp_nb.formats import run_state
from fsdp_nb.formats.restricted import ALLOWED, RefusedGlobal, _Restricted, load_dcp_metadata

ROOT = pathlib.Path(fsdp_nb.__file__).resolve().parent.parent

# -- 8: the restricted unpickler of DCP's .metadata -----------------------------------------

ASKED = 3 << 29
"""1.5 GiB: what the crafted 30-byte ``.metadata`` asks for."""

_MEASURE = """
import contextlib, io, json, resource, sys
import torch, fsdp_nb, fsdp_nb.cli
path, how = sys.argv[1], sys.argv[2]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    if how == "cli":
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = fsdp_nb.cli.main(["inspect", path])
        said = out.getvalue()
    else:
        info = fsdp_nb.inspect(path)
        rc, said = int(not info.valid), info.problem or ""
except Exception as exc:
    rc, said = -1, f"raised {type(exc).__name__}: {exc}"
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grew_kib": grew, "rc": rc, "said": said}))
"""


def _asking(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """A folder whose 30-byte (``bytearray``) or 26-byte (``bytes``) ``.metadata`` calls
    ``builtins.<name>(1.5 GiB)``: protocol 2, GLOBAL, BININT, TUPLE1, REDUCE, STOP."""
    folder = tmp_path / name
    folder.mkdir()
    data = b"\x80\x02cbuiltins\n" + name.encode() + b"\nJ" + ASKED.to_bytes(4, "little") + b"\x85R."
    (folder / ".metadata").write_bytes(data)
    return folder


@pytest.mark.parametrize("how", ["inspect", "cli"])
@pytest.mark.parametrize("name", ["bytearray", "bytes"])
def test_a_metadata_that_asks_for_memory_by_a_count_is_refused_by_name_before_it_is_taken(tmp_path, name, how):
    folder = _asking(tmp_path, name)
    assert (folder / ".metadata").stat().st_size == {"bytearray": 30, "bytes": 26}[name]
    got = subprocess.run([sys.executable, "-c", _MEASURE, str(folder), how], capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    seen = json.loads(got.stdout.strip().splitlines()[-1])
    # what the process's peak grew by while it read the file: the 1.5 GiB is never taken
    assert seen["grew_kib"] < 256 << 10, f"the process grew {seen['grew_kib'] >> 10} MiB reading it: {seen}"
    assert seen["rc"] > 0 and f"refusing to unpickle builtins.{name}" in seen["said"], seen


def test_every_callable_the_metadata_unpickler_allows_builds_something_small_from_a_count():
    """A count handed to anything the unpickler resolves raises or builds a small object:
    only a pickle's own items make a container large, one opcode each."""
    count = 1 << 28
    called = []
    for module, names in ALLOWED.items():
        for name in sorted(names):
            fn = _Restricted(io.BytesIO()).find_class(module, name)
            if not callable(fn):
                continue
            called.append(f"{module}.{name}")
            try:
                made = fn(count)
            except Exception:  # noqa: BLE001 - refusing a count is what we want of it
                continue
            assert sys.getsizeof(made) < 1 << 20, f"{module}.{name}({count}) built {sys.getsizeof(made)} bytes"
    assert "builtins.list" in called and "torch.Size" in called
    for name in ("bytes", "bytearray"):
        with pytest.raises(RefusedGlobal, match=f"builtins.{name}"):
            _Restricted(io.BytesIO()).find_class("builtins", name)


def test_a_metadata_of_plain_values_is_named_not_a_dcp_checkpoint(tmp_path):
    import pickle

    with pytest.raises(CorruptCheckpointError, match=r"holds a builtins.list, not torch.distributed.checkpoint"):
        load_dcp_metadata(pickle.dumps([1, 2, 3]))
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    info = fsdp_nb.inspect(str(folder))  # a problem of the checkpoint, not an AttributeError
    assert not info.valid and "builtins.dict, not torch.distributed.checkpoint's Metadata" in (info.problem or "")



class AsksForMemory:
    """Pickles to a call of ``fn`` with ``count``: what an attacker puts into a checkpoint
    for torch's weights-only unpickler, which allows ``bytearray`` and torch's storage and
    tensor classes."""

    def __init__(self, fn: Any, count: int = ASKED) -> None:
        self.fn, self.count = fn, count

    def __reduce__(self):
        return (self.fn, (self.count,))


_CONSOLIDATE = """
import json, resource, sys
import torch, fsdp_nb
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    fsdp_nb.consolidate(sys.argv[1], sys.argv[2])
    said = "consolidated"
except Exception as exc:
    said = f"raised {type(exc).__name__}: {exc}"
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grew_kib": grew, "said": said}))
"""


def test_a_checkpoint_item_that_asks_torchs_unpickler_for_memory_is_refused_by_name_before_it_is_taken(tmp_path):
    """torch's weights-only unpickler allows ``bytearray``: a param group's pickled item of
    a few hundred bytes made every reader allocate 1.5 GiB."""
    import uuid

    import torch.distributed.checkpoint as dcp

    from fsdp_nb.formats.atomic import commit_sharded
    from fsdp_nb.formats.checksums import record_writer
    from fsdp_nb.formats.metadata import FORMAT
    from fsdp_nb.formats.storage import dcp_writer, sibling, url_to_fs

    sd = {"model": {"w": torch.zeros(4)},
          "optim": {"state": {}, "param_groups": [{"lr": 0.1, "asks": AsksForMemory(bytearray)}]}}
    folder = tmp_path / "asks"
    fs, target = url_to_fs(str(folder))  # written as fsdp_nb writes (checksums, marker): an attacker's own save
    token = uuid.uuid4().hex[:12]
    tmp = sibling(target, "tmp", token)
    writer = dcp_writer(fs, tmp, {})
    files = record_writer(writer).records
    dcp.save(sd, storage_writer=writer, no_dist=True)
    commit_sharded(fs, tmp, target, {"format": FORMAT, "world_size": 1}, files, token)
    got = subprocess.run([sys.executable, "-c", _CONSOLIDATE, str(folder), str(tmp_path / "full.pt")],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    seen = json.loads(got.stdout.strip().splitlines()[-1])
    assert seen["grew_kib"] < 256 << 10, f"the process grew {seen['grew_kib'] >> 10} MiB reading it: {seen}"
    assert "UnsafeCheckpointError" in seen["said"] and "'optim.param_groups.0.asks'" in seen["said"], seen
    assert f"builtins.bytearray({ASKED})" in seen["said"] and not (tmp_path / "full.pt").exists()
    info = fsdp_nb.inspect(str(folder), verify=True)
    assert not info.valid and "asks for memory by a count (builtins.bytearray" in (info.problem or "")


@pytest.mark.parametrize("fn", [bytearray, torch.ByteTensor, torch.UntypedStorage, torch.Tensor],
                         ids=["bytearray", "ByteTensor", "UntypedStorage", "Tensor"])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_every_reader_of_torch_pickles_refuses_a_call_by_a_count(tmp_path, fn, legacy):
    from fsspec.implementations.local import LocalFileSystem

    from fsdp_nb.errors import UnsafeCheckpointError
    from fsdp_nb.formats.item_tensor import tensor_from_item
    from fsdp_nb.formats.pickle_counts import count_problem
    from fsdp_nb.formats.pickles import load_bytes, load_item, load_pt

    buf = io.BytesIO()
    torch.save({"step": 3, "asks": AsksForMemory(fn, 1 << 30)}, buf, _use_new_zipfile_serialization=not legacy)
    data = buf.getvalue()
    name = f"{fn.__module__}.{fn.__name__}".replace("torch.storage.", "torch.")
    assert (count_problem(data) or "").endswith("(1073741824)")
    refused = r"asks for memory by a count \(torch\.[\w.]+|builtins\.bytearray"
    with pytest.raises(UnsafeCheckpointError, match=refused):
        load_bytes(data, "file 'train/rank0.pt'")
    (tmp_path / "full.pt").write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match=r"file 'full\.pt' holds a pickle that asks for memory"):
        load_pt(LocalFileSystem(), str(tmp_path / "full.pt"), "ck")
    if not legacy:  # what DCP stores: torch.save archives
        with pytest.raises(UnsafeCheckpointError, match=r"item 'optim.x' in file '__0_0.distcp' holds"):
            load_item(data, "optim.x", "__0_0.distcp")
        with pytest.raises(UnsafeCheckpointError, match="a stored tensor item holds a pickle"):
            tensor_from_item(memoryview(data))
    assert name.split(".")[-1] in (count_problem(data) or "")


def test_what_torch_saves_itself_passes_the_count_check():
    """Tensors (sharded or not, of every kind torch pickles), sizes, param groups and the
    values a ``bytearray`` holds are no call by a count."""
    from fsdp_nb.formats.pickle_counts import count_problem

    values = {"w": torch.randn(3, 4), "view": torch.arange(10)[2:5], "size": torch.Size([2, 3]),
              "p": torch.nn.Parameter(torch.ones(2)), "meta": torch.empty(5, device="meta"),
              "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}], "raw": bytearray(b"ab"),
              "sparse": torch.eye(3).to_sparse(), "bf16": torch.ones(2, dtype=torch.bfloat16)}
    for legacy in (False, True):
        buf = io.BytesIO()
        torch.save(values, buf, _use_new_zipfile_serialization=not legacy)
        assert count_problem(buf.getvalue()) is None
        assert count_problem(io.BytesIO(buf.getvalue())) is None
    assert count_problem(b"not a pickle") is None  # left to torch.load, which says what is wrong

# -- 9: the CUDA random state, saved by the rank's own device ----------------------------------


class FakeCuda:
    """Stand-ins for the ``torch.cuda`` random-state calls of a process that sees
    ``count`` devices and is on ``current``: each device's generator state a tensor of
    its own; a device index it does not see raises IndexError, as CUDA's does."""

    def __init__(self, count: int, current: int, seed: int = 0) -> None:
        self.count, self.current = count, current
        self.states = {i: torch.tensor([seed, i], dtype=torch.uint8) for i in range(count)}

    def _device(self, device: Any) -> int:
        i = self.current if device in (None, "cuda") else int(getattr(device, "index", device))
        if not 0 <= i < self.count:
            raise IndexError(f"device {i}: this process sees {self.count}")
        return i

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.states[self._device(device)].clone()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        self.states[self._device(device)] = state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(self.count)]

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        for i, s in enumerate(states):
            self.set_rng_state(s, i)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        for mod in (torch.cuda, torch.cuda.random):
            for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
                monkeypatch.setattr(mod, name, getattr(self, name), raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        return self


def _through_a_file(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` as a rank's file gives it back (weights-only)."""
    return run_state.decode(run_state.encode({"rng": saved, "state": {}}), "ck", "train/rank0.pt")["rng"]


def test_a_cuda_random_state_saved_on_device_3_of_4_loads_on_a_rank_that_sees_one(monkeypatch):
    saver = FakeCuda(count=4, current=3, seed=7).install(monkeypatch)
    saved = _through_a_file(rank_run_state.rng_state())
    own = saver.states[3].clone()
    loader = FakeCuda(count=1, current=0, seed=9).install(monkeypatch)
    assert rank_run_state.cuda_rng_problem(saved, "ck") is None
    rank_run_state.set_rng_state(saved)  # a list by index raised IndexError on device 1 here
    assert torch.equal(loader.states[0], own)


def test_a_cuda_random_state_goes_onto_the_loading_ranks_own_device_index(monkeypatch):
    FakeCuda(count=2, current=0, seed=1).install(monkeypatch)
    saved = _through_a_file(rank_run_state.rng_state())
    loader = FakeCuda(count=2, current=1, seed=2).install(monkeypatch)
    untouched = loader.states[0].clone()
    rank_run_state.set_rng_state(saved)
    assert torch.equal(loader.states[1], torch.tensor([1, 0], dtype=torch.uint8))
    assert torch.equal(loader.states[0], untouched)  # another device's generator is not this rank's


def test_an_old_list_of_cuda_states_loads_where_it_can_say_whose_and_is_refused_by_name_elsewhere(monkeypatch):
    old_one = {"cuda": [torch.tensor([5, 0], dtype=torch.uint8)]}
    old_four = {"cuda": [torch.tensor([6, i], dtype=torch.uint8) for i in range(4)]}
    loader = FakeCuda(count=4, current=2).install(monkeypatch)
    for saved, want in ((old_one, [5, 0]), (old_four, [6, 2])):  # one entry; as many as it sees: its own
        assert rank_run_state.cuda_rng_problem(_through_a_file(saved), "ck") is None
        rank_run_state.set_rng_state(_through_a_file(saved))
        assert loader.states[2].tolist() == want
    FakeCuda(count=2, current=1).install(monkeypatch)
    problem = rank_run_state.cuda_rng_problem(_through_a_file(old_four), "checkpoint 'ck': file 'train/rank0.pt'")
    assert problem is not None and "'train/rank0.pt'" in problem and "4 devices" in problem
    assert "sees 2" in problem and "rng=False" in problem
    assert rank_run_state.cuda_rng_problem(old_four, "ck") is not None  # not a guess
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU rank puts no CUDA state back
    assert rank_run_state.cuda_rng_problem(old_four, "ck") is None


@pytest.mark.gpu
def test_the_cuda_random_state_comes_back_on_a_real_device():
    """The same on CUDA itself (``-m gpu``): the rank's own device's state is saved, its
    next draws come back after a load, and a list of the older format loads too."""
    torch.cuda.init()
    torch.cuda.manual_seed_all(3)
    saved = _through_a_file(rank_run_state.rng_state())
    assert saved["cuda"]["device"] == torch.cuda.current_device()
    want = torch.rand(8, device="cuda")
    torch.cuda.manual_seed_all(4)
    rank_run_state.set_rng_state(saved)
    assert torch.equal(torch.rand(8, device="cuda"), want)
    torch.cuda.manual_seed_all(3)
    old = _through_a_file({"cuda": torch.cuda.get_rng_state_all()})
    want = torch.rand(8, device="cuda")
    assert rank_run_state.cuda_rng_problem(old, "ck") is None
    rank_run_state.set_rng_state(old)
    assert torch.equal(torch.rand(8, device="cuda"), want)


# -- 10: notes on an error where Python has no add_note ---------------------------------------


@pytest.fixture
def python_310(monkeypatch):
    """``fsdp_nb.errors`` sees Python 3.10, which has no ``BaseException.add_note``."""
    monkeypatch.setattr(errors, "sys", types.SimpleNamespace(version_info=(3, 10, 14)))


@pytest.mark.parametrize("make", [
    lambda: RankError("cell", [RankFailure(1, "ValueError", "bad", "tb")], 2),
    lambda: DeadRankError([1], "while running cell"),
    lambda: RuntimeError(),
    lambda: KeyError("a", "b"),
], ids=["RankError", "DeadRankError", "no argument", "two arguments"])
def test_a_note_shows_in_the_errors_text_where_the_traceback_would_not_print_it(python_310, make):
    import traceback

    err = make()
    add_note(err, "The group was re-formed.")
    add_note(err, "While the other ranks waited:\n  rank 0 in all_reduce")
    assert err.__notes__ == ["The group was re-formed.", "While the other ranks waited:\n  rank 0 in all_reduce"]
    text = str(err)
    assert "The group was re-formed." in text and text.index("re-formed") < text.index("rank 0 in all_reduce")
    # 3.10's traceback prints the text alone: the notes are in it
    shown = "".join(traceback.format_exception_only(type(err), err)).replace("\\n", "\n")
    assert "rank 0 in all_reduce" in shown


def test_a_note_on_311_and_later_is_pythons_own():
    err = RankError("cell", [RankFailure(0, "ValueError", "bad", "")], 2)
    add_note(err, "recovered")
    assert err.__notes__ == ["recovered"]
    if sys.version_info >= (3, 11):
        assert "recovered" not in str(err)  # the traceback prints it, once


def test_every_note_goes_through_the_one_helper():
    """``BaseException.add_note`` is 3.11+: the package calls it in ``errors.add_note`` alone."""
    calls = []
    for path in sorted((ROOT / "fsdp_nb").rglob("*.py")):
        if path.name == "errors.py" and path.parent.name == "fsdp_nb":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_note":
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not calls, f"BaseException.add_note (Python 3.11+) called directly: {calls}"


def test_the_type_checker_runs_at_the_oldest_python_the_package_admits():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = project["project"]["requires-python"].removeprefix(">=")
    assert floor == "3.10"
    assert project["tool"]["mypy"]["python_version"] == floor


# -- 17e: a remote file's items fetched once ----------------------------------------------------


def test_a_remote_files_items_are_fetched_in_merged_ranges_and_read_like_the_file(tmp_path):
    from fsspec.implementations.local import LocalFileSystem

    from fsdp_nb.formats import item_files
    from fsdp_nb.formats.storage import read_into

    data = bytes(range(256)) * 40
    (tmp_path / "f").write_bytes(data)
    asked: list[tuple[int, int]] = []

    class Counting(LocalFileSystem):
        def cat_file(self, path, start=None, end=None, **kw):
            asked.append((start, end))
            return super().cat_file(path, start=start, end=end, **kw)

    fs = Counting(skip_instance_cache=True)
    got = item_files.fetch(fs, str(tmp_path / "f"), [(0, 100), (100, 50), (400, 10), (10230, 100)])
    assert asked == [(0, 150), (400, 410), (10230, 10330)]  # adjacent items in one request
    for offset, length in ((0, 100), (120, 30), (400, 10)):
        buf = bytearray(length)
        got.seek(offset)
        assert read_into(got, memoryview(buf)) == length and bytes(buf) == data[offset:offset + length]
    got.seek(10230)
    buf = bytearray(100)
    assert read_into(got, memoryview(buf)) == len(data) - 10230  # the file ends first: read as truncated
    got.seek(200)
    assert got.readinto(memoryview(bytearray(4))) == 0  # never fetched
    with pytest.raises(FileNotFoundError):
        item_files.read_ranges(fs, str(tmp_path / "missing"), [(0, 4)])


# -- 17j: a progress count never passes its total ----------------------------------------------


def test_a_progress_count_shows_at_most_its_total_and_the_total_once_finished():
    from fsdp_nb.checkpoints import rank_progress

    assert rank_progress.counted(1_050, 1_000) == 1_000  # files' framing past the tensors
    assert rank_progress.counted(400, 1_000) == 400
    assert rank_progress.counted(900, 1_000, finished=True) == 1_000  # another rank wrote its replicas
    rank_progress.start(1_000, False)
    for _ in range(3):
        rank_progress.add(400)
    assert rank_progress.part(rank_progress.Progress).count["done"] == 1_000
    rank_progress.finish()


# -- the magics' target, held in an object --------------------------------------------------------


def test_the_magics_hold_their_session_in_an_object_not_a_global(monkeypatch):
    from fsdp_nb.frontends import magics

    tree = ast.parse((ROOT / "fsdp_nb" / "frontends" / "magics.py").read_text())
    assert not [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Global)]
    monkeypatch.setattr(magics, "TARGET", magics.PxTarget())
    monkeypatch.setattr(magics, "_ipython", lambda: None)

    class Open:
        state = "ready"

    a, b = Open(), Open()
    assert magics.active_session() is None
    magics.activate_px(a)  # type: ignore[arg-type]
    assert magics.active_session() is a
    magics.deactivate_px(b)  # type: ignore[arg-type]  # not the target: it stays
    assert magics.active_session() is a
    a.state = "closed"
    assert magics.active_session() is None
    magics.deactivate_px(a)  # type: ignore[arg-type]
    assert magics.TARGET.active is None

