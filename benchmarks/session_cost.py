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

Last, in this process and with no engines: what the step owner's hooks cost a step on
their own. A model ``sess.wrap`` builds is watched by its rank's step owner (a forward
pre-hook on the model, optimizer pre- and post-step hooks for every optimizer, and
IPython's cell events), whether or not a feature listens. A one-layer model's forward,
backward and SGD step (``--micro-steps`` of them, about 0.1 ms each) run in blocks that
alternate between an owner watching it and none, in ABBA order so that a drift falls on
both; the difference of the medians, in microseconds a step, is what every wrapped
model's step pays for the model's forward pre-hook and the optimizer hooks (this process
runs no IPython, so the cell events are not among them: they run once a cell).

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


def owner_hooks_cost(steps: int, blocks: int = 11) -> dict[str, float]:
    """Seconds a step of a tiny model takes with a step owner watching it and without,
    the medians of ``blocks`` alternating blocks of ``steps`` steps each (see the
    module docstring)."""
    import time

    import torch

    from fsdp_nb.engine.step import StepOwner

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)

    def block() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - t0) / steps

    def watched_block() -> float:
        owner = StepOwner()
        owner.watch(model)  # as sess.wrap does on a rank: the model's pre-hook, the optimizer hooks
        try:
            return block()
        finally:
            owner.closed()  # every hook out again

    block()  # warm up
    plain: list[float] = []
    watched: list[float] = []
    for i in range(blocks):  # ABBA: plain, watched, watched, plain, ...
        first, second = (block, watched_block) if i % 2 == 0 else (watched_block, block)
        for run in (first, second):
            (plain if run is block else watched).append(run())
    return {"plain_s": statistics.median(plain), "watched_s": statistics.median(watched)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--micro-steps", type=int, default=2000)
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
    res["owner_hooks"] = hooks = owner_hooks_cost(a.micro_steps)
    extra = hooks["watched_s"] - hooks["plain_s"]
    step_s = int(SIZE[3]) * int(SIZE[4]) / statistics.median(res["session"])  # batch x seq tokens a step
    print(f"a tiny model's step: {hooks['plain_s'] * 1e6:.1f} us plain, {hooks['watched_s'] * 1e6:.1f} us watched "
          f"by a step owner: {extra * 1e6:+.1f} us a step, {extra / step_s:.3%} of the session's step above")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "session_cost.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
