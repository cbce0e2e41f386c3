"""torchrun side of benchmarks/gpu.py: time to the first collective, then the same
transformer, sharded the same way, trained with the same loop."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gpt import GPT, SIZES, shard_like_fsdp_nb, train  # noqa: E402

out, device, steps, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cuda = device == "cuda"
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
t = torch.ones(1, device=dev)
dist.all_reduce(t)
if cuda:
    torch.cuda.synchronize()
result = {"first_collective_unix": time.time()}
kwargs, batch, seq = SIZES[device]
model = shard_like_fsdp_nb(GPT(**kwargs).to(dev), init_device_mesh(device, (dist.get_world_size(),)), True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
result["train_s"], result["tokens_per_s"] = train(model, opt, steps, warmup, batch, seq, kwargs["vocab"])
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f)
dist.destroy_process_group()
