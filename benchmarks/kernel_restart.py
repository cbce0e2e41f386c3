"""After a kernel dies: attaching to a kept-alive session vs starting a new one, and how
soon the engines of a session not kept alive are gone (2 CPU ranks, gloo).

Run: ``OMP_NUM_THREADS=1 python benchmarks/kernel_restart.py [--reps N]``.
Each rep, side by side: a process plays the kernel, starts ``Session(2)`` (timed: the
baseline), wraps a model and is killed with SIGKILL; a second process times
``Session.attach()`` and checks the weights came back. Then the same without
``keep_alive``: the time from the SIGKILL until the controller and both engines are
gone (the issue's bound: 30 s). Prints a table; writes benchmarks/out/kernel_restart.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_nb.engine.process_handles import process_alive

OUT = Path(__file__).resolve().parent / "out"

KERNEL = """
import json, sys, time, torch, fsdp_nb
t0 = time.perf_counter()
sess = fsdp_nb.Session(2, backend="gloo", keep_alive=sys.argv[1] == "keep")
started = time.perf_counter() - t0
model = sess.wrap(torch.nn.Linear(256, 256), name="model")
total = float(sum(v.sum() for v in model.state_dict().values()))
pids = [r.pid for r in sess.ranks] + [sess.cluster.cluster.controller.pid]
print(json.dumps({"start_s": started, "sum": total, "pids": pids}), flush=True)
time.sleep(3600)
"""

ATTACH = """
import json, time
t0 = time.perf_counter()
import torch, fsdp_nb  # as the baseline: imported before the clock starts
t1 = time.perf_counter()
sess = fsdp_nb.Session.attach(activate=False)
t2 = time.perf_counter()
total = float(sum(v.sum() for v in sess.models["model"].state_dict().values()))
sess.shutdown()
print(json.dumps({"import_s": t1 - t0, "attach_s": t2 - t1, "sum": total}), flush=True)
"""


def _kernel(keep: bool, env: dict) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-c", KERNEL, "keep" if keep else "no"],
                            stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("the kernel process did not start a session")
    return proc, json.loads(line)


def _gone(pids: list[int]) -> bool:
    return not any(process_alive(p) for p in pids)


def rep(env: dict) -> dict:
    proc, info = _kernel(True, env)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = subprocess.run([sys.executable, "-c", ATTACH], capture_output=True, text=True,
                         env=env, check=True, timeout=300)
    attached = json.loads(out.stdout.strip().splitlines()[-1])
    if attached["sum"] != info["sum"]:
        raise RuntimeError("attach did not bring the same weights back")
    proc, plain = _kernel(False, env)
    proc.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    proc.wait()
    while not _gone(plain["pids"]):
        if time.monotonic() - t0 > 120:
            raise RuntimeError(f"orphans {plain['pids']} still run after 120 s")
        time.sleep(0.05)
    return {
        "start_s": info["start_s"],
        "attach_s": attached["attach_s"],
        "attach_import_s": attached["import_s"],
        "orphans_gone_s": time.monotonic() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               IPYTHONDIR=tempfile.mkdtemp(prefix="fsdp_nb_bench_restart_"))
    reps = [rep(env) for _ in range(a.reps)]
    med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    med["attach_vs_start"] = med["attach_s"] / med["start_s"]
    print(f"{'':32}{'median':>10}   all reps")
    rows = [("Session(2) ready (baseline)", "start_s"), ("Session.attach() after kill -9", "attach_s"),
            ("  (import torch, fsdp_nb before)", "attach_import_s"),
            ("engines + controller gone", "orphans_gone_s")]
    for label, key in rows:
        print(f"{label:32}{med[key]:9.2f}s   " + ", ".join(f"{r[key]:.2f}" for r in reps))
    print(f"attach / start: {med['attach_vs_start']:.3f}x; orphans gone within the 30 s bound: "
          f"{all(r['orphans_gone_s'] < 30 for r in reps)}")
    OUT.mkdir(exist_ok=True)
    (OUT / "kernel_restart.json").write_text(json.dumps({"reps": reps, "median": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
