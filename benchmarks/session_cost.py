"""Where a training step's time goes in a session besides training: the same FSDP2 loop
under torchrun and in a session, interleaved, and each engine thread's CPU time.

Rounds alternate: torchrun runs benchmarks/_train_loop.py (2 ranks), then the same
function runs in a 2-rank session's ``execute`` (the ``%%px`` path, output streaming and
hang watch on, as a notebook has them), ``--rounds`` times. Per round, tokens per second
per rank; the ratio is the median of the session's rounds over the median of
torchrun's (a speed ratio: higher is better, 1.0 is torchrun's speed).

In the session's rounds each rank also counts, per thread, the CPU seconds its threads
used while the loop ran (``psutil``): the training thread, the native threads (gloo's
work threads, which torchrun has too), and every thread the session adds (the hang
watch, the engine's message threads). A thread the session adds that takes a share of
the step is where the session costs.

Each round also runs the session's loop again with the step view on (``sess.steps()``:
its hooks, its sampling thread, and the live feed that sends each rank's last steps to
the notebook once a second), beside the round with it off: its cost as a speed ratio
(on / off), and the sampling and feed threads' shares of the wall time.

Prints a table and writes benchmarks/out/session_cost.json.
Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/session_cost.py [--rounds 3 --steps 150]
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
sys.path.insert(0, str(HERE))
os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="fsdp_nb_bench_"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

SIZE = ("3", "128", "4", "8", "32")
"""bench_train's warmup, dim, layers, batch, seq: a small model, so per-step costs show."""

COUNT = """
import psutil, threading, time

def thread_cpu():
    names = {{t.native_id: t.name for t in threading.enumerate()}}
    return {{th.id: (names.get(th.id, "native"), th.user_time + th.system_time) for th in psutil.Process().threads()}}

def counted_train(steps):
    a = thread_cpu()
    out = bench_train(steps, {size})
    b = thread_cpu()
    use = {{}}
    for k, (name, t) in b.items():
        kind = "training thread" if name == "MainThread" else name if not name.startswith("Thread-") else "engine threads"
        use[kind] = use.get(kind, 0.0) + t - a.get(k, ("", 0.0))[1]
    return out, use
"""


def _stop_view() -> None:
    from fsdp_nb.steps import rank_step_timing as step_timing

    step_timing.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    a = p.parse_args()

    from session import torchrun

    import fsdp_nb

    sess = fsdp_nb.Session(2, backend="gloo", activate=False)
    res: dict = {"rounds": a.rounds, "steps": a.steps, "size": SIZE, "session": [], "torchrun": [], "threads": []}
    try:
        sess.execute((HERE / "_train_loop.py").read_text())
        sess.execute(COUNT.format(size=", ".join(SIZE)))
        sess.execute("counted_train(5)")
        res["view_on"] = []
        for _ in range(a.rounds):
            res["torchrun"].append(torchrun(2, "train", [str(a.steps), *SIZE])["tokens_per_s"])
            sess.execute(f"bench_out = counted_train({a.steps})")
            got = sess.pull("bench_out")
            res["session"].append(statistics.mean(out[1] for out, _ in got))
            res["threads"].append([{**use, "wall_s": out[0]} for out, use in got])
            view = sess.steps(window=20)  # the step view on: hooks, sampling thread, live feed
            sess.execute(f"bench_out = counted_train({a.steps})")
            got = sess.pull("bench_out")
            res["view_on"].append(statistics.mean(out[1] for out, _ in got))
            res["view_updates"] = res.get("view_updates", 0) + view.view.updated
            res["threads"][-1] = [{**old, "step sampler (view on)": use.get("fsdp_nb-step-sampler", 0.0),
                                   "step feed (view on)": sum(v for k, v in use.items()
                                                              if k.startswith("fsdp_nb-steps-sampler"))}
                                  for old, (_, use) in zip(res["threads"][-1], got)]
            view.close()
            sess.run(_stop_view)
    finally:
        sess.shutdown()
    res["ratio"] = statistics.median(res["session"]) / statistics.median(res["torchrun"])
    res["view_ratio"] = statistics.median(res["view_on"]) / statistics.median(res["session"])
    print(f"tokens/s per rank, session {[round(x) for x in res['session']]} vs torchrun "
          f"{[round(x) for x in res['torchrun']]}: session / torchrun = {res['ratio']:.3f}")
    print(f"with sess.steps() on {[round(x) for x in res['view_on']]}: view on / off = {res['view_ratio']:.3f} "
          f"(the live view redrew {res.get('view_updates', 0)} times)")
    kinds = sorted({k for rnd in res["threads"] for rank in rnd for k in rank if k != "wall_s"})
    print(f"{'thread':<28}" + "".join(f"  round {i} (share of wall)" for i in range(a.rounds)))
    for kind in kinds:
        shares = [statistics.mean(rank.get(kind, 0.0) / rank["wall_s"] for rank in rnd) for rnd in res["threads"]]
        print(f"{kind:<28}" + "".join(f"  {s:>24.2%}" for s in shares))
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "session_cost.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
