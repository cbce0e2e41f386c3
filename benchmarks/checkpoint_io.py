"""Checkpoint throughput: sharded, full and async saves and loads on 2 and 4 ranks,
side by side with the disk's own sequential write and read speed, in one run.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/checkpoint_io.py [--mb 256] [--ranks 2 4]

Disk: ``dd`` of the same number of bytes with ``conv=fsync`` (plus ``oflag=direct``
where the filesystem allows) for writing, and ``iflag=direct`` (or after dropping
the page cache, when permitted) for reading, in turn with the saves and loads below
(each of the three goes first, second and last in turn; medians). Loads run after dropping the page
cache when that is permitted, else they read warm pages (the JSON says which).
Plain DCP: ``dcp.save`` / ``dcp.load`` of the same ``get_state_dict(model, optimizer)``
on the same engines, interleaved with fsdp_nb's save and load (medians of ``--reps``;
each save starts after ``sync``, so that neither pays for the other's writeback).
Async: the time ``sess.save(..., async_save=True)`` blocks the notebook vs the
synchronous sharded save, and how much longer the training step right after it takes
than a plain step (its optimizer step waits for the background copy, and it shares the
cores with the write), also as a fraction of the sync save. The model carries AdamW state, so a save
holds three times ``--mb``. Memory: the peak each rank adds while loading the weights
from one ``.safetensors`` file, against size / N + the largest tensor, and while loading
a sharded checkpoint, against the rank's share of it. Prints a table and writes
benchmarks/out/checkpoint_io.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time

import fsdp_nb

BUILD = """
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
torch.manual_seed(0)
_mesh = init_device_mesh("cpu", (world_size,))
bench = torch.nn.Sequential(*[torch.nn.Linear({dim}, {dim}, bias=False) for _ in range({layers})])
for _l in bench:
    fully_shard(_l, mesh=_mesh)
fully_shard(bench, mesh=_mesh)
bench_opt = torch.optim.AdamW(bench.parameters(), lr=1e-4)
bench(torch.randn(2, {dim})).sum().backward()
bench_opt.step()  # AdamW state: twice the model's bytes again

def bench_step():
    bench(torch.randn(2, {dim})).sum().backward()
    bench_opt.step()
    bench_opt.zero_grad()
"""

PLAIN_DCP = """
import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint.state_dict import get_state_dict as _gsd, set_state_dict as _ssd

def plain_save(path):
    msd, osd = _gsd(bench, [bench_opt])
    _dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

def plain_load(path):
    msd, osd = _gsd(bench, [bench_opt])
    sd = {"model": msd, "optim": osd}
    _dcp.load(sd, checkpoint_id=path)
    _ssd(bench, [bench_opt], model_state_dict=sd["model"], optim_state_dict=sd["optim"])
"""


PEAK = """
def _proc_bytes(field):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1]) * 1024

def peak_reset():
    global _rss0
    import gc
    gc.collect()
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # resets this process's peak resident size (VmHWM)
    _rss0 = _proc_bytes('VmRSS')

def peak_delta():
    return _proc_bytes('VmHWM') - _rss0
