"""Session benchmarks, side by side with torchrun in one run.

- time to a ready session (engines up, process group formed) vs torchrun's time from
  launch to its first collective, same N;
- empty-cell round trip (``sess.execute("pass")``) p50 / p99 for N = 2 and 4, next to
  ipyparallel's own ``view.execute`` on the same engines;
- training throughput of the same FSDP2 loop (benchmarks/_train_loop.py) in a session
  cell vs under torchrun (ratio; target >= 0.98).

    python benchmarks/session.py [--sizes 2 4] [--repeats 200] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"


def torchrun(n: int, mode: str, extra: list[str]) -> dict:
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
         str(HERE / "_torchrun_worker.py"), mode, out, *extra],
        check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    res = json.loads(Path(out).read_text())
    res["to_first_collective_s"] = res["first_collective_unix"] - t0
    os.unlink(out)
    return res


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def bench_size(n: int, repeats: int, steps: int) -> dict:
    import fsdp_nb

    t0 = time.perf_counter()
    sess = fsdp_nb.Session(n, backend="gloo", activate=False)
    ready = time.perf_counter() - t0
    try:
        sess.dispatcher.echo = False
        rt, raw = [], []
        view = sess.view()
        for _ in range(repeats):
            t = time.perf_counter()
            sess.execute("pass")
            rt.append(time.perf_counter() - t)
            t = time.perf_counter()
            view.execute("pass", block=True)
            raw.append(time.perf_counter() - t)
        sess.execute((HERE / "_train_loop.py").read_text())
        train = sess.run(lambda s: bench_train(s), steps)  # noqa: F821 - defined on engines
    finally:
        sess.shutdown()
    tr_start = torchrun(n, "start", [])
    tr_train = torchrun(n, "train", [str(steps)])
    nb_tps = statistics.mean(t[1] for t in train)
    return {
        "n": n,
        "session_ready_s": ready,
        "torchrun_first_collective_s": tr_start["to_first_collective_s"],
        "execute_p50_ms": percentile(rt, 50) * 1e3,
        "execute_p99_ms": percentile(rt, 99) * 1e3,
        "ipyparallel_execute_p50_ms": percentile(raw, 50) * 1e3,
        "ipyparallel_execute_p99_ms": percentile(raw, 99) * 1e3,
        "session_tokens_per_s_per_rank": nb_tps,
        "torchrun_tokens_per_s_per_rank": tr_train["tokens_per_s"],
        "throughput_ratio": nb_tps / tr_train["tokens_per_s"],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    rows = [bench_size(n, a.repeats, a.steps) for n in a.sizes]
    hdr = ("N", "ready s", "torchrun s", "exec p50 ms", "exec p99 ms", "ipp p50 ms",
           "tok/s nb", "tok/s torchrun", "ratio")
    print(" | ".join(hdr))
    for r in rows:
        print(" | ".join([
            str(r["n"]), f"{r['session_ready_s']:.2f}", f"{r['torchrun_first_collective_s']:.2f}",
            f"{r['execute_p50_ms']:.2f}", f"{r['execute_p99_ms']:.2f}",
            f"{r['ipyparallel_execute_p50_ms']:.2f}",
            f"{r['session_tokens_per_s_per_rank']:.0f}", f"{r['torchrun_tokens_per_s_per_rank']:.0f}",
            f"{r['throughput_ratio']:.3f}",
        ]))
    OUT.mkdir(exist_ok=True)
    (OUT / "session.json").write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
