"""Per-rank peak memory while ``sess.wrap`` shards a ~1.6 GB fp32 model on 2 ranks.

Side by side, in one fresh 2-rank gloo session:

- ``class``: ``sess.wrap(Model, ...)`` — meta-device build, sharded, materialized shard by shard;
- ``instance``: ``sess.wrap(Model())`` built in the notebook — rank 0 receives the weights;
- ``string (naive)``: every rank builds the whole model with ``%%px`` (counted), then
  ``sess.wrap("name")`` — what the meta-device path avoids.

Per rank: peak RSS above the rank's baseline while wrapping (a sampling thread on the
engine, every 2 ms), against the bound ``size/N + largest wrapped unit``. On GPU it would
be ``torch.cuda.max_memory_allocated``; this machine has none. Prints a table and writes
``benchmarks/out/wrap_memory.json``.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/wrap_memory.py [--layers 24 --dim 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import fsdp_nb


class Layer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Model(nn.Module):
    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def start_sampler():
    """On an engine: sample this process's RSS every 2 ms in a thread; keep the peak."""
    import threading

    import psutil

    proc = psutil.Process()
    state = {"base": proc.memory_info().rss, "peak": 0, "stop": False}

    def loop():
        while not state["stop"]:
            state["peak"] = max(state["peak"], proc.memory_info().rss)
            time.sleep(0.002)

    t = threading.Thread(target=loop, daemon=True)
    state["thread"] = t
    globals()["_bench_sampler"] = state
    __import__("builtins")._bench_sampler = state
    t.start()
    return state["base"]


def stop_sampler():
    import builtins

    import psutil

    state = builtins._bench_sampler
    state["stop"] = True
    state["thread"].join()
    state["peak"] = max(state["peak"], psutil.Process().memory_info().rss)
    return {"base": state["base"], "peak": state["peak"]}


def rss():
    import psutil

    return psutil.Process().memory_info().rss


def measure(sess, label, do_wrap, size, unit):
    sess.run(lambda: __import__("gc").collect())
    sess.run(start_sampler)
    t0 = time.perf_counter()
    sm = do_wrap()
    secs = time.perf_counter() - t0
    got = sess.run(stop_sampler)
    bound = size / sess.world_size + unit
    rows = []
    for r, g in enumerate(got):
        peak = g["peak"] - g["base"]
        rows.append(
            {
                "mode": label,
                "rank": r,
                "peak_delta_mb": peak / 2**20,
                "bound_mb": bound / 2**20,
                "ratio": peak / bound,
                "within_bound": peak <= bound,
                "local_param_mb": sm.shards().bytes_per_rank()[r] / 2**20,
                "wrap_s": secs,
            }
        )
    sess.execute(f"del {sm.name}\nfrom fsdp_nb.models.rank_wrap import wrapped\nwrapped().pop({sm.name!r})")
    sess.run(lambda: __import__("gc").collect())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--skip-naive", action="store_true")
    a = ap.parse_args()
    dim, layers = a.dim, a.layers
    unit = (dim * dim + dim) * 4
    size = unit * layers
    print(f"model: {layers} x Linear({dim},{dim}) fp32 = {size / 2**30:.2f} GiB, "
          f"largest unit {unit / 2**20:.0f} MiB, 2 ranks")
    rows = []
    with fsdp_nb.Session(2, backend="gloo", activate=False) as sess:
        sess.push({"Model": Model, "Layer": Layer})
        rows += measure(
            sess, "class (meta)", lambda: sess.wrap(Model, dim, layers, name="m",
                                                   auto_wrap={Layer}), size, unit
        )
        holder = [Model(dim, layers)]
        rows += measure(
            sess, "instance", lambda: sess.wrap(holder[0], name="m", auto_wrap={Layer}), size,
            unit,
        )
        holder.clear()
        if not a.skip_naive:
            # baseline taken before every rank builds the whole model: that is the point
            def naive():
                sess.execute(f"raw = Model({dim}, {layers})")
                return sess.wrap("raw", name="m", auto_wrap={Layer})

            rows += measure(sess, "string (naive)", naive, size, unit)
            sess.execute("del raw")
    head = f"{'mode':<16}{'rank':>5}{'peak Δ RSS MiB':>16}{'bound MiB':>11}{'ratio':>7}" \
           f"{'local params MiB':>18}{'wrap s':>8}"
    print(head)
    for r in rows:
        print(f"{r['mode']:<16}{r['rank']:>5}{r['peak_delta_mb']:>16.0f}{r['bound_mb']:>11.0f}"
              f"{r['ratio']:>7.2f}{r['local_param_mb']:>18.0f}{r['wrap_s']:>8.1f}")
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "wrap_memory.json").write_text(
        json.dumps({"dim": dim, "layers": layers, "model_bytes": size, "unit_bytes": unit,
                    "world_size": 2, "omp_threads": os.environ.get("OMP_NUM_THREADS"),
                    "rows": rows}, indent=2)
    )
    print(f"wrote {out / 'wrap_memory.json'}")


if __name__ == "__main__":
    main()
