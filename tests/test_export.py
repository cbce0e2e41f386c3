"""Exporting to the layout the ecosystem reads, and reading what others wrote.

Checkpoints are written by real engines (``sess.save``); the export is read back by
``safetensors`` into an unwrapped model with ``strict=True``; torch's own
``dcp_to_torch_save`` reads an fsdp_nb checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import fsdp_nb
from fsdp_nb.checkpoints.export import parse_size

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import BUILD, build, same, snapshot  # noqa: E402


def _unwrapped(dim=16, layers=2):
    """The same architecture as the engines' ``CkNet``, as a plain module in this process."""
    ns: dict = {}
    exec(BUILD, ns)
    return ns["CkNet"](dim, layers)


@pytest.fixture
def saved(sess, tmp_path):
    """A sharded checkpoint with AdamW state of a 2-block CkNet, and its full weights."""
    build(sess, "ex_m", dim=16, layers=2)
    sess.execute("ex_m(torch.randn(4, 16)).sum().backward(); ex_m_opt.step()")
    path = tmp_path / "ck"
    sess.save(str(path), "ex_m", optimizer="ex_m_opt")
    weights = snapshot(sess, "ex_m")[0]
    yield path, weights
    sess.execute("del ex_m, ex_m_opt")


def test_export_loads_into_an_unwrapped_model_strictly(saved, tmp_path):
    path, weights = saved
    out = tmp_path / "hf"
    files = fsdp_nb.export_safetensors(str(path), str(out))
    assert files == [str(out / "model.safetensors")] and sorted(os.listdir(out)) == ["model.safetensors"]
    sd = load_file(files[0])
    net = _unwrapped()
    assert sorted(sd) == sorted(net.state_dict())  # the model's own names: no prefix, no optimizer
    net.load_state_dict(sd, strict=True)
    assert all(torch.equal(net.state_dict()[k], weights[k]) for k in weights)


def test_export_sharded_files_index_and_cast(saved, tmp_path):
    path, weights = saved
    out = tmp_path / "hf"
    # a 16x16 weight is 512 B in bf16 (sizes count after the cast): 600 B per file gives 3 files
    files = fsdp_nb.export_safetensors(str(path), str(out), dtype="bfloat16", max_shard_size=600)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    n = len(files) - 1
    assert n >= 3 and files[-1].endswith("model.safetensors.index.json")
    assert [os.path.basename(f) for f in files[:-1]] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(index["weight_map"]) == sorted(weights)
    merged = {}
    for f in files[:-1]:
        part = load_file(f)
        assert all(index["weight_map"][k] == os.path.basename(f) for k in part)
        merged.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    assert all(t.dtype == torch.bfloat16 for t in merged.values())
    assert all(torch.equal(merged[k], weights[k].to(torch.bfloat16)) for k in weights)
    _unwrapped().to(torch.bfloat16).load_state_dict(merged, strict=True)


def test_export_bad_input_before_anything_is_written(saved, tmp_path):
    path, _ = saved
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        fsdp_nb.export_safetensors(str(path), str(out))
    assert os.listdir(out) == ["keep.txt"]
    for bad in ("five", "0GB", -3, "5 parsecs"):
        with pytest.raises(ValueError, match="max_shard_size .*'5GB'"):
            fsdp_nb.export_safetensors(str(path), str(tmp_path / "x"), max_shard_size=bad)
    with pytest.raises(ValueError, match="floating dtype"):
        fsdp_nb.export_safetensors(str(path), str(tmp_path / "x"), dtype="int8")
    with pytest.raises(FileNotFoundError):
        fsdp_nb.export_safetensors(str(tmp_path / "nothing"), str(tmp_path / "x"))
    assert sorted(os.listdir(tmp_path)) == ["ck", "exists"]  # no output, no temporary left
    assert parse_size("2GiB") == 2 << 30 and parse_size("5GB") == 5 * 10**9 and parse_size(7) == 7


