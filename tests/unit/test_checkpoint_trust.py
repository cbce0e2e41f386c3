"""Checkpoints that try to run code, read offline with no engines: every reader refuses
them before it writes anything, names the item and the file, and runs nothing; the
explicit opt-in (``weights_only=False``) is what would run it.

The session's load of such checkpoints (every rank, models unchanged) is in
``tests/test_security.py``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import RunsCode

import fsdp_nb
from fsdp_nb.formats.restricted import MAX_METADATA_ENV, load_dcp_metadata


def _touch(marker) -> str:
    return f"open({str(marker)!r}, 'a').write('ran')"


def _poisoned_state(marker) -> dict:
    """A state dict whose optimizer param group holds a pickle that runs code."""
    return {
        "model": {"w": torch.randn(4, 4), "b": torch.zeros(4)},
        "optim": {"state": {}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99),
                                                 "evil": RunsCode(_touch(marker))}]},
    }


def _committed(path, sd: dict) -> None:
    """``sd`` written as fsdp_nb writes a sharded checkpoint (its own writer, checksums,
    metadata and completion marker): what an attacker's own ``sess.save`` gives."""
    import uuid

    from fsdp_nb.formats.atomic import commit_sharded
    from fsdp_nb.formats.checksums import record_writer
    from fsdp_nb.formats.metadata import FORMAT
    from fsdp_nb.formats.storage import dcp_writer, sibling, url_to_fs

    fs, p = url_to_fs(str(path))
    token = uuid.uuid4().hex[:12]
    tmp = sibling(p, "tmp", token)
    writer = dcp_writer(fs, tmp, {})
    files = record_writer(writer).records
    dcp.save(sd, storage_writer=writer, no_dist=True)
    commit_sharded(fs, tmp, p, {"format": FORMAT, "world_size": 1}, files, token)


@pytest.fixture(params=["fsdp_nb marker", "plain dcp.save"])
def poisoned(request, tmp_path):
    """The poisoned checkpoint, committed with a valid marker and checksums, or as a
    plain ``dcp.save`` folder with no marker at all."""
    marker = tmp_path / "ran"
    path = tmp_path / "ck"
    if request.param == "plain dcp.save":
        dcp.save(_poisoned_state(marker), checkpoint_id=str(path), no_dist=True)
    else:
        _committed(path, _poisoned_state(marker))
        assert fsdp_nb.inspect(str(path)).source == "fsdp_nb"
    assert not marker.exists()
    return path, marker, request.param


