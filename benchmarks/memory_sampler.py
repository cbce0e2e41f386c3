"""Memory sampler overhead: the same FSDP2 training loop with and without sampling.

One 2-rank gloo session runs benchmarks/_train_loop.py's ``bench_train`` in alternating
rounds: sampler off, sampler on (``sess.memory()`` at its default interval, its feed
and widget updating in this process), off, on, ... so machine noise hits both sides.
Also times one ``sample()`` call on the engines: cost per sample / interval is the
sampler's share of a rank's time, independent of noise.

Prints a table and writes benchmarks/out/memory_sampler.json.
Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/memory_sampler.py [--rounds 8 --steps 12]
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


def sample_cost(n: int) -> float:
    """Seconds per ``memory_sample.read()`` call on this engine, as its sampler thread makes
    them (runs on engines)."""
    import time as _t

    from fsdp_nb.memory import rank_memory_kinds as memory_kinds
    from fsdp_nb.memory.rank_memory_sample import read

    read(0, memory_kinds.readings().kept())
    t0 = _t.perf_counter()
    for i in range(n):
        read(0, memory_kinds.readings().kept(), seq=i)
    return (_t.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8, help="rounds per side (alternating)")
    ap.add_argument("--steps", type=int, default=12, help="training steps per round")
    ap.add_argument("--interval", type=float, default=None,
                    help="sampling interval (default: the widget's default)")
    args = ap.parse_args()

    import inspect

    import fsdp_nb
    from fsdp_nb.memory.memory_widget import memory_widget

    interval = args.interval or inspect.signature(memory_widget).parameters["interval"].default
    sess = fsdp_nb.Session(2, backend="gloo", activate=False)
    try:
        sess.execute((HERE / "_train_loop.py").read_text())
        sess.run(lambda: bench_train(steps=3, warmup=1))  # noqa: F821 - defined on engines
        off: list[float] = []
        on: list[float] = []
        samples = 0
        for _ in range(args.rounds):
            for side in ("off", "on"):
                w = memory_widget(sess, interval=interval) if side == "on" else None
                try:
                    dt, _tps = sess.run(lambda s: bench_train(steps=s), args.steps)[0]  # noqa: F821
                finally:
                    if w is not None:
                        samples += sum(len(w.feed.samples(r)) for r in range(sess.world_size))
                        w.close()
                (on if side == "on" else off).append(dt / args.steps)
        d = sess.dispatcher
        cost = max(d.gather(d.apply("sample cost", sample_cost, args=(500,))))
    finally:
        sess.shutdown()

    med_off, med_on = statistics.median(off), statistics.median(on)
    result = {
        "world_size": 2,
        "backend": "gloo",
        "interval_s": interval,
        "rounds_per_side": args.rounds,
        "steps_per_round": args.steps,
        "step_s_off": off,
        "step_s_on": on,
        "median_step_s_off": med_off,
        "median_step_s_on": med_on,
        "overhead_measured_pct": 100.0 * (med_on - med_off) / med_off,
        "sample_cost_us": cost * 1e6,
        "overhead_from_sample_cost_pct": 100.0 * cost / interval,
        "samples_received": samples,
    }
    rows = [
        ("step time, sampler off (median)", f"{med_off * 1e3:.2f} ms"),
        ("step time, sampler on  (median)", f"{med_on * 1e3:.2f} ms"),
        ("overhead, measured", f"{result['overhead_measured_pct']:+.2f} %"),
        ("one sample() on an engine", f"{result['sample_cost_us']:.1f} us"),
        (f"sample cost / interval ({interval:g} s)", f"{result['overhead_from_sample_cost_pct']:.4f} %"),
        ("samples received while on", str(samples)),
    ]
    width = max(len(a) for a, _ in rows)
    print("memory sampler overhead (2 ranks, gloo, FSDP2 loop)")
    for a, b in rows:
        print(f"  {a.ljust(width)}  {b}")
    print("  per-round step ms off:", " ".join(f"{x * 1e3:.1f}" for x in off))
    print("  per-round step ms on: ", " ".join(f"{x * 1e3:.1f}" for x in on))
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "memory_sampler.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'memory_sampler.json'}")


if __name__ == "__main__":
    main()
