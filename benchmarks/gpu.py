"""The GPU path, side by side in one run: a real transformer (attention, bf16-mixed).

    PYTHONPATH=$PWD python benchmarks/gpu.py --device cuda     # one engine per GPU, nccl
    PYTHONPATH=$PWD python benchmarks/gpu.py --device cpu      # the same code on 2 gloo ranks

Each number next to its baseline, measured in the same run on the same machine:

- time to a ready session vs torchrun's time from launch to its first collective;
- ``%%px`` training throughput (``sess.execute`` of the loop in ``_gpt.train``) vs the
  same loop, same model and FSDP2 options under torchrun;
- sync save / load of model + AdamW state: ``sess.save`` / ``sess.load`` vs plain
  ``dcp.save`` / ``dcp.load`` of the same ``get_state_dict`` on the same engines, and vs
  ``dd`` of the same number of bytes on the same disk;
- async save: the time the notebook is blocked vs a sync save (first and second save:
  the second reuses staging);
- ``restart(restore=)`` after kill -9 of rank 0.

Prints a table and writes benchmarks/out/gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _gpt import GPT, SIZES, Block, params, train  # noqa: E402
from checkpoint_io import dd_read, dd_write, drop_caches  # noqa: E402

import fsdp_nb  # noqa: E402


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def du(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def torchrun_side(n: int, device: str, steps: int, warmup: int, folder: str) -> dict:
    out = os.path.join(folder, "torchrun.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           str(HERE / "_gpu_worker.py"), out, device, str(steps), str(warmup)]
    t0 = time.time()
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    data = json.loads(Path(out).read_text())
    data["ready_s"] = data["first_collective_unix"] - t0
    return data


def plain_dcp_save(path: str) -> None:
    """Runs on every rank: DCP alone, on the state fsdp_nb saves."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(gpt, [gpt_opt])  # noqa: F821 - engine globals
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def plain_dcp_load(path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(gpt, [gpt_opt])  # noqa: F821 - engine globals
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(gpt, [gpt_opt], model_state_dict=sd["model"], optim_state_dict=sd["optim"])  # noqa: F821


def _make_opt() -> None:
    """``restart``'s setup: the optimizer a new engine lacks (its saved state is then loaded)."""
    global gpt_opt
    gpt_opt = torch.optim.AdamW(gpt.parameters(), lr=1e-4)  # noqa: F821 - engine globals


def session_side(n: int, backend: str, device: str, steps: int, warmup: int, folder: str) -> dict:
    kwargs, batch, seq = SIZES[device]
    res: dict = {}
    res["ready_s"], sess = timed(lambda: fsdp_nb.Session(n, backend=backend, activate=False))
    try:
        model = sess.wrap(GPT, **kwargs, name="gpt", auto_wrap={Block}, mixed_precision="bf16-mixed")
        sess.push({"bench_train": train})
        sess.execute("gpt_opt = torch.optim.AdamW(gpt.parameters(), lr=1e-4)")
        sess.execute(f"bench_out = bench_train(gpt, gpt_opt, {steps}, {warmup}, {batch}, {seq}, "
                     f"{kwargs['vocab']})")
        res["train_s"], res["tokens_per_s"] = sess.pull("bench_out")[0]

        ours, plain = os.path.join(folder, "ours"), os.path.join(folder, "plain")
        sess.save(os.path.join(folder, "warm"), model, optimizer="gpt_opt")  # plans, first touch
        sess.run(plain_dcp_save, os.path.join(folder, "warm_plain"))
        os.sync()  # each save starts on a settled disk: no writeback of what came before
        res["save_s"], _ = timed(lambda: sess.save(ours, model, optimizer="gpt_opt"))
        os.sync()
        res["plain_save_s"], _ = timed(lambda: sess.run(plain_dcp_save, plain))
        res["bytes"] = du(ours)
        ddfile = os.path.join(folder, "dd.bin")  # the disk's own speed for the same bytes
        os.sync()
        res["dd_bytes"] = max(1, res["bytes"] >> 20) << 20
        res["dd_write_s"], res["dd_write_mode"] = dd_write(ddfile, res["dd_bytes"] >> 20)
        res["cold_loads"] = drop_caches()
        res["load_s"], _ = timed(lambda: sess.load(ours, model, optimizer="gpt_opt"))
        drop_caches()
        res["plain_load_s"], _ = timed(lambda: sess.run(plain_dcp_load, plain))
        drop_caches()
        res["dd_read_s"], res["dd_read_mode"] = dd_read(ddfile)
        os.remove(ddfile)
        for i in (1, 2):
            blocked, h = timed(lambda i=i: sess.save(os.path.join(folder, f"async{i}"), model,
                                                     optimizer="gpt_opt", async_save=True))
            h.wait()
            res[f"async{i}_blocked_s"] = blocked
        for p in ("warm", "warm_plain", "plain", "async1", "async2"):
            shutil.rmtree(os.path.join(folder, p), ignore_errors=True)

        standby = sess.cluster.standby  # launched after the start; its imports are long done
        os.kill(sess.ranks[0].pid, signal.SIGKILL)
        try:
            sess.all_reduce_check()
        except fsdp_nb.DeadRankError:
            pass
        res["restart_restore_s"], _ = timed(lambda: sess.restart(restore=ours, setup=_make_opt))
        res["restart_phases"] = dict(sess.restart_phases)
        res["restart_took_standby"] = standby is not None and sess.ranks[0].pid == standby.pid
    finally:
        sess.shutdown()
    return res


def main(argv: list[str] | None = None) -> dict:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("-n", type=int, default=None, help="ranks (default: GPUs, or 2 on CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20 cuda, 5 cpu)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp dir)")
    a = ap.parse_args(argv)
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    n = a.n or (torch.cuda.device_count() if device == "cuda" else 2)
    steps = a.steps or (20 if device == "cuda" else 5)
    backend = "nccl" if device == "cuda" else "gloo"
    folder = tempfile.mkdtemp(prefix="fsdp_nb_gpu_bench_", dir=a.dir)
    try:
        tr = torchrun_side(n, device, steps, a.warmup, folder)
        ss = session_side(n, backend, device, steps, a.warmup, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    gb = ss["bytes"] / 1e9
    disk = {"write_GBps": ss["dd_bytes"] / ss["dd_write_s"] / 1e9 if ss["dd_write_s"] else None,
            "read_GBps": ss["dd_bytes"] / ss["dd_read_s"] / 1e9 if ss["dd_read_s"] else None,
            "write_mode": ss["dd_write_mode"], "read_mode": ss["dd_read_mode"]}
    r = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "ranks": n, "backend": backend, "params": params(SIZES[device][0]),
        "torchrun": tr, "session": ss, "disk": disk,
        "ready_ratio": ss["ready_s"] / tr["ready_s"],
        "throughput_ratio": ss["tokens_per_s"] / tr["tokens_per_s"],
        "save_GBps": gb / ss["save_s"], "plain_save_GBps": gb / ss["plain_save_s"],
        "load_GBps": gb / ss["load_s"], "plain_load_GBps": gb / ss["plain_load_s"],
        "save_vs_plain": ss["plain_save_s"] / ss["save_s"],
        "load_vs_plain": ss["plain_load_s"] / ss["load_s"],
        "save_vs_dd": (gb / ss["save_s"]) / disk["write_GBps"] if disk["write_GBps"] else None,
        "load_vs_dd": (gb / ss["load_s"]) / disk["read_GBps"] if disk["read_GBps"] else None,
        "async1_blocked_vs_sync": ss["async1_blocked_s"] / ss["save_s"],
        "async2_blocked_vs_sync": ss["async2_blocked_s"] / ss["save_s"],
    }
    rows = [
        ("ready session", f"{ss['ready_s']:.1f} s", f"torchrun first collective {tr['ready_s']:.1f} s",
         f"{r['ready_ratio']:.2f}x"),
        ("%%px training", f"{ss['tokens_per_s']:.0f} tok/s/rank", f"torchrun {tr['tokens_per_s']:.0f}",
         f"{r['throughput_ratio']:.3f}"),
        ("sync save", f"{r['save_GBps']:.2f} GB/s ({gb:.2f} GB)", f"dcp.save {r['plain_save_GBps']:.2f}; "
         f"dd {disk['write_GBps'] or 0:.2f}", f"{r['save_vs_plain']:.2f} of dcp"),
        ("load", f"{r['load_GBps']:.2f} GB/s", f"dcp.load {r['plain_load_GBps']:.2f}; dd "
         f"{disk['read_GBps'] or 0:.2f}", f"{r['load_vs_plain']:.2f} of dcp"),
        ("async save blocked", f"{ss['async1_blocked_s']:.2f} / {ss['async2_blocked_s']:.2f} s",
         f"sync save {ss['save_s']:.2f} s", f"{r['async2_blocked_vs_sync']:.1%}"),
        ("restart(restore=)", f"{ss['restart_restore_s']:.1f} s",
         "rank 0 replaced by the " + ("standby engine" if ss["restart_took_standby"] else "new engine"),
         ""),
    ]
    print(f"\n{r['device']}, {n} rank(s), {backend}, GPT {r['params'] / 1e6:.0f}M parameters, bf16-mixed")
    for row in rows:
        print(f"  {row[0]:<20} {row[1]:<28} {row[2]:<40} {row[3]}")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(r, indent=2, default=str))
    return r


if __name__ == "__main__":
    main()
