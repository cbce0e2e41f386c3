"""Which trainer wrote a DCP folder, from its stored keys and files: no engines."""

from __future__ import annotations

import pytest

from fsdp_nb.errors import CheckpointError
from fsdp_nb.formats.keys import nest_keys, rekey_optim
from fsdp_nb.formats.layouts import Layout, find_layout, layout_of_keys, match_names

HF = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
"""A Hugging Face causal LM's own names: they start with ``model.`` themselves."""


def _optim(root: str, names: list[str], flat: bool = False, inner: str = "") -> list[str]:
    keys = [f"{root}.state.{inner}{n}.exp_avg" for n in names] + [f"{root}.state.{inner}{n}.step" for n in names]
    if flat:
        return keys + [f"{root}.param_groups.{inner}{n}.lr" for n in names]
    return keys + [f"{root}.param_groups.0.lr", f"{root}.param_groups.0.params"]


@pytest.mark.parametrize(("name", "keys", "kw", "want"), [
    ("fsdp_nb", ["model." + k for k in HF] + _optim("optim", HF), {"ours": True}, ("fsdp_nb", "model", "optim")),
    ("fabric", ["model." + k for k in HF] + _optim("optimizer", HF), {"side": True},
     ("lightning_fabric", "model", "optimizer")),
    ("trainer", ["state_dict.model." + k for k in HF] + _optim("optimizer_0", HF, inner="model."), {},
     ("lightning_trainer", "state_dict", "optimizer_0")),
    ("torchtitan", HF + _optim("optimizer", HF, flat=True) + ["train_state.step", "lr_scheduler.last_epoch"], {},
     ("torchtitan", "", "optimizer")),
    ("plain nested", ["model." + k for k in HF], {}, ("dcp", "model", None)),
    # dcp.save(hf_model.state_dict()): the model's own names start with "model." too, and
    # lm_head is beside them; read as bare, not as nested (an export keeps lm_head)
    ("plain bare", HF, {}, ("dcp", "", None)),
])
def test_the_keys_structure_names_the_layout(name, keys, kw, want):
    lay = layout_of_keys(None, "/ck", keys, **kw)
    assert (lay.name, lay.model_root, lay.optim_root) == want, name
    model = [k for k in keys if lay.fqn(k) is not None]
    assert sorted(lay.fqn(k) for k in model) == sorted(HF) or lay.name == "lightning_trainer"


def test_a_flat_optimizer_is_told_from_a_nested_one():
    assert layout_of_keys(None, "/ck", HF + _optim("optimizer", HF, flat=True)).flat_optim
    assert not layout_of_keys(None, "/ck", HF + _optim("optimizer", HF)).flat_optim


def test_the_models_names_find_the_root_and_a_module_prefix():
    keys = ["state_dict.model." + k for k in HF] + _optim("optimizer_0", HF, inner="model.")
    lay = match_names(layout_of_keys(None, "/ck", keys), keys, HF, "/ck")
    assert (lay.model_root, lay.inner) == ("state_dict", "model.")
    assert lay.model_key("lm_head.weight") == "state_dict.model.lm_head.weight"
    assert lay.optim_key("lm_head.weight", "exp_avg") == "optimizer_0.state.model.lm_head.weight.exp_avg"
    assert lay.optim_fqn("optimizer_0.state.model.model.norm.weight.exp_avg") == ("model.norm.weight", "exp_avg")
    # the same names nested under "model" (fsdp_nb, Fabric), and bare (torchtitan)
    nested = ["model." + k for k in HF]
    assert match_names(layout_of_keys(None, "/ck", nested), nested, HF, "/ck").model_prefix == "model."
    assert match_names(layout_of_keys(None, "/ck", nested), HF, HF, "/ck").model_prefix == ""


