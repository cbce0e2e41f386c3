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
from fsdp_nb.checkpoint.export import parse_size

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import BUILD, build, snapshot  # noqa: E402


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
    from fsdp_nb.progress import Progress

    with Progress(10**10, "big") as p:  # a test is no notebook: nothing drawn, still counted
        p.update(5)
    assert p.bar is None and p.done == 5
    with Progress(100, "asked", enabled=True) as p:
        p.update(60)
        p.update(40)
    assert p.bar.n == 100 and p.bar.total == 100