def test_export_cli_and_from_a_full_file(sess, saved, tmp_path):
    path, weights = saved
    full = tmp_path / "full.pt"
    sess.save(str(full), "ex_m", optimizer="ex_m_opt", sharded=False)
    out = tmp_path / "from_full"
    fsdp_nb.export_safetensors(str(full), str(out))
    sd = load_file(str(out / "model.safetensors"))
    assert sorted(sd) == sorted(weights) and all(torch.equal(sd[k], weights[k]) for k in weights)
    cli = subprocess.run([sys.executable, "-m", "fsdp_nb.cli", "export", str(path), str(tmp_path / "cli"),
                          "--dtype", "float16"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.split() == [str(tmp_path / "cli" / "model.safetensors")]
    assert load_file(str(tmp_path / "cli" / "model.safetensors"))["head.weight"].dtype == torch.float16


def test_torch_dcp_to_torch_save_reads_an_fsdp_nb_checkpoint(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, weights = saved
    dcp_to_torch_save(str(path), str(tmp_path / "t.pt"))
    obj = torch.load(str(tmp_path / "t.pt"), weights_only=True)
    assert sorted(obj["model"]) == sorted(weights)
    assert all(torch.equal(obj["model"][k], weights[k]) for k in weights)
    assert "exp_avg" in next(iter(obj["optim"]["state"].values()))


def test_progress_only_where_asked_or_in_a_notebook():
    from fsdp_nb.display.progress import Progress

    with Progress(10**10, "big") as p:  # a test is no notebook: nothing drawn, still counted
        p.update(5)
    assert p.bar is None and p.done == 5
    with Progress(100, "asked", enabled=True) as p:
        p.update(60)
        p.update(40)
    assert p.bar.n == 100 and p.bar.total == 100


def test_full_safetensors_holds_the_models_own_names_optimizer_beside(sess, saved, tmp_path):
    _, weights = saved
    full = tmp_path / "full.safetensors"
    info = sess.save(str(full), "ex_m", optimizer="ex_m_opt", sharded=False, extra={"step": 1})
    assert info.valid and info.has_optimizer and info.files.keys() == {"full.safetensors", "full.optim.safetensors"}
    sd = load_file(str(full))
    net = _unwrapped()
    net.load_state_dict(sd, strict=True)  # no prefix, no optimizer state inside
    assert all(torch.equal(sd[k], weights[k]) for k in weights)
    assert sorted(i.name for i in fsdp_nb.list_checkpoints(str(tmp_path))) == ["ck", "full.safetensors"]
    # the optimizer file of another save is refused by its token; the weights still load
    other = tmp_path / "other.safetensors"
    sess.save(str(other), "ex_m", optimizer="ex_m_opt", sharded=False)
    (tmp_path / "full.optim.safetensors").write_bytes((tmp_path / "other.optim.safetensors").read_bytes())
    with pytest.raises(fsdp_nb.CorruptCheckpointError, match="written by another save"):
        sess.load(str(full), "ex_m", optimizer="ex_m_opt")
    assert not fsdp_nb.inspect(str(full)).valid
    # a save without optimizer state replaces the pair: no stale optimizer file stays
    sess.save(str(full), "ex_m", sharded=False, overwrite=True)
    assert not (tmp_path / "full.optim.safetensors").exists()
    assert sess.load(str(full), "ex_m") == {}
    # keep_last counts the pair once and removes both files
    sess.save(str(tmp_path / "newest.safetensors"), "ex_m", optimizer="ex_m_opt", sharded=False, keep_last=1)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "newest.optim.safetensors", "newest.safetensors"]


READS = """
import fsdp_nb.formats.safetensors_layout as _sl
_reads = []
_plain_read = _sl.PieceReader.read
def _logged_read(self, st, offsets=None, sizes=None):
    _reads.append((st.key, offsets, sizes))
    return _plain_read(self, st, offsets, sizes)
_sl.PieceReader.read = _logged_read
"""


def test_load_hugging_face_folder_each_rank_reads_its_slice(sess, saved, tmp_path):
    path, weights = saved
    out = tmp_path / "hf"
    fsdp_nb.export_safetensors(str(path), str(out), max_shard_size=1200)
    assert (out / "model.safetensors.index.json").exists()
    build(sess, "ex_n", dim=16, layers=2, seed=9)
    sess.execute(READS)
    try:
        assert sess.load(str(out), "ex_n") == {}
        reads = sess.pull("_reads")
    finally:
        sess.execute("_sl.PieceReader.read = _plain_read")
    assert same(snapshot(sess, "ex_n")[0], weights)
    for rank, rank_reads in enumerate(reads):  # 16 rows of blocks.0.weight: 8 per rank, no more
        assert ("blocks.0.weight", (8 * rank, 0), (8, 16)) in rank_reads
        assert all(key != "blocks.0.weight" or off == (8 * rank, 0) for key, off, _ in rank_reads)
    # a cast export loads into the float32 model, each value cast back
    fsdp_nb.export_safetensors(str(path), str(tmp_path / "bf16"), dtype="bfloat16")
    sess.load(str(tmp_path / "bf16" / "model.safetensors"), "ex_n")
    got = snapshot(sess, "ex_n")[0]
    assert all(torch.equal(got[k], weights[k].to(torch.bfloat16).float()) for k in weights)
    sess.execute("del ex_n, ex_n_opt")


def test_load_safetensors_keys_and_shapes_checked_before_any_rank_changes(sess, saved, tmp_path):
    path, weights = saved
    out = tmp_path / "hf"
    fsdp_nb.export_safetensors(str(path), str(out))
    build(sess, "ex_x", dim=16, layers=2, seed=3, extra=True)
    before = snapshot(sess, "ex_x")
    with pytest.raises(fsdp_nb.CheckpointError, match=r"(?s)missing keys \(2\): tail.bias, tail.weight.*strict=False"):
        sess.load(str(out), "ex_x")
    with pytest.raises(fsdp_nb.CheckpointError, match="no optimizer state"):
        sess.load(str(out), "ex_x", optimizer="ex_x_opt", strict=False)
    assert same(snapshot(sess, "ex_x"), before)
    sess.load(str(out), "ex_x", strict=False)
    got = snapshot(sess, "ex_x")[0]
    assert all(torch.equal(got[k], weights[k]) for k in weights) and torch.equal(got["tail.weight"], before[0]["tail.weight"])
    build(sess, "ex_8", dim=8, layers=2)
    before = snapshot(sess, "ex_8")
    with pytest.raises(fsdp_nb.CheckpointError,
                       match=r"shape mismatch blocks.0.weight: checkpoint \[16, 16\], model \[8, 8\]"):
        sess.load(str(out / "model.safetensors"), "ex_8", strict=False)
    assert same(snapshot(sess, "ex_8"), before)
    sess.execute("del ex_x, ex_x_opt, ex_8, ex_8_opt")


PLAIN_DCP = """
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
_msd, _osd = get_state_dict(ex_m, [ex_m_opt])
dcp.save({{"model": _msd, "optim": _osd}}, checkpoint_id={nested!r})
dcp.save(get_model_state_dict(ex_m), checkpoint_id={bare!r})  # torchtitan's layout: the model's keys at the top
"""


def test_plain_dcp_folders_are_inspected_and_loaded(sess, saved, tmp_path):
    _, weights = saved
    nested, bare = tmp_path / "nested", tmp_path / "bare"
    sess.execute(PLAIN_DCP.format(nested=str(nested), bare=str(bare)))
    full = snapshot(sess, "ex_m")
    for folder in (nested, bare):
        info = fsdp_nb.inspect(str(folder))
        assert info.valid and info.source == "dcp" and info.world_size == 2
        assert sorted(info.model_keys) == sorted(weights)
    assert fsdp_nb.inspect(str(nested)).has_optimizer
    build(sess, "ex_p", dim=16, layers=2, seed=5)
    sess.load(str(nested), "ex_p", optimizer="ex_p_opt")
    assert same(snapshot(sess, "ex_p"), full)
    build(sess, "ex_p", dim=16, layers=2, seed=5)
    sess.load(str(bare), "ex_p")
    assert same(snapshot(sess, "ex_p")[0], weights)
    fsdp_nb.export_safetensors(str(bare), str(tmp_path / "hf"))
    _unwrapped().load_state_dict(load_file(str(tmp_path / "hf" / "model.safetensors")), strict=True)
    # what cannot be verified is refused, naming why and the opt-in
    (bare / "__1_0.distcp").unlink()
    assert "'__1_0.distcp' is missing" in fsdp_nb.inspect(str(bare)).problem
    with pytest.raises(fsdp_nb.CheckpointError, match=r"plain dcp.save.*'__1_0.distcp' is missing.*verify=False"):
        sess.load(str(bare), "ex_p")
    sess.execute("del ex_p, ex_p_opt")


def test_unverifiable_fsdp_nb_checkpoint_loads_only_when_asked(sess, saved):
    path, weights = saved
    (path / ".fsdp_nb_complete").unlink()
    build(sess, "ex_v", dim=16, layers=2, seed=5)
    with pytest.raises(fsdp_nb.CheckpointError, match="no completion marker.*verify=False"):
        sess.load(str(path), "ex_v")
    sess.load(str(path), "ex_v", verify=False)
    assert same(snapshot(sess, "ex_v")[0], weights)
    with pytest.raises(TypeError, match="verify must be True or False"):
        sess.load(str(path), "ex_v", verify="no")
    sess.execute("del ex_v, ex_v_opt")
