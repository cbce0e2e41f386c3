"""``sess.resize`` against what a user does without it, and what it holds in memory.

Run: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/resize.py [--dim D] [--layers L] [--vocab V]``.
Prints a table and writes benchmarks/out/resize.json.

The model is benchmarks/_gpt.py's GPT wrapped with ``auto_wrap={Block}``, AdamW after
one step (so the state is weights plus two moments), on CPU gloo ranks.

- resize: ``sess.resize(3)`` then ``sess.resize(2)`` on a live 2-rank session (the
  standby engine as shipped), against the same moves done by hand in the same run:
  ``sess.save`` to disk, ``shutdown``, a new ``Session(n)`` with the setup cell, ``wrap``,
  a new optimizer and ``sess.load``. The target is a ratio of at most 0.5.
- peak resident memory of each rank during each resize (sampled every 10 ms on the
  ranks), beside the bytes of state each rank holds, and what went through /dev/shm.
- the staging medium, on 2 and on 3 ranks with no change of world: the state out and
  back in through a DCP folder in /dev/shm (each rank writes and reads its own shards,
  as resize does) against through host memory over the group (the full state gathered
  to rank 0, then broadcast back into the shards, as torch's ``broadcast_from_rank0``
  does); seconds, and the most resident memory either adds to a rank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="fsdp_nb_bench_"))

import fsdp_nb  # noqa: E402
from fsdp_nb.runtime.cluster import wait_until  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _gpt import GPT, Block, params  # noqa: E402

SETUP = "import torch\nimport torch.nn.functional as F\n"
STEP = ("idx = torch.randint(0, {vocab}, (2, 33), generator=torch.Generator().manual_seed(rank))\n"
        "loss = F.cross_entropy(model(idx[:, :-1]).view(-1, {vocab}), idx[:, 1:].reshape(-1))\n"
        "loss.backward(); optimizer.step(); optimizer.zero_grad()\n")
OPTIM = "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"


def _session(n: int, kw: dict, standby: bool = True) -> fsdp_nb.Session:
    s = fsdp_nb.Session(n, backend="gloo", activate=False, standby=standby)
    s.execute(SETUP)
    s.wrap(GPT, name="model", auto_wrap={Block}, **kw)
    s.execute(OPTIM)
    return s


def _by_hand(s: fsdp_nb.Session, n: int, kw: dict, folder: str) -> tuple[fsdp_nb.Session, float]:
    """Save, stop, start a session of ``n`` ranks, set it up, wrap, load: (it, seconds)."""
    t0 = time.perf_counter()
    s.save(folder, "model", optimizer="optimizer", overwrite=True)
    s.shutdown()
    s = _session(n, kw, standby=False)
    s.load(folder, "model", optimizer="optimizer")
    return s, time.perf_counter() - t0


def _held(s: fsdp_nb.Session) -> list[int]:
    """Bytes of model and optimizer state each rank holds."""
    from fsdp_nb.recovery.rank_resize import state_size

    return s.run(state_size, {"model": ("optimizer",)})


def _rss(s: fsdp_nb.Session) -> list[int]:
    import psutil

    return [psutil.Process(r.pid).memory_info().rss for r in s.ranks]


def _medium(s: fsdp_nb.Session, reps: int) -> dict[str, float]:
    """Seconds to move the state out and back in, through /dev/shm and through the group,
    and the most resident memory either added to a rank (MiB)."""
    from fsdp_nb.recovery.rank_resize import memory_peak, watch_memory

    def shm(folder: str) -> float:
        import time

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        dist.barrier()
        t = time.perf_counter()
        msd, osd = get_state_dict(model, [optimizer])  # noqa: F821
        sd = {"model": msd, "optim": osd}
        dcp.save(sd, storage_writer=FileSystemWriter(folder, single_file_per_rank=True, sync_files=False))
        dcp.load(sd, storage_reader=FileSystemReader(folder))
        set_state_dict(model, [optimizer], model_state_dict=sd["model"], optim_state_dict=sd["optim"])  # noqa: F821
        dist.barrier()
        return time.perf_counter() - t

    def group() -> float:
        import time

        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        dist.barrier()
        t = time.perf_counter()
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(model, options=full)  # noqa: F821
        osd = get_optimizer_state_dict(model, optimizer, options=full)  # noqa: F821
        back = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, msd, options=back)  # noqa: F821
        set_optimizer_state_dict(model, optimizer, osd, options=back)  # noqa: F821
        dist.barrier()
        return time.perf_counter() - t

    out: dict[str, list[float]] = {"shm": [], "group": [], "shm MiB": [], "group MiB": []}
    for _ in range(reps):
        folder = tempfile.mkdtemp(prefix="fsdp_nb-bench-", dir="/dev/shm")
        for route, args in (("shm", (folder,)), ("group", ())):
            before = _rss(s)
            s.run(watch_memory)
            try:
                out[route].append(max(s.run(shm if route == "shm" else group, *args)))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            out[f"{route} MiB"].append(max(p - b for p, b in zip(s.run(memory_peak), before)) / 2**20)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3, help="rounds of the staging-medium comparison")
    a = ap.parse_args()
    kw = dict(vocab=a.vocab, dim=a.dim, layers=a.layers, heads=8)
    out: dict[str, float | str] = {"model": f"GPT {params(kw) / 1e6:.0f}M parameters + AdamW"}
    step = STEP.format(vocab=a.vocab)
    s = _session(2, kw)
    s.execute(step)
    out["state MiB (all ranks)"] = sum(_held(s)) / 2**20
    # as shipped: the standby engine launched after the start has finished its imports
    wait_until(lambda: s.cluster.standby is not None and s.cluster.standby.waiting(), 120)
    for n in (3, 2):
        rss_before = _rss(s)
        rep = s.resize(n)
        out[f"resize -> {n}: s"] = rep.seconds
        for phase, sec in rep.phases.items():
            out[f"resize -> {n}: {phase}, s"] = sec
        out[f"resize -> {n}: staged MiB"] = rep.staged_bytes / 2**20
        out[f"resize -> {n}: peak RSS per rank, MiB"] = " ".join(f"{b / 2**20:.0f}" for b in rep.peak_rss)
        out[f"resize -> {n}: RSS before, MiB"] = " ".join(f"{b / 2**20:.0f}" for b in rss_before)
        out[f"resize -> {n}: state held per rank after, MiB"] = " ".join(f"{b / 2**20:.0f}" for b in _held(s))
        s.execute(step)  # it trains
    for n in (2, 3):  # the staging medium, after the resizes (the gather leaves rank 0 larger)
        if s.world_size != n:
            s.resize(n)
        medium = _medium(s, a.reps)
        out[f"{n} ranks: out and back through /dev/shm (DCP), s"] = medium["shm"]
        out[f"{n} ranks: out and back through the group (gather to rank 0, broadcast), s"] = medium["group"]
        out[f"{n} ranks: /dev/shm, most RSS added to a rank, MiB"] = medium["shm MiB"]
        out[f"{n} ranks: the group, most RSS added to a rank, MiB"] = medium["group MiB"]
    with tempfile.TemporaryDirectory(dir=os.path.expanduser("~")) as d:
        for n in (2, 3):
            s, sec = _by_hand(s, n, kw, os.path.join(d, "ck"))
            out[f"save + new session + load -> {n}: s"] = sec
            s.execute(step)
    s.shutdown()
    for n in (3, 2):
        out[f"ratio resize / by hand -> {n}"] = out[f"resize -> {n}: s"] / out[f"save + new session + load -> {n}: s"]
    width = max(map(len, out))
    for k, v in out.items():
        print(f"{k:<{width}}  {v:10.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    (HERE / "out").mkdir(exist_ok=True)
    (HERE / "out" / "resize.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
