"""What the collective check costs: per collective, and per step of the session-cost loop.

Run: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/collective_check.py [--rounds N] [--steps N]``.
Prints a table and writes benchmarks/out/collective_check.json.

One 2-rank gloo session; rounds alternate the variants, so a busy machine weighs on
each alike.

- per collective: milliseconds per call of a loop of ``all_reduce`` (float32[1024] and
  float32[1M]), ``all_gather_into_tensor`` (float32[1024] per rank) and ``barrier`` on
  the default group: with the check off (the cell not armed), on
  (``check_collectives=True``: each call first compares op, shapes and dtypes with the
  group's other ranks over the default TCP store), and on a group torch wraps itself
  (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` when the group is made: its ``ProcessGroupWrapper``
  checks each collective with a gloo side group). The added milliseconds are host time:
  on a GPU, where an NCCL all_reduce of 4 KiB takes tens of microseconds, the check
  costs the same milliseconds, which gloo's own 2-rank latency hides here.
- per step: the session-cost loop (benchmarks/_train_loop.py, FSDP2, the model of
  benchmarks/session_cost.py) with the check off and on, tokens/s per rank, the
  ratio on / off (1.0: free). FSDP2's all-gathers and reduce-scatters are checked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="fsdp_nb_bench_"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

SIZE = ("3", "128", "4", "8", "32")
"""bench_train's warmup, dim, layers, batch, seq: benchmarks/session_cost.py's model."""

CALLS = """
import os, time, torch, torch.distributed as dist

os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # only for the group made now
dist.set_debug_level_from_env()
detail_group = dist.new_group(list(range(dist.get_world_size())))
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "OFF"
dist.set_debug_level_from_env()

def per_call(kind, n, group=None):
    '''Seconds per call of ``n`` collectives of ``kind`` on ``group``.'''
    small, big = torch.ones(1024), torch.ones(1 << 20)
    gathered = torch.empty(1024 * dist.get_world_size())
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer torch's name
    call = {"all_reduce 4 KiB": lambda: dist.all_reduce(small, group=group),
            "all_reduce 4 MiB": lambda: dist.all_reduce(big, group=group),
            "all_gather 4 KiB": lambda: all_gather(gathered, small, group=group),
            "barrier": lambda: dist.barrier(group=group)}[kind]
    call()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n
"""

KINDS = {"all_reduce 4 KiB": 300, "all_reduce 4 MiB": 20, "all_gather 4 KiB": 300, "barrier": 300}
"""Each collective measured, and how many calls a round makes of it."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--calls", type=float, default=1.0, help="scale the calls per round (smoke runs: 0.1)")
    a = p.parse_args()

    import fsdp_nb

    variants = ("off", "check", "torch DETAIL")
    res: dict = {"rounds": a.rounds, "steps": a.steps, "size": SIZE,
                 "per_call_ms": {k: {v: [] for v in variants} for k in KINDS}, "step": {"off": [], "check": []}}
    sess = fsdp_nb.Session(2, backend="gloo", activate=False)
    try:
        sess.execute(CALLS)
        sess.execute((HERE / "_train_loop.py").read_text())
        sess.execute(f"bench_train(3, {', '.join(SIZE)})")
        for r in range(a.rounds):
            for kind, n in KINDS.items():
                n = max(2, int(n * a.calls))
                order = variants if r % 2 == 0 else variants[::-1]
                for v in order:
                    group = "detail_group" if v == "torch DETAIL" else "None"
                    sess.execute(f"cc_took = per_call({kind!r}, {n}, {group})", check_collectives=v == "check")
                    res["per_call_ms"][kind][v].append(1000 * max(sess.pull("cc_took")))
            for v in (("off", "check") if r % 2 == 0 else ("check", "off")):
                sess.execute(f"cc_step = bench_train({a.steps}, {', '.join(SIZE)})", check_collectives=v == "check")
                res["step"][v].append(statistics.mean(out[1] for out in sess.pull("cc_step")))
    finally:
        sess.shutdown()
    med = {k: {v: statistics.median(xs) for v, xs in by.items()} for k, by in res["per_call_ms"].items()}
    res["median_ms"] = med
    res["step_ratio"] = statistics.median(res["step"]["check"]) / statistics.median(res["step"]["off"])
    print(f"{'ms per collective (2 ranks, gloo)':<36}{'off':>8}{'check':>8}{'added':>8}{'torch DETAIL':>14}")
    for kind, m in med.items():
        print(f"{kind:<36}{m['off']:>8.3f}{m['check']:>8.3f}{m['check'] - m['off']:>8.3f}{m['torch DETAIL']:>14.3f}")
    print(f"training step (session-cost loop): tokens/s per rank off {[round(x) for x in res['step']['off']]}, "
          f"check {[round(x) for x in res['step']['check']]}: check / off = {res['step_ratio']:.3f}")
    from fsdp_nb.engine.private_files import private_file, private_folder

    out = private_folder(str(HERE / "out"))  # this user's, as everything fsdp_nb writes: 0700, the file 0600
    with os.fdopen(private_file(os.path.join(out, "collective_check.json")), "w") as f:
        f.write(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
