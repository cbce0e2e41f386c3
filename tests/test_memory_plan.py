"""A plan against the same step measured on real engines: a GPT and a Hugging Face Llama
built from a local config, on 2 and 4 ranks. The plan's peak must be within 10% of the
measured one on every rank, and the measured step must show in the processes' resident
memory (the tracker counts tensors; the kernel sees the pages)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fsdp_nb.engine.wrap import forget_all

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 3, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _llama_config():
    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2)


def _ids():
    return torch.randint(0, 512, (8, 128))


CASES = {
    "gpt": (GPT, (), {"auto_wrap": {Block}}, lambda: _ids()),
    "llama": (LlamaForCausalLM, (_llama_config(),), {}, lambda: {"input_ids": (ids := _ids()), "labels": ids}),
}


@pytest.fixture(scope="module")
def four(session_factory):
    return session_factory(4)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_is_within_ten_percent_of_the_measured_step(sess, four, n, case):
    s = sess if n == 2 else four
    cls, args, options, make_batch = CASES[case]
    batch = make_batch()
    plan = s.plan(cls, *args, batch=batch, optimizer=torch.optim.AdamW, **options)
    model = s.wrap(cls, *args, name="planned", **options)
    try:
        measured = model.measure_memory(batch, optimizer=torch.optim.AdamW)
    finally:  # dropped on the ranks and the session: a restart must not rebuild it
        s.run(forget_all, ("planned",))
        s.context.wraps.pop("planned", None)
        s.context.models.pop("planned", None)
    assert plan.world_size == measured.world_size == n and not plan.measured and measured.measured
    assert plan.fits and plan.budget == measured.budget
    for p, m in zip(plan.ranks, measured.ranks):
        assert abs(p.peak - m.peak) <= 0.10 * m.peak, (case, n, p, m)
        assert p.optimizer == m.optimizer and p.parameters > 0 and p.activations > 0
        # what the step made beyond what existed before it shows in the resident memory
        made = m.activations + m.optimizer
        assert m.resident_growth is not None and m.resident_growth >= 0.8 * made, (m.resident_growth, made)


def test_a_plan_names_the_session_budget_and_what_the_cpu_plan_leaves_out(sess):
    plan = sess.plan(GPT, batch=_ids(), auto_wrap={Block}, budget=1 << 20, what_if=[{"batch": 0.25}])
    assert plan.budget == 1 << 20 and plan.fits is False
    assert plan.what_ifs[0].peak < plan.peak
    assert any("process's own memory" in n for n in plan.notes)
    assert sess.context.last_plan is plan
    with pytest.raises(TypeError, match="world_size= and device= are for fsdp_nb.plan"):
        sess.plan(GPT, batch=_ids(), world_size=8)
