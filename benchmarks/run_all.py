"""Run every benchmark side by side in one go; print a summary table, write JSON.

    python benchmarks/run_all.py            # all of them (about 10-15 min on 2 cores)
    python benchmarks/run_all.py --quick    # smaller sizes, for a smoke run

Each benchmark is its own script (runnable alone) that compares against a baseline
measured in the same run (torchrun, dd, the sampler off, size/N). Their JSON lands in
benchmarks/out/; this runner adds benchmarks/out/all.json with the machine described.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"

BENCHES = {
    # name: (script, full args, quick args)
    "session": ("session.py", [], ["--sizes", "2", "--repeats", "50"]),
    "session_cost": ("session_cost.py", [], ["--rounds", "1", "--steps", "40"]),
    "wrap_memory": ("wrap_memory.py", [], ["--dim", "2048", "--layers", "8", "--skip-naive"]),
    "checkpoint_io": ("checkpoint_io.py", [], ["--mb", "64", "--ranks", "2"]),
    "autosave": ("autosave.py", [], ["--rounds", "1", "--steps", "10", "--every", "5"]),
    "memory_copies": ("memory_copies.py", [], ["--sizes", "small", "--rounds", "1"]),
    "memory_sampler": ("memory_sampler.py", [], ["--rounds", "2", "--steps", "4"]),
    "failures": ("failures.py", [], ["--reps", "1"]),
    "hangs": ("hangs.py", [], ["--rounds", "3", "--steps", "30"]),
    "collective_check": ("collective_check.py", [], ["--rounds", "1", "--steps", "20", "--calls", "0.1"]),
    "launchers": ("launchers.py", [], ["--only", "local"]),
    "kernel_restart": ("kernel_restart.py", [], ["--reps", "1"]),
    "memory_plan": ("memory_plan.py", [], ["--quick"]),
    # the GPU path: a transformer on one engine per GPU (nccl), or the same code on 2 CPU ranks
    "gpu": ("gpu.py", [], ["--device", "cpu", "--steps", "3"]),
}


def machine() -> dict:
    import psutil
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument("--only", nargs="*", choices=list(BENCHES), default=list(BENCHES))
    a = ap.parse_args(argv)
    OUT.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    summary: dict = {"machine": machine(), "results": {}, "failed": []}
    for name in a.only:
        script, full, quick = BENCHES[name]
        cmd = [sys.executable, str(HERE / script), *(quick if a.quick else full)]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, env=env)
        took = time.perf_counter() - t0
        if rc != 0:
            summary["failed"].append(name)
            print(f"--- {name} FAILED (exit {rc})")
            continue
        out = OUT / f"{name}.json"
        summary["results"][name] = {
            "seconds": round(took, 1),
            "data": json.loads(out.read_text()) if out.exists() else None,
        }
    (OUT / "all.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nwrote {OUT / 'all.json'}; failed: {summary['failed'] or 'none'}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
