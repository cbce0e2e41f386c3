"""torchrun side of benchmarks/session.py: first collective time, then the training loop."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

mode, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
first_collective = time.time()
result = {"first_collective_unix": first_collective}
if mode == "train":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _train_loop import bench_train

    result["train_s"], result["tokens_per_s"] = bench_train(*map(int, sys.argv[3:]))
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f)
dist.destroy_process_group()
