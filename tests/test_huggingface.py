"""Hugging Face models on the ranks: built on meta from a local config (no hub),
initialised as transformers does, sharded by their own ``_no_split_modules``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

CASES = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)),
    "gpt2": (GPT2LMHeadModel, lambda: GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)),
    "moe": (MixtralForCausalLM, lambda: MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
}


def _logits(name: str):
    """The wrapped model's logits for engine global ``ids``, in eval mode (no dropout)."""
    import torch

    from fsdp_nb.engine.namespace import user_ns

    ns = user_ns()
    model = ns[name]
    model.eval()
    with torch.no_grad():
        out = model(ns["ids"]).logits
    model.train()
    return out


def _assert_same_logits(sess, name: str, reference, vocab: int, batch: tuple[int, int] = (2, 12)) -> None:
    """The wrapped model ``name`` gives ``reference``'s logits on every rank, same ids."""
    ids = torch.randint(0, vocab, batch)
    sess.push({"ids": ids})
    reference.eval()
    with torch.no_grad():
        expected = reference(ids).logits
    for got in sess.run(_logits, name):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_a_hugging_face_class_is_built_on_meta_and_initialised_as_transformers_does(sess, case):
    cls, config = CASES[case]
    cfg = config()
    model = sess.wrap(cls, cfg, name=f"hf_{case}")
    try:
        block = cls._no_split_modules[0]
        units = [u for u in model.summary.units if u]
        assert len(units) == cfg.num_hidden_layers, units  # one unit per block, by default
        assert block in repr(model)
        full = model.state_dict()
        assert not any(t.isnan().any() for t in full.values())
        reference = cls(cfg)  # transformers' own build, on a real device
        reference.load_state_dict(full, strict=True)  # the same parameters, by name
        weights = [k for k in full if k.endswith("weight") and full[k].dim() == 2]
        for k in weights:  # transformers' normal(0, initializer_range), on each rank's shards
            assert abs(float(full[k].std()) - cfg.initializer_range) < 0.006, k
        norms = [k for k in full if ("norm" in k or "ln_" in k) and k.endswith("weight")]
        assert norms and all(bool((full[k] == 1).all()) for k in norms)
        _assert_same_logits(sess, f"hf_{case}", reference, cfg.vocab_size)  # rotary buffers, shards right
    finally:
        sess.execute(f"del hf_{case}, ids")


def test_tied_embeddings_stay_tied_through_sharding_and_training(sess):
    cls, config = CASES["gpt2"]
    sess.wrap(cls, config(), name="hf_tied")
    try:
        sess.execute(
            "import torch\n"
            "opt = torch.optim.AdamW(hf_tied.parameters(), lr=1e-2)\n"
            "batch = torch.randint(0, 128, (2, 8))\n"
            "hf_tied(batch, labels=batch).loss.backward(); opt.step()\n"
            "tied = hf_tied.lm_head.weight is hf_tied.transformer.wte.weight\n"
            "same = bool((hf_tied.lm_head.weight.full_tensor() == hf_tied.transformer.wte.weight.full_tensor()).all())"
        )
        assert sess.pull("tied") == [True, True] and sess.pull("same") == [True, True]
    finally:
        sess.execute("del hf_tied, opt, batch, tied, same")


def test_an_explicit_auto_wrap_wins_over_the_models_own(sess):
    cls, config = CASES["llama"]
    model = sess.wrap(cls, config(), name="hf_root", auto_wrap=None)
    try:
        assert model.summary.units == ("",)
    finally:
        sess.execute("del hf_root")