def test_a_folder_whose_keys_name_nothing_of_the_model_says_what_it_found():
    keys = ["encoder.blocks.0.w", "encoder.blocks.1.w", "head.w", "opt.state.x"]
    with pytest.raises(CheckpointError) as err:
        match_names(layout_of_keys(None, "/ck", keys), keys, HF, "/ck")
    msg = str(err.value)
    assert "encoder.blocks.0.w" in msg and "encoder, head, opt" in msg and "lm_head.weight" in msg
    assert "Lightning" in msg and "torchtitan" in msg and "Accelerate" in msg


def test_folders_and_side_files_of_each_trainer_are_found(tmp_path):
    import fsspec

    fs = fsspec.filesystem("file")
    keys = {"olmo/model_and_optim": ["model.w", "optim.state.w.exp_avg"],
            "acc/pytorch_model_fsdp_0": ["model.w"], "acc/optimizer_0": ["optimizer.state.w.exp_avg"],
            "fab": ["model.w", "optimizer.state.w.exp_avg"], "ours": ["model.w"]}
    for folder in keys:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / ".metadata").write_bytes(b"")
    (tmp_path / "olmo" / "train").mkdir()
    (tmp_path / "olmo" / "train" / "rank0.pt").write_bytes(b"")
    for n in ("scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl"):
        (tmp_path / "acc" / n).write_bytes(b"")
    (tmp_path / "fab" / "meta.pt").write_bytes(b"")
    (tmp_path / "ours" / "fsdp_nb.json").write_bytes(b"{}")
    (tmp_path / "ours" / "meta.pt").write_bytes(b"")  # not a side file of ours

    def read(folder: str) -> list[str]:
        return keys[str(folder)[len(str(tmp_path)) + 1:]]

    olmo = find_layout(fs, str(tmp_path / "olmo"), read, "olmo")
    assert (olmo.name, olmo.folder.endswith("model_and_optim"), olmo.optim_root) == ("olmo_core", True, "optim")
    assert [s.rsplit("/", 2)[-2:] for s in olmo.side_files] == [["train", "rank0.pt"]]
    acc = find_layout(fs, str(tmp_path / "acc"), read, "acc")
    assert acc.name == "accelerate" and acc.optim_in_own_folder and acc.optim_root == "optimizer"
    assert sorted(s.rsplit("/", 1)[-1] for s in acc.side_files) == ["custom_checkpoint_0.pkl", "scheduler.bin"]
    assert find_layout(fs, str(tmp_path / "fab"), read, "fab").name == "lightning_fabric"
    ours = find_layout(fs, str(tmp_path / "ours"), read, "ours")
    assert ours.name == "fsdp_nb" and ours.side_files == ()


def test_optimizer_names_are_renamed_nested_or_flat_and_back():
    nested = {"state": {"w": {"exp_avg": 1}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    there = rekey_optim(nested, False, lambda f: "model." + f)
    assert there == {"state": {"model.w": {"exp_avg": 1}}, "param_groups": [{"lr": 0.1, "params": ["model.w"]}]}
    assert rekey_optim(there, False, lambda f: f[len("model."):]) == nested
    flat = {"state.a.b.exp_avg": 1, "param_groups.a.b.lr": 0.1}
    assert rekey_optim(flat, True, lambda f: "m." + f) == {"state.m.a.b.exp_avg": 1, "param_groups.m.a.b.lr": 0.1}


def test_a_trainers_state_kept_in_the_folder_is_nested_back():
    flat = {"train_state.step": 3, "train_state.ntokens_seen": 96, "dataloader.dp_rank_0": b"x"}
    paths = {"train_state.step": ("train_state", "step")}
    assert nest_keys(flat, paths) == {"train_state": {"step": 3, "ntokens_seen": 96}, "dataloader": {"dp_rank_0": b"x"}}


def test_a_layout_spells_and_reads_back_its_keys():
    lay = Layout("torchtitan", "/ck", "", optim_root="optimizer", extra_roots=("train_state",))
    assert lay.fqn("lm_head.weight") == "lm_head.weight"
    assert lay.fqn("optimizer.state.w.exp_avg") is None and lay.fqn("train_state.step") is None
    assert lay.optim_fqn("optimizer.param_groups.w.lr") is None
