"""Other trainers' checkpoints in (model, optimizer, their other state as ``extra``) and out.

Lightning writes and reads its own checkpoints here, in a process of its own on CPU
(Fabric and Trainer with ``ModelParallelStrategy``, one rank); the session (two ranks)
loads what Lightning wrote, and Lightning loads what the session wrote. torchtitan's
checkpoint manager does the same where it is installed; where it is not, its loading
protocol (``dcp.load`` of the flattened states) stands in. Plain ``dcp.save`` writes the
layouts of the trainers that need a GPU or a cluster to run (torchtitan's step folder,
OLMo-core's, Accelerate's).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

CONFIG: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2)
Q = "model.layers.0.self_attn.q_proj.weight"


def _config() -> LlamaConfig:
    return LlamaConfig(**CONFIG)


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
    osd: dict[str, Any] = get_optimizer_state_dict(
        ns[name], ns[f"{name}_opt"], options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    t = osd["state"][fqn]["exp_avg"]
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _wrap_trained(sess, name: str) -> None:
    """A Llama on the ranks with an AdamW that has taken a step (its state exists)."""
    sess.wrap(LlamaForCausalLM, _config(), name=name)
    sess.execute(f"import torch\n{name}_opt = torch.optim.AdamW({name}.parameters(), lr=1e-2)\n"
                 f"b = torch.randint(0, 96, (2, 8)); {name}(b, labels=b).loss.backward(); {name}_opt.step()")


def _same_as(sess, name: str, weights: dict, exp_avg) -> None:
    full = sess.models[name].state_dict()
    for k, v in weights.items():
        torch.testing.assert_close(full[k], v)
    for got in sess.run(_exp_avg, name, Q):
        torch.testing.assert_close(got, exp_avg)


# --- Lightning, in a process of its own ------------------------------------------------

_LIGHTNING = '''
import sys, torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(**{config!r})
mode, path, out = sys.argv[1:4]


def shard(model, mesh):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def dump(module, opt, **rest):
    module = module.module  # the user's module inside Fabric's wrapper: its own names
    full = StateDictOptions(full_state_dict=True)
    osd = get_optimizer_state_dict(module, opt, options=full)
    torch.save({{"model": get_model_state_dict(module, options=full), "exp_avg": osd["state"][{q!r}]["exp_avg"],
                **rest}}, out)


if mode.startswith("fabric"):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(
        parallelize_fn=lambda m, mesh: shard(m, mesh["data_parallel"]), data_parallel_size=1, tensor_parallel_size=1))
    fabric.launch()
    torch.manual_seed(5)
    model = fabric.setup_module(LlamaForCausalLM(CONFIG))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if mode == "fabric-save":
        batch = torch.randint(0, 96, (2, 8))
        model(batch, labels=batch).loss.backward()
        opt.step()
        fabric.save(path, {{"model": model, "optimizer": opt, "step": 7, "lr": 0.01}})
        dump(model, opt)
    else:
        state = {{"model": model, "optimizer": opt, "step": None, "data": None}}
        rest = fabric.load(path, state)
        dump(model, opt, step=state["step"], data=state["data"], rest=rest)
else:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.model = LlamaForCausalLM(CONFIG)

        def configure_model(self):
            shard(self.model, self.device_mesh["data_parallel"])

        def training_step(self, batch, i):
            return self.model(batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randint(0, 96, (4, 8)), batch_size=2)

    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    trainer.fit(module)
    trainer.save_checkpoint(path)
    full = StateDictOptions(full_state_dict=True)
    osd = get_optimizer_state_dict(module, trainer.optimizers[0], options=full)
    torch.save({{"model": get_model_state_dict(module.model, options=full),
                "exp_avg": osd["state"]["model." + {q!r}]["exp_avg"], "global_step": trainer.global_step}}, out)
'''


def _lightning(tmp_path, mode: str, path) -> dict:
    """Run Lightning (``mode``: fabric-save, fabric-load, trainer-save) on checkpoint
    ``path`` in a process of its own; what it saw, as it wrote it out."""
    script = tmp_path / "lightning_run.py"
    script.write_text(_LIGHTNING.format(config=CONFIG, q=Q))
    out = tmp_path / f"{mode}.pt"
    done = subprocess.run([sys.executable, str(script), mode, str(path), str(out)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_lightning_fabrics_checkpoint_loads_with_its_optimizer_and_state(sess, tmp_path):
    import fsdp_nb

    path = tmp_path / "fabric"
    wrote = _lightning(tmp_path, "fabric-save", path)
    info = fsdp_nb.inspect(str(path))
    assert info.valid and info.layout == "lightning_fabric" and info.has_optimizer
    assert info.extra == {"step": 7, "lr": 0.01} and f"model.{Q}" in info.tensors
    _wrap_trained(sess, "fab")
    try:
        assert sess.load(str(path), "fab", optimizer="fab_opt") == {"step": 7, "lr": 0.01}
        _same_as(sess, "fab", wrote["model"], wrote["exp_avg"])
    finally:
        sess.execute("del fab, fab_opt, b")


def test_lightning_trainers_checkpoint_loads_through_its_lightning_module(sess, tmp_path):
    """The Trainer keeps the LightningModule's names (``state_dict.model.<fqn>``) and
    ``optimizer_0``; the model's own names find the module's ``self.model`` in them."""
    import fsdp_nb

    path = tmp_path / "trainer"
    wrote = _lightning(tmp_path, "trainer-save", path)
    info = fsdp_nb.inspect(str(path))
    assert info.valid and info.layout == "lightning_trainer" and info.has_optimizer
    _wrap_trained(sess, "tr")
    try:
        extra = sess.load(str(path), "tr", optimizer="tr_opt")
        assert extra["global_step"] == wrote["global_step"] == 2 and "loops" in extra
        _same_as(sess, "tr", wrote["model"], wrote["exp_avg"])
    finally:
        sess.execute("del tr, tr_opt, b")


def test_a_save_in_lightnings_layout_is_what_fabric_load_resumes(sess, tmp_path):
    import fsdp_nb

    _wrap_trained(sess, "out_l")
    sess.execute("out_l_sched = torch.optim.lr_scheduler.StepLR(out_l_opt, 2, gamma=0.5); out_l_sched.step()")
    path = tmp_path / "for_fabric"
    try:
        info = sess.save(str(path), "out_l", optimizer="out_l_opt", extra={"step": 11, "data": {"seen": 64}},
                         state=["out_l_sched"], layout="lightning")
        sched = sess.pull("out_l_sched")[0].state_dict()
        assert info.layout == "lightning" and info.extra == {"step": 11, "data": {"seen": 64}, "out_l_sched": sched}
        assert fsdp_nb.inspect(str(path), verify=True).valid
        got = _lightning(tmp_path, "fabric-load", path)
        # Fabric hands back meta.pt's entries: those it was asked for, and the rest
        assert (got["step"], got["data"], got["rest"]) == (11, {"seen": 64}, {"out_l_sched": sched})
        _same_as(sess, "out_l", got["model"], got["exp_avg"])
        # and back in: the scheduler takes its state from meta.pt by its name
        sess.execute("out_l_sched.step(); out_l_sched.step()")
        sess.load(str(path), "out_l", optimizer="out_l_opt", state=["out_l_sched"])
        assert [s.state_dict() for s in sess.pull("out_l_sched")] == [sched, sched]
        with pytest.raises(fsdp_nb.CheckpointError, match=r"keeps no 'out_l_opt'.*'out_l_sched', 'step'"):
            sess.load(str(path), "out_l", state=["out_l_opt"])
    finally:
        sess.execute("del out_l, out_l_opt, out_l_sched, b")


# --- torchtitan --------------------------------------------------------------------------

_TITAN = '''
import sys, torch
import torch.distributed.checkpoint as dcp
from transformers import LlamaConfig, LlamaForCausalLM

import os

CONFIG = LlamaConfig(**{config!r})
mode, path, out = sys.argv[1:4]
folder, step = path.rsplit("/step-", 1)
torch.manual_seed(5)
model = LlamaForCausalLM(CONFIG)


class TrainState:
    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {{"step": self.step, "ntokens_seen": self.ntokens_seen}}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


train_state = TrainState()
try:
    from torch.distributed.checkpoint.stateful import Stateful
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.utils import (
        get_flat_optim_state_dict, init_optim_state, load_flat_optim_state_dict)

    opt = torch.optim.AdamW(list(model.named_parameters()), lr=1e-2)  # named: torchtitan keys its state by FQN

    class Optimizers(Stateful):  # what torchtitan's OptimizersContainer does for one optimizer
        def state_dict(self):
            init_optim_state(opt)
            return get_flat_optim_state_dict(opt)

        def load_state_dict(self, sd):
            init_optim_state(opt)
            load_flat_optim_state_dict(opt, sd)

    manager = CheckpointManager(
        CheckpointManager.Config(enable=True, folder=os.path.basename(folder), last_save_model_only=False,
                                 exclude_from_loading=["dataloader", "lr_scheduler"]),
        dataloader=None, model_parts=[model], optimizers=Optimizers(), lr_schedulers=None,
        states={{"train_state": train_state}}, sd_adapter=None, base_folder=os.path.dirname(folder))
    if mode == "save":
        batch = torch.randint(0, 96, (2, 8))
        model(batch, labels=batch).loss.backward()
        opt.step()
        train_state.step, train_state.ntokens_seen = int(step), 384
        assert manager.save(int(step), last_step=True)
    else:
        assert manager.load(int(step))
    loader = "torchtitan"
except ImportError:  # its protocol: the model's keys, the flat optimizer and each state, loaded at once
    assert mode == "load", "torchtitan is not installed"
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict)

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the state to load into, as torchtitan's init_optim_state does (lr 0 there)
    states = {{**model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt, options=flat),
              "train_state": train_state}}
    dcp.load(states, checkpoint_id=path)
    model.load_state_dict({{k: v for k, v in states.items() if k in model.state_dict()}})
    set_optimizer_state_dict(model, opt, states["optimizer"], options=flat)
    loader = "protocol"
exp = {{n: opt.state[p]["exp_avg"] for n, p in model.named_parameters()}}
torch.save({{"model": model.state_dict(), "exp_avg": exp[{q!r}], "step": train_state.step,
            "ntokens_seen": train_state.ntokens_seen, "loader": loader}}, out)
'''


def _torchtitan(tmp_path, mode: str, path) -> dict:
    """torchtitan's CheckpointManager (or, with ``mode="load"`` where torchtitan is not
    installed, its protocol) saving or loading step folder ``path``, in a process of its
    own; what it saw."""
    script = tmp_path / "titan_run.py"
    script.write_text(_TITAN.format(config=CONFIG, q=Q))
    out = tmp_path / f"titan_{mode}.pt"
    done = subprocess.run([sys.executable, str(script), mode, str(path), str(out)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_torchtitans_own_checkpoint_loads_with_its_train_state(sess, tmp_path):
    pytest.importorskip("torchtitan.components.checkpoint", reason="torchtitan is not installed (it is optional)")
    import fsdp_nb

    path = tmp_path / "checkpoint" / "step-7"
    wrote = _torchtitan(tmp_path, "save", path)
    info = fsdp_nb.inspect(str(path))
    assert info.valid and info.layout == "torchtitan" and info.has_optimizer
    assert info.extra["train_state"] == {"step": 7, "ntokens_seen": 384}
    _wrap_trained(sess, "titan")
    try:
        extra = sess.load(str(path), "titan", optimizer="titan_opt")
        assert extra["train_state"] == {"step": 7, "ntokens_seen": 384}
        _same_as(sess, "titan", wrote["model"], wrote["exp_avg"])
    finally:
        sess.execute("del titan, titan_opt, b")


def test_a_save_in_torchtitans_layout_is_what_its_checkpointer_resumes(sess, tmp_path):

    _wrap_trained(sess, "out_t")
    sess.execute("lr_scheduler = torch.optim.lr_scheduler.StepLR(out_t_opt, 2, gamma=0.5); lr_scheduler.step()")
    path = tmp_path / "checkpoint" / "step-12"
    try:
        info = sess.save(str(path), "out_t", optimizer="out_t_opt", layout="torchtitan", state=["lr_scheduler"],
                         extra={"train_state": {"step": 12, "ntokens_seen": 768}})
        assert info.layout == "torchtitan" and info.valid and info.has_optimizer
        sched = sess.pull("lr_scheduler")[0].state_dict()
        assert info.extra["lr_scheduler"] == sched
        assert f"model.{Q}" in info.tensors
        got = _torchtitan(tmp_path, "load", path)
        assert (got["step"], got["ntokens_seen"]) == (12, 768)
        _same_as(sess, "out_t", got["model"], got["exp_avg"])
        # and back in: the train state comes back as extra, the optimizer from its flat keys
        sess.execute("out_t_opt.state.clear(); out_t_opt.zero_grad(set_to_none=True)")
        sess.execute("lr_scheduler.step()")
        extra = sess.load(str(path), "out_t", optimizer="out_t_opt", state=["lr_scheduler"])
        assert extra["train_state"] == {"step": 12, "ntokens_seen": 768}
        assert [s.state_dict() for s in sess.pull("lr_scheduler")] == [sched, sched]
        _same_as(sess, "out_t", got["model"], got["exp_avg"])
        if got["loader"] != "torchtitan":
            pytest.skip("torchtitan is not installed: its loading protocol stood in for its CheckpointManager")
    finally:
        sess.execute("del out_t, out_t_opt, lr_scheduler, b")


_TITAN_LOADER = """
import os, pickle, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torchdata.stateful_dataloader import StatefulDataLoader