"""


def load_memory(n: int, folder: str, layers: int, dim: int) -> tuple[dict, dict]:
    """Peak memory a rank adds while ``sess.load`` reads (1) a weights-only
    ``.safetensors``, against the bound size / N + the largest tensor, and (2) a sharded
    checkpoint with AdamW state, against the rank's share of it.

    Its own session, whose engines return freed memory at once (a fixed malloc mmap
    threshold): else memory freed by earlier calls is reused unseen and the peak reads low.
    """
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    try:
        sess = fsdp_nb.Session(n, backend="gloo", activate=False)
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]

    def peaks_of(load) -> tuple[float, list[int]]:
        sess.execute("peak_reset()")
        t, _ = timed(load)
        sess.execute("_peak = peak_delta()")
        return t, sess.pull("_peak")

    try:
        sess.execute(BUILD.format(dim=dim, layers=layers))
        sess.execute(PEAK)
        path, sharded = os.path.join(folder, f"weights{n}.safetensors"), os.path.join(folder, f"mem{n}")
        sess.save(path, "bench", sharded=False)
        t, peaks = peaks_of(lambda: sess.load(path, "bench"))
        sess.save(sharded, "bench", optimizer="bench_opt")
        _, sharded_peaks = peaks_of(lambda: sess.load(sharded, "bench", optimizer="bench_opt"))
    finally:
        sess.shutdown()
    size, largest = layers * dim * dim * 4, dim * dim * 4
    bound, share = size / n + largest, 3 * size / n
    return ({"bytes": size, "seconds": t, "peak_added_per_rank": peaks, "bound": bound,
             "peak_vs_bound": max(peaks) / bound},
            {"share": share, "peak_added_per_rank": sharded_peaks, "peak_vs_share": max(sharded_peaks) / share})


def drop_caches() -> bool:
    """Drop the page cache if this process may (root, writable /proc/sys/vm/drop_caches)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _dd(args: list[str]) -> float | None:
    """Seconds dd took (from its own report), or None if it failed."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    m = re.search(r"copied, ([0-9.e+-]+) s", out.stderr)
    return float(m.group(1)) if m else None


def dd_write(path: str, mb: int) -> tuple[float | None, str]:
    """Seconds dd took to write ``mb`` MiB to ``path`` and fsync them (direct I/O where
    the filesystem allows it), and how it wrote."""
    t = _dd(["if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "conv=fsync", "oflag=direct"])
    if t is not None:
        return t, "conv=fsync oflag=direct"
    return _dd(["if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "conv=fsync"]), "conv=fsync"


def dd_read(path: str) -> tuple[float | None, str]:
    """Seconds dd took to read ``path`` (direct I/O, else after dropping the page cache
    where permitted), and how it read."""
    t = _dd([f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])
    if t is not None:
        return t, "iflag=direct"
    mode = "after drop_caches" if drop_caches() else "page cache (warm)"
    return _dd([f"if={path}", "of=/dev/null", "bs=1M"]), mode


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def model_shape(mb: int) -> tuple[int, int]:
    """(width, layers) of the benchmark's stack of square fp32 linears holding ``mb`` MiB."""
    dim = 2048
    return dim, max(1, (mb << 20) // (dim * dim * 4))


def bench_ranks(n: int, folder: str, mb: int, cold: bool, reps: int) -> dict:  # noqa: C901 - its six timed turns are closures over one session
    dim, layers = model_shape(mb)
    sess = fsdp_nb.Session(n, backend="gloo", activate=False)
    try:
        sess.execute(BUILD.format(dim=dim, layers=layers))
        sess.execute(PLAIN_DCP)
        nbytes = 3 * layers * dim * dim * 4  # weights + AdamW's two moments
        res: dict = {"ranks": n, "bytes": nbytes, "reps": reps}
        sharded, full = os.path.join(folder, f"s{n}"), os.path.join(folder, f"f{n}.pt")
        plain = os.path.join(folder, f"plain{n}")
        sess.save(os.path.join(folder, f"warmup{n}"), "bench", optimizer="bench_opt")  # plans, imports
        sess.execute(f"plain_save({os.path.join(folder, f'warmupp{n}')!r})")
        # the first async save also creates its gloo group and writer thread
        sess.save(os.path.join(folder, f"warmupa{n}"), "bench", optimizer="bench_opt", async_save=True).wait()
        # side by side, interleaved: fsdp_nb's save / load and plain DCP's of the same
        # state, taking turns at going first (the first runs right after the last save's
        # writes, the second does not)
        ours_s, plain_s, ours_l, plain_l, dd_s, dd_l = [], [], [], [], [], []
        ddfile = os.path.join(folder, "dd.bin")

        def ours_save() -> None:
            shutil.rmtree(sharded, ignore_errors=True)  # both write a fresh folder...
            os.sync()  # ...on a settled disk: no writeback of what came before
            ours_s.append(timed(lambda: sess.save(sharded, "bench", optimizer="bench_opt"))[0])

        def plain_save() -> None:
            shutil.rmtree(plain, ignore_errors=True)
            os.sync()
            plain_s.append(timed(lambda: sess.execute(f"plain_save({plain!r})"))[0])

        def disk_save() -> None:  # the disk's own speed, for the same bytes, in turn
            if os.path.exists(ddfile):
                os.remove(ddfile)
            os.sync()
            t, res["dd_write_mode"] = dd_write(ddfile, nbytes >> 20)
            dd_s.append(t)

        def ours_load() -> None:
            if cold:
                drop_caches()
            ours_l.append(timed(lambda: sess.load(sharded, "bench", optimizer="bench_opt"))[0])

        def plain_load() -> None:
            if cold:
                drop_caches()
            plain_l.append(timed(lambda: sess.execute(f"plain_load({plain!r})"))[0])

        def disk_load() -> None:
            if cold:
                drop_caches()
            t, res["dd_read_mode"] = dd_read(ddfile)
            dd_l.append(t)

        saves, loads = [ours_save, plain_save, disk_save], [ours_load, plain_load, disk_load]
        for i in range(reps):  # each side goes first, second and last in turn
            k = i % 3
            for turn in saves[k:] + saves[:k] + loads[k:] + loads[:k]:
                turn()
        os.remove(ddfile)
        res.update(save_sharded_s=_median(ours_s), plain_dcp_save_s=_median(plain_s),
                   load_sharded_s=_median(ours_l), plain_dcp_load_s=_median(plain_l),
                   dd_write_s=_median(dd_s), dd_read_s=_median(dd_l),
                   samples={"save": ours_s, "plain_save": plain_s, "dd_write": dd_s,
                            "load": ours_l, "plain_load": plain_l, "dd_read": dd_l})
        res["save_vs_dcp"] = res["plain_dcp_save_s"] / res["save_sharded_s"]
        res["load_vs_dcp"] = res["plain_dcp_load_s"] / res["load_sharded_s"]
        res["save_vs_dd"] = res["dd_write_s"] / res["save_sharded_s"]
        res["plain_dcp_save_vs_dd"] = res["dd_write_s"] / res["plain_dcp_save_s"]
        res["load_vs_dd"] = res["dd_read_s"] / res["load_sharded_s"]
        t, _ = timed(lambda: sess.save(full, "bench", optimizer="bench_opt", sharded=False))
        res["save_full_s"] = t
        # async: the call, then one training step right away (its optimizer step waits
        # for the copy, and it shares the cores with the write), against a plain step
        blocked, steps, plain_steps = [], [], []
        for i in range(reps):
            plain_steps.append(timed(lambda: sess.execute("bench_step()"))[0])
            t_block, h = timed(lambda i=i: sess.save(os.path.join(folder, f"a{n}-{i}"), "bench",
                                                     optimizer="bench_opt", async_save=True))
            steps.append(timed(lambda: sess.execute("bench_step()"))[0])
            t_wait, _ = timed(h.wait)
            blocked.append(t_block)
        res["async_blocked_s"] = _median(blocked)
        res["samples"]["async_blocked"] = blocked
        res["async_blocked_on_ranks_s"] = h.blocked_s
        res["async_total_s"] = t_block + t_wait
        res["async_blocked_vs_sync"] = res["async_blocked_s"] / res["save_sharded_s"]
        res["step_s"], res["step_after_async_save_s"] = _median(plain_steps), _median(steps)
        res["async_step_delay_vs_sync"] = max(0.0, res["step_after_async_save_s"] - res["step_s"]) / res["save_sharded_s"]
        if cold:
            drop_caches()
        t, _ = timed(lambda: sess.load(full, "bench", optimizer="bench_opt"))
        res["load_full_s"] = t
        for k in ("save_sharded", "save_full", "load_sharded", "load_full", "plain_dcp_save", "plain_dcp_load",
                  "dd_write", "dd_read"):
            res[k + "_GBps"] = nbytes / res[k + "_s"] / 1e9
        res["async_effective_GBps"] = nbytes / res["async_total_s"] / 1e9
        return res
    finally:
        sess.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=256, help="model size in MiB (float32)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp dir)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (medians reported)")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="fsdp_nb_ckbench_", dir=args.dir)
    try:
        cold = drop_caches()
        rows = [bench_ranks(n, folder, args.mb, cold, args.reps) for n in args.ranks]
        for r in rows:
            r["safetensors_load"], r["sharded_load_memory"] = load_memory(r["ranks"], folder, *model_shape(args.mb)[::-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out = {"cold_loads": cold, "model_MiB": args.mb, "runs": rows,
           "note": "2 CPU cores shared with other jobs; gloo; local disk"}
    r0 = rows[0]
    print(f"dd: write {r0['dd_write_mode']}, read {r0['dd_read_mode']}, the same bytes as each save, in turn "
          f"with the saves; loads {'cold (page cache dropped)' if cold else 'warm (cannot drop the page cache)'}")
    head = (f"{'ranks':>5} {'MB':>6} | {'save':>11} {'dcp.save':>11} {'vs dcp':>6} {'vs dd':>6} | "
            f"{'load':>11} {'dcp.load':>11} {'vs dcp':>6} {'vs dd':>6} | {'full save':>11} {'full load':>11} | "
            f"{'async blk':>9} blocked/sync")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['ranks']:>5} {r['bytes'] / 1e6:>6.0f} | {r['save_sharded_GBps']:>6.3f}GB/s {r['plain_dcp_save_GBps']:>6.3f}GB/s "
              f"{r['save_vs_dcp']:>6.2f} {r['save_vs_dd']:>6.2f} | "
              f"{r['load_sharded_GBps']:>6.3f}GB/s {r['plain_dcp_load_GBps']:>6.3f}GB/s {r['load_vs_dcp']:>6.2f} "
              f"{r['load_vs_dd']:>6.2f} | {r['save_full_GBps']:>6.3f}GB/s "
              f"{r['load_full_GBps']:>6.3f}GB/s | {r['async_blocked_s']:>8.3f}s {100 * r['async_blocked_vs_sync']:.1f}%")
    for r in rows:
        print(f"{r['ranks']} ranks: dd wrote {r['dd_write_GBps']:.3f} GB/s and read {r['dd_read_GBps']:.3f} GB/s; "
              f"plain dcp.save reached {r['plain_dcp_save_vs_dd']:.2f} of dd's write")
    for r in rows:
        print(f"{r['ranks']} ranks: async save blocked the notebook {100 * r['async_blocked_vs_sync']:.1f}% of a sync save "
              f"(target <= 5%); the training step right after it took {r['step_after_async_save_s']:.3f} s vs "
              f"{r['step_s']:.3f} s for a plain step: {100 * r['async_step_delay_vs_sync']:.1f}% of a sync save more")
    for r in rows:
        m = r["safetensors_load"]
        print(f"{r['ranks']} ranks: load of {m['bytes'] / 1e6:.0f} MB of .safetensors weights took {m['seconds']:.2f} s; "
              f"peak added per rank {[round(p / 1e6, 1) for p in m['peak_added_per_rank']]} MB, bound "
              f"(size/N + largest tensor) {m['bound'] / 1e6:.1f} MB: {m['peak_vs_bound']:.2f}x (target <= 1.1)")
    for r in rows:
        m = r["sharded_load_memory"]
        print(f"{r['ranks']} ranks: sharded load (weights + AdamW state, {m['share'] / 1e6:.0f} MB a rank) added a peak of "
              f"{[round(p / 1e6, 1) for p in m['peak_added_per_rank']]} MB per rank: {m['peak_vs_share']:.2f}x its share")
    os.makedirs(os.path.join(os.path.dirname(__file__), "out"), exist_ok=True)
    dest = os.path.join(os.path.dirname(__file__), "out", "checkpoint_io.json")
    with open(dest, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
