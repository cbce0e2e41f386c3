"""Memory plans: predicted against measured, and what planning costs.

1. **Accuracy.** For a GPT (``_gpt.GPT``) and a Hugging Face Llama built from a local
   config, on 2 and 4 ranks: ``sess.plan`` (fake process group, fake tensors, before
   anything is allocated) against ``measure_memory`` of the same step on the real
   ranks (the same tracker over real tensors), per rank; beside it how far each
   engine's peak resident memory rose over the step (what the kernel saw), and on
   CUDA ``torch.cuda.max_memory_allocated`` with CUDA's own overhead (reserved minus
   allocated) stated, not hidden in the plan.
2. **Cost.** ``fsdp_nb.plan`` of a ~1B-parameter GPT at N = 8 (bf16-mixed, AdamW): the
   seconds it takes and how far this (the notebook's) process's resident memory rose
   while it ran (sampled every 10 ms).

Prints tables and writes ``benchmarks/out/memory_plan.json``.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/memory_plan.py [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpt import GPT, Block  # noqa: E402

import fsdp_nb  # noqa: E402
from fsdp_nb.models.rank_wrap import forget_all

OUT = Path(__file__).resolve().parent / "out"


def _cases(quick: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    dim, layers, seq = (128, 2, 128) if quick else (256, 4, 256)
    ids = torch.randint(0, 2048, (8, seq))
    llama = LlamaConfig(vocab_size=2048, hidden_size=dim, intermediate_size=dim * 11 // 4, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2)
    return {
        "gpt": (GPT, (), dict(vocab=2048, dim=dim, layers=layers, heads=4, auto_wrap={Block}), ids),
        "llama": (LlamaForCausalLM, (llama,), {}, {"input_ids": ids, "labels": ids}),
    }


def accuracy(quick: bool, device: str) -> list[dict]:
    rows = []
    backend = "nccl" if device == "cuda" else "gloo"
    for n in (2, 4):
        if device == "cuda" and torch.cuda.device_count() < n:
            print(f"skipping N={n}: {torch.cuda.device_count()} GPU(s)")
            continue
        with fsdp_nb.Session(n, backend=backend, activate=False) as sess:
            for case, (cls, args, kw, batch) in _cases(quick).items():
                plan = sess.plan(cls, *args, batch=batch, optimizer=torch.optim.AdamW, **kw)
                model = sess.wrap(cls, *args, name="bench_plan", **kw)
                got = model.measure_memory(batch, optimizer=torch.optim.AdamW)
                sess.run(forget_all, ("bench_plan",))
                for p, m in zip(plan.ranks, got.ranks):
                    rows.append(dict(case=case, n=n, rank=p.rank, predicted=p.peak, measured=m.peak,
                                     ratio=p.peak / m.peak, resident_growth=m.resident_growth,
                                     device_peak=m.device_peak, peak_unit=p.peak_unit, phase=p.peak_phase,
                                     plan_seconds=plan.seconds))
    return rows


def cost(quick: bool) -> dict:
    kw = (dict(vocab=32000, dim=1024, layers=8, heads=16) if quick else
          dict(vocab=32000, dim=2048, layers=16, heads=16))
    me = psutil.Process(os.getpid())
    base = me.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], me.memory_info().rss)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    plan = fsdp_nb.plan(GPT, world_size=8, batch=torch.randint(0, 32000, (2, 2048)), optimizer=torch.optim.AdamW,
                        auto_wrap={Block}, mixed_precision="bf16-mixed", **kw)
    seconds = time.perf_counter() - t0
    done.set()
    t.join()
    params = sum(p.numel() for p in GPT(**kw).parameters()) if quick else None
    return dict(model=kw, params=params, world_size=8, seconds=seconds, notebook_rss_growth=peak[0] - base,
                planned_peak=plan.peak, ranks_planned=len(plan.ranks))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = ap.parse_args()
    rows = accuracy(a.quick, a.device)
    print(f"\npredicted vs measured peak per rank ({a.device})")
    print(f"{'case':6} {'N':>2} {'rank':>4} {'predicted MiB':>14} {'measured MiB':>13} {'ratio':>6} "
          f"{'RSS rise MiB':>13} {'peak in':>20}")
    for r in rows:
        rss = f"{r['resident_growth'] / 2**20:13.1f}" if r["resident_growth"] is not None else f"{'-':>13}"
        print(f"{r['case']:6} {r['n']:>2} {r['rank']:>4} {r['predicted'] / 2**20:14.1f} {r['measured'] / 2**20:13.1f} "
              f"{r['ratio']:6.3f} {rss} {(r['peak_unit'] or '(root)') + ' ' + r['phase']:>20}")
    c = cost(a.quick)
    print(f"\nplanning {'a ~1B' if not a.quick else 'a smaller'} GPT at N=8: {c['seconds']:.1f} s, notebook RSS "
          f"+{c['notebook_rss_growth'] / 2**20:.0f} MiB, planned peak {c['planned_peak'] / 2**30:.2f} GiB per rank")
    OUT.mkdir(exist_ok=True)
    (OUT / "memory_plan.json").write_text(json.dumps({"device": a.device, "accuracy": rows, "cost": c}, indent=1))


if __name__ == "__main__":
    main()