class TitanLoader(StatefulDataLoader):
    \"\"\"torchtitan's ParallelAwareDataloader, its state protocol as torchtitan/components/dataloader.py
    has it: each data-parallel rank's state pickled under its own key, and the world size.\"\"\"

    def state_dict(self):
        return {f"dp_rank_{rank}": pickle.dumps(super().state_dict()), "world_size": world_size}

    def load_state_dict(self, sd):
        assert sd["world_size"] == world_size, "dataloader resharding is not supported yet"
        super().load_state_dict(pickle.loads(sd[f"dp_rank_{rank}"]))


def tl_make(cls=StatefulDataLoader):
    # a shuffled loader per rank: its state holds the sampler's generator, a tensor
    return cls(list(range(64)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(11 + rank))
"""


def test_torchtitans_dataloader_state_goes_both_ways_each_rank_its_own(sess, tmp_path):
    """torchtitan's loader (its state protocol, as its CheckpointManager saves it with
    ``dcp.save``) resumes into a session's ``StatefulDataLoader`` named ``dataloader``,
    each rank its own position; and a session's save in torchtitan's layout resumes
    torchtitan's. A pickle in that state that could run code is refused, nothing loaded."""
    import fsdp_nb

    _wrap_trained(sess, "ttl")
    sess.execute(_TITAN_LOADER)
    theirs, ours, evil = (tmp_path / "checkpoint" / f"step-{n}" for n in (3, 4, 5))
    try:
        # torchtitan wrote it: three batches read on each rank, the model's keys at the top
        sess.execute("tl = tl_make(TitanLoader); tl_it = iter(tl); [next(tl_it) for _ in range(3)]\n"
                     f"dcp.save({{**get_model_state_dict(ttl), 'dataloader': tl}}, checkpoint_id={str(theirs)!r})")
        info = fsdp_nb.inspect(str(theirs))
        assert info.layout == "torchtitan" and sorted(info.extra["dataloader"]) == ["dp_rank_0", "dp_rank_1",
                                                                                   "world_size"]
        sess.execute("dataloader = tl_make(); dl_it = None")
        sess.load(str(theirs), "ttl", state=["dataloader"])
        sess.execute("dl_it = iter(dataloader); got, want = next(dl_it), next(tl_it)")
        got, want = sess.pull("got"), sess.pull("want")
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        assert got[0].tolist() != got[1].tolist()  # each rank took its own position
        # and back: the session writes torchtitan's form, torchtitan's loader resumes from it
        sess.save(str(ours), "ttl", layout="torchtitan", state=["dataloader"])
        sess.execute(f"tl2 = tl_make(TitanLoader); dcp.load({{'dataloader': tl2}}, checkpoint_id={str(ours)!r})\n"
                     "got, want = next(iter(tl2)), next(dl_it)")
        got, want = sess.pull("got"), sess.pull("want")
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        # a loader entry whose pickle runs code is refused before any rank loads anything
        marker = tmp_path / "ran"
        sess.execute("class Evil:\n    def __reduce__(self):\n"
                     f"        return (os.system, ('touch {marker}',))\n"
                     "bad = {f'dp_rank_{rank}': pickle.dumps(Evil()), 'world_size': world_size}\n"
                     f"dcp.save({{**get_model_state_dict(ttl), 'dataloader': bad}}, checkpoint_id={str(evil)!r})")
        with pytest.raises(fsdp_nb.UnsafeCheckpointError, match=r"'dataloader\.dp_rank_0' names posix\.system"):
            sess.load(str(evil), "ttl", state=["dataloader"])
        assert not marker.exists()
    finally:
        sess.execute("for n in ('ttl', 'ttl_opt', 'b', 'tl', 'tl_it', 'tl2', 'dataloader', 'dl_it', 'got', 'want', 'bad'):\n"
                     "    globals().pop(n, None)")


