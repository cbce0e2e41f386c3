"""The transformer and training loop of benchmarks/gpu.py, the same on both sides.

fsdp_nb wraps ``GPT`` with ``sess.wrap`` and runs ``train`` from a ``%%px``-style
``sess.execute``; the torchrun worker shards the same class with the same FSDP2
options and calls the same ``train``: the only difference measured is how the ranks
are driven.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    """Pre-norm attention (scaled_dot_product_attention) and MLP."""

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
    def __init__(self, vocab: int = 32000, dim: int = 1024, layers: int = 24, heads: int = 16):
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


SIZES = {
    # name: GPT kwargs, batch, seq
    "cuda": (dict(vocab=32000, dim=1024, layers=24, heads=16), 8, 1024),  # ~336M parameters
    "cpu": (dict(vocab=2048, dim=128, layers=2, heads=4), 4, 64),
}


def params(kwargs: dict) -> int:
    d, L, v = kwargs["dim"], kwargs["layers"], kwargs["vocab"]
    return 2 * v * d + L * (12 * d * d + 4 * d) + 2 * d


def train(model, opt, steps: int, warmup: int, batch: int, seq: int, vocab: int) -> tuple[float, float]:
    """``warmup`` + ``steps`` steps on random tokens; (seconds, tokens per second per rank)."""
    device = next(model.parameters()).device
    if device.type == "meta":  # pragma: no cover - never after wrap
        raise RuntimeError("model not materialised")
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else device
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(dev)
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    dt = time.perf_counter() - t0
    return dt, steps * batch * seq / dt


def shard_like_fsdp_nb(model, mesh, mixed_precision: bool):
    """What ``sess.wrap(GPT, auto_wrap={Block}, mixed_precision="bf16-mixed")`` does,
    with plain FSDP2 calls (torchrun's side)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model

