"""The in-memory autosave (``sess.autosave(..., in_memory=True)``): what the copies cost a
step, and what a dead engine costs with them against a disk autosave of the same run.

One 4-rank gloo session per model size (``--sizes``: the session-cost loop's small model,
and one of about 100M parameters). For each:

1. **Step time, copies on against off.** Rounds alternate: train ``--steps`` steps with no
   autosave, then with ``autosave(in_memory=True)`` (copies after every step), ... The
   ratio is a speed ratio: the median round without copies over the median with them
   (1.0: free; the goal is at least 0.98).
2. **Recovery.** Autosave to disk every ``N`` steps and into memory; train ``N`` steps
   (the disk save of step N is written and committed), then ``N // 2`` more. Rank 1 is
   killed (SIGKILL, through the session's verified handle), and ``restart(restore=
   "latest", setup=...)`` takes the state from memory. Then, from the same run, rank 1
   is killed again and ``restart(restore=<the disk autosave of step N>)`` reads it with
   the page cache dropped (cold, as ``checkpoint_io.py`` reads). Each is split into its
   parts: the engine replaced (the kill seen, the new engine registered), the group
   formed (the group, the definitions and wraps replayed, the features told, setup
   run), the state moved (from memory, or loaded from disk), the autosave armed again,
   and the first step after. The state-moving ratio is memory's over the disk's (goal at
   most 0.3); the whole, memory's over the disk's (goal no more than 1.0).
3. **Steps lost**: the steps trained before the kill, less the step restored.

Prints a table and writes benchmarks/out/memory_copies.json.
Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/memory_copies.py [--sizes small,100m --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="fsdp_nb_bench_"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

SIZES = {
    # name: (dim, layers, batch, seq, steps per round, disk every N)
    "small": (128, 4, 8, 32, 40, 8),  # the session-cost loop's model
    "100m": (1024, 12, 1, 8, 4, 2),   # about 100M parameters: 1.2 GB of fp32 weights and AdamW moments
}

LOOP = """
import time
import torch
import torch.distributed as dist

class McBatches:
    '''A loader of its own class: a position, saved and restored.'''
    def __init__(self):
        self.pos = 0
    def next(self):
        self.pos += 1
        g = torch.Generator().manual_seed(self.pos * 97 + rank)
        return torch.randn(mc_batch, mc_seq, mc_dim, generator=g)
    def state_dict(self):
        return {"pos": self.pos}
    def load_state_dict(self, state):
        self.pos = state["pos"]

def mc_setup():
    global mc_opt, mc_sched, mc_batches, mc_dim, mc_batch, mc_seq
    mc_dim, mc_batch, mc_seq = {dim}, {batch}, {seq}  # in the function: a new engine gets them with it
    mc_opt = torch.optim.AdamW(mc_model.parameters(), lr=1e-4)
    mc_sched = torch.optim.lr_scheduler.StepLR(mc_opt, 100)
    mc_batches = McBatches()

def mc_train(steps):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        mc_model(mc_batches.next()).square().mean().backward()
        mc_opt.step()
        mc_opt.zero_grad()
        mc_sched.step()
    dist.barrier()
    return time.perf_counter() - t0
"""


def _setup() -> None:
    """``restart(setup=)``: the run's objects on every rank."""
    mc_setup()  # noqa: F821 - an engine global (LOOP), replayed on a new engine


def _parts(phases: dict[str, float], moved: str) -> dict[str, float]:
    """A restart's phases folded into the parts the issue names."""
    engine = phases.get("engines replaced", 0.0) + phases.get("health hooks", 0.0)
    group = sum(phases.get(k, 0.0) for k in ("group re-formed", "definitions replayed", "wraps replayed",
                                             "features re-formed", "setup ran"))
    return {"engine replaced": engine, "group formed": group, "state moved": phases.get(moved, 0.0),
            "autosave armed again": phases.get("autosave armed again", 0.0)}


def _kill_and_restart(sess, restore: str, moved: str, cold: bool) -> dict:
    from checkpoint_io import drop_caches

    from fsdp_nb.runtime.cluster import wait_until

    wait_until(lambda: sess.cluster.standby is None or sess.cluster.standby.waiting(), 120)  # a fair start
    if cold:
        drop_caches()
    t0 = time.perf_counter()
    sess.cluster.signal([1], signal.SIGKILL)
    assert wait_until(lambda: 1 in sess.cluster.dead_ranks(), 60)
    seen = time.perf_counter() - t0
    report = sess.restart(restore=restore, setup=_setup)
    parts = _parts(sess.restart_phases, moved)
    parts["engine replaced"] += seen
    t1 = time.perf_counter()
    sess.execute("mc_train(1)")
    parts["first step"] = time.perf_counter() - t1
    return {"parts": parts, "total_s": time.perf_counter() - t0, "step": report.restored.step,
            "from_memory": report.restored.memory is not None, "report": report.line()}


