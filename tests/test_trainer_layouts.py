"""Checkpoints other trainers write, loaded with their optimizer and their other state.

Plain ``dcp.save`` writes each documented layout here, from one process: Lightning
Fabric's ModelParallel folder (the user's keys ``model`` / ``optimizer`` plus
``meta.pt``), torchtitan's step folder (the model's own keys plus ``optimizer``) and
OLMo-core's (``model_and_optim/`` holding ``model`` / ``optim``, plus ``train/rank0.pt``).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


def _trained():
    """A Llama and its AdamW after one step, in this process: their state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(5)
    model = LlamaForCausalLM(_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 96, (2, 8))
    model(batch, labels=batch).loss.backward()
    opt.step()
    return get_state_dict(model, [opt])


def _exp_avg(name: str, fqn: str):
    """The whole of ``fqn``'s AdamW ``exp_avg`` on this rank's optimizer ``name``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from fsdp_nb.engine.namespace import user_ns

    ns = user_ns()
    osd = get_optimizer_state_dict(ns[name], ns[f"{name}_opt"],
                                   options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    t = osd["state"][fqn]["exp_avg"]
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("layout", ["lightning_fabric", "torchtitan", "olmo_core"])
def test_another_trainers_folder_loads_model_optimizer_and_extra(sess, tmp_path, layout):
    import torch.distributed.checkpoint as dcp

    import fsdp_nb

    msd, osd = _trained()
    folder = tmp_path / layout
    if layout == "lightning_fabric":
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(folder))
        torch.save({"step": 7, "lr": 0.01}, folder / "meta.pt")  # what fabric.save keeps beside
        want_extra = {"step": 7, "lr": 0.01}
    elif layout == "torchtitan":
        dcp.save({**msd, "optimizer": osd}, checkpoint_id=str(folder))
        want_extra = {}
    else:  # OLMo-core's step folder: the shards in model_and_optim/, the trainer's state beside
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder / "model_and_optim"))
        (folder / "train").mkdir()
        torch.save({"global_step": 3, "tokens_seen": 384}, folder / "train" / "rank0.pt")
        want_extra = {"global_step": 3, "tokens_seen": 384}
    info = fsdp_nb.inspect(str(folder))  # offline, one process: what the browser lists
    assert info.valid and info.source == "dcp" and info.has_optimizer and info.extra == want_extra
    assert "model.layers.0.self_attn.q_proj.weight" in {k.removeprefix("model.") for k in info.tensors} | set(info.tensors)
    sess.wrap(LlamaForCausalLM, _config(), name="trainer")
    try:
        sess.execute("import torch\ntrainer_opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)\n"
                     "b = torch.randint(0, 96, (2, 8)); trainer(b, labels=b).loss.backward(); trainer_opt.step()")
        extra = sess.load(str(folder), "trainer", optimizer="trainer_opt")
        assert extra == want_extra
        full = sess.models["trainer"].state_dict()
        for k, v in msd.items():
            torch.testing.assert_close(full[k], v)
        fqn = "model.layers.0.self_attn.q_proj.weight"
        for got in sess.run(_exp_avg, "trainer", fqn):
            torch.testing.assert_close(got, osd["state"][fqn]["exp_avg"])
    finally:
        sess.execute("del trainer, trainer_opt, b")


def test_a_side_file_that_could_run_code_is_refused(sess, tmp_path):
    import torch.distributed.checkpoint as dcp

    import fsdp_nb

    msd, _ = _trained()
    dcp.save({"model": msd}, checkpoint_id=str(tmp_path / "ck"))
    torch.save({"step": 1, "hook": print}, tmp_path / "ck" / "meta.pt")  # a global weights-only refuses
    sess.wrap(LlamaForCausalLM, _config(), name="trainer_bad")
    try:
        with pytest.raises(fsdp_nb.UnsafeCheckpointError):
            sess.load(str(tmp_path / "ck"), "trainer_bad")
    finally:
        sess.execute("del trainer_bad")
