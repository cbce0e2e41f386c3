"""A rank's own part of a save, without engines: its file (written, checked, read
weights-only), its random state, what a load may ask of it at another world size, the
names ``state=`` takes, and the fp16 scaler's count of skipped steps."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from fsdp_nb.checkpoints import rank_run_state as engine_state
from fsdp_nb.checkpoints.arguments import check_state
from fsdp_nb.checkpoints.wire_checkpoint import LoadSpec
from fsdp_nb.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from fsdp_nb.formats import run_state
from fsdp_nb.formats.metadata import META_FILE

FS = LocalFileSystem()


class _Opaque:
    """A class the weights-only unpickler does not know."""


def test_a_rank_file_is_written_private_checked_and_read_weights_only(tmp_path):
    part = {"rng": {"torch": torch.get_rng_state()}, "state": {"sched": {"last_epoch": 3}}}
    name, record = run_state.write(FS, str(tmp_path), 1, run_state.encode(part))
    assert name == "train/rank1.pt" and run_state.rank_of_state_file(name) == 1
    assert run_state.rank_of_state_file("__1_0.distcp") is None
    assert (tmp_path / name).stat().st_mode & 0o077 == 0
    assert (tmp_path / "train").stat().st_mode & 0o077 == 0  # its folder too
    back = run_state.read(FS, str(tmp_path), "ck", 1, record)
    assert back["state"] == part["state"] and torch.equal(back["rng"]["torch"], part["rng"]["torch"])

    data = bytearray((tmp_path / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / name).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="train/rank1.pt"):
        run_state.read(FS, str(tmp_path), "ck", 1, record)
    with pytest.raises(CorruptCheckpointError, match="'train/rank0.pt' is missing"):
        run_state.read(FS, str(tmp_path), "ck", 0, record)


def test_a_rank_file_that_pickles_a_class_is_refused_unless_trusted(tmp_path):
    _, record = run_state.write(FS, str(tmp_path), 0, run_state.encode({"state": {"mine": _Opaque()}}))
    with pytest.raises(UnsafeCheckpointError, match=r"'train/rank0.pt'.*weights_only=False"):
        run_state.read(FS, str(tmp_path), "ck", 0, record)
    assert isinstance(run_state.read(FS, str(tmp_path), "ck", 0, record, weights_only=False)["state"]["mine"],
                      _Opaque)


def test_the_random_state_comes_back_for_python_numpy_and_torch():
    saved = engine_state.rng_state()
    assert set(saved) >= {"python", "numpy", "torch"}
    want = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    back = run_state.decode(run_state.encode({"rng": saved, "state": {}}), "ck", "train/rank0.pt")
    engine_state.set_rng_state(back["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])


def _folder(tmp_path, world_size: int, kept: list[str]) -> str:
    (tmp_path / META_FILE).write_text(json.dumps({"world_size": world_size, "run_state": kept}))
    return str(tmp_path)


def _spec(state: tuple[str, ...] = (), rng: bool | None = None) -> LoadSpec:
    return LoadSpec(url="ck", storage_options={}, model="m", optimizer=None, strict=True, state=state, rng=rng,
                    verify=False)


def test_per_rank_state_from_another_world_size_is_refused_by_name(tmp_path):
    p = _folder(tmp_path, 4, ["rng", "loader"])
    with pytest.raises(CheckpointError, match=r"written by 4 ranks and this session has 2: each rank's 'loader', 'rng'"):
        engine_state.read_part(_spec(("loader",), True), FS, p, True, 0, 2)
    with pytest.raises(CheckpointError, match="'loader' belongs to one of those 4 ranks"):
        engine_state.read_part(_spec(("loader",)), FS, p, True, 0, 2)
    # asked for nothing per rank: the model and optimizer reshard, the ranks keep their own
    assert engine_state.read_part(_spec(), FS, p, True, 0, 2) == (None, False)
    assert engine_state.read_part(_spec(rng=False), FS, p, True, 0, 2) == (None, False)


def test_a_load_may_ask_only_for_what_the_checkpoint_keeps(tmp_path):
    p = _folder(tmp_path, 2, ["rng", "sched"])
    with pytest.raises(CheckpointError, match=r"keeps no 'loader'.*state= may name 'sched'"):
        engine_state.read_part(_spec(("loader",)), FS, p, True, 0, 2)
    (tmp_path / META_FILE).write_text(json.dumps({"world_size": 2}))
    with pytest.raises(CheckpointError, match="keeps no per-rank state, so it has no 'rng'"):
        engine_state.read_part(_spec(rng=True), FS, p, True, 0, 2)
    assert engine_state.read_part(_spec(), FS, p, True, 0, 2) == (None, False)


@pytest.mark.parametrize(("state", "error", "match"), [
    ("sched", TypeError, "must be a list of engine global names"),
    (["sched", 3], TypeError, "holds 3"),
    (["not a name"], TypeError, "'not a name'"),
    (["rng"], ValueError, "random state goes by"),
    (["a", "a"], ValueError, "names an object twice"),
])
def test_state_names_are_checked_before_any_rank_is_asked(state, error, match):
    with pytest.raises(error, match=match):
        check_state(state)
    assert check_state(None) == () and check_state(["sched", "loader"]) == ("sched", "loader")


def test_the_scaler_counts_the_steps_it_skips(group):
    from fsdp_nb.models.rank_grad_scaler import CountingScaler

    lin = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = CountingScaler(device="cpu")
    for bad in (False, True, False):
        loss = lin(torch.ones(1, 2)).sum() * (float("inf") if bad else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.skipped == 1
    state = scaler.state_dict()
    assert state["skipped"] == 1 and state["scale"] == 65536.0 / 2
    fresh = CountingScaler(device="cpu")
    fresh.load_state_dict(state)
    assert fresh.skipped == 1 and fresh.get_scale() == state["scale"]


def test_latest_needs_an_autosave_and_a_report_says_what_came_back():
    from helpers import fake_context

    from fsdp_nb.autosave.autosave import Autosaving, latest
    from fsdp_nb.autosave.wire_autosave import AutosaveState
    from fsdp_nb.recovery.restart_report import RestartReport, RestorePlan

    with pytest.raises(CheckpointError, match="this session has had no autosave; pass the path"):
        latest(fake_context())
    plan = RestorePlan("ck/step-8", "model", "opt", ("loader",), True, 8)
    report = RestartReport(replaced=(1,), rebuilt=("teacher",), restored=plan, repointed=("opt",), setup=True,
                           autosave="autosave goes on from step 8", survivors=(0,))
    assert report.lines() == [
        "rank(s) 1 replaced by new engines: the session's imports, classes and functions were replayed there; "
        "any other variable a cell made on them is gone",
        "rank(s) 0 kept every variable their cells made",
        "rebuilt from initialisation (not the trained weights): teacher",
        "optimizers pointed at the rebuilt parameters: opt",
        "setup ran on every rank",
        "restored: model 'model', optimizer 'opt', 'loader', each rank's random state from ck/step-8 (step 8)",
        "autosave goes on from step 8",
    ]
    healthy = RestartReport(replaced=(), rebuilt=(), restored=None, repointed=(), setup=False, autosave="",
                            survivors=(0, 1))
    assert healthy.line().startswith("no engine had died: every rank kept its variables")
    on = Autosaving("ck", 4, "model", ("opt",), ("loader",), 2,
                    (AutosaveState(step=9, saved="ck/step-8", failed=None),
                     AutosaveState(step=9, saved="ck/step-8", failed="disk full")))
    assert repr(on) == ("<autosave of model, opt, loader, each rank's random state to ck every 4 optimizer steps, "
                        "keeping the last 2; at step 9, last save ck/step-8; a save FAILED: disk full>")


def test_several_models_and_their_optimizers_are_checked_before_any_rank_is_asked():
    from fsdp_nb.checkpoints.arguments import models_and_optimizers, several_optimizers
    from fsdp_nb.formats.layouts import choose_part

    assert models_and_optimizers("m", "o") == ("m", "o", ())
    assert models_and_optimizers(["s", "t"], ["so", None]) == ("s", "so", (("s", "so"), ("t", None)))
    assert models_and_optimizers(["s"], ["so"]) == ("s", "so", ())
    with pytest.raises(TypeError, match="with 2 models, optimizer is a list of as many"):
        models_and_optimizers(["s", "t"], "so")
    # one model with several optimizers: saved and loaded together (several_optimizers)
    assert models_and_optimizers("s", ["emb", "rest"]) == ("s", "emb", ())
    assert several_optimizers("s", ["emb", "rest"]) == ("emb", "rest") and several_optimizers("s", ["so"]) == ()
    assert several_optimizers(["s", "t"], ["so", None]) == () == several_optimizers("s", "so")
    with pytest.raises(TypeError, match="for one model, name each of its optimizers"):
        models_and_optimizers("s", ["so", None])
    with pytest.raises(ValueError, match="names an optimizer twice"):
        several_optimizers("s", ["so", "so"])
    with pytest.raises(ValueError, match="names a model twice"):
        models_and_optimizers(["s", "s"], None)
    with pytest.raises(ValueError, match="names an optimizer twice"):
        models_and_optimizers(["s", "t"], ["o", "o"])
    with pytest.raises(ValueError, match="'optim' is what a checkpoint calls an optimizer"):
        models_and_optimizers(["optim", "t"], None)
    assert choose_part("ck", ["s", "t"], "t") == "t" and choose_part("ck", None, None) is None
    with pytest.raises(CheckpointError, match="holds several models, 's', 't': pass model="):
        choose_part("ck", ["s", "t"], None)
    with pytest.raises(CheckpointError, match="holds one model; model='s' chooses among several"):
        choose_part("ck", None, "s")


def test_a_rank_file_its_completion_marker_does_not_list_is_refused_when_verifying(tmp_path):
    import dataclasses

    from fsdp_nb.formats.metadata import MARKER

    p = _folder(tmp_path, 2, ["rng", "sched"])
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "rank0.pt").write_bytes(run_state.encode({"rng": None, "state": {"sched": {}}}))
    (tmp_path / MARKER).write_text(json.dumps({"files": {"__0_0.distcp": {"size": 1}}}))
    verified = dataclasses.replace(_spec(("sched",)), verify=True)
    with pytest.raises(CorruptCheckpointError, match=r"completion marker lists no 'train/rank0.pt'"):
        engine_state.read_part(verified, FS, p, True, 0, 2)
    part, _ = engine_state.read_part(_spec(("sched",)), FS, p, True, 0, 2)  # unverified: read as it is
    assert part is not None and part["state"] == {"sched": {}}


def test_a_setup_function_gives_back_every_global_it_binds_however_it_binds_it(monkeypatch):
    """``restart(setup=)``: a notebook function runs on a copy of the ranks' namespace; the
    globals it binds by ``global``, from a function it defines, or through ``globals()``
    all reach the namespace (here this process's, which stands for a rank's)."""
    from fsdp_nb.engine import namespace
    from fsdp_nb.runtime.shipping import by_value

    ns: dict = {"kept": 1}
    monkeypatch.setattr(namespace, "user_ns", lambda: ns)
    code = (
        "def setup():\n"
        "    global opt\n"
        "    opt = 'adamw'\n"
        "    def inner():\n"
        "        global sched\n"
        "        sched = 'cosine'\n"
        "    inner()\n"
        "    globals()['loader'] = 'stateful'\n"
    )
    scope: dict = {"__name__": "__main__"}  # a notebook cell's function: shipped by value
    exec(code, scope)
    shipped = by_value(scope["setup"])
    assert namespace.call_setup(shipped) == ["loader", "opt", "sched"]
    assert ns == {"kept": 1, "opt": "adamw", "sched": "cosine", "loader": "stateful"}