@pytest.mark.parametrize("case", ["llama", "gpt2"])
def test_an_export_is_read_by_from_pretrained_with_no_extra_step(sess, tmp_path, case):
    import json

    import fsdp_nb

    cls, config = CASES[case]
    cfg = config()
    sess.wrap(cls, cfg, name=f"hf_out_{case}")
    try:
        sess.save(str(tmp_path / "ck"), f"hf_out_{case}")
        info = fsdp_nb.inspect(str(tmp_path / "ck"))
        assert info.hf_config["architectures"] == [cls.__name__]
        out = tmp_path / "export"
        files = fsdp_nb.export_safetensors(str(tmp_path / "ck"), str(out))
        assert {p.rsplit("/", 1)[1] for p in files} >= {"model.safetensors", "config.json", "generation_config.json"}
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            stored = set(f.keys())
        if cfg.tie_word_embeddings:  # one copy of a tied tensor, as save_pretrained writes
            assert info.tied == {"lm_head.weight": "transformer.wte.weight"} and "lm_head.weight" not in stored
        back = transformers.AutoModelForCausalLM.from_pretrained(str(out))
        assert type(back) is cls and json.loads((out / "config.json").read_text())["model_type"] == cfg.model_type
        _assert_same_logits(sess, f"hf_out_{case}", back, cfg.vocab_size, (1, 10))
        if cfg.tie_word_embeddings:
            assert back.lm_head.weight is back.transformer.wte.weight
    finally:
        sess.execute(f"del hf_out_{case}, ids")


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A Llama built by transformers in this process, written four ways."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    cls, config = CASES["llama"]
    torch.manual_seed(3)
    reference = cls(config()).eval()
    root = tmp_path_factory.mktemp("llama")
    reference.save_pretrained(str(root / "hf"))
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(root / "weights.safetensors"))
    dcp.save(reference.state_dict(), checkpoint_id=str(root / "plain_dcp"))  # its own names, "model." included
    return reference, root


@pytest.mark.parametrize("source", ["hf", "weights.safetensors", "plain_dcp", "fsdp_nb"])
def test_weights_fill_a_model_built_on_meta_from_each_source(sess, saved_llama, source):
    reference, root = saved_llama
    cls, config = CASES["llama"]
    if source == "fsdp_nb":
        sess.wrap(cls, config(), name="hf_src", weights=str(root / "hf"))
        sess.save(str(root / "fsdp_nb"), "hf_src", overwrite=True)
    sess.wrap(cls, config(), name="hf_in", weights=str(root / source))
    try:
        _assert_same_logits(sess, "hf_in", reference, 128)
    finally:
        sess.execute("del hf_in, ids" + (", hf_src" if source == "fsdp_nb" else ""))


def test_weights_of_a_tied_model_from_save_pretrained(sess, tmp_path):
    cls, config = CASES["gpt2"]
    torch.manual_seed(4)
    reference = cls(config()).eval()
    reference.save_pretrained(str(tmp_path / "gpt2"))  # holds no lm_head.weight: it is tied
    sess.wrap(cls, config(), name="hf_tied_in", weights=str(tmp_path / "gpt2"))
    try:
        _assert_same_logits(sess, "hf_tied_in", reference, 128, (1, 9))
        sess.execute("tied = hf_tied_in.lm_head.weight is hf_tied_in.transformer.wte.weight")
        assert sess.pull("tied") == [True, True]
    finally:
        sess.execute("del hf_tied_in, ids, tied")


def test_weights_that_do_not_fit_are_refused_and_leave_nothing_behind(sess, saved_llama, tmp_path):
    import fsdp_nb

    _, root = saved_llama
    cls, config = CASES["llama"]
    bigger = config()
    bigger.num_hidden_layers = 3
    with pytest.raises(fsdp_nb.CheckpointError, match=r"missing keys \(9\): model.layers.2"):
        sess.wrap(cls, bigger, name="hf_bad", weights=str(root / "hf"))
    assert sess.run(lambda: "hf_bad" in __import__("fsdp_nb.models.rank_wrap", fromlist=["wrapped"]).wrapped()) == [False, False]
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        sess.wrap(cls, config(), name="hf_bad", weights=str(tmp_path / "nothing"))
    with pytest.raises(TypeError, match="brings its own weights"):
        sess.wrap(cls(config()), name="hf_bad", weights=str(root / "hf"))


def test_weights_that_carry_code_are_refused_before_any_rank_runs_it(sess, saved_llama, tmp_path):
    import torch.distributed.checkpoint as dcp
    from helpers import RunsCode

    import fsdp_nb

    reference, _ = saved_llama
    ran = tmp_path / "ran"
    poisoned = {**reference.state_dict(), "notes": RunsCode(f"open({str(ran)!r}, 'a').write('ran')")}
    dcp.save(poisoned, checkpoint_id=str(tmp_path / "poisoned"), no_dist=True)
    cls, config = CASES["llama"]
    with pytest.raises(fsdp_nb.UnsafeCheckpointError, match="notes"):
        sess.wrap(cls, config(), name="hf_poisoned", weights=str(tmp_path / "poisoned"))
    assert not ran.exists()  # neither the notebook's check nor any rank unpickled it
    assert sess.run(lambda: "hf_poisoned" in __import__("fsdp_nb.models.rank_wrap", fromlist=["wrapped"]).wrapped()) == [False, False]