def test_consolidate_export_and_inspect_refuse_a_poisoned_item(poisoned, tmp_path):
    path, marker, kind = poisoned
    if kind == "plain dcp.save":  # consolidate takes fsdp_nb's own checkpoints only
        with pytest.raises(fsdp_nb.CheckpointError, match="no completion marker"):
            fsdp_nb.consolidate(str(path), str(tmp_path / "full.pt"))
        with pytest.raises(fsdp_nb.UnsafeCheckpointError, match="optim.param_groups.0.evil"):
            fsdp_nb.export_safetensors(str(path), str(tmp_path / "hf"))
        assert not (tmp_path / "hf").exists() and not marker.exists()
        assert not fsdp_nb.inspect(str(path), verify=True).valid
        return
    out = tmp_path / "full.pt"
    with pytest.raises(fsdp_nb.UnsafeCheckpointError,
                       match=r"item 'optim\.param_groups\.0\.evil' in file '__0_0\.distcp'.*could run code"
                             r".*weights_only=False"):
        fsdp_nb.consolidate(str(path), str(out))
    assert not out.exists() and not marker.exists()
    with pytest.raises(fsdp_nb.UnsafeCheckpointError, match="optim.param_groups.0.evil"):
        fsdp_nb.export_safetensors(str(path), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists() and not marker.exists()
    info = fsdp_nb.inspect(str(path), verify=True)
    assert not info.valid and "could run code" in info.problem
    assert fsdp_nb.inspect(str(path)).valid  # reading only the metadata is harmless
    assert not marker.exists()
    # the command line says it in one line, status 2, and runs nothing either
    cli = subprocess.run([sys.executable, "-m", "fsdp_nb.cli", "consolidate", str(path), str(out)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "could run code" in cli.stderr and "--trust-pickles" in cli.stderr
    assert "Traceback" not in cli.stderr and not marker.exists()
    # the opt-in is what runs it: the poisoned item is real
    fsdp_nb.consolidate(str(path), str(out), weights_only=False)
    assert marker.read_text() == "ran"


def test_metadata_that_points_outside_the_folder_is_refused(tmp_path):
    path = tmp_path / "ck"
    dcp.save({"model": {"w": torch.randn(4, 4)}}, checkpoint_id=str(path), no_dist=True)
    (tmp_path / "secret").write_bytes(b"not yours")
    meta = path / ".metadata"
    md = load_dcp_metadata(meta.read_bytes())
    for bad in ("../secret", str(tmp_path / "secret"), "sub/../../secret"):
        for si in md.storage_data.values():
            si.relative_path = bad
        meta.write_bytes(pickle.dumps(md))
        info = fsdp_nb.inspect(str(path))
        assert not info.valid and "not a file inside the checkpoint's folder" in info.problem, bad
        with pytest.raises(fsdp_nb.UnsafeCheckpointError, match=r"'model\.w' in .*refused"):
            fsdp_nb.export_safetensors(str(path), str(tmp_path / "hf"))
        assert not (tmp_path / "hf").exists()


def test_metadata_with_other_classes_or_too_large_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    path = tmp_path / "ck"
    dcp.save({"model": {"w": torch.randn(4, 4)}}, checkpoint_id=str(path), no_dist=True)  # no marker
    good = (path / ".metadata").read_bytes()
    # a .metadata that is a pickle running code
    (path / ".metadata").write_bytes(pickle.dumps(RunsCode(_touch(marker))))
    with pytest.raises(fsdp_nb.UnsafeCheckpointError, match=r"'\.metadata': refusing to unpickle builtins\.exec"):
        fsdp_nb.export_safetensors(str(path), str(tmp_path / "hf"))
    assert "refusing to unpickle builtins.exec" in fsdp_nb.inspect(str(path)).problem
    assert not marker.exists()
    # a .metadata over the size fsdp_nb reads is not even read
    (path / ".metadata").write_bytes(good)
    monkeypatch.setenv(MAX_METADATA_ENV, str(len(good) - 1))
    info = fsdp_nb.inspect(str(path))
    assert not info.valid and f"over the {len(good) - 1} bytes" in info.problem
    monkeypatch.setenv(MAX_METADATA_ENV, str(len(good)))
    assert fsdp_nb.inspect(str(path)).valid


def test_a_poisoned_full_pt_file_is_refused(tmp_path):
    marker = tmp_path / "ran"
    full = tmp_path / "full.pt"
    torch.save({"model": {"w": torch.randn(4, 4)}, "fsdp_nb": {"extra": RunsCode(_touch(marker))}}, full)
    with pytest.raises(fsdp_nb.UnsafeCheckpointError, match=r"file 'full\.pt' holds a pickle .*could run code"):
        fsdp_nb.consolidate(str(full), str(tmp_path / "sharded"))
    with pytest.raises(fsdp_nb.UnsafeCheckpointError, match="full.pt"):
        fsdp_nb.export_safetensors(str(full), str(tmp_path / "hf"))
    info = fsdp_nb.inspect(str(full))
    assert not info.valid and "could run code" in info.problem
    assert not marker.exists() and not (tmp_path / "sharded").exists() and not (tmp_path / "hf").exists()
    assert os.listdir(tmp_path) == ["full.pt"]  # no temporary folders left either


def test_a_trainer_state_item_that_could_run_code_is_read_by_nobody(tmp_path):
    """torchtitan keeps its ``train_state`` as pickled items in the DCP folder, which
    ``inspect`` reads for ``extra`` (no verify asked): weights-only, so a poisoned one runs
    nothing and the checkpoint is reported, not trusted."""
    marker = tmp_path / "ran"
    path = tmp_path / "step-3"
    dcp.save({"w": torch.randn(4), "train_state": {"step": RunsCode(_touch(marker))}},
             checkpoint_id=str(path), no_dist=True)
    info = fsdp_nb.inspect(str(path))
    assert info.layout == "torchtitan" and not info.valid
    assert "item 'train_state.step'" in info.problem and "could run code" in info.problem
    assert not marker.exists()
