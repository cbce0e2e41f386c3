"""Autosave's cost to training: the same FSDP2 loop with ``sess.autosave`` off and on.

One 2-rank gloo session trains benchmarks/_train_loop.py's ``Block`` stack in alternating
rounds: autosave off, on (every ``--every`` optimizer steps, the model, AdamW and a
scheduler, async, keeping the last 2), off, on, ... so machine noise hits both sides.
Two numbers per round with autosave on:

- **blocked**: the seconds training was held by the saves (their call at the iteration
  boundary, and the next steps' waits for the staging copy), as each rank counts them,
  over the seconds of the steps the round spans: the issue's target is at most 2 %;
- **slowdown**: the round's time against the median of the rounds without autosave, which
  also holds what the background write takes from the training's cores (on 2 cores with
  2 ranks the write has no core of its own).

Prints a table and writes benchmarks/out/autosave.json.
Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/autosave.py [--rounds 4 --steps 40 --every 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="fsdp_nb_bench_"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

LOOP = """
import time
import torch
import torch.distributed as dist

def ab_setup():
    global ab_opt, ab_sched, ab_x
    ab_opt = torch.optim.AdamW(ab_model.parameters(), lr=1e-4)
    ab_sched = torch.optim.lr_scheduler.StepLR(ab_opt, 100)
    ab_x = torch.randn(ab_batch, ab_seq, ab_dim)

def ab_train(steps):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        ab_model(ab_x).square().mean().backward()
        ab_opt.step()
        ab_opt.zero_grad()
        ab_sched.step()
    dist.barrier()
    return time.perf_counter() - t0
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=4, help="rounds per side (alternating)")
    ap.add_argument("--steps", type=int, default=40, help="training steps per round")
    ap.add_argument("--every", type=int, default=10, help="autosave every this many steps")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dir", default=None, help="folder on the disk to save to (default: a temp dir)")
    args = ap.parse_args()

    import torch
    from _train_loop import Block
    from torch import nn

    import fsdp_nb
    from fsdp_nb.checkpoints.rank_async_saves import drain

    folder = tempfile.mkdtemp(prefix="fsdp_nb_autosave_", dir=args.dir)
    sess = fsdp_nb.Session(2, backend="gloo")
    try:
        sess.push({"ab_dim": args.dim, "ab_batch": args.batch, "ab_seq": args.seq})
        model = sess.wrap(nn.Sequential, *[Block(args.dim) for _ in range(args.layers)], name="ab_model",
                          auto_wrap={Block})
        sess.execute(LOOP + "\nab_setup()\n")
        nbytes = 3 * model.num_params * 4  # the weights and AdamW's two moments, fp32
        sess.execute("ab_train(3)")  # warm up: allocations, the first collectives
        off: list[float] = []
        on: list[dict] = []
        for r in range(args.rounds):
            off.append(max(sess.run(lambda n: ab_train(n), args.steps)))  # noqa: F821 - an engine global
            root = os.path.join(folder, f"round{r}")
            sess.autosave(root, every=args.every, model=model, optimizer="ab_opt", state=["ab_sched"], keep_last=2)
            span = max(sess.run(lambda n: ab_train(n), args.steps))  # noqa: F821
            ranks = sess.autosave().ranks
            sess.stop_autosave()
            sess.run(drain)  # the last save's write finishes before the next round
            blocked = max(s.blocked_s for s in ranks if s is not None)
            on.append({"span_s": span, "blocked_s": blocked, "saves": args.steps // args.every})
            shutil.rmtree(root, ignore_errors=True)
        base = statistics.median(off)
        res = {
            "ranks": 2, "steps": args.steps, "every": args.every, "state_bytes": nbytes,
            "step_s": base / args.steps,
            "off_round_s": off,
            "on": on,
            "blocked_fraction": statistics.median(o["blocked_s"] / o["span_s"] for o in on),
            "slowdown": statistics.median(o["span_s"] for o in on) / base - 1,
            "torch": torch.__version__,
        }
    finally:
        sess.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "autosave.json").write_text(json.dumps(res, indent=1))
    print(f"{'round':>5} {'off s':>7} {'on s':>7} {'blocked s':>9} {'blocked %':>9}")
    for i, (a, b) in enumerate(zip(off, on)):
        print(f"{i:>5} {a:>7.2f} {b['span_s']:>7.2f} {b['blocked_s']:>9.3f} {100 * b['blocked_s'] / b['span_s']:>8.2f}%")
    print(f"autosave of {nbytes / 2**20:.0f} MiB every {args.every} steps ({res['step_s'] * 1e3:.0f} ms a step): "
          f"training blocked {100 * res['blocked_fraction']:.2f}% of the steps it spans (target <= 2%); "
          f"the rounds took {100 * res['slowdown']:+.1f}% against autosave off (the background write shares "
          "the 2 ranks' cores)")


if __name__ == "__main__":
    main()