def test_a_torchtitan_layout_save_is_refused_before_any_work_when_torchtitan_could_not_resume_it(sess, tmp_path):
    with pytest.raises(ValueError, match="step-<N>"):
        sess.save(str(tmp_path / "latest"), "anything", layout="torchtitan")
    with pytest.raises(ValueError, match=r"extra\['step'\] is int"):
        sess.save(str(tmp_path / "step-1"), "anything", layout="torchtitan", extra={"step": 1})
    with pytest.raises(ValueError, match="layout must be one of 'fsdp_nb', 'lightning', 'torchtitan'"):
        sess.save(str(tmp_path / "x"), "anything", layout="megatron")
    with pytest.raises(ValueError, match="sharded folder"):
        sess.save(str(tmp_path / "x.pt"), "anything", layout="lightning", sharded=False)
    with pytest.raises(ValueError, match=r"torchtitan's own states, train_state, lr_scheduler, dataloader.*\['sched'\]"):
        sess.save(str(tmp_path / "step-1"), "anything", layout="torchtitan", state=["sched"])
    assert not any(tmp_path.iterdir())


# --- layouts written by plain dcp.save ---------------------------------------------------

@pytest.mark.parametrize("layout", ["torchtitan", "olmo_core", "accelerate"])
def test_another_trainers_folder_loads_model_optimizer_and_extra(sess, tmp_path, layout):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import _flatten_optim_state_dict

    import fsdp_nb
    from fsdp_nb.checkpoints.checkpoint_view import label
    from fsdp_nb.formats.listing import list_checkpoints

    msd, osd = _trained()
    folder = tmp_path / layout
    if layout == "torchtitan":  # the model's own keys, the optimizer flat, the trainer's states
        dcp.save({**msd, "optimizer": _flatten_optim_state_dict(osd),
                  "train_state": {"step": 7, "ntokens_seen": 384}}, checkpoint_id=str(folder / "step-7"))
        folder = folder / "step-7"
        want_extra, want_step = {"train_state": {"step": 7, "ntokens_seen": 384}}, 7
    elif layout == "olmo_core":  # the shards in model_and_optim/, the trainer's state beside
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder / "model_and_optim"))
        (folder / "train").mkdir()
        torch.save({"global_step": 3, "tokens_seen": 384}, folder / "train" / "rank0.pt")
        want_extra, want_step = {"global_step": 3, "tokens_seen": 384}, 3
    else:  # Accelerate's save_state with a sharded FSDP state dict
        dcp.save({"model": msd}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"))
        dcp.save({"optimizer": osd}, checkpoint_id=str(folder / "optimizer_0"))
        torch.save({"last_epoch": 4, "base_lrs": [0.01]}, folder / "scheduler.bin")
        torch.save({"numpy": "state"}, folder / "random_states_0.pkl")  # per process: not restored
        want_extra, want_step = {"scheduler": {"last_epoch": 4, "base_lrs": [0.01]}}, None
    info = fsdp_nb.inspect(str(folder))  # offline, one process
    assert info.valid and info.source == "dcp" and info.layout == layout and info.has_optimizer
    assert info.extra == want_extra and f"model.{Q}" in info.tensors and f"optim.state.{Q}.exp_avg" in info.tensors
    listed = list_checkpoints(str(folder.parent))  # what the checkpoint browser lists
    assert [(i.name, i.step) for i in listed] == [(folder.name, want_step)]
    assert f"sharded ({layout})" in label(listed[0])
    _wrap_trained(sess, "trainer")
    try:
        assert sess.load(str(folder), "trainer", optimizer="trainer_opt") == want_extra
        _same_as(sess, "trainer", msd, osd["state"][Q]["exp_avg"])
    finally:
        sess.execute("del trainer, trainer_opt, b")


def test_a_folder_whose_keys_name_nothing_of_the_model_is_refused_with_what_it_holds(sess, tmp_path):
    import torch.distributed.checkpoint as dcp

    import fsdp_nb

    dcp.save({"encoder": {"blocks.0.w": torch.zeros(2)}, "head": torch.zeros(3)}, checkpoint_id=str(tmp_path / "ck"))
    _wrap_trained(sess, "nomap")
    before = sess.models["nomap"].state_dict()
    try:
        with pytest.raises(fsdp_nb.CheckpointError, match=r"(?s)cannot map its layout.*encoder\.blocks\.0\.w.*head"):
            sess.load(str(tmp_path / "ck"), "nomap")
        for k, v in sess.models["nomap"].state_dict().items():
            torch.testing.assert_close(v, before[k])
    finally:
        sess.execute("del nomap, nomap_opt, b")


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


def test_a_plain_save_of_a_hugging_face_model_exports_whole(tmp_path):
    """``dcp.save(model.state_dict())`` of a causal LM: its own names start with
    ``model.`` and ``lm_head`` is beside them. The export keeps every tensor under its
    own name, and ``from_pretrained`` reads it back (offline, no engines)."""
    import torch.distributed.checkpoint as dcp

    import fsdp_nb

    msd, _ = _trained()
    dcp.save(msd, checkpoint_id=str(tmp_path / "ck"))
    fsdp_nb.export_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"))
    _config().save_pretrained(tmp_path / "hf")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(back) == set(msd)
    for k, v in msd.items():
        torch.testing.assert_close(back[k], v)
