"""The FSDP2 training loop both sides of the throughput benchmark run, byte for byte.

Executed on fsdp_nb engines (its source sent with ``sess.execute``) and imported by
the torchrun script, so the only difference measured is how the ranks were driven.
Assumes the default process group exists.
"""

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.ff(self.norm(x))


def bench_train(steps=20, warmup=3, dim=256, layers=4, batch=16, seq=64):
    """Train ``steps`` steps after ``warmup``; return (seconds, tokens per second per rank)."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(*[Block(dim) for _ in range(layers)])
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, seq, dim)
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dt = time.perf_counter() - t0
    return dt, steps * batch * seq / dt