def bench(size: str, rounds: int, folder: str) -> dict:
    from _train_loop import Block
    from torch import nn

    import fsdp_nb
    from fsdp_nb.checkpoints.rank_async_saves import drain

    dim, layers, batch, seq, steps, every = SIZES[size]
    sess = fsdp_nb.Session(4, backend="gloo")
    try:
        model = sess.wrap(nn.Sequential, *[Block(dim) for _ in range(layers)], name="mc_model", auto_wrap={Block})
        sess.execute(LOOP.replace("{dim}", str(dim)).replace("{batch}", str(batch)).replace("{seq}", str(seq))
                     + "\nmc_setup()\nmc_train(2)\n")  # warm up: allocations, the first collectives
        arm = {"model": model, "optimizer": "mc_opt", "loaders": ["mc_batches"], "state": ["mc_sched"],
               "in_memory": True}
        off: list[float] = []
        on: list[float] = []
        blocked: list[float] = []
        for _ in range(rounds):
            off.append(max(sess.run(lambda n: mc_train(n), steps)))  # noqa: F821 - an engine global
            sess.autosave(**arm)
            on.append(max(sess.run(lambda n: mc_train(n), steps)))  # noqa: F821
            said = sess.autosave()
            blocked.append(max(r.blocked_s for r in said.ranks if r is not None))
            held = max(r.copies.bytes for r in said.ranks if r is not None and r.copies is not None)
            sess.stop_autosave()
        root = os.path.join(folder, size)
        sess.autosave(root, every=every, keep_last=2, **arm)
        sess.execute(f"mc_train({every})")  # the disk save of step N, written at the cell's end
        sess.run(drain)  # ... and committed
        sess.execute(f"mc_train({every // 2 or 1})")
        trained = every + (every // 2 or 1)
        memory = _kill_and_restart(sess, "latest", "state moved from memory", cold=False)
        disk = _kill_and_restart(sess, os.path.join(root, f"step-{every}"), "checkpoint loaded", cold=True)
        sess.stop_autosave()
        res = {
            "size": size, "params": model.num_params, "ranks": 4, "steps": steps, "every": every,
            "state_bytes_per_rank": 3 * model.num_params * 4 // 4, "copies_bytes_per_rank": held,
            "off_round_s": off, "on_round_s": on, "blocked_s": blocked,
            "step_ratio": statistics.median(off) / statistics.median(on),
            "memory": memory, "disk": disk,
            "moved_ratio": memory["parts"]["state moved"] / max(disk["parts"]["state moved"], 1e-9),
            "whole_ratio": memory["total_s"] / disk["total_s"],
            "steps_lost": {"memory": trained - memory["step"], "disk": trained - disk["step"]},
        }
    finally:
        sess.shutdown()
    return res


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="small,100m", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--rounds", type=int, default=3, help="step-time rounds per side (alternating)")
    ap.add_argument("--dir", default=None, help="folder on the disk for the disk autosave (default: a temp dir)")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="fsdp_nb_memory_copies_", dir=args.dir)
    try:
        rows = [bench(s, args.rounds, folder) for s in args.sizes.split(",")]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out = HERE / "out"
    out.mkdir(mode=0o700, exist_ok=True)  # this user's, as everything fsdp_nb writes: the folder 0700, the file 0600
    from fsdp_nb.engine.private_files import private_file

    with os.fdopen(private_file(str(out / "memory_copies.json")), "w") as f:
        f.write(json.dumps({"runs": rows, "torch": torch.__version__}, indent=1))
    for r in rows:
        print(f"\n{r['size']}: {r['params'] / 1e6:.0f}M parameters on 4 ranks, copies {r['copies_bytes_per_rank'] / 2**20:.0f}"
              f" MiB per rank; step speed with copies / without: {r['step_ratio']:.3f} (goal >= 0.98; "
              f"{statistics.median(r['off_round_s']) / r['steps'] * 1e3:.0f} ms a step without)")
        print(f"  {'part':<22} {'memory s':>9} {'disk s':>9}")
        for part in r["memory"]["parts"]:
            print(f"  {part:<22} {r['memory']['parts'][part]:>9.2f} {r['disk']['parts'][part]:>9.2f}")
        print(f"  {'whole':<22} {r['memory']['total_s']:>9.2f} {r['disk']['total_s']:>9.2f}")
        print(f"  state moved, memory / disk: {r['moved_ratio']:.3f} (goal <= 0.3); whole: {r['whole_ratio']:.3f} "
              f"(goal <= 1.0); steps lost: memory {r['steps_lost']['memory']}, disk {r['steps_lost']['disk']} "
              f"(memory restored {'from memory' if r['memory']['from_memory'] else 'NOT from memory'})")


if __name__ == "__main__":
    main()
