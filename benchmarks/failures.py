"""Time to a clear error and to a usable session, per failure kind (2 CPU ranks, gloo).

Run: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/failures.py [--reps N]``.
Prints a table and writes benchmarks/out/failures.json. Every case trains an FSDP2
model first and checks afterwards that its weights were kept (where no engine died)
and that a collective answers.
"""

from __future__ import annotations

import _thread
import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="fsdp_nb_bench_"))

import torch  # noqa: E402

import fsdp_nb  # noqa: E402
from fsdp_nb.errors import DeadRankError, RankError, RankTimeoutError  # noqa: E402

MODEL = """
import time, torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
torch.manual_seed(0)
bm_mesh = init_device_mesh("cpu", (2,))
bm_net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
for _m in bm_net:
    if isinstance(_m, torch.nn.Linear):
        fully_shard(_m, mesh=bm_mesh)
fully_shard(bm_net, mesh=bm_mesh)
bm_opt = torch.optim.AdamW(bm_net.parameters())
def bm_step():
    loss = bm_net(torch.randn(8, 64)).pow(2).mean(); loss.backward(); bm_opt.step(); bm_opt.zero_grad()
def bm_local():
    return {k: v.to_local().clone() for k, v in bm_net.state_dict().items()}
bm_step()
"""
BLOCKED = "t = torch.ones(1)\ndist.all_reduce(t)\n"


def _weights(s):
    return s.run(lambda: bm_local())  # noqa: F821


def _kept(a, b) -> bool:
    return all(torch.equal(a[r][k], b[r][k]) for r in range(len(a)) for k in a[r])


def _usable(s, t_err: float) -> float:
    s.all_reduce_check()
    return time.monotonic() - t_err


def partial(s, grace: float) -> dict:
    s.grace = grace
    before = _weights(s)
    t0 = time.monotonic()
    try:
        s.execute("if rank == 1:\n    raise ValueError('x')\n" + BLOCKED)
    except RankError:
        pass
    t_err = time.monotonic()
    usable = _usable(s, t_err)
    return {"to_error_s": t_err - t0, "error_to_usable_s": usable, "kept": _kept(before, _weights(s))}


def ctrl_c(s) -> dict:
    before = _weights(s)
    fired: list[float] = []

    def fire():
        fired.append(time.monotonic())
        _thread.interrupt_main()

    timer = threading.Timer(1.0, fire)
    timer.start()
    try:
        s.execute("if rank == 1:\n    time.sleep(30)\n" + BLOCKED)
    except KeyboardInterrupt:
        pass
    t_err = time.monotonic()
    usable = _usable(s, t_err)
    return {"to_error_s": t_err - fired[0], "error_to_usable_s": usable, "kept": _kept(before, _weights(s))}


def timeout(s, limit: float = 2.0) -> dict:
    before = _weights(s)
    t0 = time.monotonic()
    try:
        s.execute("if rank == 0:\n    time.sleep(30)\n" + BLOCKED, timeout=limit)
    except RankTimeoutError:
        pass
    t_err = time.monotonic()
    usable = _usable(s, t_err)
    return {"to_error_s": t_err - t0 - limit, "error_to_usable_s": usable, "kept": _kept(before, _weights(s))}


def killed(s) -> dict:
    victim = s.ranks[1].pid
    killed_at: list[float] = []

    def kill():
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    try:
        s.execute("if rank == 1:\n    time.sleep(30)\n" + BLOCKED)
    except DeadRankError:
        pass
    t_err = time.monotonic()
    s.restart()
    usable = _usable(s, t_err)
    s.execute(MODEL)
    return {"to_error_s": t_err - killed_at[0], "error_to_usable_s": usable, "kept": None}


def status_latency(s) -> dict:
    p = s.dispatcher.execute("time.sleep(3)")
    time.sleep(0.3)
    t0 = time.monotonic()
    st = s.status()
    dt = time.monotonic() - t0
    s.dispatcher.gather(p, 30)
    return {"status_busy_s": dt, "busy": st.busy}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {}
    with fsdp_nb.Session(2, backend="gloo", activate=False) as s:
        s.execute(MODEL)
        for _ in range(args.reps):
            rows.setdefault("rank raises, grace=1", []).append(partial(s, 1.0))
            rows.setdefault("rank raises, grace=3 (default)", []).append(partial(s, 3.0))
            rows.setdefault("Ctrl-C in collective", []).append(ctrl_c(s))
            rows.setdefault("timeout=2 (error after limit)", []).append(timeout(s))
            rows.setdefault("kill -9 in collective + restart", []).append(killed(s))
        st = [status_latency(s) for _ in range(args.reps)]
    table = []
    print(f"{'case':<34} {'to error s':>11} {'error->usable s':>16} {'state kept':>11}")
    for case, rs in rows.items():
        e = statistics.median(r["to_error_s"] for r in rs)
        u = statistics.median(r["error_to_usable_s"] for r in rs)
        kept = "n/a" if rs[0]["kept"] is None else str(all(r["kept"] for r in rs))
        table.append({"case": case, "to_error_s": e, "error_to_usable_s": u, "kept": kept, "runs": rs})
        print(f"{case:<34} {e:>11.2f} {u:>16.2f} {kept:>11}")
    sl = statistics.median(x["status_busy_s"] for x in st)
    print(f"{'status() while both ranks busy':<34} {sl:>11.3f}")
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "failures.json").write_text(json.dumps(
        {"cases": table, "status_busy_s": sl, "reps": args.reps, "ranks": 2, "backend": "gloo"},
        indent=2))
    print(f"wrote {out / 'failures.json'}")


if __name__ == "__main__":
    main()
