"""``sess.wrap(LlamaForCausalLM, config, weights=folder)`` against ``from_pretrained``.

A Llama of a few GB (fp32) is written once by transformers' ``save_pretrained``. Then,
side by side:

- ``from_pretrained`` in this one process, every weight then read once (it maps the
  file, so the load alone reads nothing): the time, and the peak RSS above the process's
  baseline (a sampling thread, every 2 ms);
- ``sess.wrap(...)`` with transformers' random init, for scale;
- ``sess.wrap(..., weights=folder)`` on N gloo ranks: the time, and each rank's peak RSS
  above its baseline while it builds on meta, shards and reads the slices it owns,
  against the bound ``1.1 × (size / N + largest tensor)``.

Prints a table and writes ``benchmarks/out/hf_weights.json``.

    OMP_NUM_THREADS=1 python benchmarks/hf_weights.py [--hidden 2048 --layers 8 --ranks 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from wrap_memory import start_sampler, stop_sampler

import fsdp_nb


def _peak_here(fn):
    """(seconds, peak RSS above the start) of ``fn()`` in this process."""
    proc, state = psutil.Process(), {"peak": 0, "stop": False}
    base = proc.memory_info().rss

    def loop():
        while not state["stop"]:
            state["peak"] = max(state["peak"], proc.memory_info().rss)
            time.sleep(0.002)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    t0 = time.perf_counter()
    out = fn()
    secs = time.perf_counter() - t0
    state["stop"] = True
    t.join()
    return secs, max(state["peak"], proc.memory_info().rss) - base, out


def _touched(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every weight read once: transformers maps the file, so its load
    alone reads nothing until a first step does; the wrap has read all it holds."""
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                      tie_word_embeddings=False)
    folder = tempfile.mkdtemp(prefix="fsdp_nb_hf_weights_")
    try:
        with torch.device("meta"):
            shapes = LlamaForCausalLM(cfg).state_dict()
        size = sum(t.numel() * 4 for t in shapes.values())
        largest = max(t.numel() * 4 for t in shapes.values())
        model = LlamaForCausalLM(cfg)
        model.save_pretrained(folder)
        del model
        gc.collect()
        hf_s, hf_peak, loaded = _peak_here(lambda: _touched(LlamaForCausalLM.from_pretrained(folder)))
        del loaded
        gc.collect()
        with fsdp_nb.Session(args.ranks, backend="gloo", activate=False) as sess:
            sess.run(lambda: __import__("transformers"))  # imported before, as from_pretrained's was
            sess.run(start_sampler)  # first, on fresh ranks: freed memory would hide a peak
            t0 = time.perf_counter()
            sess.wrap(LlamaForCausalLM, cfg, name="llama", weights=folder)
            ours_s = time.perf_counter() - t0
            got = sess.run(stop_sampler)
            sess.execute("del llama")
            t0 = time.perf_counter()
            sess.wrap(LlamaForCausalLM, cfg, name="llama")  # for scale: transformers' random init instead
            init_s = time.perf_counter() - t0
        bound = 1.1 * (size / args.ranks + largest)
        rows = [{"rank": r, "peak_mb": (g["peak"] - g["base"]) / 2**20, "bound_mb": bound / 2**20,
                 "within": g["peak"] - g["base"] <= bound} for r, g in enumerate(got)]
        result = {"size_mb": size / 2**20, "largest_tensor_mb": largest / 2**20, "ranks": args.ranks,
                  "from_pretrained_s": hf_s, "from_pretrained_peak_mb": hf_peak / 2**20,
                  "wrap_weights_s": ours_s, "time_vs_from_pretrained": ours_s / hf_s,
                  "wrap_random_init_s": init_s, "per_rank": rows}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"model {result['size_mb']:.0f} MB fp32, largest tensor {result['largest_tensor_mb']:.0f} MB, N={args.ranks}")
    print(f"from_pretrained, one process: {hf_s:.2f} s, peak +{hf_peak / 2**20:.0f} MB")
    print(f"sess.wrap(weights=), {args.ranks} ranks: {ours_s:.2f} s ({ours_s / hf_s:.2f}x); "
          f"sess.wrap with transformers' random init instead: {init_s:.2f} s")
    for row in rows:
        print(f"  rank {row['rank']}: peak +{row['peak_mb']:.0f} MB, bound {row['bound_mb']:.0f} MB: "
              f"{'within' if row['within'] else 'OVER'}")
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "hf_weights.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
